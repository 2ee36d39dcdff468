"""A peer of the daemon's control socket that speaks ZMTP by hand (no libzmq): the attack
tests and the attack soak use it to send what no libzmq client would."""

import os
import socket

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


def read_reply(s: socket.socket) -> dict:
    """The header of the next message on ``s`` (frames: flags, size, body)."""
    buf = b""
    frames = []
    while True:
        while len(buf) < 9:
            chunk = s.recv(65536)
            assert chunk, "closed before a reply"
            buf += chunk
        flags = buf[0]
        size, at = (int.from_bytes(buf[1:9], "big"), 9) if flags & zmtp.LONG else (buf[1], 2)
        while len(buf) < at + size:
            buf += s.recv(65536)
        frames.append(buf[at:at + size])
        buf = buf[at + size:]
        if not flags & zmtp.MORE:
            return decode(frames)[0]


def hello(s: socket.socket, name: str = "attacker") -> dict:
    send_message(s, encode(MsgType.HELLO, 1, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": name})[0])
    return read_reply(s)


