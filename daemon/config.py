"""Daemon configuration: one frozen dataclass, every setting a field.

Precedence: defaults < TOML file (``--config``) < ``SPARSEKV_*`` environment < command line.
Each setting has one environment name, ``SPARSEKV_<NAME>``, read through
``proto/settings.py``, and one flag, ``--<name>``. A bad value is one :class:`ConfigError`
line naming the setting and its source.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import tomllib
from dataclasses import MISSING, dataclass, field, fields

from sparsekv.proto.cpus import parse_cpu_list
from sparsekv.proto.args import breaks_line
from sparsekv.proto.settings import (KERNEL_CACHE_DIR, Setting, SettingError, default_run_dir, format_size, parse_bool,
                                     parse_float, parse_int, parse_size, size_text)

ConfigError = SettingError  # a bad setting; the message names it and where it came from

PIN_PAGE_BYTES = 2 << 20  # pool registrations are whole huge pages


def _s(default, help: str, *, kind: str = "", choices: tuple = (), bounds: tuple = (), debug: bool = False,
       metavar: str = "", shown: str = "", factory=None):
    """A setting's field: its default and help line; ``kind`` where the annotation does
    not say it (``size``: bytes with a unit; ``cpus``: a CPU list); ``bounds`` ``(lo, hi)``
    (``hi`` None: none; a float's ``lo`` is excluded); ``shown``: the default in ``--help``."""
    meta = {"help": help, "kind": kind, "choices": choices, "bounds": bounds, "debug": debug, "metavar": metavar,
            "shown": shown}
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


@dataclass(frozen=True)
class Config:
    """Everything the daemon can be told. Units are in the names (sizes are bytes)."""

    backend: str = _s("auto", "auto: cuda when CuPy sees a GPU, else cpu", choices=("auto", "cpu", "cuda"))
    run_dir: str = _s(None, "where the sockets and the lock live", factory=default_run_dir, metavar="DIR",
                      shown="$RUNTIME_DIRECTORY or /run/sparsekv")
    pool_size: int = _s(1 << 30, "host pool for every engine's KV rows (all layers), with a unit: 256MiB, 64GiB; "
                        "at least 2MiB (an engine's range is whole 2 MiB pages)", kind="size", bounds=(2 << 20, None))
    pool_backing: str = _s("anon_thp", "anon_thp: anonymous memory in transparent huge pages; memfd: shared "
                           "memory in small pages (ten times slower to pre-fault)", choices=("anon_thp", "memfd"))
    prefault_threads: int = _s(0, "threads that pre-fault the pool; 0: one per core, at most 16", bounds=(0, 1024))
    pin_pool_at_start: str = _s("1", "cuda: page-lock the pool chunk by chunk while it is pre-faulted (1), once "
                                "it is (after), or each engine's range at its attach (0)", choices=("1", "after", "0"))
    pin_chunk_gib: float = _s(4.0, "cuda: the largest cudaHostRegister call on the pool, at start or at attach, "
                              "in GiB (rounded to whole 2 MiB pages)", bounds=(0, 1 << 20), metavar="GIB")
    devices: str = _s("all", "cuda: GPUs to serve, 'all' or a comma list of ordinals", metavar="all|0,1,..")
    max_clients: int = _s(256, "connected clients (engine ranks) at most", bounds=(1, 1_000_000))
    reap_interval_s: float = _s(2.0, "seconds between checks for dead client processes (they are detached); "
                                "more than 0.01 (less kept a core busy)", bounds=(0.01, 3600), metavar="S")
    shm_dir: str = _s("/dev/shm", "where older versions put slab files; stale ones of this run dir are removed at "
                      "start", metavar="DIR")
    kernel_cache_dir: str = _s(None, "cuda: compiled kernel cache", metavar="DIR",
                               factory=lambda: os.path.expanduser(KERNEL_CACHE_DIR.default), shown=KERNEL_CACHE_DIR.default)
    gather_blocks: int = _s(32, "cuda: thread blocks the gather may use (SMs are shared with attention)",
                            bounds=(1, None))
    device_arena_size: int = _s(16 << 30, "cuda: one allocation per GPU for every rank's slab and rings, with a "
                                "unit", kind="size", bounds=(1, None))
    ring_depth: int = _s(8, "cuda: top-k requests a rank may have in flight", bounds=(1, 1024))
    # A module load waits for every stream of the GPU, a parked doorbell stream too: at an
    # attach it would hold the daemon's loop until that rank's engine rings again.
    warm_row_bytes: str = _s("656", "cuda: the row sizes (bytes, a comma list of multiples of 16) whose copy "
                             "kernels are loaded at start; a layout of another row size loads them at its first "
                             "attach, which waits for any parked doorbell stream of the GPU", metavar="LIST")
    # The next request of a decode step then costs no wake-up (tens of microseconds in a VM).
    busy_poll_us: int = _s(-1, "poll the control socket this long after a request before sleeping; -1: 1000 on "
                           "cuda, 0 on cpu", bounds=(-1, 1_000_000), metavar="US")
    # In a VM a halted vCPU takes tens of microseconds to wake: give the daemon's loop a
    # warm CPU (proto/cpus.py).
    io_cpus: str = _s("", "CPUs of the daemon's loop thread, which reads and writes the control socket (its other "
                      "threads keep off them), e.g. 3 or 2-3; '': not pinned", kind="cpus", metavar="CPUS")
    warm_cpus: str = _s("", "CPUs kept from halting by an idle-priority busy loop each (VMs: deploy/README.md); "
                        "'': none", kind="cpus", metavar="CPUS")
    metrics_port: int = _s(0, "serve Prometheus text on http://127.0.0.1:PORT/metrics from the daemon's loop; "
                           "0: off (the stats socket serves the same)", bounds=(0, 65535), metavar="PORT")
    max_slab_bytes: int = _s(16 << 30, "most memory one rank's attach may take (hot slab + staging + residency "
                             "state, 9 bytes per slot and index group), with a unit", kind="size", bounds=(1, None))
    tp_max_lag: int = _s(256, "requests a TP group's ranks may run ahead of its slowest rank (attach with "
                         "tp_size): the group keeps that many resolved top-k batches for the ranks still to "
                         "reach them; one more is refused (TP_LAG); at least 2 (a TOPK carrying its STEP makes "
                         "two)", bounds=(2, 65536))
    tp_max_lag_bytes: int = _s(1 << 30, "bytes of the entries the TP groups of one uid's engines keep for their "
                               "slowest ranks (resolved batches: about 4 x the top-k's bytes each, 6 x with prefetch), "
                               "with a unit; a request that would keep more is refused (TP_LAG)", kind="size",
                               bounds=(1 << 20, None))
    admin_gid: int = _s(-1, "members of this group may join any user's engine, naming its owner (ATTACH "
                        "owner_uid); -1: nobody but root", bounds=(-1, 2**32 - 2))
    # Per-uid quotas, checked before anything is allocated; root counts like anyone. The
    # client and connection caps are on by default (-1: sized from max_clients, see
    # uid_client_cap / uid_connection_cap) so that one uid cannot lock out the others.
    max_clients_per_uid: int = _s(-1, "sessions (HELLO) of one uid at most; -1: max_clients // 4 (at least 1); "
                                  "0: no cap beyond max_clients", bounds=(-1, 1_000_000))
    max_pool_bytes_per_uid: int = _s(0, "pool bytes of the engines one uid created, with a unit; 0B: no quota",
                                     kind="size", bounds=(0, None))
    max_blocks_per_uid: int = _s(0, "block store blocks one uid's sessions hold private, reserved or pinned (a "
                                 "block once for each session pinning it), over every engine's store (DESIGN §9); "
                                 "0: no quota", bounds=(0, 2**40))
    max_store_bytes: int = _s(2 << 30, "daemon memory the block stores' bookkeeping may take, with a unit: "
                              "8 KiB and about 200 B to 1.1 KiB a block of every store (its arrays, key table and "
                              "chain memo) and 8 B a block for each rank attached to one, whatever the rows' size; "
                              "an ATTACH beyond it is POOL_FULL unless engines kept for their cached blocks yield; "
                              "0B: no cap", kind="size",
                              bounds=(0, None))
    max_store_share_per_uid: float = _s(0.5, "share of max_store_bytes one uid's stores (its engines') and "
                                        "ranks may take (QUOTA_EXCEEDED beyond it)", bounds=(0.01, 1),
                                        metavar="F")
    max_slab_share_per_uid: float = _s(0.5, "share of this host's memory that the ranks one uid's clients attached "
                                       "may take together (each bounded by max_slab_bytes: hot slab, staging, "
                                       "residency state; the cpu backend's, host memory); 1: the whole memory", bounds=(0.01, 1),
                                       metavar="F")
    # Each connection costs a file descriptor; a process that said HELLO lately has no deadline.
    max_connections_per_uid: int = _s(-1, "open control connections of one uid at most (more are closed at once "
                                      "and counted); -1: twice the per-uid client cap, at least 16; 0: no cap",
                                      bounds=(-1, 1_000_000))
    # Frames over 4 KiB are read into this budget; a connection waits (unread) while it is
    # spent, so the daemon's memory for requests stays bounded (daemon/control_socket.py).
    inflight_bytes: int = _s(256 << 20, "bytes of requests being read or waiting to be served, all connections "
                             "together (a quarter per uid), with a unit; at least 64MiB", kind="size",
                             bounds=(64 << 20, None))
    hello_timeout_s: float = _s(10.0, "a control connection that sends no HELLO within this is closed",
                                bounds=(0.1, 86400), metavar="S")
    idle_timeout_s: float = _s(600.0, "a session not attached is dropped after this long without a request",
                               bounds=(0.1, 86400), metavar="S")
    log_level: str = _s("info", "debug, info, warning or error", choices=("debug", "info", "warning", "error"))
    cuda_graphs: bool = _s(True, "cuda: replay one captured CUDA graph per request; 0: launch kernel by kernel "
                           "(for compute-sanitizer)", debug=True, metavar="1|0")

    @property
    def pin_chunk_bytes(self) -> int:
        """``pin_chunk_gib`` in bytes: whole 2 MiB pages, at least one."""
        return max(1, round(self.pin_chunk_gib * (1 << 30) / PIN_PAGE_BYTES)) * PIN_PAGE_BYTES

    @property
    def uid_slab_cap(self) -> int:
        """Bytes the ranks of one uid may take together: ``max_slab_share_per_uid`` of this
        host's memory."""
        import psutil  # noqa: PLC0415 - read once, at start

        return int(self.max_slab_share_per_uid * psutil.virtual_memory().total)

    @property
    def uid_client_cap(self) -> int:
        """Sessions one uid may hold (0: no cap): ``max_clients_per_uid``, or for -1 a
        quarter of ``max_clients`` (at least 1), so one uid leaves three quarters to others."""
        if self.max_clients_per_uid >= 0:
            return self.max_clients_per_uid
        return max(1, self.max_clients // 4)

    @property
    def uid_connection_cap(self) -> int:
        """Control connections one uid may hold open (0: no cap): ``max_connections_per_uid``,
        or for -1 twice the per-uid client cap (a client's connection plus a reconnect or a
        probe each), at least 16."""
        if self.max_connections_per_uid >= 0:
            return self.max_connections_per_uid
        return max(16, 2 * (self.uid_client_cap or self.max_clients))

    def validate(self) -> "Config":
        """Self, when every value lies in its range; else ConfigError naming the first that does not."""
        for f in fields(self):
            try:
                _check(f, getattr(self, f.name))
            except ValueError as e:
                raise ConfigError(str(e)) from None
        return self

    def to_toml(self, sources: dict[str, str] | None = None) -> str:
        """The settings as TOML; with ``sources`` (from :func:`load_with_sources`) each line
        ends with a comment saying where its value came from, and whether it is a debug switch."""
        lines = [] if sources is None else ["# effective sparsekvd settings; after each: default, file, env or flag"]
        for f in fields(self):
            line = f"{f.name} = {_toml_value(f, getattr(self, f.name))}"
            if sources is not None:
                debug = " (debug switch)" if f.metadata["debug"] else ""
                line = f"{line:<40} # {sources.get(f.name, 'default')}{debug}"
            lines.append(line)
        return "\n".join(lines) + "\n"


_FIELDS = {f.name: f for f in fields(Config)}


def _kind(f) -> str:
    return f.metadata["kind"] or f.type  # the annotation's name: int, float, bool, str


def _cpu_text(text: str) -> str:
    parse_cpu_list(text, "a CPU list")
    return text.strip()


_PARSERS = {"int": parse_int, "float": parse_float, "bool": parse_bool, "size": parse_size, "cpus": _cpu_text}
_SETTINGS = {f.name: Setting(f.name, _PARSERS.get(_kind(f), str.strip),
                             f.default if f.default is not MISSING else f.default_factory, f.metadata["help"])
             for f in fields(Config)}


def _config_path(text: str) -> str:
    path = text.strip()
    if not path:  # (a blank value is a mistake, not "no file": the unset variable says that)
        raise ValueError("a blank path; name the file, or unset the variable")
    return path


CONFIG_FILE = Setting("config", _config_path, "", "the TOML file of sparsekvd's settings (--config)")


def unknown_env(environ=None) -> list[str]:
    """One line for each ``SPARSEKV_*`` variable set in ``environ`` whose name is close to a
    setting's but is none, nor a variable another part of sparsekv reads
    (``proto/settings.py``): a misspelt setting would be ignored without a word (the TOML
    file refuses an unknown key). Names close to none are left alone: the prefix is shared
    with clients and tools. Names are shown escaped (one line each, valid in a TOML comment)."""
    from sparsekv.proto import settings as proto_settings  # noqa: PLC0415 - its variables, at call time

    environ = os.environ if environ is None else environ
    daemon = {s.env[len("SPARSEKV_"):]: s.env for s in [*_SETTINGS.values(), CONFIG_FILE]}
    known = set(daemon.values()) | {v.env for v in vars(proto_settings).values() if isinstance(v, Setting)}
    lines = []
    for name in sorted(environ):
        if not name.startswith("SPARSEKV_") or not environ[name] or name in known:
            continue
        near = difflib.get_close_matches(name[len("SPARSEKV_"):], daemon, n=1, cutoff=0.8)
        if near:
            shown = name if re.fullmatch(r"\w+", name, re.ASCII) else ascii(name)
            lines.append(f"{shown} is set but is no setting of sparsekvd (did you mean {daemon[near[0]]}?): ignored")
    return lines


def cuda_settings_ignored(sources: dict[str, str]) -> str | None:
    """The settings of the cuda backend alone (their help says ``cuda:``) given in a file,
    the environment or a flag, as the cpu backend's start says it ignores them; None when
    there are none."""
    given = [f"{name} ({sources[name]})" for name, f in _FIELDS.items() if f.metadata["help"].startswith("cuda:")
             and name in sources and not sources[name].startswith("default")]
    return f"the cpu backend ignores the cuda settings given: {', '.join(given)}" if given else None


def moot_settings(cfg: "Config", sources: dict[str, str]) -> list[str]:
    """Limits that another setting makes moot, or that no block store fits, a line each
    naming the settings and where they came from (the start logs them as warnings,
    ``--print-config`` prints them): each is taken as it is."""
    def named(name: str, shown) -> str:
        return f"{name} {shown} ({sources.get(name, 'default')})"

    out = []
    if cfg.max_clients_per_uid > cfg.max_clients:
        out.append(f"{named('max_clients_per_uid', cfg.max_clients_per_uid)} is more than "
                   f"{named('max_clients', cfg.max_clients)}: no uid reaches it")
    if cfg.max_pool_bytes_per_uid > cfg.pool_size:
        out.append(f"{named('max_pool_bytes_per_uid', format_size(cfg.max_pool_bytes_per_uid))} is more than "
                   f"{named('pool_size', format_size(cfg.pool_size))}: no uid reaches it")
    if cfg.backend != "cpu" and cfg.max_slab_bytes > cfg.device_arena_size:
        out.append(f"{named('max_slab_bytes', format_size(cfg.max_slab_bytes))} is more than "
                   f"{named('device_arena_size', format_size(cfg.device_arena_size))}: a rank's attach is bounded "
                   "by its GPU's arena")
    if cfg.max_store_bytes:
        from .store_room import least_store_bytes  # (the block store's arrays: numpy, only here)
        least = least_store_bytes()
        if cfg.max_store_bytes < least:
            out.append(f"{named('max_store_bytes', format_size(cfg.max_store_bytes))} is less than a block store "
                       f"of one block and one rank takes ({least} bytes): every attach with a block size is refused")
        elif int(cfg.max_store_bytes * cfg.max_store_share_per_uid) < least:
            out.append(f"{named('max_store_share_per_uid', cfg.max_store_share_per_uid)} of "
                       f"{named('max_store_bytes', format_size(cfg.max_store_bytes))} is less than a block store of "
                       f"one block and one rank takes ({least} bytes): every attach with a block size is refused")
    return out


def env_name(setting: str) -> str:
    """The one environment variable of ``setting``."""
    return _SETTINGS[setting].env


def _check(f, v) -> None:
    """ValueError naming setting ``f`` when ``v`` is not one of its choices or out of its bounds."""
    m, kind = f.metadata, _kind(f)
    if isinstance(v, str):
        try:
            v.encode()
        except UnicodeEncodeError:  # bytes the locale could not decode: the TOML of --print-config cannot hold them
            raise ValueError(f"{f.name} must be UTF-8 text, got {v!r}") from None
    if f.name.endswith("_dir") and isinstance(v, str) and not v.strip():
        raise ValueError(f"{f.name} must name a directory, got {v!r}")
    if m["choices"] and v not in m["choices"]:
        raise ValueError(f"{f.name} must be {', '.join(m['choices'][:-1])} or {m['choices'][-1]}, got {v!r}")
    if m["bounds"]:
        lo, hi = m["bounds"]
        shown = size_text if kind == "size" else str
        if kind == "float":  # nan fails both comparisons
            ok, want = lo < v and (hi is None or v <= hi), f"in ({lo}, {hi}]"
        else:
            ok, want = lo <= v and (hi is None or v <= hi), f"in [{lo}, {hi}]"
        if hi is None:
            want = "positive" if lo == 1 else f">= {shown(lo)}"
        if not ok:
            raise ValueError(f"{f.name} must be {want}, got {shown(v)}")
    if kind == "cpus":
        parse_cpu_list(v, f.name)
    if f.name == "devices" and v != "all" and not re.fullmatch(r"[0-9]+(,[0-9]+)*", v):
        raise ValueError(f"devices must be 'all' or a comma list of ordinals, got {v!r}")
    if f.name == "warm_row_bytes" and (not re.fullmatch(r"[0-9]+(,[0-9]+)*", v)
                                       or any(int(x) <= 0 or int(x) % 16 for x in v.split(","))):
        raise ValueError(f"warm_row_bytes must be a comma list of positive multiples of 16, got {v!r}")


_NEEDS = {"int": "an integer is needed", "float": "a number is needed", "bool": "true or false is needed",
          "str": "text is needed", "size": 'a size is text with a unit such as "64GiB"',
          "cpus": 'a CPU list is text such as "62-63"'}


def _from_toml(f, value):
    """A TOML value must already have the setting's type: ``max_clients = 2.7`` is an
    error, not 2, and ``true`` is not 1. Text is parsed as the environment's is."""
    kind = _kind(f)
    if type(value) is int and kind == "size":
        return parse_size(value)  # raises: a size needs its unit
    if type(value) is int and kind == "cpus":
        value = str(value)  # io_cpus = 63
    if type(value) is int and any(c.isdigit() for c in f.metadata["choices"]):
        value = str(value)  # pin_pool_at_start = 1: checked against the choices as text
    if type(value) not in {"int": (int,), "float": (int, float), "bool": (bool,)}.get(kind, (str,)):
        raise ValueError(f"{_NEEDS[kind]}, got {_toml_type(value)} {value!r}")
    if kind == "float" and not math.isfinite(value):
        raise ValueError(f"{value!r} is not a finite number")
    if isinstance(value, str):
        return _SETTINGS[f.name].parse(value)
    return float(value) if kind == "float" else value


def _coerce(name: str, value, where: str, convert):
    """``value`` of setting ``name`` from ``where``, converted and checked; ConfigError
    naming both otherwise."""
    f = _FIELDS.get(name)
    if f is None:
        near = difflib.get_close_matches(str(name).lower(), list(_FIELDS), n=1, cutoff=0.8)
        raise ConfigError(f"{where}: unknown setting {name!r}" + (f" (did you mean {near[0]}?)" if near else ""))
    try:
        value = convert(f, value)
    except (ValueError, OverflowError) as e:
        raise ConfigError(f"{where}: bad value for {name}: {e}") from None
    if isinstance(value, str) and "\x00" in value:
        raise ConfigError(f"{where}: bad value for {name}: text with a NUL character")
    try:
        _check(f, value)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    return value


def _toml_value(f, v) -> str:
    if _kind(f) == "size":
        return f'"{size_text(v)}"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return _toml_string(v)
    return str(v)


_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_string(v: str) -> str:
    """``v`` as a TOML basic string on one line that reads back as ``v``: its quote,
    backslash, control characters and line separators escaped."""
    out = []
    for ch in v:
        esc = _TOML_ESCAPES.get(ch)
        if esc is None and breaks_line(ch):
            esc = f"\\u{ord(ch):04X}"
        out.append(esc or ch)
    return '"' + "".join(out) + '"'


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
    values: dict = {"run_dir": default_run_dir(environ)}
    sources: dict[str, str] = {name: "default" for name in _FIELDS}
    if environ.get("RUNTIME_DIRECTORY"):  # what default_run_dir() reads
        sources["run_dir"] = "default (env RUNTIME_DIRECTORY, set by systemd)"
    cfg_file = getattr(args, "config", None)
    if cfg_file == "":  # (an empty variable is unset; an empty flag is a mistake, not "use the variable")
        raise ConfigError("flag --config: an empty path; name the file, or leave the flag out")
    cfg_file = cfg_file or CONFIG_FILE.get(environ)
    if cfg_file:
        for k, v in _read_file(cfg_file).items():
            values[k] = _coerce(k, v, f"config file {cfg_file}", _from_toml)
            if k.endswith("_dir") and not values[k].startswith(("/", "~")):
                raise ConfigError(f"config file {cfg_file}: {k} must be an absolute path, got {values[k]!r} (a "
                                  "relative one would be taken from the daemon's working directory, / under "
                                  "systemd, not from the file's)")
            sources[k] = f"file {cfg_file}"
    for name, setting in _SETTINGS.items():
        value = setting.lookup(environ)  # ConfigError naming the variable for a bad text
        if value is not None:
            values[name] = _coerce(name, value, f"environment {setting.env}", lambda f, v: v)
            sources[name] = f"env {setting.env}"
    for name in _FIELDS:
        text = getattr(args, name, None)  # args None: no flags
        if text is not None:
            flag = f"--{name.replace('_', '-')}"
            values[name] = _coerce(name, text, f"flag {flag}", lambda f, v: _SETTINGS[f.name].parse(v))
            sources[name] = f"flag {flag}"
    for name in _DIRS:  # what the daemon uses, and what --print-config writes so that it reads back
        if name in values:  # the defaults are absolute
            values[name] = os.path.abspath(os.path.expanduser(values[name]))
    return Config(**values), sources


_DIRS = [name for name in _FIELDS if name.endswith("_dir")]


def _read_file(cfg_file: str) -> dict:
    try:
        with open(cfg_file, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as e:
        raise ConfigError(f"cannot read config file {cfg_file}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {cfg_file} is not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"config file {cfg_file} nests its tables or arrays too deep") from None
    return _settings_table(data, cfg_file)


def _settings_table(data: dict, cfg_file: str) -> dict:
    """The settings of a parsed TOML file: the table ``[sparsekvd]``, or the top level
    when there is none. Anything else is a one-line error, never a setting ignored."""
    where = f"config file {cfg_file}"
    inside = ""  # how the file names a table in the settings' table
    if "sparsekvd" in data:
        section = data["sparsekvd"]
        if not isinstance(section, dict):
            raise ConfigError(f"{where}: sparsekvd must be a table ([sparsekvd]), got {_toml_type(section)}")
        others = sorted(k for k in data if k != "sparsekvd")
        if others:
            raise ConfigError(f"{where}: {others} outside the table [sparsekvd]; put every setting in it")
        data, inside = section, "sparsekvd."
    for k, v in data.items():
        if isinstance(v, dict) or (isinstance(v, list) and v and all(isinstance(x, dict) for x in v)):
            named = f"[{inside}{k}]" if isinstance(v, dict) else f"[[{inside}{k}]]"
            what = f"setting {k} cannot be a table" if k in _FIELDS else f"unknown table {named}"
            raise ConfigError(f"{where}: {what}; settings are plain keys (at the top level or in [sparsekvd])")
    return data


def _default_text(f) -> str:
    v = f.default
    if f.metadata["shown"]:
        return f.metadata["shown"]
    if _kind(f) == "size":
        return format_size(v)
    if isinstance(v, bool):
        return str(int(v))
    return repr(v) if isinstance(v, str) else str(v)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Command-line flags for every setting, each None when not given and parsed as its
    environment variable is; its help shows the built-in default and the variable."""
    p.add_argument("--config", metavar="FILE.toml", help="TOML file with settings (table [sparsekvd] or top level) "
                   f"(default: none; env {CONFIG_FILE.env})")
    for f in fields(Config):
        m = f.metadata
        kw = {"dest": f.name, "help": f"{'debug switch: ' if m['debug'] else ''}{m['help']} "
                                      f"(default: {_default_text(f)}; env {env_name(f.name)})"}
        if m["choices"]:
            kw["choices"] = m["choices"]
        else:
            kw["metavar"] = m["metavar"] or {"size": "SIZE", "cpus": "CPUS"}.get(_kind(f), "N")
        p.add_argument(f"--{f.name.replace('_', '-')}", **kw)
