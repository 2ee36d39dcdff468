"""The client's ZMTP connection (client/wire.py) against a scripted peer: the handshake in
libzmq's order, frames cut anywhere by reads, long frames read straight into their
buffer, replies that came before the end still read, a closed or lying peer ending the
connection, a send into a full socket reading replies meanwhile, PING answered."""

import os
import socket
import threading
import time

import pytest

import helpers
from sparsekv.client.wire import MAX_FRAME, SMALL_FRAME, Wire, WireClosed
from sparsekv.proto import zmtp

SERVER_READY = zmtp.command(b"READY", zmtp.properties(Socket_Type=b"ROUTER"))


class Peer:
    """A listening socket; ``accept()`` gives the connection after the handshake's first
    half (the client's greeting read), ``finish()`` the second."""

    def __init__(self, path):
        self.path = path
        self.lsock = socket.socket(socket.AF_UNIX)
        self.lsock.bind(path)
        self.lsock.listen(4)
        self.conn = None

    def accept(self, greet=True, ready=True):
        """Accept, then (in order) send our greeting, read the client's, read its READY,
        send ours: what a libzmq ROUTER does."""
        self.conn, _ = self.lsock.accept()
        self.conn.settimeout(10)
        if greet:
            self.conn.sendall(zmtp.GREETING)
            assert self._read(64)[:1] == b"\xff"
        if ready:
            body = self._read_frame()
            assert b"READY" in body and b"DEALER" in body
            self.conn.sendall(SERVER_READY)

    def _read(self, n):
        out = b""
        while len(out) < n:
            got = self.conn.recv(n - len(out))
            assert got, "the client hung up"
            out += got
        return out

    def _read_frame(self):
        flags, size = self._read(2)
        if flags & zmtp.LONG:
            size = int.from_bytes(bytes([size]) + self._read(7), "big")
        return self._read(size)

    def read_message(self):
        frames = []
        while True:
            flags = self.conn.recv(1, socket.MSG_PEEK)[0]
            frames.append(self._read_frame())
            if not flags & zmtp.MORE:
                return frames

    def send(self, *frames, chunk=None):
        data = b"".join(bytes(b) for b in zmtp.encode_message(list(frames)))
        if chunk is None:
            self.conn.sendall(data)
            return
        for i in range(0, len(data), chunk):
            self.conn.sendall(data[i:i + chunk])
            time.sleep(0.001)

    def close(self):
        for s in (self.conn, self.lsock):
            if s is not None:
                s.close()


@pytest.fixture
def peer():
    with helpers.short_tmpdir() as d:
        p = Peer(os.path.join(d, "control.sock"))
        yield p
        p.close()


def connect(peer, **kw):
    """A Wire to ``peer``, the peer's half of the handshake run in a thread."""
    t = threading.Thread(target=peer.accept, kwargs=kw)
    t.start()
    try:
        w = Wire.connect(peer.path, timeout_s=2)
    finally:
        t.join(10)
    return w


def recv(w, timeout_s=5.0):
    end = time.monotonic() + timeout_s
    while not w.wait(50):
        assert time.monotonic() < end, "no message"
    return w.recv()


def test_a_request_and_its_reply_through_a_peer_that_handshakes_as_libzmq_does(peer):
    w = connect(peer)
    w.send([b"head", memoryview(b"x" * 300)])
    assert peer.read_message() == [b"head", b"x" * 300]
    peer.send(b"reply", b"")
    assert recv(w) == [b"reply", b""]
    w.close()


