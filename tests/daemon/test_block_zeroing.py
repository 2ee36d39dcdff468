"""The zeroing of a block store's freed blocks (found by an adversarial test: a dead
client's million private blocks, all freed at once, zeroed one by one, held the daemon's
loop for 1.3 s): a run of consecutive blocks at a time, exactly the blocks named; those
of a request's blocks on a worker thread before its reply."""

import threading

import numpy as np
import pytest

import helpers
from block_engine import BS, KEYS, LAY, attach_keys
from sparsekv.client import Client
from sparsekv.daemon.engine import EngineSpace
from sparsekv.daemon.engine_blocks import ZeroWrite
from sparsekv.proto import Layout


def test_zeroing_freed_blocks_zeroes_exactly_them_run_by_run():
    lay = Layout(num_layers=2, row_bytes=16, top_k=4, region_stride=8, max_reqs=1, host_rows=64,
                 index_groups=((0, 1),)).validate()
    rng = np.random.default_rng(0)
    pool = rng.integers(1, 256, size=(2, 64, 16), dtype=np.uint8)
    space = EngineSpace("e", lay, pool)
    space.block_size = 4  # 16 blocks
    space.keys = rng.integers(1, 256, size=(16, 2, 4, 8), dtype=np.uint8)
    before, keys = pool.copy(), space.keys.copy()
    named = [9, 3, 4, 5, 12, 4, 15]  # runs 3-5, then 9, 12, 15; one named twice, out of order
    space.zero_blocks(named)
    gone = np.zeros(16, bool)
    gone[named] = True
    rows = np.repeat(gone, 4)
    assert (pool[:, rows] == 0).all() and (space.keys[gone] == 0).all()
    np.testing.assert_array_equal(pool[:, ~rows], before[:, ~rows])
    np.testing.assert_array_equal(space.keys[~gone], keys[~gone])
    space.zero_blocks([])  # nothing named: nothing changes
    np.testing.assert_array_equal(pool[:, ~rows], before[:, ~rows])


# The zeros of the blocks a request frees or evicts are written before its reply, on a
# worker thread from heavy_bytes on (2,048 DeepSeek-V3.2 blocks are 5.3 GB: ~75 ms that
# held every client on the loop), holding only that engine's requests.
def _hashes(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-2**62, 2**62, (n, 2), dtype=np.int64)


def _block_rows(blocks) -> np.ndarray:
    return (np.asarray(blocks)[:, None] * BS + np.arange(BS)).reshape(-1)


@pytest.fixture
def gated(monkeypatch):
    """ZeroWrite held until ``go`` is set; ``threads``: where each ran."""
    go, threads, started = threading.Event(), [], threading.Event()
    write = ZeroWrite.__call__

    def held(self):
        threads.append(threading.current_thread())
        started.set()
        assert go.wait(20)
        return write(self)

    monkeypatch.setattr(ZeroWrite, "__call__", held)
    return go, threads, started


@pytest.mark.parametrize("request_kind", ["alloc_evicting", "release"])
def test_the_zeros_of_a_requests_blocks_are_written_off_the_loop_before_its_reply(request_kind, gated):
    go, threads, started = gated
    with helpers.serving_daemon(4 << 20) as d:
        d.block_requests.heavy_bytes = 1  # every zeroing on a worker thread
        with Client(d.run_dir) as c, Client(d.run_dir) as other, Client(d.run_dir) as peer:
            blocks = attach_keys(c)
            space = d.engines.space("m")
            mine = blocks.alloc(16)  # the whole store: nothing zeroed yet (free blocks hold zeros)
            assert not threads
            c.write(_block_rows(mine), np.full((LAY.num_layers, 16 * BS, LAY.row_bytes), 7, np.uint8))
            blocks.write_keys(mine, np.full((16, *KEYS), 9, np.uint8))
            if request_kind == "alloc_evicting":
                blocks.commit(mine, _hashes(1, 16))
                blocks.release(mine)  # cached, unpinned: evictable
                assert not threads
                target, call = mine[:6], lambda: blocks.alloc(6)  # the 6 least recently unpinned
            else:
                target, call = mine[2:8], lambda: blocks.release(mine[2:8])
            done = {}
            t = threading.Thread(target=lambda: done.setdefault("out", call()))
            t.start()
            assert started.wait(10)
            other.attach(LAY, engine="other", block_size=BS)  # the loop serves another engine meanwhile
            assert other.blocks.alloc(3).size == 3
            # a rank of the same engine attaching, then asking, waits for the held engine
            waiting = threading.Thread(target=lambda: done.setdefault("peer", attach_keys(peer).alloc(0)))
            waiting.start()
            waiting.join(0.3)
            assert "out" not in done and "peer" not in done and waiting.is_alive()
            go.set()
            t.join(10), waiting.join(10)
            assert threads and all(th is not d.thread for th in threads)
            if request_kind == "alloc_evicting":
                assert sorted(done["out"]) == sorted(target)
            rows = _block_rows(target)
            assert not space.pool[:, rows].any() and not space.keys[target].any()
            rest = np.setdiff1d(mine, target)
            assert (space.pool[:, _block_rows(rest)] == 7).all() and (space.keys[rest] == 9).all()


