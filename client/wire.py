"""``Wire``: a client's connection to ``control.sock``, ZMTP as a DEALER (``proto/zmtp.py``),
written and read by the thread that makes the requests.

The client speaks ZMTP itself instead of through a libzmq DEALER: libzmq moves every
message through its own I/O thread, so a request and its reply each wait for a thread to
wake up (on a VM, tens of microseconds each: a 2,048-block lookup took 168 µs through
libzmq and 108 µs like this on the same daemon; ~80 µs like this on today's daemon,
docs/PERF.md). Here the caller's ``sendmsg`` puts the
request on the socket and the reply is read by the caller's thread, which spins on a
non-blocking read before it sleeps in ``poll``. Nothing reconnects: a connection the
daemon closes (it exited, restarted, or closed this one for breaking a limit) ends the
session, and the replies that came before the end are still read.

Not thread-safe: one thread per client, as the client.
"""

from __future__ import annotations

import collections
import select
import socket
import time

from sparsekv.proto import LIMITS
from sparsekv.proto.zmtp import (COMMAND, GREETING, GREETING_LEN, LONG, MAX_COMMAND_BYTES, MORE, ZmtpError,
                                 check_greeting, command, encode_message, parse_properties, properties, split_command)

SCRATCH_BYTES = 256 << 10  # one read's buffer; a larger frame is read straight into its own
SMALL_FRAME = 4096  # frames up to this are copied out of the scratch buffer as bytes
# The largest reply frame accepted: a reply carries what a request may (proto Limits).
MAX_FRAME = LIMITS.max_frame_bytes + LIMITS.max_header_bytes
POLL_IN, POLL_OUT = select.POLLIN, select.POLLOUT
POLL_END = select.POLLHUP | select.POLLERR


CONNECT_RETRY_S = (0.0005, 0.02)  # the first and the longest pause between connects to a full accept queue


def connect_unix(path: str, timeout_s: float) -> socket.socket:
    """A Unix stream socket connected to ``path`` within ``timeout_s``; connect's OSError as
    it comes (TimeoutError once ``timeout_s`` passed with the accept queue full), the socket
    closed. A connect that finds the daemon's accept queue full fails at once (EAGAIN, also
    with a timeout set): it is tried again after a pause (doubling, CONNECT_RETRY_S) until
    ``timeout_s``, so that a burst of clients (every rank of a node starting) or a flood of
    another user's connections does not turn away a client the daemon would accept a
    moment later."""
    deadline = time.monotonic() + timeout_s
    pause, longest = CONNECT_RETRY_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.connect(path)
        except (BlockingIOError, TimeoutError):
            sock.close()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{path}: the accept queue stayed full for {timeout_s} s") from None
            time.sleep(min(pause, left))
            pause = min(2 * pause, longest)
            continue
        except BaseException:
            sock.close()
            raise
        sock.settimeout(timeout_s)
        return sock


class WireClosed(ConnectionError):
    """The connection has ended (the daemon closed it, or it broke the protocol) and no
    reply is left to read."""


