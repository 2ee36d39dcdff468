"""Keep the control socket from costing the daemon its last file descriptor.

libzmq (4.3.5 and earlier) aborts the whole process when ``accept()`` on an ``ipc://``
listener fails with EMFILE (``Too many open files (src/ipc_listener.cpp:...)``: only
ENFILE is tolerated there), and every connection it accepts costs a descriptor, handshake
or not. There is no libzmq option that caps connections, and unbinding the endpoint would
drop every connection it accepted. So, when the open descriptors come within
``reserve_fds`` of ``RLIMIT_NOFILE``, the guard renames ``control.sock`` to
``control.sock.busy``: nobody can start a new connection (connect() by path fails with
ENOENT, for root too), the connections already made keep working, and the listener
itself is untouched. When enough descriptors are free again it renames it back.

Accepts come faster than any reaction, so the guard reacts from its own thread, woken by
libzmq's monitor events (accepted, disconnected, ...) and once a second. It gates on an
estimate (the last count of ``/proc/self/fd`` plus the accepts minus the disconnects
since), read 64 events at a time, and scans ``/proc/self/fd`` only to correct it. What
remains: connections started before the rename (at most the listen backlog, 32, plus
those racing with the guard's wake-up) are still accepted; the reserve (half of a limit
up to 4096, a quarter of a larger one; 128 .. 4096) absorbs them. On the 2-core dev VM,
10 processes opening 10,000 raw connections as fast as they can against a limit of 1024
no longer abort it (``tests/soak/goals.py``). Give the daemon a large ``LimitNOFILE=``
all the same (the unit sets 65536; sparsekvd raises its soft limit to the hard one).

The same thread feeds the connection table (``daemon/connections.py``: credentials of
each connection, the per-uid cap, the HELLO deadline) after the gate.

Clients see a missing ``control.sock`` beside a ``control.sock.busy`` and say so
(``Client.connect``); a connected client treats either name holding its socket file as
its daemon.
"""

from __future__ import annotations

import logging
import os
import resource
import threading
import time

import zmq

from .connections import Connections

log = logging.getLogger("sparsekv.server")

BUSY_SUFFIX = ".busy"
_EVENTS_PER_PASS = 64  # monitor events read between two looks at the gate


