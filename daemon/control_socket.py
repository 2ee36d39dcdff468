"""The control socket: a Unix stream socket speaking ZMTP (``daemon/zmtp.py``), read by the
daemon's event loop, and what each peer may cost it.

Clients connect a ZMTP DEALER (``client/wire.py``, or libzmq's) to ``control.sock``; the daemon accepts, reads and
writes each connection itself, so every limit holds before anything is read:

* **Who.** ``SO_PEERCRED`` is read when a connection is accepted, with a pidfd of the
  process that connected (``SO_PEERPIDFD``, else ``pidfd_open`` of its pid at once): the
  session a HELLO opens is bound to that connection (its identity is the connection's,
  never a routing id a peer chose), a HELLO once that process has exited is refused (its
  pid may be another process's), and a connection of a uid with ``max_per_uid`` open is
  closed at once.
* **How much.** A frame's size is known before its bytes are read. Before its HELLO is
  answered a connection may send messages of ``LIMITS.max_header_bytes`` at most; after,
  ``LIMITS.max_message_bytes``, frames of ``max_frame_bytes`` (the header frame
  ``max_header_bytes``), ``max_frames`` of them. A larger one is refused with a typed
  TOO_LARGE reply and the connection closed, before its bytes are read.
* **How much in all.** Frames over ``SMALL_FRAME`` bytes are read into buffers taken from
  one budget (``inflight_bytes``, and a quarter of it per uid) and given back when the
  daemon drops the last reference to them (the request answered, or dropped). A frame
  the budget cannot take yet pauses that connection's reads until it can: the kernel's
  socket buffer and the client wait, the daemon's memory does not grow. Paused
  connections resume in the order they paused; one that waits only for its own uid's
  share keeps its place without holding up the others' uids.
* **How long.** No HELLO within ``hello_timeout_s``, or a message begun and not finished
  within ``MESSAGE_TIMEOUT_S`` (a peer that stops half way would hold its budget): closed.
* **Descriptors.** Within ``reserve_fds`` of ``RLIMIT_NOFILE`` the daemon stops accepting
  (``daemon/listener.py``).
* **Turns.** A connection's reads stop after ``MAX_BURST`` frames or PINGs, or at its
  next message once ``TURN_NS`` have passed since they began, until every other ready
  connection has had its turn: a flood of tiny frames, or of requests that each take long
  (a STEP invalidating in every row of a large batch), delays others by one request each.
* **Replies.** What a peer does not read is queued up to ``MAX_OUT_BYTES`` a connection
  and ``MAX_OUT_TOTAL`` in all (``daemon/outbox.py``); past either the connection is
  closed. A connection dropped while its bytes are being decoded serves nothing more (its
  credentials are gone with it: a HELLO there is refused).
"""

from __future__ import annotations

import collections
import logging
import os
import select
import socket
import time
import weakref
from dataclasses import dataclass

from sparsekv.proto import LIMITS, ErrorCode
from sparsekv.proto.zmtp import encode_message

from .inflight import Budget, FrameBuffer, Refused, declared
from .listener import Listener
from .outbox import NotReading, Outbox, Outboxes
from .peers import Peer, peer_pidfd, pidfd_exited
from .ratelog import RateLimitedLog
from .zmtp import Decoder, ZmtpError

log = logging.getLogger("sparsekv.server")

SMALL_FRAME = 4096  # frames up to this are plain bytes, outside the budget
READ_SLICE = 4 << 20  # bytes read from one connection before the others get their turn
SCRATCH_BYTES = 256 << 10
MESSAGE_TIMEOUT_S = 10.0
MAX_BURST = 256  # frames and PINGs of one connection read before the others get their turn
TURN_NS = 5_000_000  # past this since a connection's reads began, its next message waits for the others' turn
MAX_EVENTS = 256


