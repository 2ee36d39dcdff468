"""``client.wire.connect_unix``: a connect that finds the daemon's accept queue full (a burst
of ranks starting, another user's flood) fails at once with EAGAIN, so it is tried again
until its timeout: the client gets in once the daemon accepts, and is told so only after
the whole timeout."""

import os
import socket
import threading
import time

import pytest

from sparsekv.client.wire import connect_unix


@pytest.fixture
def full_queue(tmp_path):
    """A listening socket (backlog 1) whose accept queue is full; yields (path, listener)."""
    path = os.path.join(tmp_path, "s")
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(path)
    lst.listen(1)
    held = []
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            break
        held.append(s)
    yield path, lst
    for s in held:
        s.close()
    lst.close()


def test_a_full_accept_queue_is_waited_for_until_the_daemon_accepts(full_queue):
    path, lst = full_queue

    def accept_later():
        time.sleep(0.2)
        for _ in range(4):
            lst.settimeout(1)
            try:
                lst.accept()
            except OSError:
                return

    t = threading.Thread(target=accept_later)
    t.start()
    t0 = time.monotonic()
    sock = connect_unix(path, timeout_s=5.0)
    took = time.monotonic() - t0
    t.join()
    sock.close()
    assert 0.15 < took < 2.0, took


def test_a_queue_that_stays_full_times_out_after_the_timeout(full_queue):
    path, _ = full_queue
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="accept queue stayed full"):
        connect_unix(path, timeout_s=0.3)
    assert time.monotonic() - t0 >= 0.29


def test_no_socket_there_fails_at_once(tmp_path):
    with pytest.raises(FileNotFoundError):
        connect_unix(os.path.join(tmp_path, "none"), timeout_s=5.0)