def test_frames_cut_anywhere_by_reads_and_long_frames_arrive_whole(peer):
    w = connect(peer)
    big = os.urandom(3 * (256 << 10) + 17)  # past the scratch buffer: read straight into its own
    mid = os.urandom(SMALL_FRAME + 1)
    t = threading.Thread(target=lambda: (peer.send(b"h", mid, b"y" * 256), peer.send(b"h2", big),
                                         peer.send(b"cut", b"z" * 1000, chunk=1)))  # one byte a read
    t.start()
    got = [recv(w) for _ in range(3)]
    t.join(10)
    assert [bytes(f) for f in got[0]] == [b"h", mid, b"y" * 256]
    assert bytes(got[1][1]) == big and got[1][0] == b"h2"
    assert [bytes(f) for f in got[2]] == [b"cut", b"z" * 1000]
    assert isinstance(got[1][1], memoryview) and got[1][1].readonly  # large: a read-only view of its buffer
    w.close()


def test_replies_that_came_before_the_end_are_read_then_the_end_is_said(peer):
    w = connect(peer)
    peer.send(b"one")
    peer.send(b"two")
    peer.conn.close()
    assert recv(w) == [b"one"] and recv(w) == [b"two"]
    with pytest.raises(WireClosed, match="closed the connection"):
        recv(w)
    with pytest.raises(WireClosed):
        w.send([b"more"])


@pytest.mark.parametrize("bad, says", [
    (bytes((0x80, 1)) + b"x", "frame flags"),
    (zmtp.frame_header(MAX_FRAME + 1), f"a frame of {MAX_FRAME + 1} bytes"),
    (zmtp.command(b"ERROR", b"\x03bad"), "command b'ERROR'"),
    (zmtp.frame_header(5000, zmtp.COMMAND), "malformed command"),
])
def test_a_peer_that_breaks_the_protocol_ends_the_connection(peer, bad, says):
    w = connect(peer)
    peer.conn.sendall(bad)
    with pytest.raises(WireClosed, match=says):
        recv(w)


def test_a_message_before_ready_or_another_socket_type_fails_the_handshake(peer):
    t = threading.Thread(target=peer.accept, kwargs={"ready": False})
    t.start()
    try:
        with pytest.raises(WireClosed, match="socket type b'PUB'"):
            threading.Timer(0.2, lambda: peer.conn.sendall(
                zmtp.command(b"READY", zmtp.properties(Socket_Type=b"PUB")))).start()
            Wire.connect(peer.path, timeout_s=2)
    finally:
        t.join(10)


def test_a_silent_peer_times_the_handshake_out(peer):
    t = threading.Thread(target=peer.accept, kwargs={"greet": False, "ready": False})
    t.start()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no ZMTP handshake"):
        Wire.connect(peer.path, timeout_s=0.3)
    assert time.monotonic() - t0 < 2
    t.join(10)


def test_not_a_zmtp_peer_is_refused(peer):
    def http():  # kept open until the client has read it (a close with its greeting unread resets)
        peer.conn = peer.lsock.accept()[0]
        peer.conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n" + bytes(64))

    t = threading.Thread(target=http)
    t.start()
    with pytest.raises(WireClosed, match="bad signature"):
        Wire.connect(peer.path, timeout_s=2)
    t.join(10)


def test_a_ping_is_answered_with_pong(peer):
    w = connect(peer)
    peer.conn.sendall(zmtp.command(b"PING", b"\x00\x0a" + b"ctx"))
    peer.send(b"after")
    assert recv(w) == [b"after"]
    assert peer._read_frame() == b"\x04PONGctx"


def test_a_send_into_a_full_socket_reads_replies_meanwhile_and_calls_idle(peer):
    w = connect(peer)
    w.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    peer.send(b"early reply")  # arrives while the client is still sending
    big = os.urandom(8 << 20)
    idle_calls = []

    def reader():
        time.sleep(0.6)  # the client's send stalls: idle() runs at least once
        assert peer.read_message() == [b"req", big]

    t = threading.Thread(target=reader)
    t.start()
    w.send([b"req", big], idle=lambda: idle_calls.append(time.monotonic()))
    t.join(20)
    assert idle_calls, "a send stalled past a slice without calling idle()"
    assert w._messages and list(w._messages[0]) == [b"early reply"]  # read while sending
    assert recv(w) == [b"early reply"]