@pytest.mark.parametrize("how", ["detach", "close"])
def test_a_gone_clients_private_blocks_are_zeroed_off_the_loop_holding_only_its_engine(how, gated):
    """A client that detaches or goes holding private blocks (GBs of a long request): their
    zeros are written on a worker thread while the loop serves others; its engine's other
    ranks wait, and get zeroed blocks."""
    go, threads, started = gated
    with helpers.serving_daemon(4 << 20) as d:
        d.engines.heavy_bytes = 1  # every gone client's zeros on a worker thread
        with Client(d.run_dir) as c, Client(d.run_dir) as peer, Client(d.run_dir) as other:
            blocks, theirs = attach_keys(c), attach_keys(peer)
            space = d.engines.space("m")
            mine, kept = blocks.alloc(10), theirs.alloc(6)  # the whole store
            c.write(_block_rows(mine), np.full((LAY.num_layers, 10 * BS, LAY.row_bytes), 7, np.uint8))
            blocks.write_keys(mine, np.full((10, *KEYS), 9, np.uint8))
            peer.write(_block_rows(kept), np.full((LAY.num_layers, 6 * BS, LAY.row_bytes), 5, np.uint8))
            assert not threads
            c.detach() if how == "detach" else c.close()
            assert started.wait(10)
            other.attach(LAY, engine="other", block_size=BS)  # the loop serves another engine meanwhile
            assert other.blocks.alloc(3).size == 3
            done = {}
            waiting = threading.Thread(target=lambda: done.setdefault("alloc", theirs.alloc(10)))
            waiting.start()
            waiting.join(0.3)
            assert waiting.is_alive() and "alloc" not in done  # its engine is held
            go.set()
            waiting.join(10)
            assert threads and all(th is not d.thread for th in threads)
            assert sorted(done["alloc"]) == sorted(mine)  # the blocks it left, zeroed
            assert not space.pool[:, _block_rows(mine)].any() and not space.keys[mine].any()
            assert (space.pool[:, _block_rows(kept)] == 5).all()


def test_the_daemon_stops_after_a_gone_clients_zeros_are_written(gated, monkeypatch):
    """Stopping waits for a gone client's zeros in flight before the pool is closed (a
    worker thread writing into an unmapped pool would crash the daemon), then releases
    the engine they held."""
    go, threads, started = gated
    ended, seen = [], {}
    held = ZeroWrite.__call__
    monkeypatch.setattr(ZeroWrite, "__call__", lambda self: (held(self), ended.append(1))[0])
    with helpers.serving_daemon(4 << 20) as d:
        d.engines.heavy_bytes = 1
        pool = d.engines.pool
        close = pool.close
        monkeypatch.setattr(pool, "close", lambda: (seen.update(ended=len(ended), used=pool.used_bytes), close()))
        zeroed = d.engines.zeroed
        monkeypatch.setattr(d.engines, "zeroed", lambda name: (seen.update(at_zeroed=len(ended)), zeroed(name)))
        with Client(d.run_dir) as c, Client(d.run_dir) as peer:
            blocks = attach_keys(c)
            attach_keys(peer)
            blocks.alloc(4)
            c.detach()
            assert started.wait(10)
        threading.Timer(0.3, go.set).start()  # the stop waits for it
    assert seen == {"at_zeroed": 1, "ended": 1, "used": 0}


