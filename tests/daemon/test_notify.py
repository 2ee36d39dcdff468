"""Notifier (sd_notify without libsystemd): datagrams to $NOTIFY_SOCKET, path or abstract
name, a silent no-op without it, the watchdog period from WATCHDOG_USEC, and
EXTEND_TIMEOUT_USEC for a long start."""

import os
import socket
import uuid

import pytest

from sparsekv.daemon.notify import Notifier


@pytest.fixture
def listener(tmp_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    s.bind(path)
    s.settimeout(5)
    yield path, s
    s.close()


def test_messages_reach_a_path_socket(listener):
    path, s = listener
    n = Notifier({"NOTIFY_SOCKET": path})
    assert n.enabled
    assert n.status("pre-faulting")
    assert s.recv(4096) == b"STATUS=pre-faulting"
    assert n.ready("serving")
    assert s.recv(4096) == b"READY=1\nSTATUS=serving"
    assert n.stopping()
    assert s.recv(4096) == b"STOPPING=1\nSTATUS=stopping"
    assert n.watchdog()
    assert s.recv(4096) == b"WATCHDOG=1"
    assert n.extend_timeout(60)
    assert s.recv(4096) == b"EXTEND_TIMEOUT_USEC=60000000"
    assert n.extend_timeout(1.5, status="pre-faulting host pool of 1GiB: 10%")
    assert s.recv(4096) == b"STATUS=pre-faulting host pool of 1GiB: 10%\nEXTEND_TIMEOUT_USEC=1500000"
    n.close()
    n.close()


def test_messages_reach_an_abstract_socket():
    name = f"sparsekv-test-{uuid.uuid4().hex}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(5)
    try:
        n = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert n.ready("up")
        assert s.recv(4096) == b"READY=1\nSTATUS=up"
        n.close()
    finally:
        s.close()


def test_without_notify_socket_nothing_is_sent():
    n = Notifier({})
    assert not n.enabled
    assert n.ready("x") is False and n.status("x") is False


def test_unreachable_socket_is_not_an_error(tmp_path):
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody")})
    assert n.status("x") is False


@pytest.mark.parametrize(
    "env, interval_s",
    [
        ({"WATCHDOG_USEC": "2000000"}, 1.0),
        ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}, 1.0),
        ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}, 0.0),  # meant for another process
        ({"WATCHDOG_USEC": "soon"}, 0.0),
        ({}, 0.0),
    ],
)
def test_watchdog_interval_is_half_the_systemd_period(env, interval_s):
    assert Notifier(env).watchdog_interval_s == interval_s