def reserve_for(limit_fds: int) -> int:
    """Descriptors kept free below the soft limit: half of a small limit (a flood is
    accepted faster than the guard can react: about a thousand in a few milliseconds
    here), a quarter of a larger one, 128 .. 4096."""
    return min(max(128, limit_fds // 2 if limit_fds <= 4096 else limit_fds // 4), 4096)


def open_fds() -> int:
    """Descriptors this process has open now (the limit when they cannot be counted:
    listing /proc/self/fd needs a descriptor of its own)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class ConnectionGuard:
    """Renames ``path`` away while the process is short of descriptors (see above).

    Arguments:
        router: the bound ROUTER socket (owned by the caller's thread; only
            ``get_monitor_socket`` / ``disable_monitor`` are called on it, from there).
        path: the endpoint's socket file.
        limit_fds: the soft ``RLIMIT_NOFILE`` (read now when None).
        reserve_fds: descriptors to keep free (:func:`reserve_for` the limit when None).
        connections: the table of connections (``daemon/connections.py``) this thread
            feeds with the monitor's accepted / disconnected events and expires once a
            second; None: no table.
    """

    def __init__(self, router, path: str, *, limit_fds: int | None = None, reserve_fds: int | None = None,
                 connections: Connections | None = None):
        self.router = router
        self.connections = connections
        self.path = path
        self.busy_path = path + BUSY_SUFFIX
        self.limit_fds = limit_fds or resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.reserve_fds = reserve_fds if reserve_fds is not None else reserve_for(self.limit_fds)
        # Gated from limit - reserve open descriptors, open again below ungate_at.
        self.ungate_at = self.limit_fds - self.reserve_fds - self.reserve_fds // 2
        self.gated = False
        self.gated_count = 0  # times the socket was renamed away (tests, logs)
        self.last_fds = open_fds()  # at the last scan
        self._lock = threading.Lock()  # gate / ungate / close: one at a time
        self._closed = False
        self._monitor = router.get_monitor_socket(zmq.EVENT_ALL)  # the guard thread owns it from here
        self._thread = threading.Thread(target=self._run, name="sparsekv-connguard", daemon=True)

    def start(self) -> "ConnectionGuard":
        self._thread.start()
        return self

    def check(self) -> None:
        """Gate or ungate for the descriptors open now."""
        n = self.last_fds = open_fds()
        if not self.gated and n >= self.limit_fds - self.reserve_fds:
            self.gate(n)
            return
        with self._lock:
            if self._closed:
                return
            if self.gated and n < self.ungate_at:
                self._ungate()
                log.info("%d of %d file descriptors in use: accepting new connections again", n, self.limit_fds)

    def gate(self, n: int) -> None:
        """Hold off new connections: ``n`` descriptors are (about to be) open."""
        with self._lock:
            if self._closed or self.gated:
                return
            try:
                os.rename(self.path, self.busy_path)
            except OSError as e:
                log.error("cannot hold off new connections (rename %s: %s)", self.path, e.strerror)
                return
            self.gated = True
            self.gated_count += 1
        log.warning("%d of %d file descriptors in use: refusing new connections until fewer than %d are open "
                    "(%s renamed to %s); raise LimitNOFILE= or find the client that leaks connections "
                    "(sparsekv clients)", n, self.limit_fds, self.ungate_at, self.path, self.busy_path)

    def _ungate(self) -> None:
        try:
            os.rename(self.busy_path, self.path)
        except OSError as e:
            log.error("cannot accept new connections again (rename %s: %s)", self.busy_path, e.strerror)
            return
        self.gated = False

    def _run(self) -> None:
        mon = self._monitor
        # The open descriptors, estimated between scans from the monitor's events: a
        # flood must be gated on the estimate, at once; the scan of /proc/self/fd (a
        # millisecond with a thousand open) only corrects it, once a second or while
        # near the limit or gated.
        net, last_scan = 0, time.monotonic()
        last_expire = last_scan
        table: list[tuple[int, int]] = []  # (event, fd) for the connection table, later
        try:
            while True:
                if mon.poll(1000 if not table else 0):
                    for _ in range(_EVENTS_PER_PASS):  # a flood never drains: look at the gate between
                        try:
                            frames = mon.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        head = frames[0] if frames else b""
                        event = int.from_bytes(head[:2], "little") if len(head) >= 2 else 0
                        if event == zmq.EVENT_MONITOR_STOPPED:
                            return
                        if event in (zmq.EVENT_ACCEPTED, zmq.EVENT_DISCONNECTED):
                            net += 1 if event == zmq.EVENT_ACCEPTED else -1
                            if len(head) >= 6:
                                table.append((event, int.from_bytes(head[2:6], "little")))  # value: the fd
                now = time.monotonic()
                near = self.last_fds + net >= self.limit_fds - self.reserve_fds
                if near and not self.gated:
                    self.gate(self.last_fds + net)  # on the estimate, before anything else
                if self.gated or now - last_scan >= 1.0 or self.last_fds + net >= self.ungate_at:
                    self.check()
                    net, last_scan = 0, now
                # Then the table, a batch per pass (reading each new connection's
                # credentials takes a few microseconds: the gate must keep up first).
                if self.connections is not None:
                    batch, table = table[:_EVENTS_PER_PASS], table[_EVENTS_PER_PASS:]
                    for event, fd in batch:
                        if event == zmq.EVENT_ACCEPTED:
                            self.connections.accepted(fd)
                        else:
                            self.connections.disconnected(fd)
                if self.connections is not None and now - last_expire >= 1.0:
                    self.connections.expire()
                    last_expire = now
                if self.connections is None:
                    table.clear()
        except zmq.ZMQError as e:  # the context is going away
            if e.errno not in (zmq.ETERM, zmq.ENOTSOCK):
                log.exception("connection guard failed")
        except Exception:  # noqa: BLE001 - a thread must not die silently
            log.exception("connection guard failed")
        finally:
            mon.close(0)

    def close(self) -> None:
        """Stop the thread (from the router's thread) and put the socket file back."""
        with self._lock:
            self._closed = True
            if self.gated:
                self._ungate()
        if not self._thread.is_alive() and self._thread.ident is None:  # never started
            self._monitor.close(0)
            return
        try:
            self.router.disable_monitor()
        except zmq.ZMQError:
            pass
        self._thread.join(5)