@pytest.mark.parametrize("off_loop", [False, True])
def test_a_failed_zero_write_of_a_request_stops_the_daemon(monkeypatch, off_loop):
    """A BLOCK_RELEASE whose zeros cannot be written has freed blocks that are not zero:
    the daemon stops (exit code 70) rather than hand them out."""
    with helpers.serving_daemon(4 << 20) as d:
        d.block_requests.heavy_bytes = 1 if off_loop else 1 << 40
        with Client(d.run_dir, timeout_s=5) as c:
            blocks = attach_keys(c)
            mine = blocks.alloc(4)
            monkeypatch.setattr(ZeroWrite, "__call__", lambda self: (_ for _ in ()).throw(MemoryError("boom")))
            with pytest.raises(Exception, match="writing the zeros of freed blocks failed: MemoryError: boom"):
                blocks.release(mine)
            d.thread.join(10)
            assert not d.thread.is_alive() and d.exit_code == 70 and "MemoryError: boom" in d.fatal_reason


def test_zeros_deferred_in_a_block_that_raises_are_written_before_the_error_goes_on():
    lay = Layout(num_layers=2, row_bytes=16, top_k=4, region_stride=8, max_reqs=1, host_rows=64,
                 index_groups=((0, 1),)).validate()
    space = EngineSpace("e", lay, np.full((2, 64, 16), 5, np.uint8))
    space.block_size = 4
    with pytest.raises(KeyError):
        with space.deferring_zeros() as zeros:
            space.zero_blocks([2, 3])
            assert zeros and (space.pool[:, 8:16] == 5).all()  # deferred
            raise KeyError("the store's request failed after freeing them")
    assert not space.pool[:, 8:16].any() and (space.pool[:, 16:] == 5).all()
    with space.deferring_zeros() as zeros:  # and it may defer again
        space.zero_blocks([4])
    assert (space.pool[:, 16:20] == 5).all() and zeros


def test_a_released_blocks_hot_copies_are_dropped_off_the_loop_from_heavy_slots(gated):
    """Found by an adversarial review: freeing a block dropped its rows' hot copies on the
    loop, scanning every slot of every rank (seconds for 128M cpu slots). From
    ``heavy_slots`` the drop goes with the zeros to the worker thread, before the reply:
    the rank's copies of those rows are gone when the release returns, the others kept."""
    go, threads, started = gated
    go.set()
    with helpers.serving_daemon(4 << 20) as d:
        with Client(d.run_dir) as c:
            blocks = attach_keys(c)
            space = d.engines.space("m")
            slots = space.drop_scan_slots()
            d.block_requests.heavy_slots = slots  # this engine's drops: on the worker thread
            d.block_requests.heavy_bytes = 1 << 40  # (not for the zeros' bytes)
            mine = blocks.alloc(4)
            c.write(_block_rows(mine), np.full((LAY.num_layers, 4 * BS, LAY.row_bytes), 7, np.uint8))
            c.step(0, np.array([0], np.int32), np.array([True]))
            hot = np.concatenate([_block_rows(mine[:1]), _block_rows(mine[3:])])[:LAY.top_k].astype(np.int32)
            c.topk(0, 0, hot[None, :])
            assert not threads
            blocks.release(mine[:1])
            assert threads and all(th is not d.thread for th in threads)
            r = c.topk(0, 0, hot[None, :])  # the released block's rows were dropped, the others hit
            assert int(r.misses.sum()) == np.isin(hot, _block_rows(mine[:1])).sum() > 0, (r.misses, hot)
            threads.clear()
            d.block_requests.heavy_slots = slots + 1  # below it: on the loop, as before
            blocks.release(mine[1:2])
            assert threads and all(th is d.thread for th in threads)
