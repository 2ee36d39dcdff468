"""Keep the control socket from costing the daemon its last file descriptor.

libzmq aborts the whole process when ``accept()`` on an ``ipc://`` listener fails with
EMFILE, and no libzmq option caps connections. So, when the open descriptors come within
``reserve_fds`` of ``RLIMIT_NOFILE``, the guard renames ``control.sock`` to
``control.sock.busy``: nobody can start a new connection (connect() by path fails with
ENOENT, for root too), the connections already made keep working. When enough
descriptors are free again it renames it back.

The guard reacts from its own thread, woken by libzmq's monitor events and once a second,
on an estimate (the last count of ``/proc/self/fd`` plus the accepts minus the
disconnects since); the reserve absorbs the connections that race with it. The same
thread feeds the connection table (``daemon/connections.py``).
"""

from __future__ import annotations

import logging
import os
import queue
import resource
import threading
import time

import zmq

from .connections import Connections

log = logging.getLogger("sparsekv.server")

BUSY_SUFFIX = ".busy"
_EVENTS_PER_PASS = 64  # monitor events read between two looks at the gate
_DRAIN_MAX = 4096  # monitor events read at most before the counts are corrected
PROBE_S, PROBE_FLOOD = 0.002, 64  # reopening: a first look after 2 ms; this many more descriptors: a flood
HOLD_MIN_S, HOLD_MAX_S = 1.0, 8.0  # how long a gate stays shut at least: the first, and after repeated floods


