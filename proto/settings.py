"""Settings from the environment: one typed registry, and the parsers of setting text.

Every variable sparsekv reads is ``SPARSEKV_<NAME>``. The daemon's settings are the fields
of ``daemon/config.py``'s ``Config``, which reads them through :class:`Setting` too; those
below belong to processes without a ``Config`` (``client/``, ``csrc/build.py``, the
benchmarks' private daemons), each the default of an argument not given. An empty variable
is the same as an unset one; a bad value raises :class:`SettingError` naming the variable.

Sizes (:func:`parse_size`) are a number and a unit: ``B``; ``KiB``, ``MiB``, ``GiB``,
``TiB`` (powers of 1024); ``KB``, ``MB``, ``GB``, ``TB`` (powers of 1000). A bare
``K``/``M``/``G``/``T`` is refused: tools disagree on what it means; so is an upper-case
prefix before a lower-case ``b`` (``1Mb``, ``64Gib``): that spelling is bits.
"""

from __future__ import annotations

import math
import os
import re
from fractions import Fraction
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

_BINARY = {"TiB": 1 << 40, "GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10}
_DECIMAL = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}
_UNITS = {u.lower(): n for u, n in (*_BINARY.items(), *_DECIMAL.items(), ("B", 1))}


class SettingError(ValueError):
    """A setting has a bad value; the message names it and where it came from."""


MAX_SIZE = (1 << 63) - 1  # the largest size a setting takes (int64)


def parse_size(text: str | int) -> int:
    """``'64GiB'`` -> bytes (units: see the module's docstring; case does not matter). A number
    without a unit is an error: ``pool_size = 64`` meant as GiB would silently be 64 bytes;
    so is a fraction of a byte (``1.5B``, ``0.1KiB``) and a size past :data:`MAX_SIZE`."""
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ValueError(f"bad size {text!r}; use e.g. 256MiB or 64GiB")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        raise ValueError(f"size {text} has no unit; write e.g. \"{text}B\", 256MiB or 64GiB")
    if re.fullmatch(r"\s*-.*", text):
        raise ValueError(f"size {text.strip()!r} is negative; a size is at least 0B (e.g. 256MiB or 64GiB)")
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)  # (ASCII digits: \d takes any script's)
    number, unit = (m.group(1), m.group(2).lower()) if m else ("", "")
    if m and re.fullmatch(r"[KMGT]i?b", m.group(2)):
        raise ValueError(f"size {text.strip()!r} reads as bits (lower-case b): write {number}{m.group(2)[:-1]}B "
                         "for bytes")
    if unit in ("k", "m", "g", "t"):
        u = unit.upper()
        raise ValueError(f"size {text.strip()!r} is ambiguous: write {number}{u}iB (powers of 1024) "
                         f"or {number}{u}B (powers of 1000)")
    if not m or (unit and unit not in _UNITS):
        raise ValueError(f"bad size {text!r}; use e.g. 256MiB, 64GiB or 4096B")
    if not unit:
        raise ValueError(f"size {number!r} has no unit; write e.g. \"{number}B\", 256MiB or 64GiB")
    if len(number) > 40:  # before any arithmetic on it
        raise ValueError(f"size {text.strip()[:48]!r}... is too long; at most {MAX_SIZE} bytes")
    value = Fraction(number) * _UNITS[unit]
    if value.denominator != 1:
        raise ValueError(f"size {text.strip()!r} is not a whole number of bytes")
    if value > MAX_SIZE:
        raise ValueError(f"size {text.strip()!r} is too large; at most {MAX_SIZE} bytes")
    return int(value)


def size_text(n: int) -> str:
    """``n`` bytes as setting text that reads back as exactly ``n``: in the largest unit,
    binary or decimal, that holds it whole (``64GiB``, ``1536MiB``, ``64GB``), else in
    bytes. What ``--print-config`` writes and a message that names a limit exactly."""
    whole = [(scale, unit) for unit, scale in (*_BINARY.items(), *_DECIMAL.items()) if n >= scale and n % scale == 0]
    if not whole:
        return f"{n}B"
    scale, unit = max(whole)
    return f"{n // scale}{unit}"


