"""The control socket's connections, one by one: who opened each, and when to close one.

libzmq hides a ROUTER's connections from the application: it accepts them, reads from
them and drops them by itself. Two things it tells: its monitor reports each accepted
and each closed connection with its file descriptor (``EVENT_ACCEPTED`` /
``EVENT_DISCONNECTED``, value = fd), and every message received carries the descriptor
it came from (the ``ZMQ_SRCFD`` property). That is enough to

* read each connection's ``SO_PEERCRED`` when it is accepted, and refuse (close at once)
  connections of a uid beyond ``max_per_uid`` (0: no cap), counted in ``refused``;
* close a connection that has not said HELLO within ``hello_timeout_s``, counted in
  ``expired``: a peer that connects and stays silent would otherwise hold a descriptor
  for ever (ZeroMQ heartbeats only prove that the peer's libzmq is alive);
* close the connection of a session the server drops (``close``).

A connection is closed with ``shutdown(2)`` on libzmq's descriptor (borrowed, never
duplicated nor closed):
libzmq sees the end of the stream, as if the peer had hung up, and cleans up its pipe
and descriptor itself. A descriptor number can be reused once libzmq closed it, so each
entry keeps the socket's inode and nothing is shut down unless the descriptor still
names that same socket (and is not a listening socket).

Thread use: :meth:`accepted`, :meth:`disconnected` and :meth:`expire` run on the
connection guard's thread (it owns the monitor socket), :meth:`greeted`, :meth:`close`
and :meth:`by_uid` on the event loop; one lock guards the table.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("sparsekv.server")

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass
class Conn:
    fd: int
    ino: int  # the socket's inode: the descriptor still names this connection
    pid: int
    uid: int
    gid: int
    at: float  # time.monotonic() when accepted
    greeted: bool = False  # a HELLO came on it


class _Borrowed:
    """libzmq's descriptor ``fd`` as a socket object, without a duplicate: a duplicate
    would take a descriptor, and near the open-files limit libzmq's next accept would then
    fail with EMFILE, which aborts it (daemon/connguard.py). Detached, never closed, on
    the way out."""

    def __init__(self, fd: int):
        self.fd = fd
        self.sock: socket.socket | None = None

    def __enter__(self) -> socket.socket | None:
        try:
            self.sock = socket.socket(fileno=self.fd)
        except OSError:  # not a socket (any more)
            return None
        return self.sock

    def __exit__(self, *exc) -> None:
        if self.sock is not None:
            self.sock.detach()


def inspect(fd: int) -> tuple[int, int, int, int] | None:
    """(inode, pid, uid, gid) of the connected UNIX socket ``fd``, or None when ``fd`` is
    not one (closed meanwhile, reused by something else, a listening socket)."""
    try:
        ino = os.fstat(fd).st_ino
    except OSError:
        return None
    with _Borrowed(fd) as s:
        if s is None:
            return None
        try:
            if s.family != socket.AF_UNIX or s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return None
            pid, uid, gid = _CRED.unpack(s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
        except OSError:
            return None
    return ino, pid, uid, gid


def shutdown(fd: int, ino: int) -> bool:
    """End connection ``fd`` if it is still the socket of inode ``ino`` (see the module)."""
    try:
        if os.fstat(fd).st_ino != ino:
            return False
    except OSError:
        return False
    with _Borrowed(fd) as s:
        if s is None:
            return False
        try:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return False
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
    return True


class Connections:
    """The table of open control connections (see the module).

    Arguments:
        max_per_uid: connections of one uid at most (0: no cap); one more is closed when
            accepted and counted in ``refused``.
        hello_timeout_s: a connection with no HELLO after this long is closed and
            counted in ``expired``.
        own_pid: connections from this process (in-process clients, the daemon's own
            probes) are never capped or expired.
    """

    def __init__(self, *, max_per_uid: int = 0, hello_timeout_s: float = 10.0, own_pid: int | None = None,
                 clock=time.monotonic):
        self.max_per_uid = max_per_uid
        self.hello_timeout_s = hello_timeout_s
        self.own_pid = os.getpid() if own_pid is None else own_pid
        self._clock = clock
        self._lock = threading.Lock()
        self._conns: dict[int, Conn] = {}
        # Sockets (by inode) that said HELLO before the guard's thread saw them accepted:
        # the loop may read a HELLO before the monitor's ACCEPTED event is handled.
        self._early: dict[int, float] = {}
        self.refused = 0  # closed when accepted: the uid's cap
        self._last_refusal_log = float("-inf")
        self.expired = 0  # closed: no HELLO in time
        self.closed = 0  # closed for the server (a dropped session)

    # -- the guard's thread ------------------------------------------------------------
    def accepted(self, fd: int) -> None:
        """libzmq accepted connection ``fd``: note it, or close it if its uid has its cap."""
        info = inspect(fd)
        if info is None:
            return  # gone already (its DISCONNECTED event follows), or not a connection
        ino, pid, uid, gid = info
        with self._lock:
            n = sum(1 for c in self._conns.values() if c.uid == uid and c.fd != fd)
            over = self.max_per_uid and n >= self.max_per_uid and pid != self.own_pid
            if not over:
                self._conns[fd] = Conn(fd, ino, pid, uid, gid, self._clock(),
                                       greeted=self._early.pop(ino, None) is not None)
                return
            self._conns.pop(fd, None)
            self.refused += 1
        shutdown(fd, ino)
        now = self._clock()
        if now - self._last_refusal_log >= 10.0:  # a flood must not flood the journal too
            self._last_refusal_log = now
            log.warning("control connection of pid %d uid %d closed: uid %d has %d open (max_connections_per_uid "
                        "%d); %d refused so far (this is logged at most every 10 s)", pid, uid, uid, n,
                        self.max_per_uid, self.refused)

    def disconnected(self, fd: int) -> None:
        with self._lock:
            self._conns.pop(fd, None)

    def expire(self) -> int:
        """Close the connections that said no HELLO within ``hello_timeout_s``; how many."""
        now = self._clock()
        limit = now - self.hello_timeout_s
        with self._lock:
            for ino in [i for i, t in self._early.items() if t < now - 60.0]:
                del self._early[ino]  # accepted events that never came (closed at once)
            late = [c for c in self._conns.values()
                    if not c.greeted and c.at <= limit and c.pid != self.own_pid]
            for c in late:
                del self._conns[c.fd]
        n = 0
        for c in late:
            if shutdown(c.fd, c.ino):
                n += 1
                log.info("control connection of pid %d uid %d closed: no HELLO within %g s", c.pid, c.uid,
                         self.hello_timeout_s)
        with self._lock:
            self.expired += n
        return n

    # -- the event loop ----------------------------------------------------------------
    def greeted(self, fd: int) -> tuple[int, int] | None:
        """A HELLO came on ``fd``: it is a client's now. Returns (fd, inode) to close it
        by later (:meth:`close`), None if ``fd`` is no socket any more. Matched by inode:
        the guard's thread may not have seen this connection accepted yet (then it is
        marked when it does), or may still list an earlier socket of the same number."""
        try:
            ino = os.fstat(fd).st_ino
        except OSError:
            return None
        with self._lock:
            c = self._conns.get(fd)
            if c is not None and c.ino == ino:
                c.greeted = True
            else:
                self._early[ino] = self._clock()
            return fd, ino

    def close(self, conn: tuple[int, int] | None) -> bool:
        """Close the connection :meth:`greeted` returned (None: nothing to do)."""
        if conn is None:
            return False
        fd, ino = conn
        with self._lock:
            c = self._conns.get(fd)
            known = c is not None and c.ino == ino
            if known:
                del self._conns[fd]
            known = self._early.pop(ino, None) is not None or known
        if known and shutdown(fd, ino):  # only while fd still names that socket
            with self._lock:
                self.closed += 1
            return True
        return False

    def by_uid(self) -> dict[int, int]:
        """Open connections per uid (stats)."""
        with self._lock:
            return dict(collections.Counter(c.uid for c in self._conns.values()))

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {"connections_refused": self.refused, "connections_expired": self.expired,
                    "connections_open": len(self._conns)}