def reserve_for(limit_fds: int) -> int:
    """Descriptors kept free below the soft limit: half of a small limit (a flood is
    accepted faster than the guard can react), a quarter of a larger one, 128 .. 4096."""
    return min(max(128, limit_fds // 2 if limit_fds <= 4096 else limit_fds // 4), 4096)


def open_fds() -> int:
    """Descriptors this process has open now (the limit when they cannot be counted:
    listing /proc/self/fd needs a descriptor of its own)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _discard_events(mon) -> None:
    """Read and drop a monitor's events until it is stopped or its context ends: libzmq
    sends them with a blocking send, so a monitor nobody reads would stop the I/O thread,
    and with it every socket of the daemon."""
    try:
        while True:
            head = mon.recv_multipart()[0]
            if len(head) >= 2 and int.from_bytes(head[:2], "little") == zmq.EVENT_MONITOR_STOPPED:
                return
    except zmq.ZMQError:
        return


class ConnectionGuard:
    """Renames ``path`` away while the process is short of descriptors (see above).

    Arguments:
        router: the bound ROUTER socket (only ``get_monitor_socket`` / ``disable_monitor``
            are called on it, from its owner's thread).
        path: the endpoint's socket file.
        limit_fds: the soft ``RLIMIT_NOFILE`` (read now when None).
        reserve_fds: descriptors to keep free (:func:`reserve_for` the limit when None).
        connections: the table of connections this thread feeds; None: no table.
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
        # (A bounded gap: below a small limit's daemon's own descriptors it would never reopen.)
        self.ungate_at = self.limit_fds - self.reserve_fds - min(self.reserve_fds // 2, 64)
        self.gated = False
        self._hold_s = HOLD_MIN_S / 2  # doubled at the first gate
        self._hold_until = 0.0
        self._ungated_at = float("-inf")
        self.last_fds = open_fds()  # at the last scan
        self._lock = threading.Lock()  # gate / ungate / close: one at a time
        self._closed = False
        self._monitor = router.get_monitor_socket(zmq.EVENT_ALL)  # the guard thread owns it from here
        self._thread = threading.Thread(target=self._run, name="sparsekv-connguard", daemon=True)
        self._table_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._table_thread = None if connections is None else \
            threading.Thread(target=self._run_table, name="sparsekv-conntable", daemon=True)

    def start(self) -> "ConnectionGuard":
        self._thread.start()
        if self._table_thread is not None:
            self._table_thread.start()
        return self

    def check(self) -> None:
        """Gate or ungate for the descriptors open now."""
        n = self.last_fds = open_fds()
        if not self.gated and n >= self.limit_fds - self.reserve_fds:
            self.gate(n)
            return
        with self._lock:
            if self._closed or not (self.gated and n < self.ungate_at and time.monotonic() >= self._hold_until):
                return
            # Reopen for PROBE_S first: a waiting flood lands at once, faster than the
            # monitor's events say so, and fits in the margin; count, and close again if so.
            self._ungate()
        time.sleep(PROBE_S)
        m = self.last_fds = open_fds()
        if m - n >= PROBE_FLOOD:
            self.gate(m)
            return
        log.info("%d of %d file descriptors in use: accepting new connections again", m, self.limit_fds)

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
            # A gate soon after the last reopening holds twice as long, up to HOLD_MAX_S; a
            # quiet minute starts again from HOLD_MIN_S.
            now = time.monotonic()
            self._hold_s = min(2 * self._hold_s, HOLD_MAX_S) if now - self._ungated_at < 60 else HOLD_MIN_S
            self._hold_until = now + self._hold_s
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
        self._ungated_at = time.monotonic()

    def _run(self) -> None:
        mon = self._monitor
        gate_at = self.limit_fds - self.reserve_fds
        # The open descriptors, estimated between scans from the monitor's events: a flood
        # is gated on the estimate, at once; the scan of /proc/self/fd only corrects it (once
        # a second, or near the limit, gated, or in the second after reopening).
        net, last_scan = 0, time.monotonic()
        table = self._table_queue  # (event, fd) for the table's thread
        try:
            while True:
                if mon.poll(1000):
                    for i in range(_DRAIN_MAX):
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
                            if len(head) >= 6 and self.connections is not None:
                                table.put((event, int.from_bytes(head[2:6], "little")))  # value: the fd
                        if i % _EVENTS_PER_PASS == 0 and not self.gated and self.last_fds + net >= gate_at:
                            self.gate(self.last_fds + net)  # on the estimate, before anything else
                now = time.monotonic()
                if not self.gated and self.last_fds + net >= gate_at:
                    self.gate(self.last_fds + net)
                if self.gated or now - last_scan >= 1.0 or self.last_fds + net >= self.ungate_at \
                        or now - self._ungated_at < 1.0:
                    self.check()
                    net, last_scan = 0, now
        except zmq.ZMQError as e:  # the context is going away
            if e.errno not in (zmq.ETERM, zmq.ENOTSOCK):
                self._failed(mon)
        except Exception:  # noqa: BLE001 - a thread must not die silently
            self._failed(mon)
        finally:
            mon.close(0)
            self._table_queue.put(None)  # the table's thread ends too

    def _failed(self, mon) -> None:
        """The guard's loop failed: new connections are taken again, and the monitor is
        read and dropped until the guard is closed."""
        log.exception("connection guard failed; new connections are no longer held off")
        with self._lock:
            if self.gated and not self._closed:
                self._ungate()
        _discard_events(mon)

    def _run_table(self) -> None:
        """The connection table's own thread: its microseconds per connection must never
        delay the gate."""
        q, last_expire = self._table_queue, time.monotonic()
        try:
            while True:
                try:
                    item = q.get(timeout=1.0)
                except queue.Empty:
                    item = ()
                if item is None:
                    return
                if item:
                    event, fd = item
                    if event == zmq.EVENT_ACCEPTED:
                        self.connections.accepted(fd)
                    else:
                        self.connections.disconnected(fd)
                now = time.monotonic()
                if now - last_expire >= 1.0:
                    self.connections.expire()
                    last_expire = now
        except Exception:  # noqa: BLE001 - a thread must not die silently
            log.exception("connection table failed")

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
        if self._table_thread is not None:
            self._table_queue.put(None)
            self._table_thread.join(5)  # before the server closes the table's spare descriptors

