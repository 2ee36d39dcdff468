"""The control socket's connections, one by one: who opened each, and when to close one.

libzmq hides a ROUTER's connections, but its monitor reports each accepted and closed
connection with its file descriptor, and every message carries the descriptor it came
from (``ZMQ_SRCFD``). That is enough to

* read each connection's ``SO_PEERCRED`` when it is accepted, and refuse (close at once)
  connections of a uid beyond ``max_per_uid`` (0: no cap), counted in ``refused``;
* close a connection that sent no HELLO within ``hello_timeout_s``, counted in
  ``expired`` (a silent peer would otherwise hold a descriptor for ever). A connection of
  a process that has said HELLO (in the last ``HELLO_MEMORY_S``) needs none: a client's
  libzmq reconnects under the same routing id without saying HELLO again.

A connection is closed with ``shutdown(2)``: libzmq sees the end of the stream and cleans
up itself. The descriptor belongs to libzmq, whose I/O threads may close and reuse its
number at any moment, so it is never used directly: ``dup2`` pins the file it names onto
a spare descriptor held for this (no new descriptor is taken near the open-files limit:
daemon/connguard.py), every check and the ``shutdown`` act on that pinned file, and the
spare is then pointed back at ``/dev/null``.

Thread use: :meth:`accepted`, :meth:`disconnected` and :meth:`expire` run on the
connection table's thread, :meth:`hello` and :meth:`counters` on the event loop; one lock
guards the table, another the spare. Whichever thread sees a connection first reads its
credentials and applies the cap, so no HELLO is answered on a connection beyond it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass

from .ratelog import RateLimitedLog

log = logging.getLogger("sparsekv.server")

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
HELLO_MEMORY_S = 600.0  # a process that said HELLO needs none on its next connections for this long


@dataclass
class Conn:
    fd: int
    ino: int  # the socket's inode: the descriptor still names this connection
    pid: int
    uid: int
    gid: int
    at: float  # time.monotonic() when accepted
    greeted: bool = False  # a HELLO came on it, or its process said one lately


class Connections:
    """The table of open control connections (see the module).

    Arguments:
        max_per_uid, hello_timeout_s: as in the module docstring (0: no cap).
        own_pid: connections from this process are never capped or expired.
        bound_path: the path the listener was bound under (``getsockname()`` of every
            connection it accepted): nothing else is ever inspected or shut down. None:
            not checked.

    :meth:`open` takes the two spare descriptors before use, :meth:`close` gives them back.
    """

    def __init__(self, *, max_per_uid: int = 0, hello_timeout_s: float = 10.0, own_pid: int | None = None,
                 bound_path: str | None = None, clock=time.monotonic):
        self.max_per_uid = max_per_uid
        self.hello_timeout_s = hello_timeout_s
        self.own_pid = os.getpid() if own_pid is None else own_pid
        self.bound_path = bound_path
        self._clock = clock
        self._lock = threading.Lock()
        self._conns: dict[int, Conn] = {}
        self._hello_pids: dict[int, float] = {}  # pid -> when it last said HELLO
        self._pin_lock = threading.Lock()
        self._null = self._spare = -1
        # Called (on the table's thread) with the descriptor of a closed connection that
        # said HELLO, or whose process had: the server drops the sessions it carried.
        self.on_closed = None
        self.refused = 0  # closed when accepted: the uid's cap
        self.expired = 0  # closed: no HELLO in time
        self.rlog = RateLimitedLog(log, clock=clock)  # a line per closed connection, limited per cause

    def open(self) -> "Connections":
        if self._spare < 0:
            self._null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            self._spare = os.dup(self._null)
        return self

    def close(self) -> None:
        with self._pin_lock:
            for fd in (self._spare, self._null):
                if fd >= 0:
                    os.close(fd)
            self._null = self._spare = -1

    # -- the pinned file -----------------------------------------------------------------
    @contextlib.contextmanager
    def _pinned(self, fd: int):
        """The socket that ``fd`` names now, on the spare descriptor (not to be closed), or
        None when it is not a socket accepted by the control socket's listener."""
        with self._pin_lock:
            if self._spare < 0:
                yield None
                return
            try:
                os.dup2(fd, self._spare, inheritable=False)
            except OSError:  # closed meanwhile
                yield None
                return
            s = None
            try:
                try:
                    s = socket.socket(fileno=self._spare)
                    ok = (s.family == socket.AF_UNIX and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                          and (self.bound_path is None or s.getsockname() == self.bound_path))
                except OSError:  # not a socket
                    ok = False
                yield s if ok else None
            finally:
                if s is not None:
                    s.detach()  # the spare stays ours
                os.dup2(self._null, self._spare, inheritable=False)  # let the socket go with libzmq's close

    def inspect(self, fd: int) -> tuple[int, int, int, int] | None:
        """(inode, pid, uid, gid) of the control connection ``fd`` names, or None."""
        with self._pinned(fd) as s:
            if s is None:
                return None
            try:
                pid, uid, gid = _CRED.unpack(s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
                return os.fstat(s.fileno()).st_ino, pid, uid, gid
            except OSError:
                return None

    def shutdown(self, fd: int, ino: int) -> bool:
        """End connection ``fd`` if it still names the socket of inode ``ino``."""
        with self._pinned(fd) as s:
            if s is None:
                return False
            try:
                if os.fstat(s.fileno()).st_ino != ino:
                    return False
                s.shutdown(socket.SHUT_RDWR)
                return True
            except OSError:
                return False

    # -- admission (either thread) ----------------------------------------------------
    def _admit(self, fd: int, greeted: bool) -> bool:
        """Note connection ``fd`` (whichever thread sees it first), or close it if its uid
        has its cap. Returns whether it may be served."""
        info = self.inspect(fd)
        if info is None:
            return False  # gone already (its DISCONNECTED event follows), or not a connection
        ino, pid, uid, gid = info
        with self._lock:
            c = self._conns.get(fd)
            if greeted:
                self._hello_pids[pid] = self._clock()
            if c is not None and c.ino == ino:  # the other thread was first
                c.greeted |= greeted
                return True
            greeted = greeted or pid in self._hello_pids
            n = self._count(uid, fd)
            if self.max_per_uid and n >= self.max_per_uid and pid != self.own_pid:
                # The monitor's events come from several I/O threads, out of order: an
                # entry whose DISCONNECTED is still on its way must not count.
                for c in [c for c in self._conns.values() if c.uid == uid and not _names(c)]:
                    del self._conns[c.fd]
                n = self._count(uid, fd)
            over = self.max_per_uid and n >= self.max_per_uid and pid != self.own_pid
            if not over:
                self._conns[fd] = Conn(fd, ino, pid, uid, gid, self._clock(), greeted=greeted)
                return True
            self._conns.pop(fd, None)
            self.refused += 1
        self.shutdown(fd, ino)
        self.rlog.log("connection over its uid's cap", logging.WARNING, "control connection of pid %d uid %d closed: "
                      "uid %d has %d open (max_connections_per_uid %d); %d refused so far", pid, uid, uid, n,
                      self.max_per_uid, self.refused)
        return False

    def _count(self, uid: int, fd: int) -> int:
        return sum(1 for c in self._conns.values() if c.uid == uid and c.fd != fd)

    # -- the guard's thread ------------------------------------------------------------
    def accepted(self, fd: int) -> None:
        """libzmq accepted connection ``fd``."""
        self._admit(fd, greeted=False)

    def disconnected(self, fd: int) -> None:
        with self._lock:
            c = self._conns.pop(fd, None)
        if c is not None and c.greeted and self.on_closed is not None:
            self.on_closed(fd)  # a flood's connections, never greeted, cost the loop nothing

    def expire(self) -> int:
        """Close the connections without a HELLO within ``hello_timeout_s``; how many."""
        now = self._clock()
        limit = now - self.hello_timeout_s
        with self._lock:
            for pid in [p for p, t in self._hello_pids.items() if t < now - HELLO_MEMORY_S]:
                del self._hello_pids[pid]
            late = [c for c in self._conns.values()
                    if not c.greeted and c.at <= limit and c.pid != self.own_pid]
            for c in late:
                del self._conns[c.fd]
        n = 0
        for c in late:
            if self.shutdown(c.fd, c.ino):
                n += 1
                self.rlog.log("connection without HELLO", logging.INFO, "control connection of pid %d uid %d "
                              "closed: no HELLO within %g s", c.pid, c.uid, self.hello_timeout_s)
        with self._lock:
            self.expired += n
        self.rlog.flush()  # the summaries of windows that are over (this runs every second)
        return n

    # -- the event loop ----------------------------------------------------------------
    def hello(self, fd: int | None) -> bool:
        """A HELLO came on ``fd`` (None: an in-process call): its connection, and the next
        ones of its process, have no HELLO deadline. Returns whether to answer it: False
        when the connection is beyond its uid's cap (closed now)."""
        if fd is None:
            return True
        return self._admit(fd, greeted=True)

    def key(self, fd: int | None) -> tuple[int, int] | None:
        """(descriptor, socket inode) of open connection ``fd`` in the table, or None: what a
        session remembers of the connection its HELLO came on."""
        if fd is None:
            return None
        with self._lock:
            c = self._conns.get(fd)
            return (c.fd, c.ino) if c is not None else None

    def by_uid(self) -> dict[int, int]:
        """Open connections per uid (stats)."""
        with self._lock:
            return dict(collections.Counter(c.uid for c in self._conns.values()))

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {"connections_refused": self.refused, "connections_expired": self.expired,
                    "connections_open": len(self._conns)}


def _names(c: Conn) -> bool:
    """Whether descriptor ``c.fd`` still names ``c``'s socket (an inode check, no pin:
    only used to forget stale entries)."""
    return names(c.fd, c.ino)


def names(fd: int, ino: int) -> bool:
    """Whether descriptor ``fd`` names the socket of inode ``ino`` now (an ``fstat``: it
    never uses the descriptor, which is libzmq's)."""
    try:
        return os.fstat(fd).st_ino == ino
    except OSError:
        return False
