"""The fd socket's server (``proto/fd_socket.py``), on the daemon's loop.

Two requests, one per connection, each checked against the connection's kernel identity
(``SO_PEERCRED``):

* ``<token>``: the descriptors of the rank the token was offered for (its slab, its
  pinned step blocks), to the process that attached that rank and to no other;
* ``deposit``, with one descriptor beside it: an engine-owned slab (``proto/slab.py``)
  the process brings to its next ATTACH, kept under a random id, bound to the depositing
  process, for :data:`DEPOSIT_TTL_S` (at most :data:`DEPOSITS_PER_PID` per process and
  :data:`DEPOSITS_PER_UID` per uid, so one user's processes cannot refuse another's).

Bounded like the stats socket (``uid_slots.py``): :data:`MAX_CONNECTIONS` served at once,
at most :data:`PER_UID` of one uid (SO_PEERCRED), :data:`RESERVED` more for operators (root,
the daemon's uid, ``admin_gid`` members); a connection beyond is answered at once with a
busy refusal (QUOTA_EXCEEDED, ``"busy": true``, which the client retries for a moment:
``proto/fd_socket.py``) and counted in ``fd_connections_refused``; a request must come
within ``fd_socket.REQUEST_TIMEOUT_S``. Every other refusal is answered and counted in
``fd_refusals``; a connection closed before it sent anything is answered nothing, logged
nothing and counted in ``fd_connections_empty``. Refusals are logged at most
``ratelog.BURST`` lines a cause every ``ratelog.INTERVAL_S`` (``ratelog.py``).

A request brings at most one descriptor (a deposit's): each read makes room for one and,
once one came, for none, so a connection makes the daemon hold one descriptor at most. A
second, or one the kernel had to cut off (``MSG_CTRUNC``: more than one in a message, or
one after the first), ends the request: whatever came is closed and it is refused
(BAD_ARGUMENT). The descriptors a request brought are closed on every path but a deposit
kept (an answer, a refusal, a timeout, an error, the daemon stopping).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass

from sparsekv.proto import ErrorCode, ProtocolError
from sparsekv.proto import fd_socket

from .peers import Peer
from .ratelog import RateLimitedLog
from .uid_slots import UidSlots

log = logging.getLogger("sparsekv.server")

# fd socket connections served at once. Each carries one request, sent as soon as the
# client connects, and one answer, given by the loop in well under a millisecond: what is
# open at once is the processes connecting in that moment (a rank at ATTACH, a slab or a
# keys buffer deposited; 300 processes depositing in one instant held at most 6 open).
# One uid may hold PER_UID of the MAX_CONNECTIONS: every rank of a TP group of the largest
# size (LIMITS.max_tp_size, 64) connecting in the same instant; four uids are needed to
# fill them. Operators (root, the daemon's own uid, which runs the engines in the
# documented deployment, and admin_gid members) have RESERVED more, used once their share
# or the shared ones are taken. A connection beyond is answered busy at once, which the
# client tries again for up to fd_socket.BUSY_RETRY_S; a silent one is closed after
# fd_socket.REQUEST_TIMEOUT_S.
MAX_CONNECTIONS = 256
PER_UID = 64
RESERVED = 64
DEPOSIT_TTL_S = 60.0  # a deposited slab descriptor not used by an ATTACH is closed after this
DEPOSITS_PER_PID = 4
DEPOSITS_PER_UID = 64


@dataclass
class Deposit:
    fd: int
    pid: int
    uid: int
    gid: int
    at: float  # time.monotonic() of the deposit


class FdServer:
    """Args:
        stats: the daemon's counters.
        share_fds: ``client_id -> {name: fd}``, the backend's descriptors of a client's rank.
        is_attacher: ``(session, pid, uid, gid) -> bool``: whether that process attached
            the session's rank.
    """

    def __init__(self, stats, share_fds, is_attacher, is_operator=lambda peer: False, clock=time.monotonic):
        self.stats = stats
        self.rlog = RateLimitedLog(log, clock=clock)  # refusals: any local user can cause them at will
        self._share_fds = share_fds
        self._is_attacher = is_attacher
        self.offers: dict[str, object] = {}  # token -> session (one per attached rank at most)
        self.deposits: dict[str, Deposit] = {}
        # connections being served, by uid; is_operator: Sessions.sees_all
        self.slots = UidSlots(is_operator, MAX_CONNECTIONS, PER_UID, RESERVED, "fd socket connections")
        self._listener: socket.socket | None = None
        self._task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    # -- lifetime ----------------------------------------------------------------------
    async def start(self, path: str) -> None:
        """Listen on ``path``: bound under a private name, mode 0660, listening, then
        renamed into place (a client that sees the name can connect)."""
        new_path = path + ".new"
        for p in (path, new_path):
            if os.path.lexists(p):
                os.unlink(p)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            listener.bind(new_path)
            os.chmod(new_path, 0o660)
            listener.listen(64)
            os.rename(new_path, path)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._task = asyncio.get_running_loop().create_task(self._accept(), name="fd-socket")

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for t in list(self._tasks):
            t.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self.offers.clear()
        for dep in self.deposits.values():
            os.close(dep.fd)
        self.deposits.clear()

    # -- offers (daemon -> client) -----------------------------------------------------
    def offer(self, session) -> str:
        """A one-time token for the descriptors of ``session``'s rank."""
        token = secrets.token_hex(fd_socket.TOKEN_BYTES)
        self.offers[token] = session
        return token

    def withdraw(self, token: str | None) -> None:
        if token is not None:
            self.offers.pop(token, None)

    # -- deposits (client -> daemon) ---------------------------------------------------
    def take_deposit(self, dep_id, pid: int, uid: int, gid: int) -> int:
        """The descriptor deposited as ``dep_id`` by process ``pid`` (uid, gid): the
        caller owns it from now on. Raises PERMISSION_DENIED for another process's
        deposit (kept for it), BAD_ARGUMENT for an unknown or expired id."""
        dep = self.deposits.get(dep_id) if isinstance(dep_id, str) else None
        if dep is None:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "unknown or expired slab deposit: deposit the slab's "
                                f"descriptor on the fd socket (it is kept {DEPOSIT_TTL_S:g} s), then attach once "
                                "with its id")
        if (dep.pid, dep.uid, dep.gid) != (pid, uid, gid):
            self.stats.add(fd_refusals=1)
            raise ProtocolError(ErrorCode.PERMISSION_DENIED, "this slab deposit belongs to another process: "
                                "only the process that deposited a slab may attach with it")
        del self.deposits[dep_id]
        return dep.fd

    def expire(self, now: float | None = None) -> int:
        """Close deposits older than :data:`DEPOSIT_TTL_S`; return how many. (Called
        every ``reap_interval_s``: the refusals' log summaries are written here too.)"""
        now = time.monotonic() if now is None else now
        old = [k for k, d in self.deposits.items() if now - d.at > DEPOSIT_TTL_S]
        for k in old:
            os.close(self.deposits.pop(k).fd)
        self.rlog.flush()
        return len(old)

    # -- the socket --------------------------------------------------------------------
    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as e:  # EMFILE and the like: keep serving
                log.warning("fd socket: accept failed: %s", e)
                await asyncio.sleep(0.05)
                continue
            try:
                conn.setblocking(False)
                peer = Peer.of_socket(conn, groups=True)
            except OSError as e:  # the peer hung up already, say
                log.debug("fd socket: %s", e)
                conn.close()
                continue
            reserved, why = self.slots.take(peer)
            if reserved is None:  # its uid's share, or every slot, is taken: keep the descriptors
                self.stats.add(fd_connections_refused=1)  # (not logged: a flood would flood the log too)
                _refuse_busy(conn, why)
                continue
            t = loop.create_task(self._serve(conn, peer, reserved))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket, peer: Peer, reserved: bool) -> None:
        received: list[int] = []  # what came with the request: closed below unless a deposit took it
        try:
            pid, uid, gid = peer.pid, peer.uid, peer.gid
            try:
                line = await _read_line(conn, received)
            except _TooManyFds:
                answer, fds = self._refuse(pid, uid, _TOO_MANY_FDS, ErrorCode.BAD_ARGUMENT, cause="descriptors")
            else:
                if line == b"":  # closed before sending anything: nobody to answer, nothing to log
                    self.stats.add(fd_connections_empty=1)
                    log.debug("fd socket: pid %d uid %d closed its connection without a request", pid, uid)
                    return
                answer, fds = self._answer(line, received, pid, uid, gid)  # a deposit takes its fd out
            socket.send_fds(conn, [answer], fds)
        except (OSError, ValueError) as e:  # the peer hung up, say
            log.debug("fd socket: %s", e)
        except asyncio.CancelledError:
            pass
        finally:
            for fd in received:
                os.close(fd)
            conn.close()
            self.slots.give(peer, reserved)

    def _answer(self, line: bytes | None, received: list[int], pid: int, uid: int,
                gid: int) -> tuple[bytes, list[int]]:
        """The answer to ``line`` (what came up to its newline; None: nothing came in time)
        and the descriptors to send; a deposit takes its own out of ``received``, the
        caller closes the rest."""
        text = (line or b"").split(b"\n", 1)[0].strip().decode("ascii", "replace")
        if text == fd_socket.DEPOSIT:
            return self._deposit(received, pid, uid, gid)
        s = self.offers.get(text) if text else None
        if line is None:
            why, cause = f"no request within {fd_socket.REQUEST_TIMEOUT_S:g} s", "no request in time"
        elif received:
            why, cause = "descriptors are taken only with a deposit request", "descriptors"
        elif s is None:
            why, cause = ("unknown or already used token: a token serves one connection, from the process that "
                          "attached, until it detaches"), "unknown token"
        elif not self._is_attacher(s, pid, uid, gid):  # leaked or stolen: kept for the rank's process
            self.rlog.log("another process's token", logging.WARNING, "fd socket: pid %d (uid %d gid %d) presented "
                          "the token of client %d (pid %d uid %d)", pid, uid, gid, s.client_id, s.pid, s.uid)
            why, cause = (f"this process (pid {pid}, uid {uid}) did not attach this rank: only the process that "
                          "attached it gets its memory"), "another process's token"
        else:
            del self.offers[text]
            s.fd_token = None
            fds = self._share_fds(s.client_id)
            log.debug("fd socket: client %d (pid %d) got %s", s.client_id, pid, ", ".join(fds))
            return fd_socket.answer(True, fds=list(fds)), list(fds.values())
        return self._refuse(pid, uid, why, cause=cause)

    def _deposit(self, received: list[int], pid: int, uid: int, gid: int) -> tuple[bytes, list[int]]:
        if len(received) != 1:
            return self._refuse(pid, uid, f"a deposit brings exactly one descriptor, this one {len(received)}",
                                cause="deposit refused")
        self.expire()
        mine = sum(1 for d in self.deposits.values() if d.pid == pid)
        users = sum(1 for d in self.deposits.values() if d.uid == uid)
        if mine >= DEPOSITS_PER_PID or users >= DEPOSITS_PER_UID:
            return self._refuse(pid, uid, f"too many slab deposits not yet used by an ATTACH ({mine} of this "
                                f"process, {users} of its uid); attach with them or wait "
                                f"{DEPOSIT_TTL_S:g} s", ErrorCode.TOO_LARGE, cause="deposit refused")
        dep_id = secrets.token_hex(fd_socket.TOKEN_BYTES)
        self.deposits[dep_id] = Deposit(received.pop(), pid, uid, gid, time.monotonic())
        log.debug("fd socket: pid %d deposited a slab descriptor", pid)
        return fd_socket.answer(True, deposit=dep_id), []

    def _refuse(self, pid: int, uid: int, why: str, code: ErrorCode = ErrorCode.PERMISSION_DENIED, *,
                cause: str = "refused"):
        """A refusal's answer, counted (``fd_refusals``) and logged, at most so many lines a
        ``cause`` (``ratelog.py``): any local user can cause them as fast as it connects."""
        self.stats.add(fd_refusals=1)
        self.rlog.log(f"fd socket: {cause}", logging.INFO, "fd socket: refused pid %d uid %d: %s", pid, uid, why)
        return fd_socket.answer(False, code=code, msg=why), []


