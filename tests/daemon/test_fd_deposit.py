"""Deposits on the fd socket (daemon/fd_server.py): an engine-owned slab's descriptor
given to the daemon for the depositing process's next ATTACH; bounded per process and in
time, so no client can make the daemon hoard descriptors."""

import os
import socket

import pytest

from sparsekv.daemon import fd_server as fd_server_mod
from sparsekv.daemon.fd_server import FdServer
from sparsekv.proto import ErrorCode, ProtocolError, fd_socket


def memfd():
    fd = os.memfd_create("deposit-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    return fd


def sock_path(d):
    return os.path.join(d.run_dir, fd_socket.FD_SOCKET)


def test_a_process_may_hold_a_few_deposits_then_is_refused_and_counted(daemon):
    from sparsekv.client import Client

    fds = [memfd() for _ in range(fd_server_mod.DEPOSITS_PER_PID + 1)]
    try:
        ids = [fd_socket.deposit_fd(sock_path(daemon), fd) for fd in fds[:-1]]
        assert len(set(ids)) == len(ids)
        with pytest.raises(ProtocolError, match="too many slab deposits") as e:
            fd_socket.deposit_fd(sock_path(daemon), fds[-1])
        assert e.value.code == ErrorCode.TOO_LARGE
        with Client(daemon.run_dir) as c:
            assert c.stats()["fd_refusals"] >= 1
    finally:
        for fd in fds:
            os.close(fd)


def test_a_deposit_without_a_descriptor_and_a_token_with_one_are_refused(daemon):
    with pytest.raises(ProtocolError, match="exactly one descriptor"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(sock_path(daemon))
        s.sendall(b"deposit\n")
        fd_socket._read_answer(s, b"")
    fd = memfd()
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(sock_path(daemon))
        socket.send_fds(s, [b"00112233445566778899aabbccddeeff\n"], [fd])
        with pytest.raises(ProtocolError, match="only with a deposit request"):
            fd_socket._read_answer(s, b"")
    finally:
        os.close(fd)


class _Stats:
    def __init__(self):
        self.counts = {}

    def add(self, **kw):
        for k, v in kw.items():
            self.counts[k] = self.counts.get(k, 0) + v


def test_deposits_expire_and_are_closed_and_belong_to_their_process():
    srv = FdServer(_Stats(), lambda cid: {}, lambda *a: False)
    fd = memfd()
    srv.deposits["a"] = fd_server_mod.Deposit(fd, 10, 1000, 1000, at=0.0)
    srv.deposits["b"] = fd_server_mod.Deposit(memfd(), 11, 1000, 1000, at=100.0)
    with pytest.raises(ProtocolError, match="another process") as e:
        srv.take_deposit("b", 10, 1000, 1000)
    assert e.value.code == ErrorCode.PERMISSION_DENIED and "b" in srv.deposits
    assert srv.stats.counts["fd_refusals"] == 1
    assert srv.expire(now=fd_server_mod.DEPOSIT_TTL_S + 1) == 1
    assert "a" not in srv.deposits
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by the daemon
    with pytest.raises(ProtocolError, match="unknown or expired"):
        srv.take_deposit("a", 10, 1000, 1000)
    got = srv.take_deposit("b", 11, 1000, 1000)
    os.fstat(got)  # the caller owns it now
    os.close(got)
    srv.close()


def test_a_deposit_brings_one_descriptor_in_any_message_of_its_line_and_no_second(daemon):
    """Room for one descriptor a request (daemon/fd_server.py): a deposit whose descriptor
    comes with the first part of its line is kept; one whose message brings two is refused
    BAD_ARGUMENT, neither kept."""
    fd = memfd()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(sock_path(daemon))
            socket.send_fds(s, [b"dep"], [fd])
            s.sendall(b"osit\n")
            head = fd_socket._read_answer(s, b"")
        assert head["ok"] is True and isinstance(head["deposit"], str)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(sock_path(daemon))
            socket.send_fds(s, [b"deposit\n"], [fd, fd])
            with pytest.raises(ProtocolError, match=r"^BAD_ARGUMENT: a request brings at most one descriptor") as e:
                fd_socket._read_answer(s, b"")
        assert e.value.code == ErrorCode.BAD_ARGUMENT
        assert fd_socket.deposit_fd(sock_path(daemon), fd)  # one, the client's way
    finally:
        os.close(fd)
