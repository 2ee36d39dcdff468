"""Who is at the other end of a control connection, and whether its process still lives.

The kernel, not the client, says who a peer is: the control socket reads ``SO_PEERCRED``
of each connection when it accepts it (daemon/control_socket.py); the pid is translated
into the daemon's pid namespace, 0 when the peer's process is not visible there.

A peer's process is watched through a pidfd: it names one process, not a number that may
be reused, and becomes readable when that process exits, so a dead client is reclaimed at
once; where ``pidfd_open`` fails the reaper's periodic ``psutil`` check is the fallback.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import select
import socket
import struct
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("sparsekv.peers")



@dataclass(frozen=True)
class Peer:
    """A connection's credentials.

    Attributes:
        uid, gid, pid: the peer process's, pid in the daemon's pid namespace (0: unknown).
        verified: whether the kernel said so. False only for requests handed to
            ``Daemon.handle`` as plain bytes: taken as the daemon's own uid and gid, pid 0.
        groups: the process's supplementary groups, read while a pidfd of the process
            that connected showed it running (``of_socket(..., groups=True)``); None: not read.
    """

    uid: int
    gid: int
    pid: int
    verified: bool
    groups: frozenset | None = None

    @classmethod
    def unverified(cls) -> "Peer":
        return cls(os.getuid(), os.getgid(), 0, False)

    @classmethod
    def of_socket(cls, sock: socket.socket, groups: bool = False) -> "Peer":
        """The kernel's credentials of a UNIX socket's peer (``SO_PEERCRED``); OSError when
        they cannot be read (the peer hung up already, say). ``groups``: with the
        supplementary groups of the process that connected (:func:`connected_groups`)."""
        pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
        return cls(uid, gid, pid, True, connected_groups(sock, pid) if groups else None)


_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5+: a pidfd of the process that connected


def peer_pidfd(sock: socket.socket, pid: int) -> int | None:
    """A pidfd of the process at the other end of a UNIX socket, which the caller closes:
    the kernel's own (``SO_PEERPIDFD``, the process that connected, whatever became of its
    pid), else, where the kernel lacks that option (before Linux 6.5), one opened from
    ``pid`` now (right after accept); None when neither can be had (pid 0: another pid
    namespace). OSError when the kernel has the option and says the process is gone."""
    try:
        return sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as e:
        if e.errno not in (errno.ENOPROTOOPT, errno.EOPNOTSUPP):
            raise  # the kernel has the option: the process is gone (reaped); its pid may be another's
    if pid <= 0:
        return None
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def connected_groups(sock: socket.socket, pid: int) -> frozenset[int]:
    """The supplementary groups of the process that connected ``sock`` (``/proc``), empty
    unless a pidfd of it (:func:`peer_pidfd`) shows it still running once they are read:
    its pid may be another process's once it has exited."""
    try:
        fd = peer_pidfd(sock, pid)
    except OSError:  # gone
        return frozenset()
    if fd is None:
        return frozenset()
    try:
        groups = process_groups(pid)
        return frozenset() if pidfd_exited(fd) else groups
    finally:
        os.close(fd)


def pidfd_exited(fd: int) -> bool:
    """Whether the process of pidfd ``fd`` has exited (its pidfd is readable then)."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))


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