@dataclass(eq=False)
class Conn:
    sock: socket.socket
    ident: bytes
    peer: Peer
    at: float  # time.monotonic() when accepted
    out: Outbox  # its replies not yet written
    decoder: Decoder | None = None
    greeted: bool = False  # its HELLO was answered
    message_at: float = 0.0  # when its message in progress began (or was last resumed)
    closing: bool = False  # refused: closed once its last reply is out
    burst: int = 0  # frames and PINGs read since its turn began
    yielded: bool = False  # its reads wait for the next turn (MAX_BURST or TURN_NS reached)
    turn_at: int = 0  # perf_counter_ns when its reads of this turn began
    plan: list | None = None  # the array frames' sizes its message's header declares
    refusal: tuple | None = None  # (code, message) its message in progress is refused with
    pidfd: int | None = None  # the connecting process's pidfd (peers.peer_pidfd), closed with the connection
    reserved: int = 0  # budget taken for those and not yet read into a buffer
    wanted: int = 0  # the budget its paused message waits for
    events: int = 0  # registered with epoll


class ControlSocket:
    """The control connections: accepted from the :class:`Listener`, read, their frames
    admitted or refused, their replies handed to their :class:`Outbox` (see the module).
    Used from the loop's thread only, except :class:`Budget`'s give-backs.

    Arguments:
        path: where ``control.sock`` goes (bound under a private name, renamed into place).
        on_message: ``(ident, frames, tr, refusal)`` for every complete message; ``refusal``:
            None, or (code, message) of a limit it broke (its frames were dropped: answer
            it with that error).
        on_closed: ``(ident)`` when a connection whose HELLO was answered closes.
        inflight_bytes: the budget of large frames held (a quarter of it per uid).
        max_per_uid: connections of one uid at most (0: no cap; this process is never capped).
        hello_timeout_s: how long a connection may stay without an answered HELLO.
        limit_fds, reserve_fds: the descriptor limit and how many to keep free.
    """

    def __init__(self, path: str, *, on_message, on_closed, inflight_bytes: int = 256 << 20, max_per_uid: int = 0,
                 hello_timeout_s: float = 10.0, limit_fds: int | None = None, reserve_fds: int | None = None,
                 clock=time.monotonic):
        self.path = path
        self.on_message, self.on_closed = on_message, on_closed
        self.budget = Budget(inflight_bytes, max(inflight_bytes // 4, LIMITS.max_message_bytes))
        self.max_per_uid = max_per_uid
        self.hello_timeout_s = hello_timeout_s
        self._clock = clock
        self.exempt_pid = os.getpid()
        self._ep = select.epoll()
        self._conns: dict[int, Conn] = {}  # by descriptor
        self._pidfds = 0  # the connections' pidfds open (each connection: its socket and maybe one)
        self.listener = Listener(path, self._ep, lambda: len(self._conns) + self._pidfds, limit_fds=limit_fds,
                                 reserve_fds=reserve_fds)
        self._by_ident: dict[bytes, Conn] = {}
        self._paused: collections.deque[Conn] = collections.deque()  # waiting for the budget, in order
        self._yielded: list[Conn] = []  # waiting for their next turn
        self._resuming: Conn | None = None  # the paused connection being resumed
        self._outboxes = Outboxes(evict=self._evicted)
        self._next = 0
        self._scratch = bytearray(SCRATCH_BYTES)
        self._scratch_view = memoryview(self._scratch)
        self._loop = None  # the event loop, to wake it when a give-back unpauses someone
        # Inside poll(): only there does a turn yielded for time get taken up again (by the
        # next poll's _next_turn); a give-back's _unpause runs outside, with nothing to wake it.
        self._polling = False
        self.rlog = RateLimitedLog(log, clock=clock)
        self.counts = collections.Counter()  # refused, expired, broken, too_large, paused, stalled, not_reading

    # -- life --------------------------------------------------------------------------
    def open(self, loop=None) -> "ControlSocket":
        """Bind and listen; the path appears once the socket listens (with mode 0660)."""
        self.listener.open()
        self._loop = loop
        return self

    def fileno(self) -> int:
        """A descriptor readable whenever there is something to do (:meth:`poll`)."""
        return self._ep.fileno()

    def close(self) -> None:
        for c in list(self._conns.values()):
            self._drop(c, notify=False)
        self.listener.close()
        self._ep.close()

    # -- what the server asks ------------------------------------------------------------
    def peer_alive(self, ident: bytes) -> bool:
        """Whether the process that opened connection ``ident`` still runs (True where its
        pidfd could not be had, or for a connection gone): a HELLO is refused on a connection
        its opener left behind, whose pid another process may hold by now."""
        c = self._by_ident.get(ident)
        return c is None or c.pidfd is None or not pidfd_exited(c.pidfd)

    def peer(self, ident: bytes) -> Peer | None:
        """The credentials of connection ``ident`` (None: not a connection, e.g. in process)."""
        c = self._by_ident.get(ident)
        return c.peer if c is not None else None

    def greet(self, ident: bytes) -> None:
        """Connection ``ident``'s HELLO was answered: full-size messages, no HELLO deadline."""
        c = self._by_ident.get(ident)
        if c is not None:
            c.greeted = True

    def send(self, ident: bytes, frames) -> bool:
        """Queue one message to connection ``ident``; False when it is gone."""
        c = self._by_ident.get(ident)
        if c is None:
            return False
        try:
            c.out.write(encode_message(frames))
        except NotReading as e:
            self._not_reading(c, e)
            return False
        except OSError:
            self._drop(c)
            return False
        if c.out:
            self._watch(c)
        return True

    def _evicted(self, out: Outbox, why: str) -> None:
        """(Outboxes) ``out``'s queue was dropped for another connection's reply: its
        connection is closed, after the reply being sent (a loop callback, not inside it)."""
        c = next((c for c in self._conns.values() if c.out is out), None)
        if c is None:
            return
        if self._loop is None:
            self._not_reading(c, NotReading(why))
        else:
            self._loop.call_soon(self._not_reading, c, NotReading(why))

    def _not_reading(self, c: Conn, e: NotReading) -> None:
        if self._by_ident.get(c.ident) is not c:
            return  # gone already (an eviction's callback after the peer hung up)
        self.counts["not_reading"] += 1
        self.rlog.log("not reading", logging.WARNING, "control connection of pid %d uid %d closed: %s", c.peer.pid,
                      c.peer.uid, e)
        self._drop(c)

    def counters(self) -> dict[str, int]:
        n = self.counts
        return {"connections_open": len(self._conns), "connections_refused": n["refused"],
                "connections_expired": n["expired"] + n["stalled"], "connections_broken": n["broken"] + n["too_large"],
                "messages_refused": n["refused_messages"] + n["too_large"], "reads_paused": n["paused"],
                "inflight_bytes": self.budget.held, "inflight_bytes_peak": self.budget.peak}

    def by_uid(self) -> dict[int, int]:
        return dict(collections.Counter(c.peer.uid for c in self._conns.values()))

    # -- the loop's work ---------------------------------------------------------------
    def poll(self) -> int:
        """Do what is ready now (accept, read, write) without blocking; returns how many
        events there were."""
        self._polling = True  # a turn yielded for time is taken up by the next poll
        try:
            return self._poll()
        finally:
            self._polling = False

    def _poll(self) -> int:
        self._unpause()
        turns = self._next_turn()
        events = self._ep.poll(0, MAX_EVENTS)
        listener = self.listener.fileno()
        for fd, ev in events:
            if fd == listener:
                for sock in self.listener.accept():
                    self._admit(sock)
                continue
            c = self._conns.get(fd)
            if c is None:
                continue
            try:
                if ev & select.EPOLLOUT:
                    self._flush(c)
                if ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) and fd in self._conns:
                    self._read(c)
            except Exception:  # noqa: BLE001 - a fault of ours with one connection: drop it, serve the rest
                log.exception("control connection of pid %d uid %d failed", c.peer.pid, c.peer.uid)
                self._drop(c)
        return len(events) + turns

    def _next_turn(self) -> int:
        """Go on with the connections that yielded their turn (what they sent is read
        already); how many."""
        yielded, self._yielded = self._yielded, []
        for c in yielded:
            c.yielded, c.burst, c.turn_at = False, 0, time.perf_counter_ns()
            if self._resume(c):
                self._watch(c)
        return len(yielded)

    def _resume(self, c: Conn) -> bool:
        """Let ``c``'s decoder go on; False when ``c`` is gone (closed, refused, broken)."""
        if self._conns.get(c.sock.fileno()) is not c or c.closing:
            return False
        try:
            c.decoder.resume()
        except Refused as e:
            self._refuse(c, e)
            return False
        except ZmtpError:
            self._drop(c)
            return False
        return True

    def expire(self) -> None:
        """Once a second: connections without HELLO in time, messages begun and not
        finished in time, and accepting again once descriptors are free."""
        now = self._clock()
        for c in list(self._conns.values()):
            if c.peer.pid == self.exempt_pid:
                continue
            if not c.greeted and now - c.at > self.hello_timeout_s:
                self.counts["expired"] += 1
                self.rlog.log("connection without HELLO", logging.INFO, "control connection of pid %d uid %d closed: "
                              "no HELLO within %g s", c.peer.pid, c.peer.uid, self.hello_timeout_s)
                self._drop(c)
            elif c.decoder.in_message and not c.decoder.paused and now - (
                    c.message_at if c.decoder.head_since is None else c.decoder.head_since) > MESSAGE_TIMEOUT_S:
                self.counts["stalled"] += 1
                self.rlog.log("message not finished", logging.WARNING, "control connection of pid %d uid %d closed: "
                              "a message begun %g s ago is not finished", c.peer.pid, c.peer.uid, MESSAGE_TIMEOUT_S)
                self._drop(c)
        self.listener.recount()
        self.rlog.flush()

    # -- accepting ---------------------------------------------------------------------
    def _admit(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        try:
            peer = Peer.of_socket(sock)
        except OSError:
            sock.close()
            return
        pid, uid = peer.pid, peer.uid
        if self.max_per_uid and pid != self.exempt_pid:
            n = sum(1 for c in self._conns.values() if c.peer.uid == uid)
            if n >= self.max_per_uid:
                sock.close()
                self.counts["refused"] += 1
                self.rlog.log("connection over its uid's cap", logging.WARNING, "control connection of pid %d uid %d "
                              "closed: uid %d has %d open (max_connections_per_uid %d); %d refused so far", pid, uid,
                              uid, n, self.max_per_uid, self.counts["refused"])
                return
        try:
            pidfd = peer_pidfd(sock, pid)
        except OSError:  # the process that connected is gone already
            sock.close()
            return
        self._next += 1
        c = Conn(sock, b"c" + self._next.to_bytes(8, "little"), peer, self._clock(),
                 self._outboxes.new(sock, uid))
        c.pidfd = pidfd
        self._pidfds += pidfd is not None
        ref = weakref.ref(c)
        self._conns[sock.fileno()] = c
        self._by_ident[c.ident] = c
        c.decoder = Decoder(on_message=lambda frames: self._message(ref(), frames),
                            send=lambda data: self._raw_send(ref(), data),
                            admit=lambda *a: self._frame(ref(), *a), clock=self._clock)  # sends the greeting
        self._watch(c)

    # -- reading -----------------------------------------------------------------------
    def _read(self, c: Conn) -> None:
        got = 0
        dec = c.decoder
        c.turn_at = time.perf_counter_ns()
        try:
            while got < READ_SLICE and not dec.paused and not c.closing:
                view = dec.body_view()
                if view is not None:
                    want = min(len(view), READ_SLICE)
                    n = c.sock.recv_into(view, want)
                    if n:
                        dec.body_filled(n)
                else:
                    want = SCRATCH_BYTES
                    n = c.sock.recv_into(self._scratch)
                    if n:
                        dec.feed(self._scratch_view[:n])
                if not n:
                    self._drop(c)
                    return
                got += n
                if n < want:  # the socket is empty (epoll is level-triggered: more is seen next poll)
                    break
        except (BlockingIOError, InterruptedError):
            pass
        except Refused as e:
            self.counts["too_large"] += 1
            self.rlog.log("message too large", logging.WARNING, "control connection of pid %d uid %d closed: %s",
                          c.peer.pid, c.peer.uid, e)
            self._refuse(c, e)
        except ZmtpError as e:
            self.counts["broken"] += 1
            self.rlog.log("protocol error", logging.INFO, "control connection of pid %d uid %d closed: %s",
                          c.peer.pid, c.peer.uid, e)
            self._drop(c)
        except OSError:  # reset by the peer
            self._drop(c)
        else:
            if dec.paused and c.sock.fileno() in self._conns:
                self._watch(c)

    def _frame(self, c: Conn, size: int, frames: list, count: int, total: int):
        """The decoder's question before a frame is read (see :class:`zmtp.Decoder`).

        A message over ``max_message_bytes`` is refused and its connection closed. Any other
        limit broken (frames, header size, size before HELLO, a frame its header does not
        declare) is answered with its typed error once the message ends; its frames are
        read and dropped meanwhile. The header (frame 0) declares the arrays that follow:
        the first array frame reserves the budget of all of them at once, so a message
        begun never waits half read."""
        limits = LIMITS
        if c is None or self._by_ident.get(c.ident) is not c:
            # Dropped while its bytes were being decoded (a reply's send failed): the rest
            # is never read, and nothing is reserved for a connection nobody gives back for.
            return Decoder.PAUSE
        c.burst += 1
        if c.burst > MAX_BURST or (count == 0 and c.burst > 1 and self._polling
                                   and time.perf_counter_ns() - c.turn_at > TURN_NS):
            self._yield(c)  # asked again on its next turn (a turn: frames, or time at a message's start)
            return Decoder.PAUSE
        if count == 0:
            c.message_at = self._clock()
            c.refusal, c.plan = None, None
        if total + size > limits.max_message_bytes:
            raise Refused(ErrorCode.TOO_LARGE, f"a message of more than {limits.max_message_bytes} bytes")
        if count == 1 and c.refusal is None:
            c.plan = declared(frames[0])
        if c.refusal is None:
            c.refusal = self._check(c, size, count, total)
        if c.refusal is not None:
            return Decoder.DISCARD
        if count == 0:
            return None
        if count == 1:
            declared_bytes = big = 0
            for x in c.plan or ():
                declared_bytes += x
                if x > SMALL_FRAME:
                    big += x
            if declared_bytes > limits.max_message_bytes:
                raise Refused(ErrorCode.TOO_LARGE, f"arrays of {declared_bytes} bytes declared, more than "
                              f"{limits.max_message_bytes}")
            if not c.greeted and total + declared_bytes > limits.max_header_bytes:
                # Before HELLO a message is small: refused before any budget is reserved for it.
                c.refusal = (ErrorCode.TOO_LARGE, f"a message of {total + declared_bytes} bytes declared before "
                             f"HELLO, more than {limits.max_header_bytes}")
                return Decoder.DISCARD
            if big and not self.budget.take(c.peer.uid, big):
                c.wanted = big
                if c is not self._resuming:
                    self._paused.append(c)
                    self.counts["paused"] += 1
                c.burst -= 1  # asked again when resumed
                return Decoder.PAUSE
            c.reserved = big
        if size <= SMALL_FRAME:
            return None
        buf = FrameBuffer(size, self._give, c.peer.uid)
        c.reserved -= size  # the buffer gives it back from now on
        return buf

    def _check(self, c: Conn, size: int, count: int, total: int) -> tuple | None:
        """(code, message) of the limit frame ``count`` of ``size`` bytes breaks, or None."""
        limits = LIMITS
        if count >= limits.max_frames:
            return ErrorCode.TOO_LARGE, f"a message of more than {limits.max_frames} frames"
        if count == 0 and size > limits.max_header_bytes:
            return ErrorCode.TOO_LARGE, f"a header of {size} bytes exceeds {limits.max_header_bytes}"
        if not c.greeted and total + size > limits.max_header_bytes:
            return ErrorCode.TOO_LARGE, f"a message of more than {limits.max_header_bytes} bytes before HELLO"
        if count >= 1 and size > SMALL_FRAME and (c.plan is None or count > len(c.plan) or size != c.plan[count - 1]):
            return ErrorCode.BAD_FRAME, f"frame {count} of {size} bytes is not what its header describes"
        return None

    def _give(self, uid: int, n: int) -> None:
        self.budget.give(uid, n)
        if self._paused and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._unpause)
            except RuntimeError:  # the loop is closed: the daemon stops
                pass

    def _unpause(self) -> None:
        """Resume the connections waiting for the budget, first come first served, until
        one still does not fit the whole budget (it keeps its place). One that fits the
        whole budget but not its uid's share keeps its place too, and the ones behind it
        go on: a uid's own queue never holds up another uid's messages."""
        skipped: list[Conn] = []
        try:
            while self._paused:
                c = self._paused.popleft()
                self._resuming = c
                try:
                    if not self._resume(c):
                        continue
                finally:
                    self._resuming = None
                if c.decoder.paused and not c.yielded and self._conns.get(c.sock.fileno()) is c:
                    if self.budget.room_for(c.wanted):
                        skipped.append(c)  # only its uid's share is full
                        continue
                    self._paused.appendleft(c)
                    return  # still no room
                c.message_at = self._clock()
                self._watch(c)
        finally:
            self._paused.extendleft(reversed(skipped))

    def _message(self, c: Conn, frames: list) -> None:
        if self._by_ident.get(c.ident) is not c:
            return  # dropped while its bytes were being decoded: nothing more of it is served
        if c.reserved:  # declared frames that never came
            self._give(c.peer.uid, c.reserved)
            c.reserved = 0
        refusal, c.refusal = c.refusal, None
        if refusal is not None:
            self.counts["refused_messages"] += 1
        self.on_message(c.ident, frames, time.perf_counter_ns(), refusal)

    def _yield(self, c: Conn) -> None:
        """``c`` has had its turn: its reads wait until the others have had theirs."""
        if not c.yielded:
            c.yielded = True
            self._yielded.append(c)

    def _refuse(self, c: Conn, e: Refused) -> None:
        """Answer the message over a limit with its typed error, then close."""
        c.closing = True  # nothing more is read from it
        self.on_message(c.ident, list(c.decoder.frames), time.perf_counter_ns(), (e.code, str(e)))
        if c.ident in self._by_ident and not c.out:
            self._drop(c)

    # -- writing -----------------------------------------------------------------------
    def _raw_send(self, c: Conn, data: bytes) -> None:
        """The protocol's own bytes (greeting, READY, PONG), queued as replies are; each
        counts as a message of the connection's turn."""
        if self._conns.get(c.sock.fileno()) is not c:
            return
        if c.decoder is not None:  # a PONG: a PING counts as a frame of its turn
            c.burst += 1
            if c.burst > MAX_BURST and not c.closing:
                c.decoder.paused = True  # the decoder keeps what it has not parsed
                self._yield(c)
        try:
            c.out.write([data])
        except NotReading as e:
            self._not_reading(c, e)
            return
        except OSError:
            return  # the read that follows sees it closed
        if c.out:
            self._watch(c)

    def _flush(self, c: Conn) -> None:
        try:
            c.out.flush()
        except OSError:
            self._drop(c)
            return
        if not c.out and c.closing:
            self._drop(c)
            return
        self._watch(c)

    # -- bookkeeping -------------------------------------------------------------------
    def _watch(self, c: Conn) -> None:
        """Register what ``c`` waits for: input unless paused or closing, output while queued."""
        if c.decoder is None:  # being made (its greeting queued): registered once made
            return
        want = (0 if c.decoder.paused or c.closing else select.EPOLLIN) | (select.EPOLLOUT if c.out else 0)
        if want == c.events:
            return
        fd = c.sock.fileno()
        if c.events == 0:
            self._ep.register(fd, want)
        elif want == 0:
            self._ep.unregister(fd)
        else:
            self._ep.modify(fd, want)
        c.events = want

    def _drop(self, c: Conn, notify: bool = True) -> None:
        fd = c.sock.fileno()
        if self._conns.get(fd) is not c:
            return
        del self._conns[fd]
        del self._by_ident[c.ident]
        if c.events:
            self._ep.unregister(fd)
            c.events = 0
        c.sock.close()
        if c.pidfd is not None:
            os.close(c.pidfd)
            c.pidfd = None
            self._pidfds -= 1
        c.out.clear()
        c.decoder = _CLOSED  # its buffers (and their budget) go now
        if c in self._paused:
            self._paused.remove(c)
        if c.reserved:  # (the connections paused behind it are woken)
            self._give(c.peer.uid, c.reserved)
            c.reserved = 0
        if notify and c.greeted:
            self.on_closed(c.ident)


class _Closed:
    paused = True
    in_message = False
    frames: list = []

    def resume(self) -> None:
        pass


_CLOSED = _Closed()
