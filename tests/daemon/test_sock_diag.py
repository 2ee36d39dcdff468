"""The kernel's answer to who owns the client's end of a loopback TCP connection
(daemon/sock_diag.py, NETLINK_SOCK_DIAG), with real sockets: the HTTP endpoint's
connections are shared out by that uid (test_operator_limits.py)."""

import errno
import logging
import os
import socket
import subprocess
import sys

import pytest

import helpers
from sparsekv.daemon import sock_diag as sock_diag_mod
from sparsekv.daemon.sock_diag import UNKNOWN, SockDiag


@pytest.fixture
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    yield srv
    srv.close()


@pytest.fixture
def diag():
    d = SockDiag()
    yield d
    d.close()


def test_the_kernel_names_this_process_as_the_owner_of_its_end(listener, diag):
    """Both ends are this process's: the client's socket is looked up by (its address, the
    daemon's), not the accepted one's; a 4-tuple of no socket, or a client that closed its
    end already (no process holds it: its inode is 0), is nobody's (-1)."""
    assert diag.check(listener.getsockname()) is None
    with socket.create_connection(listener.getsockname()) as c:
        a, peer = listener.accept()
        with a:
            local = a.getsockname()
            assert peer == c.getsockname()
            assert diag.peer_uid(peer, local) == os.geteuid()
            assert diag.peer_uid(local, peer) == os.geteuid()  # the daemon's own end
            assert diag.peer_uid(("127.0.0.1", 1), local) == UNKNOWN  # no such socket: ENOENT
            assert diag.peer_uid(("::1", 1, 0, 0), local) == UNKNOWN  # IPv4 only
            assert diag.peer_uid(None, local) == UNKNOWN  # (peername of a connection reset at once)
            c.close()
            assert diag.peer_uid(peer, local) == UNKNOWN  # FIN_WAIT: found, but nobody's
    assert diag._warned is False  # (none of this is a failure of the lookups)


# Run as another uid: connect to the port, print the local port, hold it until stdin ends.
CONNECT = r"""
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
print(s.getsockname()[1], flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(helpers.why_not_other_users() is not None, reason=str(helpers.why_not_other_users()))
def test_the_kernel_names_another_uid_as_the_owner_of_its_end(listener, diag):
    host, port = listener.getsockname()
    p = subprocess.Popen([*helpers.as_user(65533), sys.executable, "-c", CONNECT, str(port)], cwd="/tmp",
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        client_port = int(p.stdout.readline())
        a, peer = listener.accept()
        with a:
            assert peer == (host, client_port)
            assert diag.peer_uid(peer, a.getsockname()) == 65533
            assert diag.peer_uid(a.getsockname(), peer) == os.geteuid()  # the accepted socket: ours
    finally:
        p.stdin.close()
        p.wait(5)


def test_no_netlink_is_uid_minus_1_and_one_warning(listener, diag, monkeypatch, caplog):
    """Where the daemon may not open a netlink socket (systemd's RestrictAddressFamilies
    without AF_NETLINK: EAFNOSUPPORT), every lookup is -1 and one warning says why."""
    real = socket.socket

    def no_netlink(family=socket.AF_INET, *a, **k):
        if family == socket.AF_NETLINK:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real(family, *a, **k)

    monkeypatch.setattr(sock_diag_mod.socket, "socket", no_netlink)
    caplog.set_level(logging.WARNING, logger="sparsekv.sock_diag")
    why = diag.check(listener.getsockname())
    assert why == "[Errno 97] EAFNOSUPPORT"
    with socket.create_connection(listener.getsockname()) as c:
        a, peer = listener.accept()
        with a:
            for _ in range(3):
                assert diag.peer_uid(peer, a.getsockname()) == UNKNOWN
    assert [r.getMessage() for r in caplog.records] == [
        "HTTP endpoint: the kernel cannot say who owns a connection (NETLINK_SOCK_DIAG: [Errno 97] EAFNOSUPPORT); "
        "such connections share the slots of uid -1"]


class FakeNetlink:
    """A netlink socket whose answers the test writes (the kernel's own are not at hand)."""

    def __init__(self, answer):
        self.answer, self.sent = answer, []

    def send(self, data):
        self.sent.append(data)
        return len(data)

    def recv(self, n):
        return self.answer(self.sent[-1])

    def close(self):
        pass


def test_answers_that_name_no_live_socket_are_uid_minus_1(diag):
    """A kernel error, an answer of another request or another socket, a short one: -1,
    never a uid read from the wrong place; a kernel error other than ENOENT is warned about."""
    hdr = sock_diag_mod._NLMSGHDR
    peer, local = ("127.0.0.1", 40000), ("127.0.0.1", 9100)

    def answer(uid, inode=7, sockid=None, seq_delta=0, kind=sock_diag_mod.SOCK_DIAG_BY_FAMILY, cut=0):
        def make(request):
            seq = hdr.unpack_from(request)[3] + seq_delta
            sid = sockid or request[hdr.size + 8:hdr.size + 8 + 48]
            body = bytes([socket.AF_INET, 1, 0, 0]) + sid + sock_diag_mod._MSG_TAIL.pack(0, 0, 0, uid, inode)
            body = body[:len(body) - cut]
            return hdr.pack(hdr.size + len(body), kind, 0, seq, 0) + body
        return make

    def error(err):
        return lambda request: hdr.pack(hdr.size + 4, sock_diag_mod.NLMSG_ERROR, 0, hdr.unpack_from(request)[3],
                                        0) + sock_diag_mod._ERRNO.pack(-err)

    diag._sock = FakeNetlink(answer(1234))
    assert diag.peer_uid(peer, local) == 1234  # (the fake says what the kernel would)
    for fake in (answer(1234, inode=0), answer(1234, seq_delta=1), error(errno.ENOENT),
                 answer(1234, sockid=sock_diag_mod._sockid(local, peer) + bytes(12)), answer(1234, cut=8)):
        diag._sock = FakeNetlink(fake)
        assert diag.peer_uid(peer, local) == UNKNOWN
    assert diag._warned  # (the answers not ours: EPROTO)
    diag._warned = False
    diag._sock = FakeNetlink(error(errno.ENOENT))
    assert diag.peer_uid(peer, local) == UNKNOWN and not diag._warned  # no such socket: not a failure
    diag._sock = FakeNetlink(error(errno.EINVAL))
    assert diag.peer_uid(peer, local) == UNKNOWN and diag._warned
