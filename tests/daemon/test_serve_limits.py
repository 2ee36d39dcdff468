"""What one peer of the control socket can cost a serving daemon (``Daemon.serve`` in a
thread of this process, cpu backend), and the daemon's exit on a sticky CUDA error.

A raw ``AF_UNIX`` peer speaking just enough ZMTP 3 shows what the control socket allows: a
frame announced larger than any request (1 GiB) is refused and its connection closed at
once, unread; a peer that is not ZMTP 3 is closed at its first byte; one that says no
HELLO (or never finishes its handshake) is closed after ``hello_timeout_s``.
A handler raising CuPy's ``CUDARuntimeError`` with a sticky status (a fake class of that
name here) makes the daemon log CRITICAL, set ``STATUS=`` and stop with exit code 70."""

import contextlib
import logging
import os
import socket
import sys
import time

import pytest

import helpers
from sparsekv.client import Client, SparseKVError
from sparsekv.daemon import main as main_mod
from sparsekv.daemon import server as server_mod
from sparsekv.daemon.notify import Notifier
from sparsekv.proto import LIMITS, MsgType

MiB = 1 << 20


def serving(notifier=None, **kw):
    """A daemon serving a short run dir from a thread; stopped (if still serving) after."""
    return helpers.serving_daemon(8 * MiB, notifier=notifier, **kw)


def zmtp_peer(path: str, minor: int = 1) -> socket.socket:
    """A raw connection that completes a ZMTP 3.x NULL handshake as a DEALER."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.settimeout(10)
    s.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, minor]) + b"NULL".ljust(20, b"\x00") + b"\x00" * 32)
    body = bytes([5]) + b"READY" + bytes([11]) + b"Socket-Type" + (6).to_bytes(4, "big") + b"DEALER"
    s.sendall(bytes([0x04, len(body)]) + body)
    got = b""
    while len(got) < 64 + 2:  # the daemon's greeting and (the start of) its READY
        chunk = s.recv(4096)
        assert chunk, "the daemon closed the connection during the handshake"
        got += chunk
    return s


def closed_within(s: socket.socket, timeout_s: float) -> float | None:
    """Seconds until the daemon closes ``s`` (reading and dropping what it sends), or None."""
    s.settimeout(timeout_s)
    t0 = time.monotonic()
    try:
        while s.recv(65536):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


def test_a_frame_larger_than_any_request_drops_its_connection_unread():
    assert LIMITS.max_frame_bytes < LIMITS.max_message_bytes < 1 << 30
    with serving() as d:
        s = zmtp_peer(d.control_path)
        # A long frame header announcing 1 GiB, then only a few bytes of it.
        s.sendall(bytes([0x02]) + (1 << 30).to_bytes(8, "big") + b"x" * 100)
        took = closed_within(s, 5)
        assert took is not None and took < 3.0  # (at once: not after a timeout of 10 s)
        with Client(d.run_dir, timeout_s=5) as c:  # everyone else goes on
            assert c.stats()["clients"] == 1


def test_zmtp_1_0_peers_are_refused_at_once_and_cost_no_memory():
    """A ZMTP/1.0 or 2.0 peer (a first byte other than 0xff) is closed at its first byte."""
    import psutil

    with serving() as d:
        first = socket.socket(socket.AF_UNIX)
        first.connect(d.control_path)
        first.sendall(b"\x05\x00abcd" + b"\x07" * 200)
        took = closed_within(first, 5)
        assert took is not None and took < 3.0  # (at once: not after a timeout of 10 s)
        me = psutil.Process()
        before = me.memory_info().rss
        for i in range(2000):  # 31 MiB of leak without the ZAP domain
            s = socket.socket(socket.AF_UNIX)
            s.connect(d.control_path)
            try:
                s.sendall(bytes([1 + i % 250]) + b"\x00" + b"\x07" * 1000)
            except OSError:  # refused before all of it was sent
                pass
            s.close()
        time.sleep(0.5)
        grown_mib = (me.memory_info().rss - before) / MiB
        assert grown_mib < 10, f"{grown_mib:.1f} MiB for 2,000 ZMTP/1.0 connections"
        with Client(d.run_dir, timeout_s=5) as c:  # ZMTP 3 clients are served
            assert c.stats()["clients"] == 1


def test_peers_without_hello_and_handshakes_that_never_end_are_dropped():
    with serving(hello_timeout_s=0.3) as d:
        d.control.exempt_pid = -1  # the peers are this process's, as is the daemon
        silent = zmtp_peer(d.control_path)  # a handshake, then nothing
        mute = socket.socket(socket.AF_UNIX)  # connects and never says anything
        mute.connect(d.control_path)
        for s in (silent, mute):  # the deadline, and a pass of the expiry (each second)
            took = closed_within(s, 5)
            assert took is not None and took < 4.5  # (0.3 s and a pass of the expiry, not never)
        with Client(d.run_dir, timeout_s=5) as c:  # a client that said HELLO: kept
            time.sleep(1.5)
            assert c.stats()["clients"] == 1
        assert d.control.counters()["connections_expired"] == 2


class CUDARuntimeError(RuntimeError):
    """Shaped like CuPy's (cupy_backends.cuda.api.runtime): a ``status`` attribute."""

    def __init__(self, status: int):
        super().__init__(f"cudaErrorIllegalAddress: an illegal memory access was encountered ({status})")
        self.status = status


