"""The zeros of the private blocks a client leaves when it goes (DETACH, exit, crash),
written on the holds' own thread while its engine is held (``HeavyRequests.hold``),
found by an adversarial review of the first version: a kept engine being zeroed must
still yield to a new engine (not POOL_FULL), the zeros must not take the workers that
requests use, an engine that goes writes none, an error after them strands nobody, and
one in them stops the daemon (the blocks are free but not zero)."""

import os
import threading

import numpy as np
import pytest

import helpers
from block_engine import BS, LAY, attach_keys
from sparsekv.client import Client, DaemonUnavailable
from sparsekv.daemon.engine_blocks import ZeroWrite
from sparsekv.proto import MsgType


def _rows(blocks) -> np.ndarray:
    return (np.asarray(blocks)[:, None] * BS + np.arange(BS)).reshape(-1)


class Gates:
    """Every ZeroWrite call waits for its own gate, opened in call order or all at once."""

    def __init__(self):
        self.cv = threading.Condition()
        self.calls: list[threading.Event] = []
        self.all_open = False

    def started(self, n: int, timeout: float = 10) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: len(self.calls) >= n, timeout)

    def open_all(self) -> None:
        with self.cv:
            self.all_open = True
            for e in self.calls:
                e.set()


@pytest.fixture
def gates(monkeypatch):
    g = Gates()
    write = ZeroWrite.__call__

    def held(self):
        e = threading.Event()
        with g.cv:
            if g.all_open:
                e.set()
            g.calls.append(e)
            g.cv.notify_all()
        assert e.wait(20)
        return write(self)

    monkeypatch.setattr(ZeroWrite, "__call__", held)
    yield g
    g.open_all()


