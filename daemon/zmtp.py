"""ZMTP 3.1, the server's half, as the daemon speaks it on its control socket (rfc.zeromq.org
spec 37, NULL mechanism only): the bytes of one connection in, its messages out.

The daemon reads its control connections itself instead of through a libzmq ROUTER, so
that it decides what a peer may cost before reading it: libzmq allocates every frame a
peer announces (up to ``ZMQ_MAXMSGSIZE``) and keeps the frames of a message it has not
finished without any bound, one socket-wide limit for every connection. Here each frame's
size is known before its bytes are read and every frame passes :meth:`Decoder.admit`
first. The codec both ends share is ``proto/zmtp.py``; any ZeroMQ DEALER may connect.

What a peer must send: a ZMTP 3.x greeting with the NULL mechanism, a READY command
whose ``Socket-Type`` is DEALER, then messages (frames whose MORE flag chains them) and,
at any time between frames, PING commands (answered with PONG). Anything else is a
:class:`ZmtpError` and the connection is closed.
"""

from __future__ import annotations

import struct
import time

from sparsekv.proto.zmtp import (COMMAND, GREETING, GREETING_LEN, LONG, MAX_COMMAND_BYTES, MORE, ZmtpError,
                                 check_greeting, command, parse_properties, properties, split_command)

PEER_TYPES = (b"DEALER",)
READY = command(b"READY", properties(Socket_Type=b"ROUTER"))