def format_size(n: int) -> str:
    """``n`` bytes for a person to read: in the largest binary unit it fills, whole where
    that unit holds it whole (``64GiB``), else the largest decimal one that does
    (``64GB``), else to one decimal (``1.5GiB``, ``23.5GiB``; rounded)."""
    for units in (_BINARY, _DECIMAL):
        for unit, scale in units.items():
            if n >= scale:
                if n % scale == 0:
                    return f"{n // scale}{unit}"
                break
    for unit, scale in _BINARY.items():
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


def parse_int(text: str) -> int:
    """A decimal integer in ASCII digits, optionally signed (``int()`` would also take
    ``1_0`` and other scripts' digits)."""
    t = text.strip()
    if not re.fullmatch(r"[+-]?[0-9]+", t):
        raise ValueError(f"an integer is needed, got {text!r}")
    return int(t)


def parse_float(text: str) -> float:
    t = text.strip()
    if not re.fullmatch(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(inf|infinity|nan)", t, re.I):
        raise ValueError(f"a number is needed, got {text!r}")  # (ASCII digits, no underscores)
    v = float(t)
    if not math.isfinite(v):
        raise ValueError(f"{text.strip()} is not a finite number")
    return v


def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"1 or 0 (true or false) is needed, got {text!r}")


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One variable, ``SPARSEKV_<NAME>``: ``parse`` turns its text into a value (or raises
    ValueError saying what is wrong); ``default`` applies when it is unset or empty (a
    callable is called with the environment)."""

    name: str
    parse: Callable[[str], T]
    default: T | Callable[[Mapping[str, str]], T]
    help: str

    @property
    def env(self) -> str:
        return "SPARSEKV_" + self.name.upper()

    def lookup(self, environ: Mapping[str, str] | None = None) -> T | None:
        """The value the environment sets; None where it sets none."""
        text = (os.environ if environ is None else environ).get(self.env, "")
        if not text:
            return None
        try:
            return self.parse(text)
        except (ValueError, OverflowError) as e:
            raise SettingError(f"environment {self.env}: bad value for {self.name}: {e}") from None

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        value = self.lookup(environ)
        if value is not None:
            return value
        return self.default(os.environ if environ is None else environ) if callable(self.default) else self.default


def default_run_dir(environ: Mapping[str, str] | None = None) -> str:
    """Where a daemon's run dir is when no setting names one: systemd's ``RuntimeDirectory=``
    (``$RUNTIME_DIRECTORY``, colon-separated when several), else ``/run/sparsekv``."""
    runtime = (os.environ if environ is None else environ).get("RUNTIME_DIRECTORY", "")
    return runtime.split(":")[0] or "/run/sparsekv"


def parse_dir(text: str) -> str:
    """A directory setting as sparsekvd uses it: surrounding blanks dropped, ``~`` expanded,
    absolute; empty (or blank) refused."""
    path = text.strip()
    if not path:
        raise ValueError("an empty path; name a directory")
    return os.path.abspath(os.path.expanduser(path))


RUN_DIR = Setting("run_dir", parse_dir, default_run_dir,
                  "the daemon's run dir (its sockets), for clients and the CLI (read as sparsekvd reads it)")
KERNEL_CACHE_DIR = Setting("kernel_cache_dir", str, "~/.cache/sparsekv/kernels",
                           "compiled kernels (csrc/build.py), for every process that launches them")
CLIENT_DEVICE_WAIT = Setting("client_device_wait", parse_bool, False,
                             "Client(device_wait=): a cuda rank's stream waits for its top-k on the GPU")
STOP_TIMEOUT_S = Setting("stop_timeout_s", parse_float, 20.0,
                         "bench's private daemons: seconds a daemon may take to stop before it is killed")
BENCH_DAEMON_LOG = Setting("bench_daemon_log", str, "", "bench: the file a benchmark's private daemon logs to")
SOAK_S = Setting("soak_s", parse_float, 60.0, "make soak: seconds each long soak test runs")
TEST_DAEMON_LOG = Setting("test_daemon_log", str, "", "tests: the file the GPU tests' private daemons log to "
                          "(tests/gpu/device_run.sh sets it)")