def on_loop(d, fn):
    """``fn()`` run on the daemon's loop; its value."""
    box, done = {}, threading.Event()

    def run():
        try:
            box["v"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread
            box["e"] = e
        done.set()
    d.call_soon(run)
    assert done.wait(10)
    if "e" in box:
        raise box["e"]
    return box.get("v")


def crash(d, c) -> None:
    """Client ``c``'s process is gone: its session reaped on the loop (no BYE)."""
    cid = c.info["client_id"]
    on_loop(d, lambda: d.sessions.reap(next(s for s in d.sessions.values() if s.client_id == cid)))
    c._drop_socket()
    c.info, c.attachment = {}, None


def in_thread(fn):
    box = {}

    def run():
        try:
            fn()
            box["v"] = "ok"
        except Exception as e:  # noqa: BLE001 - reported by the test
            box["v"] = f"{type(e).__name__}: {e}"
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_two_gone_clients_of_one_engine_are_zeroed_in_turn_and_the_engine_waits_for_both(gates):
    with helpers.serving_daemon(4 << 20) as d:
        d.engines.heavy_bytes = 1
        with Client(d.run_dir) as a, Client(d.run_dir) as b, Client(d.run_dir) as peer:
            ba, bb, bp = attach_keys(a), attach_keys(b), attach_keys(peer)
            space = d.engines.space("m")
            ma, mb = ba.alloc(5), bb.alloc(5)
            bp.alloc(6)
            for c, m in ((a, ma), (b, mb)):
                c.write(_rows(m), np.full((LAY.num_layers, 5 * BS, LAY.row_bytes), 7, np.uint8))
            crash(d, a)
            assert gates.started(1)
            crash(d, b)
            got = []
            t = threading.Thread(target=lambda: got.append(bp.alloc(10)))
            t.start()
            gates.calls[0].set()
            assert gates.started(2)  # the second after the first (one thread for them)
            t.join(0.3)
            assert t.is_alive()  # the engine is held until both are written
            gates.open_all()
            t.join(10)
            assert sorted(got[0]) == sorted(np.concatenate([ma, mb]))
            assert not space.pool[:, _rows(got[0])].any() and not space.keys[got[0]].any()


def test_gone_clients_zeros_leave_the_workers_to_requests(gates):
    """The zeros run on a thread of their own: a new engine's ATTACH (its slow part on a
    worker thread) is served while two gone clients' zeros wait."""
    with helpers.serving_daemon(8 << 20) as d:
        d.engines.heavy_bytes = 1
        with Client(d.run_dir) as a, Client(d.run_dir) as b, Client(d.run_dir) as peer, \
                Client(d.run_dir) as other:
            attach_keys(a).alloc(4)
            attach_keys(b).alloc(4)
            attach_keys(peer)
            crash(d, a)
            crash(d, b)
            assert gates.started(1)
            t, box = in_thread(lambda: attach_keys(other, engine="unrelated"))
            t.join(10)
            assert box.get("v") == "ok" and d.heavy.engine_busy("m")  # served while m is held
            gates.open_all()


def test_a_new_engine_that_needs_a_kept_engines_range_waits_for_its_zeros(gates):
    """Engine e0 is kept for a cached block, its last rank gone holding private blocks:
    while their zeros are written e0 cannot yield, so a new engine that needs its range
    waits for them, then gets it (before, POOL_FULL)."""
    with helpers.serving_daemon(4 << 20) as d:
        d.engines.heavy_bytes = 1
        clients = []
        try:
            while True:  # fill the pool with engines
                c = Client(d.run_dir).connect()
                clients.append(c)
                try:
                    attach_keys(c, engine=f"e{len(clients) - 1}")
                except Exception:  # noqa: BLE001 - full
                    break
            assert len(clients) >= 3
            c0 = clients[0]
            blk = c0.blocks.alloc(1)
            c0.blocks.commit(blk, np.array([[1, 2]], np.int64))
            c0.blocks.release(blk)
            p = Client(d.run_dir).connect()
            clients.append(p)
            attach_keys(p, engine="e0").alloc(6)
            c0.detach()
            crash(d, p)  # e0: kept (a cached block), no rank, its zeros in flight
            assert gates.started(1) and "e0" in d.engines
            new = clients[-2]  # the one the full pool refused
            t, box = in_thread(lambda: attach_keys(new, engine="fresh"))
            t.join(0.3)
            assert t.is_alive()  # waits for e0's zeros
            gates.open_all()
            t.join(10)
            assert box.get("v") == "ok", box
            assert "e0" not in d.engines and "fresh" in d.engines
        finally:
            gates.open_all()
            for c in clients:
                c.close()


def test_the_last_ranks_zeros_are_not_written_when_its_engine_goes(gates):
    """The last rank goes while another client's zeros are in flight: the engine goes once
    they are written, its whole range zeroed by the pool; the last rank's own are not."""
    with helpers.serving_daemon(4 << 20) as d:
        d.engines.heavy_bytes = 1
        with Client(d.run_dir) as a, Client(d.run_dir) as peer:
            attach_keys(a).alloc(4)
            attach_keys(peer).alloc(4)
            crash(d, a)
            assert gates.started(1)
            crash(d, peer)
            gates.open_all()
            helpers.wait_for(lambda: "m" not in d.engines, what="the engine's release")
            assert len(gates.calls) == 1


def _failing_release(space, give_back):
    raise RuntimeError("backend release failed")


def test_an_error_after_the_zeros_strands_no_request_and_the_daemon_still_stops_cleanly(gates, monkeypatch):
    """What follows a hold (the engine's release here) raising: logged; the ATTACH that
    waited for the engine is answered, and stopping later detaches and removes its sockets."""
    with helpers.serving_daemon(4 << 20) as d:
        d.engines.heavy_bytes = 1
        with Client(d.run_dir) as a, Client(d.run_dir) as peer, Client(d.run_dir, timeout_s=5) as n:
            attach_keys(a).alloc(8)
            attach_keys(peer)
            crash(d, a)
            assert gates.started(1)
            crash(d, peer)  # the last rank: the engine goes once the zeros are written
            monkeypatch.setattr(d.engines.backend, "release_engine", _failing_release)
            t, box = in_thread(lambda: attach_keys(n))
            t.join(0.3)
            assert t.is_alive()
            gates.open_all()
            t.join(8)
            assert box.get("v") is not None and "no reply" not in box["v"], box
        control = d.control_path
    assert not d.thread.is_alive() and "error" not in d.box, d.box.get("error")
    assert not os.path.exists(control)


def test_stopping_mid_hold_whose_end_raises_stops_cleanly(gates, monkeypatch):
    with helpers.serving_daemon(4 << 20, before_stop=lambda d: threading.Timer(0.3, gates.open_all).start()) as d:
        d.engines.heavy_bytes = 1
        a, peer = Client(d.run_dir).connect(), Client(d.run_dir).connect()
        attach_keys(a).alloc(8)
        attach_keys(peer)
        crash(d, a)
        assert gates.started(1)
        crash(d, peer)
        monkeypatch.setattr(d.engines.backend, "release_engine", _failing_release)
        control = d.control_path
    assert not d.thread.is_alive() and "error" not in d.box, d.box.get("error")
    assert not os.path.exists(control)


def test_after_a_fatal_error_a_hold_ending_runs_no_waiting_request(gates):
    with helpers.serving_daemon(4 << 20) as d:
        d.engines.heavy_bytes = 1
        with Client(d.run_dir) as a, Client(d.run_dir, timeout_s=3) as peer:
            attach_keys(a).alloc(4)
            attach_keys(peer)
            crash(d, a)
            assert gates.started(1)
            ran = []
            stats = d.handlers[MsgType.STATS]
            d.handlers[MsgType.STATS] = lambda *args: (ran.append(1), stats(*args))[1]
            t, _ = in_thread(peer.stats)
            helpers.wait_for(lambda: d.heavy.waiting_sessions(), what="the peer's STATS waiting")
            on_loop(d, lambda: setattr(d, "exit_code", 70))  # as _fatal sets it, before serve() stops
            gates.open_all()
            t.join(5)
            on_loop(d, lambda: setattr(d, "exit_code", 0))
            assert not ran


def test_a_failed_zero_write_stops_the_daemon_before_anyone_gets_those_blocks(monkeypatch):
    """The blocks are free once their client went; their zeros failing leaves them dirty:
    the daemon stops (exit code 70) rather than hand them out."""
    with helpers.serving_daemon(4 << 20) as d:
        d.engines.heavy_bytes = 1
        with Client(d.run_dir) as a, Client(d.run_dir, timeout_s=5) as peer:
            ba, bp = attach_keys(a), attach_keys(peer)
            space = d.engines.space("m")
            ma = ba.alloc(8)
            a.write(_rows(ma), np.full((LAY.num_layers, 8 * BS, LAY.row_bytes), 7, np.uint8))
            bp.alloc(8)
            monkeypatch.setattr(ZeroWrite, "__call__", lambda self: (_ for _ in ()).throw(MemoryError("boom")))
            crash(d, a)
            with pytest.raises(DaemonUnavailable):
                got = bp.alloc(8)
                assert not (space.pool[:, _rows(got)] == 7).any()  # (not reached: the daemon stops)
            d.thread.join(10)
            assert not d.thread.is_alive() and d.exit_code == 70 and "MemoryError: boom" in d.fatal_reason


def test_a_failed_zero_write_of_a_gone_clients_few_blocks_stops_the_daemon_too(monkeypatch):
    """Below heavy_bytes the zeros are written on the loop as the client is reaped: their
    failure stops the daemon as well (the reaper would only have logged it)."""
    with helpers.serving_daemon(4 << 20) as d:
        with Client(d.run_dir) as a, Client(d.run_dir, timeout_s=5) as peer:
            attach_keys(a).alloc(2)
            attach_keys(peer)
            monkeypatch.setattr(ZeroWrite, "__call__", lambda self: (_ for _ in ()).throw(MemoryError("boom")))
            crash(d, a)
            d.thread.join(10)
            assert not d.thread.is_alive() and d.exit_code == 70 and "MemoryError: boom" in d.fatal_reason


def test_a_client_gone_while_another_request_works_on_its_engine_is_detached_after_it(monkeypatch):
    """Found by a review: a client reaped while another session's heavy request ran on its
    engine (a cpu TOPK on a worker thread) was detached at once, dropping its freed
    blocks' hot copies from the other ranks on the loop while the worker resolved on
    them. It is detached when that request ends: its rank stays until then, and the other
    rank's copies of its rows are dropped after, not during."""
    from sparsekv.daemon import engine as engine_mod

    gate_in, gate_open, real = threading.Event(), threading.Event(), engine_mod.RankState.begin_step

    def held(self, step, *a, **kw):
        if step == 7:
            gate_in.set()
            assert gate_open.wait(20)
        return real(self, step, *a, **kw)

    monkeypatch.setattr(engine_mod.RankState, "begin_step", held)
    with helpers.serving_daemon(4 << 20) as d:
        with Client(d.run_dir) as a, Client(d.run_dir) as b:
            ba, _ = attach_keys(a), attach_keys(b)
            space = d.engines.space("m")
            mine = ba.alloc(2)
            a.write(_rows(mine), np.full((LAY.num_layers, 2 * BS, LAY.row_bytes), 7, np.uint8))
            ids = _rows(mine)[:LAY.top_k].astype(np.int32)[None, :]
            b.step(6, np.array([0], np.int32), np.array([True]))
            assert int(b.topk(6, 0, ids).misses.sum()) == LAY.top_k  # a's rows hot in b's region
            d.engine_requests.heavy_slots = 1  # b's next TOPK on a worker thread
            b.step(7, np.array([0], np.int32))
            got = {}
            t, box = in_thread(lambda: got.setdefault("misses", int(b.topk(7, 0, ids).misses.sum())))
            assert gate_in.wait(10)
            ranks = len(space.ranks)
            crash(d, a)
            assert on_loop(d, lambda: len(space.ranks)) == ranks == 2  # a's rank waits for b's request
            gate_open.set()
            t.join(10)
            assert box.get("v") == "ok" and got["misses"] == 0, (box, got)  # b's TOPK: before a's rows went
            assert on_loop(d, lambda: len(space.ranks)) == 1
            b.step(8, np.array([0], np.int32))
            assert int(b.topk(8, 0, ids).misses.sum()) == LAY.top_k  # a's freed blocks' copies: dropped
            assert not space.pool[:, _rows(mine)].any()


def test_a_failed_zero_write_of_a_request_whose_client_went_meanwhile_stops_the_daemon(monkeypatch):
    """Found by a review: a block release's zeros failing on the worker thread while its
    client was reaped were answered to nobody (Gone) and dropped: the blocks, free and
    dirty, went to the next client. The failure stops the daemon whoever asked."""
    entered, go = threading.Event(), threading.Event()

    def failing(self):
        entered.set()
        assert go.wait(20)
        raise MemoryError("boom")

    with helpers.serving_daemon(4 << 20) as d:
        d.block_requests.heavy_bytes = 1  # the release's zeros on a worker thread
        with Client(d.run_dir) as a, Client(d.run_dir, timeout_s=5) as peer:
            ba = attach_keys(a)
            attach_keys(peer)
            mine = ba.alloc(4)
            a.write(_rows(mine), np.full((LAY.num_layers, 4 * BS, LAY.row_bytes), 7, np.uint8))
            monkeypatch.setattr(ZeroWrite, "__call__", failing)
            t, _ = in_thread(lambda: ba.release(mine))
            assert entered.wait(10)
            crash(d, a)
            go.set()
            d.thread.join(10)
            assert not d.thread.is_alive() and d.exit_code == 70 and "MemoryError: boom" in d.fatal_reason
            t.join(10)