class Decoder:
    """One connection's incoming bytes, parsed as they come.

    The connection feeds what it reads to :meth:`feed`; when a frame's body is larger than
    what has arrived, :meth:`body_view` names where the rest goes (read straight into it).
    Complete messages go to ``on_message(frames)``; replies the protocol itself needs
    (the greeting, READY, PONG) to ``send(bytes)``. Before a frame is read its size goes to
    ``admit(size, frames, count, total)`` (the frames kept so far, how many frames and
    bytes the message has had before this one), which returns the buffer to read it into
    (None: the decoder makes one), ``DISCARD`` to read it and keep nothing, ``PAUSE`` to
    stop reading until :meth:`resume`, or raises :class:`ZmtpError`.
    """

    PAUSE = object()
    DISCARD = object()

    def __init__(self, *, on_message, send, admit, clock=time.monotonic):
        self.on_message = on_message
        self.send = send
        self.admit = admit
        self._clock = clock
        self.head_since: float | None = None  # when a message's first frame header began, while it is cut short
        self.ready = False  # greeting and READY done
        self.paused = False
        self.peer_properties: dict[str, bytes] = {}
        self._greeting = bytearray()
        self._head = bytearray()  # a frame header being read
        self._frames: list = []  # the message being read: its frames kept
        self._count = self._total = 0  # its frames and bytes so far, kept or not
        self._skip = 0  # bytes of a discarded frame still to read
        self._body = None  # a large frame's buffer being filled
        self._body_at = 0
        self._body_flags = 0
        self._pending_size = -1  # a frame admitted later (paused)
        self._pending_flags = 0
        self._stash = b""  # bytes read past a pause
        send(GREETING)

    @property
    def frames(self) -> list:
        """The frames of the message being read, so far."""
        return self._frames

    @property
    def in_message(self) -> bool:
        """Whether a message has begun and not ended: its frames hold budget, or its first
        frame's header came in part (:attr:`head_since`)."""
        return bool(self._count) or self._body is not None or self._pending_size >= 0 or bool(self._head)

    def body_view(self) -> memoryview | None:
        """Where the rest of a large frame's body goes, or None."""
        if self._body is None:
            return None
        return memoryview(self._body)[self._body_at:]

    def body_filled(self, n: int) -> None:
        """``n`` bytes were read into :meth:`body_view`."""
        self._body_at += n
        if self._body_at == len(self._body):
            self._frame_done(self._body, self._body_flags)
            self._body = None

    def resume(self) -> None:
        """Ask again for the frame that paused reading, and go on with what was read past it."""
        self.paused = False
        size, flags, self._pending_size = self._pending_size, self._pending_flags, -1
        if size >= 0:
            buf = self.admit(size, self._frames, self._count, self._total)
            if buf is Decoder.PAUSE:
                self.paused, self._pending_size, self._pending_flags = True, size, flags
                return
            self._begin(buf, size, flags)
        stash, self._stash = self._stash, b""
        if stash and not self.paused:
            self.feed(memoryview(stash))

    def feed(self, data: memoryview) -> None:
        """Parse ``data``, all of it (what follows a pause is kept for :meth:`resume`)."""
        i, n = 0, len(data)
        while i < n:
            if self.paused:
                self._stash = bytes(data[i:]) + self._stash
                return
            if self._skip:
                take = min(n - i, self._skip)
                i += take
                self._skip -= take
                if not self._skip:
                    self._frame_done(None, self._body_flags)
                continue
            if self._body is not None:
                take = min(n - i, len(self._body) - self._body_at)
                self._body[self._body_at:self._body_at + take] = data[i:i + take]
                i += take
                self.body_filled(take)
                continue
            if len(self._greeting) < GREETING_LEN:
                take = min(n - i, GREETING_LEN - len(self._greeting))
                self._greeting += data[i:i + take]
                i += take
                self._check_greeting()
                continue
            i = self._read_head(data, i, n)

    # -- internals -------------------------------------------------------------------
    def _check_greeting(self) -> None:
        check_greeting(self._greeting)

    def _read_head(self, data: memoryview, i: int, n: int) -> int:
        head = self._head
        if not head:
            flags = data[i]
            if flags & ~(MORE | LONG | COMMAND):
                raise ZmtpError(f"frame flags {flags:#x}")
            need = 9 if flags & LONG else 2
            if n - i >= need:  # the common case: the whole header is here
                size = struct.unpack_from(">Q", data, i + 1)[0] if need == 9 else data[i + 1]
                i += need
                return self._frame(size, flags, data, i, n)
            if not self._count:  # a message's first header, cut short: its time counts from now
                self.head_since = self._clock()
            head += data[i:n]
            return n
        need = 9 if head[0] & LONG else 2
        take = min(n - i, need - len(head))
        head += data[i:i + take]
        i += take
        if len(head) == need:
            flags = head[0]
            size = struct.unpack_from(">Q", head, 1)[0] if need == 9 else head[1]
            head.clear()
            self.head_since = None
            return self._frame(size, flags, data, i, n)
        return i

    def _frame(self, size: int, flags: int, data: memoryview, i: int, n: int) -> int:
        if flags & COMMAND or not self.ready:
            if not flags & COMMAND:
                raise ZmtpError("a message before READY")
            if flags & MORE or size > MAX_COMMAND_BYTES:
                raise ZmtpError("a malformed command")
            if n - i >= size:
                self._command(data[i:i + size])
                return i + size
            self._body, self._body_at, self._body_flags = bytearray(size), 0, flags
            return i
        buf = self.admit(size, self._frames, self._count, self._total)
        if buf is Decoder.PAUSE:
            self.paused = True
            self._pending_size, self._pending_flags = size, flags
        elif buf is None and n - i >= size:  # a small frame, all here
            self._frame_done(bytes(data[i:i + size]), flags)
            return i + size
        else:
            self._begin(buf, size, flags)
        return i

    def _begin(self, buf, size: int, flags: int) -> None:
        if buf is Decoder.DISCARD:
            self._count += 1
            self._total += size
            if size:
                self._skip, self._body_flags = size, flags
            else:
                self._frame_done(None, flags)
        elif size == 0:
            self._frame_done(b"", flags)
        else:
            self._body, self._body_at, self._body_flags = (bytearray(size) if buf is None else buf), 0, flags

    def _frame_done(self, body, flags: int) -> None:
        if flags & COMMAND:
            self._command(memoryview(body))
            return
        if body is not None:  # (None: discarded, counted already)
            self._count += 1
            self._total += len(body)
            # Arrays decoded from a frame are read-only views of it, as the handlers expect.
            self._frames.append(body if type(body) is bytes else memoryview(body).toreadonly())
        if not flags & MORE:
            frames, self._frames = self._frames, []
            self._count = self._total = 0
            self.on_message(frames)

    def _command(self, body: memoryview) -> None:
        name, rest = split_command(body)
        if not self.ready:
            if name != b"READY":
                raise ZmtpError(f"{name[:16]!r} before READY")
            self.peer_properties = parse_properties(rest)
            kind = self.peer_properties.get("socket-type", b"")
            if kind not in PEER_TYPES:
                raise ZmtpError(f"socket type {kind[:16]!r} (DEALER needed)")
            self.ready = True
            self.send(READY)
        elif name == b"PING":
            if len(rest) < 2:
                raise ZmtpError("a PING without its TTL")
            self.send(command(b"PONG", bytes(rest[2:18])))
        elif name != b"PONG":
            raise ZmtpError(f"command {name[:16]!r}")