class Wire:
    """One connection: ``send`` a message's frames, ``ready``/``wait`` for a reply, ``recv`` it.

    Args:
        sock: a Unix stream socket connected to the daemon's ``control.sock`` (the Wire owns
            it from now on: closed if the handshake fails).
        timeout_s: the handshake's limit (TimeoutError past it).
    """

    @classmethod
    def connect(cls, path: str, timeout_s: float = 5.0) -> "Wire":
        """A Wire to ``path`` (connect's OSError as it comes; the handshake within ``timeout_s``)."""
        return cls(connect_unix(path, timeout_s), timeout_s)

    def __init__(self, sock: socket.socket, timeout_s: float = 5.0):
        self.sock = sock
        try:
            self.sock.setblocking(False)
        except BaseException:
            self.sock.close()
            raise
        self._poller = select.poll()
        self._fd = self.sock.fileno()  # kept: the socket may be closed under an ending write
        self._poller.register(self._fd, POLL_IN)
        self._scratch = bytearray(SCRATCH_BYTES)
        self._scratch_view = memoryview(self._scratch)
        self._messages: collections.deque = collections.deque()
        self._greeting = bytearray()
        self._ready = False  # the daemon's READY came
        self._head = bytearray()  # a frame header cut by a read
        self._frames: list = []  # the message being read
        self._body: bytearray | None = None  # a frame whose bytes are still coming
        self._body_at = 0
        self._body_flags = 0
        self._ended: str | None = None  # why nothing more comes
        self._unwritable: str | None = None  # why nothing more can be sent
        self._writing = False  # a write is under way (a PONG must wait for its end)
        self._pongs: list = []  # PONGs waiting for it
        self.cut = False  # an exception stopped a message half written: the connection ended
        try:
            self._handshake(time.monotonic() + timeout_s)
        except BaseException:
            self.sock.close()
            raise

    def _handshake(self, deadline: float) -> None:
        """Greetings, then READY commands, each side's after the other's, as libzmq peers
        expect (one of them closes a connection whose READY came with its greeting)."""
        for mine, done in ((GREETING, lambda: len(self._greeting) == GREETING_LEN),
                           (command(b"READY", properties(Socket_Type=b"DEALER")), lambda: self._ready)):
            try:
                self._write([mine], None)
            except WireClosed:
                self._read()  # what the peer sent before it closed says more (not a ZMTP peer)
                raise WireClosed(f"{self._ended or self._unwritable} during the ZMTP handshake") from None
            while not done():
                left = deadline - time.monotonic()
                if self._ended is not None:
                    raise WireClosed(f"{self._ended} during the ZMTP handshake")
                if left <= 0:
                    raise TimeoutError("no ZMTP handshake from the daemon in time")
                self._poll(POLL_IN, max(1, int(left * 1000)))

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    # -- sending -----------------------------------------------------------------------
    def send(self, frames, idle=None) -> None:
        """Write one message of ``frames`` (bytes-like, NumPy arrays; not copied) before
        returning. While the socket is full, replies that arrive are read and kept, and
        ``idle()`` is called after each quarter second without progress (it raises to give
        up: the message may then be cut, and the connection must be closed)."""
        self._write(encode_message(frames), idle)

    def _write(self, bufs: list, idle) -> None:
        """Write ``bufs`` whole. A PING's PONG read meanwhile waits for their end (the
        bytes of one message must follow each other); an exception that stops a write half
        way (``idle``'s, a signal handler's) ends the connection: what followed the cut
        would be read as the rest of the message."""
        sock, began = self.sock, False
        self._writing = True
        try:
            while bufs:
                if self._ended is not None or self._unwritable is not None:  # (a peer that broke the
                    raise WireClosed(self._ended or self._unwritable)  # protocol may still read)
                try:
                    n = sock.sendmsg(bufs)
                except BlockingIOError:
                    n = 0
                except OSError as e:  # EPIPE, ECONNRESET: the daemon closed it; what it sent before is still read
                    self._unwritable = f"the connection was closed while sending ({e.strerror})"
                    raise WireClosed(self._unwritable) from None
                began = began or n > 0
                while n:
                    first = len(bufs[0])
                    if n >= first:
                        n -= first
                        bufs.pop(0)
                    else:
                        bufs[0] = memoryview(bufs[0])[n:]
                        n = 0
                if not bufs and self._pongs:
                    bufs, self._pongs, began = self._pongs, [], False
                if bufs and not self._poll(POLL_OUT | POLL_IN, 250):
                    if idle is not None:
                        idle()
        except BaseException as e:
            if began and bufs and not isinstance(e, WireClosed):
                self.cut = True
                self._end(f"a message was cut short by {type(e).__name__} while being sent")
            raise
        finally:
            self._writing = False

    # -- receiving ---------------------------------------------------------------------
    def ready(self) -> bool:
        """Whether a whole message is here (what has arrived is read; never waits)."""
        if not self._messages and self._ended is None:
            self._read()
        return bool(self._messages) or self._ended is not None

    def wait(self, timeout_ms: int) -> bool:
        """Sleep until a whole message is here, the connection ended, or ``timeout_ms``."""
        if self.ready():
            return True
        self._poll(POLL_IN, timeout_ms)
        return self.ready()

    def recv(self) -> list:
        """The next message's frames (bytes, or read-only memoryviews of large frames);
        WireClosed once the connection ended and nothing is left."""
        if not self._messages:
            self.ready()
        if self._messages:
            return self._messages.popleft()
        raise WireClosed(self._ended or "no message")

    # -- internals -----------------------------------------------------------------------
    def _poll(self, events: int, timeout_ms: int) -> bool:
        """Wait for ``events`` (reading what arrives meanwhile); True when the socket took
        an event other than input (writable, closed), or the connection has ended."""
        if self._ended is not None:
            return True  # nothing more comes in (a write raises WireClosed)
        self._poller.modify(self.sock.fileno(), events)
        for _, ev in self._poller.poll(timeout_ms):
            if ev & (POLL_IN | POLL_END) and self._ended is None:
                self._read()
            if ev & ~POLL_IN:
                return True
        return False

    def _read(self) -> None:
        sock = self.sock
        while self._ended is None:
            body = self._body
            try:
                if body is not None and len(body) - self._body_at > SMALL_FRAME:  # straight into the frame
                    want = len(body) - self._body_at
                    n = sock.recv_into(memoryview(body)[self._body_at:])
                    if n:
                        self._filled(n)
                else:
                    want = SCRATCH_BYTES
                    n = sock.recv_into(self._scratch)
                    if n:
                        self._feed(self._scratch_view[:n])
                if n:
                    if n < want:  # nothing more there now (no read that fails with EAGAIN)
                        return
                    continue
            except BlockingIOError:
                return
            except OSError as e:
                self._end(f"the connection failed ({e.strerror})")
                return
            except ZmtpError as e:
                self._end(f"the daemon broke the protocol ({e})")
                return
            self._end("the daemon closed the connection")

    def _end(self, why: str) -> None:
        if self._ended is None:
            self._ended = why
            try:
                self._poller.unregister(self._fd)
            except KeyError:
                pass

    def _feed(self, data: memoryview) -> None:
        i, n = 0, len(data)
        while i < n:
            if self._body is not None:
                take = min(n - i, len(self._body) - self._body_at)
                self._body[self._body_at:self._body_at + take] = data[i:i + take]
                i += take
                self._filled(take)
            elif len(self._greeting) < GREETING_LEN:
                take = min(n - i, GREETING_LEN - len(self._greeting))
                self._greeting += data[i:i + take]
                i += take
                check_greeting(self._greeting)
            else:
                i = self._frame_head(data, i, n)

    def _frame_head(self, data: memoryview, i: int, n: int) -> int:
        head = self._head
        if not head and n - i >= 2 and (n - i >= 9 or not data[i] & LONG):  # the whole header is here
            flags = data[i]
            size, i = (int.from_bytes(data[i + 1:i + 9], "big"), i + 9) if flags & LONG else (data[i + 1], i + 2)
        else:
            if not head:
                head.append(data[i])
                i += 1
            need = 9 if head[0] & LONG else 2
            take = min(n - i, need - len(head))
            head += data[i:i + take]
            i += take
            if len(head) < need:
                return i
            flags, size = head[0], int.from_bytes(head[1:need], "big")
            head.clear()
        if flags & ~(MORE | LONG | COMMAND):
            raise ZmtpError(f"frame flags {flags:#x}")
        if flags & COMMAND and (flags & MORE or size > MAX_COMMAND_BYTES):
            raise ZmtpError("a malformed command")
        if size > MAX_FRAME:
            raise ZmtpError(f"a frame of {size} bytes (replies carry at most {MAX_FRAME})")
        if n - i >= size and size <= SMALL_FRAME:
            self._done(bytes(data[i:i + size]), flags)
            return i + size
        self._body, self._body_at, self._body_flags = bytearray(size), 0, flags
        return i

    def _filled(self, k: int) -> None:
        self._body_at += k
        if self._body_at == len(self._body):
            body, self._body = self._body, None
            self._done(memoryview(body).toreadonly(), self._body_flags)

    def _done(self, body, flags: int) -> None:
        if flags & COMMAND:
            self._command(body)
            return
        if not self._ready:
            raise ZmtpError("a message before READY")
        self._frames.append(body)
        if not flags & MORE:
            self._messages.append(self._frames)
            self._frames = []

    def _command(self, body) -> None:
        name, rest = split_command(body)
        if not self._ready:
            if name != b"READY":
                raise ZmtpError(f"{name[:16]!r} before READY")
            kind = parse_properties(rest).get("socket-type", b"")
            if kind != b"ROUTER":
                raise ZmtpError(f"socket type {kind[:16]!r} (ROUTER expected)")
            self._ready = True
        elif name == b"PING":
            if len(rest) < 2:
                raise ZmtpError("a PING without its TTL")
            pong = command(b"PONG", bytes(rest[2:18]))
            if self._writing:
                self._pongs.append(pong)  # after the message being written
            else:
                self._write([pong], None)
        elif name != b"PONG":
            raise ZmtpError(f"command {name[:16]!r}")
