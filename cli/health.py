"""``sparsekv health``: a fast probe of one daemon, for systemd, scripts and Kubernetes;
and the stats socket's client for ``sparsekv stats``/``clients``/``top`` (:func:`stats_query`).

Exit codes: 0 ready (the daemon answers on its stats socket, bound once it serves), 1
alive but not ready (no socket yet, but a live process holds the run dir's lock: the
daemon pre-faults its pool or starts its backend), 2 unreachable or dead. ``--live``: 0
for ready or starting. The lock is only looked at (``/proc/locks``), never taken: a probe
that took it could make a daemon starting at that moment refuse its own run dir.
"""

from __future__ import annotations

import grp
import os
import socket
import time
from dataclasses import dataclass

from sparsekv.proto.run_dir import LOCK_FILE, lock_holder

READY, NOT_READY, UNREACHABLE = 0, 1, 2

STATS_SOCKET = "stats.sock"


class StatsSocketError(Exception):
    """The stats socket could not be asked. ``kind``: ``missing`` (no socket, or nobody
    listens on it), ``starting`` (no socket yet, but a live daemon holds the run dir's
    lock: it pre-faults its pool), ``busy`` (the daemon answered ``error: busy: ...``, or
    closed with no answer: the operator connections it allows are taken), ``timeout``,
    ``permission`` or ``error``."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


ERROR = "error: "  # how the daemon's stats socket answers what it cannot
BUSY = ERROR + "busy: "  # ... and a connection beyond its limits


def _busy(path: str, said: str = "") -> StatsSocketError:
    """The daemon answered busy (``said``: its line, after ``error: busy: ``), or closed
    the connection before an answer (or before the command)."""
    if said:
        return StatsSocketError(f"daemon at {path} is busy: {said}", "busy")
    return StatsSocketError(f"daemon at {path} closed the connection without an answer (its operator connections "
                            "are all taken: try again)", "busy")


def stats_query(run_dir: str, command: str, timeout_s: float = 5.0) -> str:
    """Send one command line to RUN_DIR/stats.sock; return the whole answer. A busy daemon
    (its ``error: busy: ...`` line, or no answer) raises :class:`StatsSocketError` ``busy``;
    any other ``error: ...`` answer (a command it does not know) ``error``."""
    path = os.path.join(run_dir, STATS_SOCKET)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    deadline = time.monotonic() + timeout_s  # for the whole answer, not each read of it
    try:
        s.connect(path)
        try:
            s.sendall(command.encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed before the command was read: its busy line may be there to read
        answer = _read_answer(s, deadline)
        if not answer:
            raise _busy(path)
        if answer.startswith(BUSY):
            raise _busy(path, answer[len(BUSY):].strip())
        if answer.startswith(ERROR):  # (an unknown command: a daemon older than this CLI)
            raise StatsSocketError(f"daemon at {path} refused {command!r}: {answer[len(ERROR):].strip()}", "error")
        return answer
    except (FileNotFoundError, ConnectionRefusedError) as e:
        pid = lock_holder(run_dir)
        if pid is not None:
            raise StatsSocketError(f"starting: sparsekvd (pid {pid or '?'}) holds {run_dir}/{LOCK_FILE} but does not "
                                   "serve yet (pre-faulting the pool or starting the backend)", "starting") from None
        where = (f"{run_dir} does not exist" if not os.path.isdir(run_dir)
                 else "nothing listens on it" if isinstance(e, ConnectionRefusedError) else "no socket")
        raise StatsSocketError(f"no daemon at {path} ({where}; is sparsekvd running with --run-dir {run_dir}?)",
                               "missing") from None
    except PermissionError:
        raise StatsSocketError(f"permission denied on {path}: {_access_hint(path)}", "permission") from None
    except (BrokenPipeError, ConnectionResetError):
        raise _busy(path) from None
    except socket.timeout:
        raise StatsSocketError(f"daemon at {path} did not answer within {timeout_s:g} s", "timeout") from None
    except OSError as e:
        raise StatsSocketError(f"cannot ask the daemon at {path}: {e.strerror or e}", "error") from None
    finally:
        s.close()


def _read_answer(s: socket.socket, deadline: float) -> str:
    """Everything the daemon writes until it closes, by ``deadline`` (``time.monotonic``;
    past it: socket.timeout). A busy daemon answers and closes without reading the command,
    so the kernel says "reset" once the busy line is read: that line is the answer; a reset
    before it, or in any other answer, is raised."""
    chunks = []
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("the answer did not end in time")
            s.settimeout(left)
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
    except ConnectionResetError:
        if not b"".join(chunks).startswith(BUSY.encode()):
            raise
    return b"".join(chunks).decode(errors="replace")


def _access_hint(path: str) -> str:
    try:
        st = os.stat(path)
        group = grp.getgrgid(st.st_gid).gr_name
    except (OSError, KeyError):
        return "run as the daemon's user or a member of its group"
    return f"the socket is mode {st.st_mode & 0o777:04o}, group {group}; run as a member of group {group}"


@dataclass(frozen=True)
class Health:
    code: int  # READY, NOT_READY or UNREACHABLE
    message: str


def probe(run_dir: str, timeout_s: float = 1.0) -> Health:
    """Ask the daemon of ``run_dir`` how it is; never raises."""
    try:
        answer = stats_query(run_dir, "health", timeout_s).strip()
    except StatsSocketError as e:
        if e.kind == "busy":  # the loop accepted and answered busy (or closed): it serves
            return Health(READY, "ready (busy: " + str(e) + ")")
        return Health(NOT_READY if e.kind == "starting" else UNREACHABLE, str(e))
    # Any answer means the loop serves (even an error line for an unknown `health`).
    return Health(READY, answer.splitlines()[0] if answer else "ready")


def exit_code(h: Health, live: bool) -> int:
    """The probe's exit code: with ``live``, starting counts as alive (0)."""
    if live and h.code == NOT_READY:
        return READY
    return h.code
