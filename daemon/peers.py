"""Who is at the other end of a control connection, and whether its process still lives.

The kernel, not the client, says who a peer is. libzmq reads ``SO_PEERCRED`` of an
``ipc://`` connection when it is accepted and attaches it to every message received on it
as the property ``Peer-Address`` (``"<host>:<uid>:<gid>:<pid>"``); the pid is translated
into the daemon's pid namespace, 0 when the peer's process is not visible there.

A peer's process is watched through a pidfd: it names one process, not a number that may
be reused, and becomes readable when that process exits, so a dead client is reclaimed at
once; where ``pidfd_open`` fails the reaper's periodic ``psutil`` check is the fallback.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
from dataclasses import dataclass, field
from typing import Callable

from sparsekv.proto import ErrorCode, ProtocolError

log = logging.getLogger("sparsekv.peers")

_UID_LIMIT = 2**32 - 1  # (uid_t) -1 is "no uid", never a peer's
_PID_LIMIT = 2**22 + 1  # PID_MAX_LIMIT (4 Mi) on 64-bit Linux; 0 = not in our pid namespace


@dataclass(frozen=True)
class Peer:
    """A connection's credentials.

    Attributes:
        uid, gid, pid: the peer process's, pid in the daemon's pid namespace (0: unknown).
        verified: whether the kernel said so. False only for requests handed to
            ``Daemon.handle`` as plain bytes: taken as the daemon's own uid and gid, pid 0.
        address: the ``Peer-Address`` string itself ("" when not verified).
    """

    uid: int
    gid: int
    pid: int
    verified: bool
    address: str = field(default="", compare=False)

    @classmethod
    def unverified(cls) -> "Peer":
        return cls(os.getuid(), os.getgid(), 0, False)


def peer_creds(frames) -> Peer | None:
    """The credentials of the connection ``frames`` arrived on, or None for plain bytes (in
    process); ``ProtocolError`` PERMISSION_DENIED when they are missing or unreadable."""
    get = getattr(frames[0], "get", None) if frames else None
    if get is None:
        return None
    try:
        value = get("Peer-Address")
    except Exception as e:  # noqa: BLE001 - zmq.ZMQError (no such property), anything else alike
        raise ProtocolError(ErrorCode.PERMISSION_DENIED,
                            f"the daemon cannot read this connection's credentials ({type(e).__name__}: {e}); "
                            "connect over the ipc:// control socket") from None
    peer = parse_peer_address(value)
    if peer is None:
        raise ProtocolError(ErrorCode.PERMISSION_DENIED,
                            f"this connection's credentials {str(value)[:64]!r} are not <host>:<uid>:<gid>:<pid>; "
                            "connect over the ipc:// control socket")
    return peer


def parse_peer_address(value) -> Peer | None:
    """``"<host>:<uid>:<gid>:<pid>"`` as a verified :class:`Peer`, or None if it is not
    exactly that. The host part may hold no colon: an IPv6 peer's address
    (``fe80::1:2:3:4``) must never read as credentials."""
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not isinstance(value, str):
        return None
    parts = value.split(":")
    if len(parts) != 4 or not all(p.isdecimal() and p.isascii() for p in parts[1:]):
        return None
    uid, gid, pid = (int(p) for p in parts[1:])
    if uid >= _UID_LIMIT or gid >= _UID_LIMIT or pid >= _PID_LIMIT:
        return None
    return Peer(uid, gid, pid, True, value)


def process_groups(pid: int) -> frozenset[int]:
    """The supplementary groups of process ``pid`` (``/proc/<pid>/status``), empty when
    they cannot be read. Callers check that the process is still the one they watch
    before trusting the answer."""
    if pid <= 0:
        return frozenset()
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return frozenset(int(g) for g in line.split()[1:] if g.isdecimal())
    except OSError:
        pass
    return frozenset()


class PidWatch:
    """A pidfd of one process; ``close()`` is idempotent.

    Arguments:
        pid: the process (in the daemon's pid namespace, > 0).
        on_exit: called once from the running event loop when the process exits; without
            a running loop callers poll :meth:`exited`.

    Raises ``OSError`` when the pidfd cannot be opened (the process is gone, or no
    ``pidfd_open``) and ``AttributeError`` on Pythons without ``os.pidfd_open``.
    """

    def __init__(self, pid: int, on_exit: Callable[[], None] | None = None):
        self.pid = pid
        self.fd: int | None = os.pidfd_open(pid)
        self._loop: asyncio.AbstractEventLoop | None = None
        if on_exit is not None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None:
                try:
                    loop.add_reader(self.fd, on_exit)
                    self._loop = loop
                except Exception:
                    self.close()
                    raise

    def exited(self) -> bool:
        """Whether the process has exited (a zombie not yet waited for included)."""
        if self.fd is None:
            return True
        p = select.poll()
        p.register(self.fd, select.POLLIN)
        return bool(p.poll(0))

    def close(self) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(fd)
        self._loop = None
        os.close(fd)
