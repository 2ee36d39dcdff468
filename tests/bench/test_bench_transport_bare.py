"""``bench cuda_transport``'s bare ZMTP + CUDA IPC event server (the floor of a hand-off),
on the CPU with CuPy and the event ring stood in: the client's Wire against it, and where
its threads run when it is given a warm CPU."""

import os
import queue
import sys
import threading
import types

import pytest

from sparsekv.bench import transport
from sparsekv.client.wire import Wire


def test_the_bare_server_starts_cuda_off_its_cpu_then_runs_its_loop_there(monkeypatch, tmp_path):
    """As the daemon: the CUDA context (whose threads inherit the affinity of the thread
    that creates it) is made off the loop's CPU, then the loop moves there; the Wire's
    requests are answered and "stop" ends it."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs 2 CPUs")
    io = (allowed[-1],)
    seen = {}

    class Ring:  # EventRing: where the CUDA context starts
        def __init__(self, device, n):
            seen["cuda"] = os.sched_getaffinity(0)
            self.handles = [b"h" * 64]

        def record(self, k, stream):
            seen["loop"] = os.sched_getaffinity(0)

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(Stream=lambda non_blocking: None)))
    monkeypatch.setattr(transport, "EventRing", Ring)
    path = str(tmp_path / "bare.sock")
    ready, handles = threading.Event(), queue.Queue()
    server = threading.Thread(target=transport._bare_server, args=(path, ready, handles, 1000, io), daemon=True)
    server.start()  # (a thread's affinity is its own: this one's stays)
    assert ready.wait(10)
    wire = Wire.connect(path)
    try:
        wire.send([b"go"])
        assert wire.wait(5000) and [bytes(f) for f in wire.recv()] == [b"ok"]
        wire.send([b"stop"])
        assert wire.wait(5000) and [bytes(f) for f in wire.recv()] == [b"bye"]
    finally:
        wire.close()
    server.join(10)
    assert not server.is_alive()
    assert seen["cuda"] == set(allowed) - set(io) and seen["loop"] == set(io)
