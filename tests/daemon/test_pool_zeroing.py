"""Freed pool ranges are zeroed before reuse: a new engine never sees the bytes of the one
that had its range before. Small ranges are zeroed in ``release``; large ones on the
pool's threads, off the request path, and stay out of use until done; an ``allocate``
that finds no other room waits for them."""

import os
import threading
import time

import numpy as np
import pytest

import helpers
from helpers import request
from sparsekv.daemon import pool as pool_mod
from sparsekv.daemon.backends import CpuBackend
from sparsekv.daemon.pool import ALIGN_BYTES, INLINE_ZERO_BYTES, HostPool, PoolError
from sparsekv.daemon.server import Daemon
from sparsekv.proto import MsgType

MiB = 1 << 20
BIG = 2 * INLINE_ZERO_BYTES  # zeroed in the background


@pytest.fixture
def gate(monkeypatch):
    """Hold background zeroing until ``gate.set()`` (set again at teardown)."""
    ev = threading.Event()
    real = pool_mod._zero
    started = []

    def held(address, nbytes):
        started.append(nbytes)
        ev.wait(30)
        real(address, nbytes)

    monkeypatch.setattr(pool_mod, "_zero", held)
    ev.started = started
    yield ev
    ev.set()


def test_small_released_range_is_zeroed_at_once():
    with HostPool(8 * MiB, threads=1) as p:
        off = p.allocate(ALIGN_BYTES)
        p.array[off : off + ALIGN_BYTES] = 0xAB
        p.release(off)
        assert p.zeroing_bytes == 0 and p.used_bytes == 0
        assert p.allocate(ALIGN_BYTES) == off
        assert not p.array[off : off + ALIGN_BYTES].any()


def test_large_release_is_zeroed_off_the_caller_and_not_reused_until_done(gate):
    with HostPool(2 * BIG, threads=1) as p:
        a = p.allocate(BIG)
        p.array[a : a + BIG] = 0xAB
        t0 = time.monotonic()
        p.release(a)
        assert time.monotonic() - t0 < 0.5  # did not wait for the held zeroing
        assert p.zeroing_bytes == BIG and p.used_bytes == 0 and p.free_bytes == BIG
        b = p.allocate(BIG)  # the other half: no waiting
        assert b != a and not p.array[b : b + BIG].any()
        gate.set()
        p.wait_zeroed()
        assert p.zeroing_bytes == 0 and p.free_bytes == BIG
        assert p.allocate(BIG) == a and not p.array[a : a + BIG].any()


def test_allocate_waits_for_pending_zeroing_when_nothing_else_fits(gate):
    with HostPool(BIG, threads=1) as p:
        a = p.allocate(BIG)
        p.array[a : a + BIG] = 0xCD
        p.release(a)
        threading.Timer(0.2, gate.set).start()
        t0 = time.monotonic()
        assert p.allocate(BIG) == a
        assert time.monotonic() - t0 >= 0.15
        assert not p.array[a : a + BIG].any()


def test_allocate_that_cannot_fit_even_after_zeroing_is_pool_full(gate):
    with HostPool(BIG, threads=1) as p:
        p.release(p.allocate(BIG))
        gate.set()
        with pytest.raises(PoolError, match="no free range"):
            p.allocate(2 * BIG)
        assert p.free_bytes == BIG


def test_close_waits_for_zeroing_in_flight(gate):
    p = HostPool(BIG, threads=1)
    p.release(p.allocate(BIG))
    helpers.wait_for(lambda: gate.started, what="the zeroing to start")
    threading.Timer(0.1, gate.set).start()
    p.close()  # must not unmap under a running memset (that would crash the process)
    p.close()


def test_failed_zeroing_keeps_the_range_out_of_use(monkeypatch, caplog):
    def broken(address, nbytes):
        raise OSError("boom")

    monkeypatch.setattr(pool_mod, "_zero", broken)
    with HostPool(2 * BIG, threads=1) as p:
        a = p.allocate(BIG)
        p.release(a)
        p.wait_zeroed()
        assert p.zeroing_bytes == 0 and p.free_bytes == BIG  # the other half only
        assert "not reused" in caplog.text
        with pytest.raises(PoolError):
            p.allocate(2 * BIG)


