"""Daemon configuration: one frozen dataclass.

Precedence: defaults < TOML file (``--config``) < ``SPARSEKV_*`` environment < command line.
Each setting has one environment name, ``SPARSEKV_<NAME>`` (``SPARSEKV_POOL_SIZE``, ...).
``sparsekvd --print-config`` shows the result as TOML, each value with where it came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import tomllib
from dataclasses import dataclass, fields

from sparsekv.proto.cpus import parse_cpu_list

_UNITS = {
    "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}


class ConfigError(ValueError):
    """A setting has a bad value; the message names the setting and where it came from."""


def parse_size(text: str | int, *, unit_required: bool = True) -> int:
    """``'64GiB'`` -> bytes: a number with a unit, B/KiB/MiB/GiB/TiB (or KB/MB/GB/TB, powers
    of 1000). A number without a unit is an error unless ``unit_required`` is False: in a
    config file ``pool_size = 64`` meant as GiB would silently be 64 bytes."""
    if isinstance(text, bool):
        raise ValueError(f"bad size {text!r}; use e.g. 256MiB or 64GiB")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        if unit_required:
            raise ValueError(f"size {text} has no unit; write e.g. \"{text}B\", 256MiB or 64GiB")
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or (m.group(2) and m.group(2).lower() not in _UNITS):
        raise ValueError(f"bad size {text!r}; use e.g. 256MiB, 64GiB or 4096B")
    if not m.group(2):
        if unit_required:
            raise ValueError(f"size {text.strip()!r} has no unit; write e.g. \"{text.strip()}B\", 256MiB or 64GiB")
        if "." in m.group(1):
            raise ValueError(f"bad size {text!r}: a byte count is a whole number")
        return int(m.group(1))
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
    shm_dir: str = "/dev/shm"  # where older versions put slab files (slabs are memfds now)
    kernel_cache_dir: str = ""  # cuda: compiled kernel cache ("" = ~/.cache/sparsekv/kernels)
    gather_blocks: int = 32  # cuda: thread blocks the gather may use (SMs shared with attention)
    device_arena_size: int = 16 << 30  # cuda: bytes of the one allocation per GPU for slabs and rings
    ring_depth: int = 8  # cuda: top-k requests a rank may have in flight (events and result entries)
    # After a request, keep polling the control socket this long before sleeping: the next
    # request of a decode step then costs no wake-up (tens of microseconds in a VM).
    # -1: 1000 on the cuda backend, 0 (off) on the cpu backend.
    busy_poll_us: int = -1
    # Where the ZeroMQ hop runs (proto/cpus.py): the CPUs of the daemon's libzmq I/O
    # threads (its other threads keep off them), and CPUs kept from halting by an
    # idle-priority busy loop each. In a VM a halted vCPU takes tens of microseconds to
    # wake, and a request/reply wakes up to four threads: give the daemon's and the
    # engines' I/O threads (Client io_cpus) warm CPUs. "" (default): not pinned, none warm.
    io_cpus: str = ""
    warm_cpus: str = ""
    # Prometheus text on http://127.0.0.1:<port>/metrics, served by the daemon's own loop;
    # 0: off (the stats socket's `prometheus` command serves the same text).
    metrics_port: int = 0
    # Most memory one rank's ATTACH may take in the daemon: hot slab + staging buffer +
    # residency state (owner and lru, 8 bytes per slot and index group), checked before
    # anything is allocated (residency/base.py check_layout_limits).
    max_slab_bytes: int = 16 << 30
    # Members of this group may join any user's engine (operators' tools); -1: none.
    admin_gid: int = -1
    # Per-uid quotas (0: none beyond the daemon-wide limits). What one user's clients may
    # hold: sessions (HELLO), and pool bytes of the engines it created; QUOTA_EXCEEDED
    # beyond, checked before anything is allocated. Root is counted like anyone else.
    max_clients_per_uid: int = 0
    max_pool_bytes_per_uid: int = 0
    # Connections to control.sock (each costs the daemon a file descriptor): at most this
    # many from one uid (0: no cap; more are closed at once and counted), each of which
    # must send a HELLO within hello_timeout_s (else closed and counted; a process that
    # said HELLO lately needs none on its next connections: libzmq's reconnects). A session not attached (never, or no more) is dropped after
    # idle_timeout_s without a request; its connection stays (an attached rank may idle
    # as long as its process lives).
    max_connections_per_uid: int = 0
    hello_timeout_s: float = 10.0
    idle_timeout_s: float = 600.0
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
        # nan compares false with everything: `nan <= 0` would let it through, and the
        # reaper would never run (inf: the same).
        if not math.isfinite(self.reap_interval_s) or not 0 < self.reap_interval_s <= 3600:
            raise ConfigError(f"reap_interval_s must be a number of seconds in (0, 3600], got {self.reap_interval_s}")
        if self.max_slab_bytes <= 0:
            raise ConfigError("max_slab_bytes must be positive")
        if not -1 <= self.admin_gid < 2**32 - 1:
            raise ConfigError(f"admin_gid must be a group id, or -1 for none, got {self.admin_gid}")
        for name in ("max_clients_per_uid", "max_connections_per_uid"):
            if not 0 <= getattr(self, name) <= 1_000_000:
                raise ConfigError(f"{name} must lie in [0, 1000000] (0: no cap), got {getattr(self, name)}")
        if self.max_pool_bytes_per_uid < 0:
            raise ConfigError(f"max_pool_bytes_per_uid must be >= 0 (0: no quota), got {self.max_pool_bytes_per_uid}")
        for name in ("hello_timeout_s", "idle_timeout_s"):
            v = getattr(self, name)
            if not math.isfinite(v) or not 0 < v <= 86400:
                raise ConfigError(f"{name} must be a number of seconds in (0, 86400], got {v}")
        if self.prefault_threads < 0 or self.prefault_threads > 1024:
            raise ConfigError(f"prefault_threads must lie in [0, 1024] (0: one per core), got {self.prefault_threads}")
        if self.max_clients > 1_000_000:
            raise ConfigError(f"max_clients must lie in [1, 1000000], got {self.max_clients}")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must lie in [0, 65535] (0: off), got {self.metrics_port}")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")
        for name in ("io_cpus", "warm_cpus"):
            try:
                parse_cpu_list(getattr(self, name), name)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.devices != "all" and not re.fullmatch(r"\d+(,\d+)*", self.devices):
            raise ConfigError(f"devices must be 'all' or a comma list of ordinals, got {self.devices!r}")
        return self

    def to_toml(self, sources: dict[str, str] | None = None) -> str:
        """The settings as TOML; with ``sources`` (from :func:`load_with_sources`) each line
        ends with a comment saying where its value came from."""
        lines = []
        if sources is not None:
            lines.append("# effective sparsekvd settings; after each: default, file, env or flag")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in _SIZES:
                line = f'{f.name} = "{format_size(v)}"'
            elif isinstance(v, str):
                line = f"{f.name} = {_toml_str(v)}"
            else:
                line = f"{f.name} = {v}"
            if sources is not None:
                line = f"{line:<40} # {sources.get(f.name, 'default')}"
            lines.append(line)
        return "\n".join(lines) + "\n"


_SIZES = ("pool_size", "device_arena_size", "max_slab_bytes", "max_pool_bytes_per_uid")
_CPU_LISTS = ("io_cpus", "warm_cpus")

# What each setting means, for --help (its default and environment name are added).
_HELP = {
    "backend": "auto: cuda when CuPy sees a GPU, else cpu",
    "run_dir": "where the sockets and the lock live",
    "pool_size": "host pool for every engine's KV rows, with a unit: 256MiB, 64GiB",
    "prefault_threads": "threads that pre-fault the pool; 0: one per core, at most 16",
    "devices": "cuda: GPUs to serve, 'all' or a comma list of ordinals",
    "max_clients": "connected clients (engine ranks) at most",
    "reap_interval_s": "seconds between checks for dead client processes",
    "shm_dir": "where older versions put slab files; stale ones of this run dir are removed at start",
    "kernel_cache_dir": "cuda: compiled kernel cache; '' = ~/.cache/sparsekv/kernels",
    "gather_blocks": "cuda: thread blocks the gather may use (SMs are shared with attention)",
    "device_arena_size": "cuda: one allocation per GPU for every rank's slab and rings, with a unit",
    "ring_depth": "cuda: top-k requests a rank may have in flight",
    "busy_poll_us": "poll the control socket this long after a request; -1: 1000 on cuda, 0 on cpu",
    "io_cpus": "CPUs for the daemon's ZeroMQ I/O threads (e.g. 3 or 2-3); '': not pinned",
    "warm_cpus": "CPUs kept from halting by an idle-priority busy loop each (VMs: see docs); '': none",
    "metrics_port": "serve Prometheus text on http://127.0.0.1:PORT/metrics; 0: off",
    "max_slab_bytes": "most memory one rank may take (hot slab + staging + residency state), with a unit",
    "admin_gid": "members of this group may join any user's engine; -1: nobody but root",
    "max_clients_per_uid": "connected clients of one uid at most; 0: no cap beyond max_clients",
    "max_pool_bytes_per_uid": "pool bytes of the engines one uid created, with a unit; 0B: no quota",
    "max_connections_per_uid": "open control connections of one uid at most (more are closed); 0: no cap",
    "hello_timeout_s": "a control connection that sends no HELLO within this is closed",
    "idle_timeout_s": "a session not attached is dropped after this long without a request",
    "log_level": "debug, info, warning or error",
}


def env_name(setting: str) -> str:
    """The one environment variable of ``setting``."""
    return "SPARSEKV_" + setting.upper()


def _toml_str(v: str) -> str:
    return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _coerce(name: str, value, source: str, *, unit_required: bool = True):
    """``value`` as setting ``name`` wants it. Text (environment, flags) is parsed; a
    TOML value must already have the right type: ``max_clients = 2.7`` is an error, not 2,
    and ``true`` is not 1."""
    kinds = {f.name: f.type for f in fields(Config)}
    if name not in kinds:
        raise ConfigError(f"{source}: unknown setting {name!r}")
    kind = kinds[name]
    try:
        if name in _CPU_LISTS:
            if type(value) is int:  # io_cpus = 63 in a TOML file
                value = str(value)
            if not isinstance(value, str):
                raise ValueError(f"a CPU list is text such as \"62-63\", got {_toml_type(value)} {value!r}")
            parse_cpu_list(value, "a CPU list")
            return value
        if name in _SIZES:
            if not isinstance(value, (str, int)) or isinstance(value, bool):
                raise ValueError(f"a size is text with a unit such as \"64GiB\", got {_toml_type(value)}")
            return parse_size(value, unit_required=unit_required)
        if kind == "int":
            if isinstance(value, str):
                return int(value.strip())
            if type(value) is not int:
                raise ValueError(f"an integer is needed, got {_toml_type(value)} {value!r}")
            return value
        if kind == "float":
            if isinstance(value, str):
                v = float(value.strip())
            elif type(value) in (int, float):
                v = float(value)
            else:
                raise ValueError(f"a number is needed, got {_toml_type(value)} {value!r}")
            if not math.isfinite(v):
                raise ValueError(f"{value!r} is not a finite number")
            return v
        if not isinstance(value, str):
            raise ValueError(f"text is needed, got {_toml_type(value)} {value!r}")
        return value
    except (TypeError, ValueError, OverflowError) as e:
        raise ConfigError(f"{source}: bad value for {name}: {e}") from None


def _toml_type(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a float", str: "text", list: "an array",
            dict: "a table"}.get(type(value), type(value).__name__)


def load(args: argparse.Namespace | None = None, environ=None) -> Config:
    """Build the configuration from the TOML file, the environment and parsed arguments."""
    return load_with_sources(args, environ)[0]


def load_with_sources(args: argparse.Namespace | None = None, environ=None) -> tuple[Config, dict[str, str]]:
    """:func:`load`, and for each setting where its value came from: ``default``,
    ``file PATH``, ``env NAME`` or ``flag --NAME``."""
    environ = os.environ if environ is None else environ
    values: dict = {}
    sources: dict[str, str] = {f.name: "default" for f in fields(Config)}
    if os.environ.get("RUNTIME_DIRECTORY"):  # what default_run_dir() reads
        sources["run_dir"] = "default (env RUNTIME_DIRECTORY, set by systemd)"
    cfg_file = getattr(args, "config", None) or environ.get("SPARSEKV_CONFIG")
    if cfg_file:
        try:
            with open(cfg_file, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as e:
            raise ConfigError(f"cannot read config file {cfg_file}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {cfg_file} is not valid TOML: {e}") from None
        section = _settings_table(data, cfg_file)
        for k, v in section.items():
            values[k] = _coerce(k, v, f"config file {cfg_file}")
            sources[k] = f"file {cfg_file}"
    for f in fields(Config):
        name = env_name(f.name)
        if name in environ:
            values[f.name] = _coerce(f.name, environ[name], f"environment {name}")
            sources[f.name] = f"env {name}"
    if args is not None:
        for f in fields(Config):
            v = getattr(args, f.name, None)
            if v is not None:
                flag = f"--{f.name.replace('_', '-')}"
                values[f.name] = _coerce(f.name, v, flag)
                sources[f.name] = f"flag {flag}"
    return Config(**values).validate(), sources


def _settings_table(data: dict, cfg_file: str) -> dict:
    """The settings of a parsed TOML file: the table ``[sparsekvd]``, or the top level
    when there is none. Anything else (another table, an array of tables, settings both
    inside and outside ``[sparsekvd]``) is a one-line error, not a traceback or a setting
    silently ignored."""
    where = f"config file {cfg_file}"
    if "sparsekvd" in data:
        section = data["sparsekvd"]
        if not isinstance(section, dict):
            raise ConfigError(f"{where}: sparsekvd must be a table ([sparsekvd]), got {_toml_type(section)}")
        others = sorted(k for k in data if k != "sparsekvd")
        if others:
            raise ConfigError(f"{where}: {others} outside the table [sparsekvd]; put every setting in it")
        data = section
    for k, v in data.items():
        if isinstance(v, dict) or (isinstance(v, list) and v and all(isinstance(x, dict) for x in v)):
            known = {f.name for f in fields(Config)}
            what = f"setting {k} cannot be a table" if k in known else f"unknown table [{k}]"
            raise ConfigError(f"{where}: {what}; settings are plain keys (at the top level or in [sparsekvd])")
    return data


def _default_text(f: dataclasses.Field) -> str:
    if f.name == "run_dir":
        return "$RUNTIME_DIRECTORY or /run/sparsekv"
    v = f.default
    if f.name in _SIZES:
        return format_size(v)
    return repr(v) if isinstance(v, str) else str(v)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Command-line flags for every setting. Each defaults to None ('not given', so the
    file and the environment apply); its help shows the built-in default and its one
    environment name."""
    p.add_argument("--config", metavar="FILE.toml",
                   help="TOML file with settings (table [sparsekvd] or top level) (default: none; env SPARSEKV_CONFIG)")
    metavars = {"pool_size": "SIZE", "device_arena_size": "SIZE", "max_slab_bytes": "SIZE", "run_dir": "DIR",
                "shm_dir": "DIR",
                "kernel_cache_dir": "DIR", "devices": "all|0,1,..", "reap_interval_s": "S", "busy_poll_us": "US",
                "metrics_port": "PORT", "io_cpus": "CPUS", "warm_cpus": "CPUS"}
    choices = {"backend": ["auto", "cpu", "cuda"], "log_level": ["debug", "info", "warning", "error"]}
    types = {"int": int, "float": float}
    for f in fields(Config):
        kw = {"dest": f.name,
              "help": f"{_HELP[f.name]} (default: {_default_text(f)}; env {env_name(f.name)})"}
        if f.name in choices:
            kw["choices"] = choices[f.name]
        else:
            kw["metavar"] = metavars.get(f.name, "N")
        if f.name not in _SIZES and f.type in types:
            kw["type"] = types[f.type]
        p.add_argument(f"--{f.name.replace('_', '-')}", **kw)
