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


def test_a_busy_socket_is_said_busy_only_while_its_daemon_holds_the_run_dir(tmp_path):
    """control.sock renamed control.sock.busy (a daemon short of descriptors) is the
    holder's only if bound after the holder wrote the lock file. Found by an adversarial
    review: one left by a daemon SIGKILLed while busy made clients say "short of file
    descriptors" with no daemon at all, and while a new one was still starting."""
    import fcntl

    from sparsekv.client import DaemonUnavailable
    from sparsekv.client.connection import open_wire
    from sparsekv.proto.run_dir import LOCK_FILE

    run = str(tmp_path)
    path = os.path.join(run, "control.sock")

    def said() -> str:
        with pytest.raises(DaemonUnavailable) as ei:
            open_wire(path, run, 1.0)
        return str(ei.value)

    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path + ".busy")  # the dead daemon's
    stale.close()
    assert "no daemon socket" in said()
    lock = os.open(os.path.join(run, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a new daemon holds the run dir, starting
        os.write(lock, f"{os.getpid()}\n".encode())
        os.utime(path + ".busy", ns=(0, os.stat(os.path.join(run, LOCK_FILE)).st_mtime_ns - 10**9))
        assert "has no control socket: it is starting" in said()
        os.unlink(path + ".busy")
        fresh = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fresh.bind(path + ".busy")  # its own, bound after its lock
        fresh.close()
        assert "short of file descriptors" in said()
    finally:
        os.close(lock)