def _refuse_busy(conn: socket.socket, why: str) -> None:
    """Answer a connection beyond the limits (busy: the client may try again) and close it,
    its request unread (the client may see a reset after the answer). The short answer fits
    the new connection's buffer: nothing waits."""
    try:
        conn.send(fd_socket.answer(False, code=ErrorCode.QUOTA_EXCEEDED, msg=f"busy: {why}; try again", busy=True))
    except OSError:
        pass
    conn.close()


_TOO_MANY_FDS = "a request brings at most one descriptor (a deposit's); this one brought more"


class _TooManyFds(Exception):
    """A request brought a second descriptor (or more in one message)."""


async def _read_line(conn: socket.socket, fds: list[int]) -> bytes | None:
    """What came of one request (at most ``MAX_REQUEST_BYTES``), up to its newline or the
    connection's end, within ``REQUEST_TIMEOUT_S``: None if it did not come in time,
    ``b""`` if the connection was closed before anything came. The descriptor that came
    with it is appended to ``fds`` as it comes (the caller closes it, whatever happens
    here). Each read makes room for one descriptor, and for none once one came: raises
    :class:`_TooManyFds` at a second or more (the kernel cut them off, ``MSG_CTRUNC``, and
    closed them), so the daemon never holds more than one for a connection."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + fd_socket.REQUEST_TIMEOUT_S
    data = b""
    while b"\n" not in data and len(data) < fd_socket.MAX_REQUEST_BYTES:
        ready = loop.create_future()
        loop.add_reader(conn.fileno(), lambda: ready.done() or ready.set_result(None))
        try:
            await asyncio.wait_for(ready, max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            return None
        finally:
            loop.remove_reader(conn.fileno())
        try:
            chunk, got, flags, _ = socket.recv_fds(conn, fd_socket.MAX_REQUEST_BYTES - len(data), 1 - len(fds),
                                                   socket.MSG_CMSG_CLOEXEC)
        except BlockingIOError:
            continue
        fds.extend(got)
        if len(fds) > 1 or flags & socket.MSG_CTRUNC:
            raise _TooManyFds
        if not chunk:
            break
        data += chunk
    return data