def test_idle_may_give_up_a_stalled_send(peer):
    w = connect(peer)
    w.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

    def give_up():
        raise TimeoutError("gave up")

    with pytest.raises(TimeoutError, match="gave up"):
        w.send([b"req", bytes(8 << 20)], idle=give_up)
    w.close()


def test_a_client_whose_connection_the_daemon_closes_is_told_so_and_its_session_ends(peer):
    """After the replies that came, the next request says the daemon closed the connection
    (its process still lives: not "gone")."""
    import msgpack

    from sparsekv.client import Client, DaemonUnavailable
    from sparsekv.proto import PROTOCOL_VERSION

    def daemon():
        peer.accept()
        head = msgpack.unpackb(peer.read_message()[0])
        peer.send(msgpack.packb({"v": PROTOCOL_VERSION, "t": head["t"], "id": head["id"], "ok": True,
                                 "client_id": 1, "version": PROTOCOL_VERSION}))
        peer.read_message()  # the STATS: no reply, the connection closed
        peer.conn.close()

    t = threading.Thread(target=daemon)
    t.start()
    c = Client(os.path.dirname(peer.path), timeout_s=5).connect()
    with pytest.raises(DaemonUnavailable, match="closed this client's connection .*its log says why"):
        c.stats()
    with pytest.raises(DaemonUnavailable, match="closed this client's connection"):
        c.stats()  # and every later request
    t.join(10)
    c.close()


def test_a_peer_that_breaks_the_protocol_while_a_send_waits_ends_the_send(peer):
    """The peer reads nothing and sends a bad frame: the send ends (it neither spins nor
    waits for a socket that will never drain)."""
    w = connect(peer)
    w.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    peer.conn.sendall(zmtp.command(b"ERROR", b"\x03bad"))
    out = {}

    def send():
        try:
            w.send([b"req", bytes(8 << 20)], idle=lambda: None)
        except WireClosed as e:
            out["error"] = e

    t = threading.Thread(target=send, daemon=True)
    t.start()
    t.join(3)
    assert not t.is_alive(), "the send still runs against a connection that ended"
    assert "command b'ERROR'" in str(out["error"])


def test_a_ping_while_a_message_is_half_written_is_answered_after_it(peer):
    """The PONG must not land between the bytes of the message being written."""
    w = connect(peer)
    w.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    big = os.urandom(1 << 20)
    got = {}

    def reader():
        peer.conn.recv(1, socket.MSG_PEEK)  # the client has begun
        peer.conn.sendall(zmtp.command(b"PING", b"\x00\x0a" + b"ctx"))
        time.sleep(0.05)  # read by the client while its send waits
        got["message"], got["next"] = peer.read_message(), peer._read_frame()

    t = threading.Thread(target=reader)
    t.start()
    w.send([b"req", big])
    t.join(10)
    assert got["message"] == [b"req", big]
    assert got["next"] == b"\x04PONGctx"
    w.send([b"after"])
    assert peer.read_message() == [b"after"]


def test_an_exception_that_cuts_a_message_ends_the_connection(peer):
    """A signal handler's exception (Ctrl-C) stops a send half way: nothing may follow the
    cut on that stream (it would be read as the rest of the message)."""
    w = connect(peer)
    w.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

    def interrupt():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        w.send([b"req", bytes(8 << 20)], idle=interrupt)
    assert w.cut
    with pytest.raises(WireClosed, match="cut short by KeyboardInterrupt"):
        w.send([b"next"])


def test_a_reply_that_came_before_the_end_is_read_after_a_send_finds_the_end(peer):
    """The daemon answered, then closed (a limit broken, it stopped): a send that finds the
    connection closed before the reply was read leaves the reply to be read."""
    w = connect(peer)
    peer.send(b"refused")
    peer.conn.close()
    time.sleep(0.05)
    with pytest.raises(WireClosed, match="closed"):
        w.send([b"req"])
    assert recv(w) == [b"refused"]
    with pytest.raises(WireClosed):
        recv(w)
