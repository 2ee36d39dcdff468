"""Daemon configuration: one frozen dataclass.

Precedence: defaults < TOML file (``--config``) < ``SPARSEKV_*`` environment < command line.
``sparsekvd --print-config`` shows the result as TOML.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass, fields

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}


class ConfigError(ValueError):
    """A setting has a bad value; the message names the setting and where it came from."""


def parse_size(text: str | int) -> int:
    """``'64GiB'`` -> bytes. Accepts an integer, or a number with B/KiB/MiB/GiB/TiB (or KB/MB/...)."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"bad size {text!r}; use e.g. 256MiB, 64GiB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


def default_run_dir() -> str:
    # systemd's RuntimeDirectory= sets RUNTIME_DIRECTORY (colon-separated when several).
    runtime = os.environ.get("RUNTIME_DIRECTORY", "")
    return runtime.split(":")[0] if runtime else "/run/sparsekv"


@dataclass(frozen=True)
class Config:
    """Everything the daemon can be told. Units are in the names."""

    backend: str = "auto"  # auto | cpu | cuda
    run_dir: str = dataclasses.field(default_factory=default_run_dir)
    pool_size: int = 1 << 30  # bytes of the shared host pool (all engines, all layers)
    prefault_threads: int = 0  # 0: one per core, at most 16
    devices: str = "all"  # cuda: "all" or a comma list of ordinals
    max_clients: int = 256
    reap_interval_s: float = 2.0  # how often dead client processes are detached
    shm_dir: str = "/dev/shm"  # where cpu-backend slabs live (clients map them)
    kernel_cache_dir: str = ""  # cuda: compiled kernel cache ("" = ~/.cache/sparsekv/kernels)
    gather_blocks: int = 32  # cuda: thread blocks the gather may use (SMs shared with attention)
    device_arena_size: int = 16 << 30  # cuda: bytes of the one allocation per GPU for slabs and rings
    ring_depth: int = 8  # cuda: top-k requests a rank may have in flight (events and result entries)
    # After a request, keep polling the control socket this long before sleeping: the next
    # request of a decode step then costs no wake-up (tens of microseconds in a VM).
    # -1: 1000 on the cuda backend, 0 (off) on the cpu backend.
    busy_poll_us: int = -1
    log_level: str = "info"

    def validate(self) -> "Config":
        if self.backend not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"backend must be auto, cpu or cuda, got {self.backend!r}")
        if self.pool_size <= 0:
            raise ConfigError("pool_size must be positive")
        if self.ring_depth < 1 or self.ring_depth > 1024:
            raise ConfigError(f"ring_depth must lie in [1, 1024], got {self.ring_depth}")
        if self.busy_poll_us < -1 or self.busy_poll_us > 1_000_000:
            raise ConfigError(f"busy_poll_us must lie in [-1, 1000000], got {self.busy_poll_us}")
        if self.gather_blocks < 1:
            raise ConfigError(f"gather_blocks must be >= 1, got {self.gather_blocks}")
        if self.max_clients < 1:
            raise ConfigError("max_clients must be >= 1")
        if self.reap_interval_s <= 0:
            raise ConfigError("reap_interval_s must be > 0")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")
        if self.devices != "all" and not re.fullmatch(r"\d+(,\d+)*", self.devices):
            raise ConfigError(f"devices must be 'all' or a comma list of ordinals, got {self.devices!r}")
        return self

    def to_toml(self) -> str:
        lines = []
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in _SIZES:
                lines.append(f'{f.name} = "{format_size(v)}"')
            elif isinstance(v, str):
                lines.append(f'{f.name} = "{v}"')
            else:
                lines.append(f"{f.name} = {v}")
        return "\n".join(lines) + "\n"


_SIZES = ("pool_size", "device_arena_size")


def _coerce(name: str, value, source: str):
    kinds = {f.name: f.type for f in fields(Config)}
    if name not in kinds:
        raise ConfigError(f"{source}: unknown setting {name!r}")
    try:
        if name in _SIZES:
            return parse_size(value)
        kind = kinds[name]
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        return str(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: bad value for {name}: {e}") from None


def load(args: argparse.Namespace | None = None, environ=None) -> Config:
    """Build the configuration from the TOML file, the environment and parsed arguments."""
    environ = os.environ if environ is None else environ
    values: dict = {}
    cfg_file = getattr(args, "config", None) or environ.get("SPARSEKV_CONFIG")
    if cfg_file:
        try:
            with open(cfg_file, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as e:
            raise ConfigError(f"cannot read config file {cfg_file}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {cfg_file} is not valid TOML: {e}") from None
        section = data.get("sparsekvd", data)
        for k, v in section.items():
            values[k] = _coerce(k, v, f"config file {cfg_file}")
    for f in fields(Config):
        env_name = "SPARSEKV_" + f.name.upper()
        if env_name in environ:
            values[f.name] = _coerce(f.name, environ[env_name], f"environment {env_name}")
    if args is not None:
        for f in fields(Config):
            v = getattr(args, f.name, None)
            if v is not None:
                values[f.name] = _coerce(f.name, v, f"--{f.name.replace('_', '-')}")
    return Config(**values).validate()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Command-line flags for every setting (all default to None: 'not given')."""
    p.add_argument("--config", metavar="FILE.toml", help="TOML file with settings (table [sparsekvd] or top level)")
    p.add_argument("--backend", choices=["auto", "cpu", "cuda"])
    p.add_argument("--run-dir", dest="run_dir", metavar="DIR", help="sockets live here (default $RUNTIME_DIRECTORY or /run/sparsekv)")
    p.add_argument("--pool-size", dest="pool_size", metavar="SIZE", help="host pool size, e.g. 256MiB, 64GiB")
    p.add_argument("--prefault-threads", dest="prefault_threads", type=int, metavar="N")
    p.add_argument("--devices", metavar="all|0,1,..")
    p.add_argument("--max-clients", dest="max_clients", type=int, metavar="N")
    p.add_argument("--reap-interval-s", dest="reap_interval_s", type=float, metavar="S")
    p.add_argument("--busy-poll-us", dest="busy_poll_us", type=int, metavar="US")
    p.add_argument("--shm-dir", dest="shm_dir", metavar="DIR")
    p.add_argument("--kernel-cache-dir", dest="kernel_cache_dir", metavar="DIR")
    p.add_argument("--gather-blocks", dest="gather_blocks", type=int, metavar="N")
    p.add_argument("--device-arena-size", dest="device_arena_size", metavar="SIZE",
                   help="cuda: one allocation per GPU holding every rank's slab and rings, e.g. 16GiB")
    p.add_argument("--ring-depth", dest="ring_depth", type=int, metavar="N")
    p.add_argument("--log-level", dest="log_level", choices=["debug", "info", "warning", "error"])

