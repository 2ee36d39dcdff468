"""Who is at the other end of a loopback TCP connection: the uid that owns the client's
socket, as the kernel says (``NETLINK_SOCK_DIAG``, ``man 7 sock_diag``).

TCP has no ``SO_PEERCRED``, but on one host the client's socket is the kernel's too: an
exact ``SOCK_DIAG_BY_FAMILY`` request (``inet_diag_req_v2``, no ``NLM_F_DUMP``) names it
by its 4-tuple seen from its own side (source: the client's address and port, the
daemon's ``peername``; destination: the daemon's, its ``sockname``) and the answer's
``inet_diag_msg`` carries ``idiag_uid``: the uid of the process that made the socket,
never what the client says. Only a socket that a process holds counts: one closed already
(in FIN_WAIT or TIME_WAIT: ``idiag_inode`` 0; older kernels say uid 0, root's, for it) is
nobody's, as one the kernel does not find.

Cost: one ``send`` and one ``recv`` on a non-blocking netlink socket kept open; the kernel
answers inside the ``send`` (the reply is queued before it returns), about 9 µs a lookup
in Python (Linux 6.18). Were the answer not there, the wait for it is bounded
(:data:`TIMEOUT_S`), so lookups may run on the daemon's event loop. No ``/proc/net/tcp``
fallback: reading it costs a line per TCP socket of the host, for each connection, on the
loop (a flood of connections would cost the loop that much each).
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import struct

log = logging.getLogger("sparsekv.sock_diag")

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLMSG_ERROR = 2
NLM_F_REQUEST = 1
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
TIMEOUT_S = 0.05  # the most one lookup waits for the kernel's answer
UNKNOWN = -1  # the uid of a socket the kernel did not name (as an unreadable SO_PEERCRED)

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_REQ = struct.Struct("=BBBxI")  # inet_diag_req_v2: family, protocol, ext, pad, states; then the id
_SOCKID = struct.Struct(">HH16s16s")  # inet_diag_sockid: sport, dport, src, dst (network order) ...
_SOCKID_TAIL = struct.Struct("=III")  # ... if, cookie[2]
_MSG = struct.Struct("=BBBB")  # inet_diag_msg: family, state, timer, retrans; then the id (48 bytes)
_MSG_TAIL = struct.Struct("=IIIII")  # expires, rqueue, wqueue, uid, inode
_MSG_SIZE = _MSG.size + _SOCKID.size + _SOCKID_TAIL.size + _MSG_TAIL.size  # 72
_ERRNO = struct.Struct("=i")


def _sockid(src: tuple, dst: tuple) -> bytes:
    """An IPv4 ``inet_diag_sockid`` from ``(host, port)`` pairs (``OSError``/``ValueError``:
    not IPv4)."""
    return _SOCKID.pack(src[1], dst[1], socket.inet_aton(src[0]).ljust(16, b"\0"),
                        socket.inet_aton(dst[0]).ljust(16, b"\0"))


class SockDiag:
    """Exact lookups of IPv4 TCP sockets over one netlink socket, opened at the first
    lookup (again after a failure); :meth:`close` it when done."""

    def __init__(self, timeout_s: float = TIMEOUT_S):
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._seq = 0
        self._warned = False  # the kernel's lookups fail: said once

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def peer_uid(self, peer: tuple, local: tuple) -> int:
        """The uid owning the TCP socket at ``peer`` connected to ``local`` (a connection's
        ``peername`` and ``sockname`` on the daemon's side); :data:`UNKNOWN` when the kernel
        names no live socket (the client closed it already, say) or cannot be asked."""
        try:
            sockid = _sockid(peer, local)
        except (OSError, ValueError, TypeError, IndexError, struct.error):
            return UNKNOWN  # not an IPv4 address: the endpoint binds 127.0.0.1 only
        uid, err = self._ask(sockid)
        if err not in (0, errno.ENOENT):  # ENOENT: no such socket (any more)
            self._warn(f"[Errno {err}] {errno.errorcode.get(err, '?')}")
        return uid

    def check(self, listening: tuple) -> str | None:
        """Whether lookups work here: the kernel is asked about the daemon's own listening
        socket at ``listening`` (``(host, port)``). None when it names it as the daemon's
        uid's; else why not (a warning is logged)."""
        uid, err = self._ask(_sockid(listening, ("0.0.0.0", 0)))  # (its id: no peer)
        if err == errno.ENOENT:
            why = "the kernel does not find the daemon's own listening socket: no TCP socket diagnostics (tcp_diag)?"
        elif err:
            why = f"[Errno {err}] {errno.errorcode.get(err, '?')}"
        elif uid != os.geteuid():
            why = f"the kernel says uid {uid} owns the daemon's own listening socket, not {os.geteuid()}"
        else:
            return None
        self._warn(why)
        return why

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("HTTP endpoint: the kernel cannot say who owns a connection (NETLINK_SOCK_DIAG: %s); "
                        "such connections share the slots of uid -1", why)

    def _ask(self, sockid: bytes) -> tuple[int, int]:
        """``(uid, 0)``, or ``(UNKNOWN, errno)``; 0 for an answer that names no owner. The
        answer must name the socket asked about."""
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                                           | socket.SOCK_NONBLOCK, NETLINK_SOCK_DIAG)
            self._seq = (self._seq + 1) & 0xFFFFFFFF
            body = (_REQ.pack(socket.AF_INET, socket.IPPROTO_TCP, 0, 0xFFFFFFFF) + sockid
                    + _SOCKID_TAIL.pack(0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE))
            self._sock.send(_NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST,
                                           self._seq, 0) + body)
            try:  # the kernel answered inside send(): the answer is there
                data = self._sock.recv(8192)
            except BlockingIOError:  # (not seen): wait for it, a while
                if not select.select([self._sock], [], [], self.timeout_s)[0]:
                    raise TimeoutError(errno.ETIMEDOUT, "no answer") from None
                data = self._sock.recv(8192)
            if len(data) < _NLMSGHDR.size or _NLMSGHDR.unpack_from(data)[3] != self._seq:
                raise OSError(errno.EPROTO, "not the answer")  # (a fresh socket for the next one)
            return self._parse(data, sockid[:_SOCKID.size])
        except OSError as e:  # no netlink (a sandbox's RestrictAddressFamilies), no answer, ...
            self.close()  # (an answer late or not ours is never read as the next one's)
            return UNKNOWN, e.errno or errno.EIO

    @staticmethod
    def _parse(data: bytes, want: bytes) -> tuple[int, int]:
        length, kind = _NLMSGHDR.unpack_from(data)[:2]
        body = data[_NLMSGHDR.size:length]
        if kind == NLMSG_ERROR:
            err = -_ERRNO.unpack_from(body)[0] if len(body) >= _ERRNO.size else errno.EIO
            return UNKNOWN, err or errno.EIO
        if kind != SOCK_DIAG_BY_FAMILY or len(body) < _MSG_SIZE:
            return UNKNOWN, errno.EPROTO
        family = _MSG.unpack_from(body)[0]
        uid, inode = _MSG_TAIL.unpack_from(body, _MSG.size + _SOCKID.size + _SOCKID_TAIL.size)[3:]
        if family != socket.AF_INET or body[_MSG.size:_MSG.size + len(want)] != want:
            return UNKNOWN, errno.EPROTO
        if not inode:  # no process holds it (closed, in FIN_WAIT or TIME_WAIT): its uid says nothing
            return UNKNOWN, 0
        return uid, 0