def test_sticky_cuda_error_is_recognised_by_name_and_status():
    assert server_mod.sticky_cuda_error(CUDARuntimeError(700)) == "700 (illegal address)"
    assert server_mod.sticky_cuda_error(CUDARuntimeError(2)) is None  # out of memory: not sticky
    assert server_mod.sticky_cuda_error(RuntimeError("illegal address")) is None
    try:
        try:
            raise type("CUDADriverError", (Exception,), {"status": 719})()
        except Exception as e:
            raise ValueError("wrapped") from e
    except ValueError as e:
        assert server_mod.sticky_cuda_error(e) == "719 (launch failure)"


def test_a_sticky_cuda_error_stops_the_daemon_with_exit_code_70(caplog, tmp_path):
    notify_path = str(tmp_path / "notify")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(5)
    with serving(Notifier({"NOTIFY_SOCKET": notify_path})) as d:
        def boom(*args):
            raise CUDARuntimeError(700)

        d.handlers[MsgType.STATS] = boom
        c = Client(d.run_dir, timeout_s=5).connect()
        with caplog.at_level(logging.CRITICAL, logger="sparsekv.server"):
            t0 = time.monotonic()
            with pytest.raises(SparseKVError) as ei:
                c.stats()
            d.thread.join(5)
            assert not d.thread.is_alive() and time.monotonic() - t0 < 5  # serve() returned: promptly
        assert "GPU context is lost" in str(ei.value) and "INTERNAL" in str(ei.value)
        assert d.exit_code == server_mod.EXIT_FATAL == 70
        assert any(r.levelno == logging.CRITICAL and "sticky CUDA error 700" in r.getMessage() for r in caplog.records)
        msgs = []
        with contextlib.suppress(TimeoutError):
            while not any(b"STOPPING=1" in m for m in msgs):
                msgs.append(notify.recv(4096))
        assert any(b"STATUS=failed: sticky CUDA error 700" in m for m in msgs), msgs
        assert not os.path.exists(d.control_path)  # stopped cleanly all the same
        c.close()
    notify.close()


def test_a_backend_failure_outside_any_request_stops_the_daemon_with_exit_code_70(caplog, tmp_path):
    """GPU work that runs without requests (a doorbell rank's stream) can fail where no
    reply can say so: the daemon finds it within a health interval and exits 70, so
    systemd restarts it and the engines' watchers release their streams."""
    notify_path = str(tmp_path / "notify")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(5)
    with serving(Notifier({"NOTIFY_SOCKET": notify_path})) as d:
        c = Client(d.run_dir, timeout_s=5).connect()
        c.stats()  # serving
        with caplog.at_level(logging.CRITICAL, logger="sparsekv.server"):
            t0 = time.monotonic()
            d.backend.failure = lambda: "the doorbell stream of GPU 0 stopped: CUDARuntimeError(700)"
            d.thread.join(5)
            assert not d.thread.is_alive()
            assert time.monotonic() - t0 < 4 * server_mod.HEALTH_INTERVAL_S + 1
        assert d.exit_code == server_mod.EXIT_FATAL
        assert "doorbell stream of GPU 0 stopped" in d.fatal_reason
        assert any(r.levelno == logging.CRITICAL and "doorbell stream" in r.getMessage() for r in caplog.records)
        msgs = []
        with contextlib.suppress(TimeoutError):
            while not any(b"STOPPING=1" in m for m in msgs):
                msgs.append(notify.recv(4096))
        assert any(b"STATUS=failed: the doorbell stream" in m for m in msgs), msgs
        c.close()
    notify.close()


def test_main_returns_the_daemons_exit_code():
    class Failing:
        exit_code = 0

        async def serve(self):
            self.exit_code = 70

        def stop(self):
            pass

    switch = sys.getswitchinterval()  # _run sets the daemon's (a process-wide setting)
    try:
        with main_mod.StartSignals() as signals:
            assert main_mod._run(Failing(), signals) == 70
        assert sys.getswitchinterval() == pytest.approx(main_mod.GIL_SWITCH_S)
    finally:
        sys.setswitchinterval(switch)  # the rest of this test worker keeps its own
