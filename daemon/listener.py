"""``control.sock``'s listening socket (daemon/control_socket.py reads what it accepts).

The socket is bound under a private name and renamed into place once it listens, so the
path appears only when connections are accepted. Within ``reserve_fds`` of
``RLIMIT_NOFILE`` the daemon stops accepting and renames ``control.sock`` to
``control.sock.busy`` (a client says the daemon refuses new connections) until
descriptors are free again; connections made keep working.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import select
import socket
from collections.abc import Callable, Iterator

log = logging.getLogger("sparsekv.server")

LISTEN_BACKLOG = 128
BUSY_SUFFIX = ".busy"  # control.sock's name while no connection is accepted
ACCEPT_BATCH = 64


def reserve_for(limit_fds: int) -> int:
    """Descriptors kept free below the soft limit: half of a small limit, a quarter of a
    larger one, 128 .. 4096."""
    return min(max(128, limit_fds // 2 if limit_fds <= 4096 else limit_fds // 4), 4096)


def open_fds() -> int:
    """Descriptors this process has open now (the limit when they cannot be counted)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class Listener:
    """The listening socket, registered with ``ep`` (an epoll) while it accepts.

    Arguments:
        path: where ``control.sock`` goes.
        ep: the epoll the connections are read through.
        connections: how many descriptors the open connections hold now (a socket each, and
            the pidfd of its opener).
        limit_fds, reserve_fds: the descriptor limit and how many to keep free.
    """

    def __init__(self, path: str, ep, connections: Callable[[], int], *, limit_fds: int | None = None,
                 reserve_fds: int | None = None):
        self.path = path
        self._ep = ep
        self._connections = connections
        self.limit_fds = limit_fds or resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.reserve_fds = reserve_for(self.limit_fds) if reserve_fds is None else reserve_fds
        self._sock: socket.socket | None = None
        self._accepting = False
        self._base_fds = 0  # descriptors open besides the connections, at the last count

    def open(self) -> None:
        """Bind and listen; the path appears once the socket listens (with mode 0660)."""
        new_path = self.path + ".new"
        for p in (self.path, new_path, self.path + BUSY_SUFFIX):
            if os.path.lexists(p):
                os.unlink(p)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        s.bind(new_path)
        s.listen(LISTEN_BACKLOG)
        os.chmod(new_path, 0o660)
        os.rename(new_path, self.path)
        self._sock = s
        self._base_fds = open_fds()
        self._accept_on()

    def fileno(self) -> int:
        """The listening descriptor (-1 when closed)."""
        return self._sock.fileno() if self._sock is not None else -1

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        for p in (self.path, self.path + BUSY_SUFFIX):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def accept(self) -> Iterator[socket.socket]:
        """The connections waiting (up to ``ACCEPT_BATCH``), each counted in
        ``connections`` or closed before the next is taken; accepting stops within
        ``reserve_fds`` of the limit."""
        for _ in range(ACCEPT_BATCH):
            if self._fds_left() <= self.reserve_fds:
                self._ep.unregister(self._sock.fileno())
                self._accepting = False
                try:
                    os.rename(self.path, self.path + BUSY_SUFFIX)
                except OSError as e:
                    log.error("cannot hold off new connections (rename %s: %s)", self.path, e.strerror)
                log.warning("%d of %d file descriptors in use: refusing new connections (%s renamed to %s); raise "
                            "LimitNOFILE= or find the client that leaks connections (sparsekv clients)",
                            self.limit_fds - self._fds_left(), self.limit_fds, self.path, self.path + BUSY_SUFFIX)
                return
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE / ENFILE / ENOBUFS: try again on the next round
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    self._base_fds = open_fds() - self._connections()
                log.warning("accept on the control socket failed: %s", e.strerror)
                return
            yield sock

    def recount(self) -> None:
        """Once a second: count the descriptors open, and accept again once enough are free."""
        self._base_fds = open_fds() - self._connections()
        if not self._accepting and self._fds_left() > self.reserve_fds + min(self.reserve_fds // 2, 64):
            try:
                os.rename(self.path + BUSY_SUFFIX, self.path)
            except OSError as e:
                log.error("cannot accept new connections again (rename %s: %s)", self.path + BUSY_SUFFIX, e.strerror)
                return
            log.warning("accepting new control connections again (%d descriptors free)", self._fds_left())
            self._accept_on()

    def _fds_left(self) -> int:
        return self.limit_fds - self._base_fds - self._connections()

    def _accept_on(self) -> None:
        if self._sock is not None and not self._accepting:
            self._ep.register(self._sock.fileno(), select.EPOLLIN)
            self._accepting = True
