"""Who holds a daemon's run dir: its lock file, RUN_DIR/sparsekvd.lock, which the daemon
(``daemon/main.py`` ``RunDirLock``) holds under ``flock`` for its life and writes its pid
into, before it pre-faults its pool and long before its sockets exist. Clients and the
operator's CLI read it to tell a daemon starting from none. The lock is only looked at
(``/proc/locks``), never taken: a probe that took it could make a daemon starting at
that moment refuse its own run dir.
"""

from __future__ import annotations

import os

LOCK_FILE = "sparsekvd.lock"


def lock_holder(run_dir: str) -> int | None:
    """The pid of the process holding RUN_DIR/sparsekvd.lock (0 when it holds it but the
    pid cannot be read), or None when nobody holds it."""
    path = os.path.join(run_dir, LOCK_FILE)
    try:
        st = os.stat(path)
    except OSError:
        return None
    try:
        with open(path) as fh:
            text = fh.read(32).strip()
    except OSError:
        text = ""
    pid = int(text) if text.isdigit() else None
    held = _flock_held(st)
    if held is None:  # no /proc/locks: believe the pid in the file if it is alive and could have written it
        held = pid is not None and _pid_alive(pid) and not _started_after(pid, st.st_mtime)
    return (pid or 0) if held else None


def _started_after(pid: int, mtime: float) -> bool:
    """Whether process ``pid`` began after ``mtime`` (1 s of slack): then it did not write
    the lock file, whose pid is a dead daemon's, reused (False when that cannot be told).
    A start time is read against the wall clock (psutil: boot time from /proc/stat), so
    a clock stepped forward by more than the slack since a daemon wrote its lock file
    reads that daemon as stale here too: a daemon with no control socket yet is then
    reported missing, not starting (only where /proc/locks cannot be read)."""
    try:
        import psutil  # noqa: PLC0415 - only on this fallback

        return psutil.Process(pid).create_time() > mtime + 1.0
    except Exception:  # noqa: BLE001 - psutil.Error, or no psutil: cannot tell
        return False


def _flock_held(st: os.stat_result) -> bool | None:
    """Whether /proc/locks lists a flock on the file ``st`` describes (None: cannot tell).
    Lines look like ``1: FLOCK  ADVISORY  WRITE 1234 fe:00:2247208 0 EOF``."""
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    try:
        with open("/proc/locks") as fh:
            lines = fh.readlines()
    except OSError:
        return None
    for line in lines:
        f = line.split()
        if len(f) < 6 or f[1] != "FLOCK":  # waiters: "->" there
            continue
        try:
            major, minor, ino = f[5].split(":")
            if (int(major, 16), int(minor, 16), int(ino)) == want:
                return True
        except ValueError:
            continue
    return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, belongs to someone else
    return True
