"""A peer of the daemon's control socket that speaks ZMTP by hand (no libzmq): the attack
tests and the attack soak use it to send what no libzmq client would."""

import os
import socket
import weakref

from sparsekv.daemon.zmtp import READY as DAEMON_READY
from sparsekv.proto import MsgType, decode, encode, zmtp

GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x01" + b"NULL".ljust(20, b"\x00") + bytes(32)
READY = zmtp.command(b"READY", zmtp.properties(Socket_Type=b"DEALER"))


def raw_peer(path: str, rcvbuf: int | None = None) -> socket.socket:
    """A connection past the ZMTP handshake (the daemon's greeting and READY read);
    ``rcvbuf``: its receive buffer's size (small: what it does not read stays queued in
    the daemon)."""
    s = socket.socket(socket.AF_UNIX)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(path)
    s.settimeout(10)
    s.sendall(GREETING + READY)
    got = b""
    while len(got) < len(zmtp.GREETING) + len(DAEMON_READY):
        got += s.recv(4096)
    return s


def send_message(s: socket.socket, *frames) -> None:
    s.sendall(b"".join(bytes(b) for b in zmtp.encode_message(list(frames))))


_LEFT: "weakref.WeakKeyDictionary[socket.socket, bytes]" = weakref.WeakKeyDictionary()


def read_reply(s: socket.socket) -> dict:
    """The header of the next message on ``s`` (frames: flags, size, body). Bytes read past
    it (a second reply in the same recv), or of a message a timeout cut, are kept for the
    next call on ``s``."""
    buf, at = _LEFT.pop(s, b""), 0
    frames = []

    def need(n: int) -> None:
        nonlocal buf
        while len(buf) < n:
            chunk = s.recv(65536)
            assert chunk, "closed before a reply"
            buf += chunk

    try:
        while True:
            need(at + 2)
            flags = buf[at]
            if flags & zmtp.LONG:
                need(at + 9)
            size, head = (int.from_bytes(buf[at + 1:at + 9], "big"), 9) if flags & zmtp.LONG else (buf[at + 1], 2)
            need(at + head + size)
            frames.append(buf[at + head:at + head + size])
            at += head + size
            if not flags & zmtp.MORE:
                if at < len(buf):
                    _LEFT[s] = buf[at:]
                return decode(frames)[0]
    except OSError:  # a timeout (or a reset): nothing read is lost for the next call
        _LEFT[s] = buf
        raise


def hello(s: socket.socket, name: str = "attacker") -> dict:
    send_message(s, encode(MsgType.HELLO, 1, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": name})[0])
    return read_reply(s)