def test_release_without_zeroing_for_a_range_nothing_wrote_to(gate):
    with HostPool(BIG, threads=1) as p:
        p.release(p.allocate(BIG), zero=False)
        assert not gate.started and p.free_bytes == BIG


# -- through the daemon: engine A's bytes never reach engine B ------------------------------
@pytest.mark.parametrize("host_rows", [64, 2048], ids=["inline", "background"])
def test_next_engine_on_a_freed_range_reads_zeros(tmp_path, host_rows):
    lay = helpers.layout(row_bytes=4096, host_rows=host_rows, top_k=4)
    size = -(-lay.pool_bytes // ALIGN_BYTES) * ALIGN_BYTES
    assert (size > INLINE_ZERO_BYTES) == (host_rows == 2048)
    pool = HostPool(size, threads=1)  # room for exactly one engine: B gets A's range
    backend = CpuBackend(str(tmp_path), shm_dir=str(tmp_path))
    dm = Daemon(str(tmp_path), backend, pool)
    try:
        for ident in (b"A", b"B"):
            hello = {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": ""}
            assert request(dm, ident, MsgType.HELLO, hello)[0]["ok"]
        assert request(dm, b"A", MsgType.ATTACH, {"engine": "a", "layout": lay.to_wire()})[0]["ok"]
        rows = np.arange(lay.host_rows, dtype=np.int32)
        data = np.full((lay.num_layers, lay.host_rows, lay.row_bytes), 0x5A, np.uint8)
        assert request(dm, b"A", MsgType.WRITE, {"layers": None}, {"rows": rows, "data": data})[0]["ok"]
        t0 = time.monotonic()
        assert request(dm, b"A", MsgType.DETACH)[0]["was_attached"]
        detach_s = time.monotonic() - t0
        assert request(dm, b"B", MsgType.ATTACH, {"engine": "b", "layout": lay.to_wire()})[0]["ok"]
        space = dm.engines.space("b")
        assert space.pool_offset == 0  # the very range engine A had
        assert not space.pool.any()
        # and what B's rank gathers from it
        assert request(dm, b"B", MsgType.STEP, {"step": 0}, {"state_rows": np.array([0], np.int32)})[0]["ok"]
        h, a = request(dm, b"B", MsgType.TOPK, {"step": 0, "group": 0}, {"topk": np.array([[0, 1, 2, 3]], np.int32)})
        assert h["ok"] and a["misses"][0] == 4
        assert not dm.sessions[b"B"].state.slab.any()
        assert detach_s < 1.0
    finally:
        for s in list(dm.sessions.values()):
            dm.sessions.detach(s)
        backend.close()
        pool.close()


def test_detach_does_not_wait_for_zeroing(tmp_path, gate):
    lay = helpers.layout(row_bytes=4096, host_rows=2048)
    pool = HostPool(64 * MiB, threads=1)
    backend = CpuBackend(str(tmp_path), shm_dir=str(tmp_path))
    dm = Daemon(str(tmp_path), backend, pool)
    try:
        request(dm, b"A", MsgType.HELLO, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": ""})
        assert request(dm, b"A", MsgType.ATTACH, {"engine": "a", "layout": lay.to_wire()})[0]["ok"]
        assert request(dm, b"A", MsgType.DETACH)[0]["ok"]  # answered while the zeroing is held
        assert pool.zeroing_bytes > 0 and dm.snapshot()["pool_used_bytes"] == 0
        # another engine attaches meanwhile, elsewhere in the pool
        assert request(dm, b"A", MsgType.ATTACH, {"engine": "b", "layout": lay.to_wire()})[0]["ok"]
        assert dm.engines.space("b").pool_offset != 0
        gate.set()
        pool.wait_zeroed()
        assert pool.zeroing_bytes == 0
    finally:
        gate.set()
        for s in list(dm.sessions.values()):
            dm.sessions.detach(s)
        backend.close()
        pool.close()
