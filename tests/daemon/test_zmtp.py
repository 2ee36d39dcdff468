"""The daemon's ZMTP decoder (daemon/zmtp.py) byte by byte, and against a real libzmq DEALER."""

import os
import socket
import threading

import pytest
import zmq

import helpers
from sparsekv.daemon.zmtp import READY as DAEMON_READY
from sparsekv.daemon.zmtp import Decoder, ZmtpError
from sparsekv.proto import zmtp

CLIENT_GREETING = b"\xff" + bytes(7) + b"\x01\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + bytes(32)
CLIENT_READY = zmtp.command(b"READY", zmtp.properties(Socket_Type=b"DEALER", Identity=b"abc"))


class Peer:
    """A decoder with what it delivered and sent; ``admit`` answers from ``self.answer``."""

    def __init__(self, answer=None):
        self.messages, self.sent, self.asked = [], [], []
        self.answer = answer
        self.d = Decoder(on_message=self.messages.append, send=self.sent.append, admit=self.admit)

    def admit(self, size, frames, count, total):
        self.asked.append((size, count, total))
        return self.answer(size, count) if self.answer else None

    def feed(self, data, step=None):
        step = step or len(data)
        for i in range(0, len(data), step):
            self.d.feed(memoryview(data[i:i + step]))


def message(*frames):
    out = b""
    for i, f in enumerate(frames):
        out += zmtp.frame_header(len(f), zmtp.MORE if i < len(frames) - 1 else 0) + f
    return out


@pytest.mark.parametrize("step", [None, 1, 7])
def test_handshake_then_messages_whole_or_byte_by_byte(step):
    p = Peer()
    assert p.sent == [zmtp.GREETING]
    big = os.urandom(70_000)  # a long frame (8-byte size)
    p.feed(CLIENT_GREETING + CLIENT_READY + message(b"head", big) + message(b"") + message(b"x" * 300), step)
    assert p.sent[1] == DAEMON_READY and p.d.ready
    assert p.d.peer_properties == {"socket-type": b"DEALER", "identity": b"abc"}
    assert [[bytes(f) for f in m] for m in p.messages] == [[b"head", big], [b""], [b"x" * 300]]
    assert [(s, c) for s, c, _ in p.asked] == [(4, 0), (70_000, 1), (0, 0), (300, 0)]
    assert not p.d.in_message


def test_ping_is_answered_with_pong_and_its_context():
    p = Peer()
    p.feed(CLIENT_GREETING + CLIENT_READY + zmtp.command(b"PING", b"\x00\x0a" + b"ctx"))
    assert p.sent[-1] == zmtp.command(b"PONG", b"ctx")


@pytest.mark.parametrize("data, says", [
    (b"\x05\x00abcd", "not a ZMTP peer"),  # ZMTP/1.0
    (b"\xff" + bytes(8) + b"\x7f\x02\x00", "version 2"),
    (CLIENT_GREETING.replace(b"NULL", b"CURV"), "mechanism"),
    (CLIENT_GREETING + message(b"hi"), "before READY"),
    (CLIENT_GREETING + zmtp.command(b"READY", zmtp.properties(Socket_Type=b"PUB")), "socket type"),
    (CLIENT_GREETING + CLIENT_READY + b"\x08\x01x", "frame flags"),
    (CLIENT_GREETING + CLIENT_READY + zmtp.command(b"SUBSCRIBE"), "command"),
    (CLIENT_GREETING + CLIENT_READY + zmtp.frame_header(5000, zmtp.COMMAND), "malformed command"),
])
def test_what_breaks_the_protocol_is_refused(data, says):
    with pytest.raises(ZmtpError, match=says):
        Peer().feed(data)


def test_discarded_frames_are_read_and_dropped_and_a_pause_keeps_what_was_read():
    answers = {1: Decoder.DISCARD}
    p = Peer(lambda size, count: answers.get(count))
    p.feed(CLIENT_GREETING + CLIENT_READY + message(b"h", b"y" * 5000, b"z"))
    assert [[bytes(f) for f in m] for m in p.messages] == [[b"h", b"z"]]
    assert p.asked[-1] == (1, 2, 5001)  # the dropped frame counts
    paused = [True]
    p = Peer(lambda size, count: Decoder.PAUSE if count == 1 and paused[0] else None)
    p.feed(CLIENT_GREETING + CLIENT_READY + message(b"h", b"y" * 5000) + message(b"next"))
    assert p.d.paused and p.messages == [] and p.d.in_message
    paused[0] = False
    p.d.resume()
    assert [[bytes(f) for f in m] for m in p.messages] == [[b"h", b"y" * 5000], [b"next"]]


def test_a_buffer_from_admit_is_filled_in_place_and_given_read_only():
    buf = bytearray(5000)
    p = Peer(lambda size, count: buf if size == 5000 else None)
    p.feed(CLIENT_GREETING + CLIENT_READY + message(b"h", b"q" * 5000), step=1000)
    frame = p.messages[0][1]
    assert bytes(buf) == b"q" * 5000 and frame.obj is buf and frame.readonly


def test_a_libzmq_dealer_talks_to_the_decoder():
    """The handshake libzmq's DEALER does, and a multipart message both ways."""
    with helpers.short_tmpdir() as d:
        path = os.path.join(d, "s")
        lst = socket.socket(socket.AF_UNIX)
        lst.bind(path)
        lst.listen(1)
        got = []

        def serve():
            conn, _ = lst.accept()
            p = Decoder(on_message=got.append, send=conn.sendall, admit=lambda *a: None)
            while not got:
                p.feed(memoryview(conn.recv(65536)))
            conn.sendall(b"".join(bytes(b) for b in zmtp.encode_message([b"re", memoryview(b"ply")])))
            conn.recv(1)  # until the client closes

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"ipc://{path}")
        s.send_multipart([b"one", b"two" * 1000])
        assert s.poll(5000)
        assert s.recv_multipart() == [b"re", b"ply"]
        assert [[bytes(f) for f in m] for m in got] == [[b"one", b"two" * 1000]]
        s.close(0)
        ctx.term()
        t.join(5)
        lst.close()
