"""Heavy requests run their slow part on a worker thread (daemon/heavy.py): a daemon
serving from a thread of this process (cpu backend), whose slow parts are held on an
Event, shows that other sessions are served meanwhile, that one session's replies stay in
order, that requests on an engine being written wait for the write, and that a failure,
a client killed mid-request or a daemon stopped mid-request leaves nothing behind.
Nothing here is timed: stalls are measured by tests/soak/stall.py."""

import contextlib
import os
import threading

import numpy as np
import pytest
import zmq

import helpers
from sparsekv.client import Client
from sparsekv.daemon import engine as engine_mod
from sparsekv.daemon import pool as pool_mod
from sparsekv.daemon import server as server_mod
from sparsekv.daemon.backends import CpuBackend
from sparsekv.daemon.pool import ALIGN_BYTES, INLINE_ZERO_BYTES
from sparsekv.daemon.residency.base import ResidencyError
from sparsekv.proto import ErrorCode, MsgType, decode, encode

MiB = 1 << 20
LAYOUT = helpers.layout()


class Gate:
    """Holds whoever calls ``wait`` until ``open``; ``entered`` says someone is held."""

    def __init__(self):
        self.entered, self._open = threading.Event(), threading.Event()

    def wait(self):
        self.entered.set()
        assert self._open.wait(30), "the gate was never opened"

    def open(self):
        self._open.set()


class GatedBackend(CpuBackend):
    """A cpu backend whose ranks of engine ``big`` are made only once the gate opens
    (``new_rank`` runs on the daemon's worker thread); ``fail``: then it raises (that
    exception, or TOO_LARGE)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate, self.fail = Gate(), False

    def new_rank(self, space, *a, **kw):
        if space.name == "big":
            self.gate.wait()
            if self.fail:
                raise self.fail if isinstance(self.fail, Exception) else \
                    ResidencyError("TOO_LARGE", "no room for the slab (injected)")
        return super().new_rank(space, *a, **kw)


@contextlib.contextmanager
def serving(pool_bytes=16 * MiB, backend_cls=GatedBackend):
    """A daemon on a GatedBackend serving a short run dir from a thread; stopped after
    (the gate opened first, so a held request cannot hang the stop)."""
    with helpers.serving_daemon(pool_bytes, backend_cls, before_stop=lambda d: d.backend.gate.open(), join_s=20,
                                reap_interval_s=0.1) as d:
        yield d
    assert "error" not in d.box, d.box


class Raw:
    """A DEALER speaking the protocol without waiting for replies (to pipeline)."""

    def __init__(self, run_dir: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"ipc://{os.path.join(run_dir, 'control.sock')}")
        self.next_id = 1

    def send(self, t, fields=None, arrays=None) -> int:
        req, self.next_id = self.next_id, self.next_id + 1
        self.sock.send_multipart(encode(t, req, fields, arrays))
        return req

    def recv(self, timeout_s: float = 10.0) -> dict | None:
        """The next reply's header, or None when none comes within ``timeout_s``."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return decode(self.sock.recv_multipart())[0]

    def call(self, t, fields=None, arrays=None) -> dict:
        req = self.send(t, fields, arrays)
        h = self.recv()
        assert h is not None and h["id"] == req, h
        return h

    def hello(self) -> dict:
        return self.call(MsgType.HELLO, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": "raw"})

    def close(self):
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def raw():
    socks = []

    def make(run_dir):
        r = Raw(run_dir)
        socks.append(r)
        return r

    yield make
    for r in socks:
        r.close()


def attached_client(run_dir: str, engine: str = "a") -> Client:
    """A client attached to ``engine``, filled, its step begun: ready for top-k."""
    c = Client(run_dir, name="other", timeout_s=10).connect()
    c.attach(LAYOUT, engine=engine)
    helpers.fill(c, LAYOUT)
    c.step(0, np.arange(2, dtype=np.int32), np.ones(2, bool))
    return c


def topk_ok(c: Client) -> None:
    r = c.topk(0, 0, np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int32))
    assert (np.asarray(r.slots) >= 0).all()


def nothing_left(d) -> bool:
    return (not d.engines and d.pool.used_bytes == 0 and not d.backend._slabs
            and not helpers.slab_memfds(d.run_dir, os.getpid()))


def test_others_are_served_while_an_attach_runs_and_its_session_is_answered_in_order(raw):
    with serving() as d:
        a = attached_client(d.run_dir)
        b = raw(d.run_dir)
        b.hello()
        ids = [b.send(MsgType.ATTACH, {"engine": "big", "layout": LAYOUT.to_wire()}),
               b.send(MsgType.STATS), b.send(MsgType.DETACH)]
        assert d.backend.gate.entered.wait(10)  # the attach's slow part is held
        for _ in range(3):  # another session: served meanwhile, every time
            topk_ok(a)
            assert a.stats()["clients"] == 2
        assert b.recv(timeout_s=0.2) is None  # B's STATS and DETACH wait behind its ATTACH
        d.backend.gate.open()
        replies = [b.recv() for _ in ids]
        assert [h["id"] for h in replies] == ids and all(h["ok"] for h in replies), replies
        assert "handles" in replies[0] and replies[2]["was_attached"] is True
        assert list(helpers.wait_for(lambda: list(d.engines) == ["a"] and list(d.engines), what="big released")) \
            == ["a"]
        a.close()


def test_a_failing_attach_rolls_back_off_the_loop_and_the_engine_can_be_attached_again(raw):
    with serving() as d:
        d.backend.fail = True
        b = raw(d.run_dir)
        b.hello()
        req = b.send(MsgType.ATTACH, {"engine": "big", "layout": LAYOUT.to_wire()})
        assert d.backend.gate.entered.wait(10)
        assert "big" in d.engines and d.pool.used_bytes > 0  # reserved while it runs
        d.backend.gate.open()
        h = b.recv()
        assert h["id"] == req and h["code"] == int(ErrorCode.TOO_LARGE) and "injected" in h["msg"], h
        assert helpers.wait_for(lambda: nothing_left(d), what="nothing left")
        snap = b.call(MsgType.STATS)["stats"]
        assert snap["errors_by_code"]["TOO_LARGE"] == 1  # counted like any request
        d.backend.fail = False
        assert b.call(MsgType.ATTACH, {"engine": "big", "layout": LAYOUT.to_wire()})["ok"]


class CUDARuntimeError(RuntimeError):
    """Shaped like CuPy's: a ``status`` attribute (700: illegal address, sticky)."""

    def __init__(self, status: int):
        super().__init__(f"cudaErrorIllegalAddress ({status})")
        self.status = status


def test_a_sticky_cuda_error_in_a_slow_part_is_answered_and_stops_the_daemon_with_70(raw):
    with serving() as d:
        d.backend.fail = CUDARuntimeError(700)
        d.backend.gate.open()
        b = raw(d.run_dir)
        b.hello()
        h = b.call(MsgType.ATTACH, {"engine": "big", "layout": LAYOUT.to_wire()})
        assert h["code"] == int(ErrorCode.INTERNAL) and "GPU context is lost" in h["msg"], h
        d.thread.join(10)
        assert not d.thread.is_alive() and d.exit_code == server_mod.EXIT_FATAL == 70


def test_an_attach_naming_an_engine_being_made_waits_for_it(raw):
    with serving() as d:
        b, c = raw(d.run_dir), raw(d.run_dir)
        b.hello(), c.hello()
        rb = b.send(MsgType.ATTACH, {"engine": "big", "layout": LAYOUT.to_wire()})
        assert d.backend.gate.entered.wait(10)
        rc = c.send(MsgType.ATTACH, {"engine": "big", "layout": helpers.layout(top_k=2).to_wire()})
        assert c.recv(timeout_s=0.2) is None  # no half-made engine to join
        d.backend.gate.open()
        assert b.recv()["id"] == rb
        h = c.recv()  # then it sees the engine, made, with its layout
        assert h["id"] == rc and h["code"] == int(ErrorCode.LAYOUT_MISMATCH), h


def test_requests_on_an_engine_wait_for_its_write_and_other_engines_are_served(raw, monkeypatch):
    gate, real = Gate(), engine_mod.EngineSpace.copy_rows

    def held_copy(self, layers, rows, src):
        if self.name == "w":
            gate.wait()
        real(self, layers, rows, src)

    monkeypatch.setattr(engine_mod.EngineSpace, "copy_rows", held_copy)
    with serving() as d:
        d.engine_requests.heavy_bytes = 0  # every write runs on the worker thread
        a = attached_client(d.run_dir)
        b, c = raw(d.run_dir), raw(d.run_dir)
        for r in (b, c):
            r.hello()
            assert r.call(MsgType.ATTACH, {"engine": "w", "layout": LAYOUT.to_wire()})["ok"]
        rows = np.arange(4, dtype=np.int32)
        data = np.full((LAYOUT.num_layers, 4, LAYOUT.row_bytes), 7, np.uint8)
        rw = b.send(MsgType.WRITE, {"layers": None}, {"rows": rows, "data": data})
        assert gate.entered.wait(10)
        rs = c.send(MsgType.STEP, {"step": 0}, {"state_rows": np.arange(2, dtype=np.int32)})  # another rank of "w"
        topk_ok(a)  # engine "a": served
        assert c.recv(timeout_s=0.2) is None  # no rank of "w" reads a half-written row
        gate.open()
        hw, hs = b.recv(), c.recv()
        assert hw["id"] == rw and hw["ok"] and hw["bytes"] == data.nbytes, hw
        assert hs["id"] == rs and hs["ok"], hs
        assert (d.engines.space("w").pool[:, :4] == 7).all()
        assert a.stats()["bytes_written"] >= data.nbytes  # counted
        a.close()


def test_a_client_killed_mid_attach_leaves_nothing(spawn_rank):
    with serving() as d:
        p = spawn_rank(d.run_dir, 0)
        p.call("connect")
        p.conn.send(("attach", {"layout": LAYOUT.to_wire(), "engine": "big"}))  # no answer awaited
        assert d.backend.gate.entered.wait(10)
        p.kill()
        helpers.wait_for(lambda: not d.sessions, what="the killed client reaped")
        assert "big" in d.engines  # its attach still runs: nothing is released under it
        d.backend.gate.open()
        assert helpers.wait_for(lambda: nothing_left(d), what="the attach rolled back")
        a = attached_client(d.run_dir, engine="big")  # the name and the room are free again
        topk_ok(a)
        a.close()


def test_a_client_killed_mid_write_keeps_its_engine_until_the_copy_is_done(spawn_rank, monkeypatch):
    gate, real = Gate(), engine_mod.EngineSpace.copy_rows

    def held_copy(self, *a):
        gate.wait()
        real(self, *a)

    monkeypatch.setattr(engine_mod.EngineSpace, "copy_rows", held_copy)
    with serving() as d:
        d.engine_requests.heavy_bytes = 0
        p = spawn_rank(d.run_dir, 0)
        p.call("connect")
        p.call("attach", layout=LAYOUT.to_wire(), engine="w")
        p.conn.send(("write", {"rows": [1, 2, 3]}))
        assert gate.entered.wait(10)
        p.kill()
        helpers.wait_for(lambda: not d.sessions, what="the killed client reaped")
        # Its engine's range is neither released nor zeroed while the copy writes into it.
        assert "w" in d.engines and d.pool.used_bytes > 0 and d.pool.zeroing_bytes == 0
        gate.open()
        assert helpers.wait_for(lambda: nothing_left(d), what="the rank released after the copy")
        assert d.stats.c["rows_written"] == 3 * LAYOUT.num_layers  # written, though answered to nobody


def test_a_client_killed_mid_heavy_topk_has_its_rows_counted(spawn_rank, monkeypatch):
    """Found by a review of the counters: a TOPK on a worker thread whose client died meanwhile
    was not counted (batch, misses, rows moved), though its resolve and gather had run."""
    gate, real = Gate(), engine_mod.RankState.resolve_and_gather

    def held(self, *a, **kw):
        gate.wait()
        return real(self, *a, **kw)

    monkeypatch.setattr(engine_mod.RankState, "resolve_and_gather", held)
    with serving() as d:
        d.engine_requests.heavy_slots = 1  # every TOPK on a worker thread
        p = spawn_rank(d.run_dir, 0)
        p.call("connect")
        p.call("attach", layout=LAYOUT.to_wire(), engine="t")
        p.call("fill")
        before = dict(d.stats.c)
        p.conn.send(("topk", {"step": 0, "group": 0, "topk": np.array([[1, 2, 3, 4]], np.int32),
                              "state_rows": np.array([0], np.int32)}))
        assert gate.entered.wait(10)
        p.kill()
        helpers.wait_for(lambda: not d.sessions, what="the killed client reaped")
        gate.open()
        assert helpers.wait_for(lambda: nothing_left(d), what="the rank released after the top-k")
        grew = {k: d.stats.c[k] - before.get(k, 0) for k in ("topk_batches", "misses", "rows_moved")}
        assert grew == {"topk_batches": 1, "misses": 4, "rows_moved": 4 * len(LAYOUT.groups[0])}, grew


def test_a_daemon_stopped_mid_attach_waits_for_it_then_leaves_nothing(raw):
    with serving() as d:
        a = attached_client(d.run_dir)
        b = raw(d.run_dir)
        b.hello()
        b.send(MsgType.ATTACH, {"engine": "big", "layout": LAYOUT.to_wire()})
        assert d.backend.gate.entered.wait(10)
        d.call_soon(d.stop)
        d.thread.join(0.3)
        assert d.thread.is_alive()  # the slow part is never interrupted: the stop waits for it
        d.backend.gate.open()
        d.thread.join(20)
        assert not d.thread.is_alive() and "error" not in d.box and d.exit_code == 0
        a.close()  # its own mapping of its slab (it runs in this process)
        assert not d.sessions and nothing_left(d)
        assert not os.path.exists(d.control_path)


def test_an_attach_that_must_wait_for_zeroing_waits_off_the_loop(raw, monkeypatch):
    gate, real = Gate(), pool_mod._zero

    def held_zero(address, nbytes):
        gate.wait()
        real(address, nbytes)

    big = helpers.layout(row_bytes=4096, host_rows=2 * INLINE_ZERO_BYTES // (2 * 4096))  # zeroed by threads
    assert big.pool_bytes > INLINE_ZERO_BYTES
    with serving(pool_bytes=big.pool_bytes + 2 * ALIGN_BYTES) as d:
        a = attached_client(d.run_dir)  # takes the rest of the pool
        b = raw(d.run_dir)
        b.hello()
        assert b.call(MsgType.ATTACH, {"engine": "z", "layout": big.to_wire()})["ok"]
        monkeypatch.setattr(pool_mod, "_zero", held_zero)
        assert b.call(MsgType.DETACH)["was_attached"]  # its range is zeroed, held
        assert gate.entered.wait(10)
        req = b.send(MsgType.ATTACH, {"engine": "z2", "layout": big.to_wire()})  # fits only once zeroed
        topk_ok(a)  # the loop does not wait for the zeroing
        assert b.recv(timeout_s=0.2) is None
        gate.open()
        h = b.recv()
        assert h["id"] == req and h["ok"], h
        a.close()


class ThreadsBackend(GatedBackend):
    """Records the thread of each call, making ranks on the loop's thread after a
    prepare_rank (as the cuda backend: pinning off the loop, device work on it)."""

    new_rank_on_loop = True

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.threads = {}

    def prepare_rank(self, space, *a, **kw):
        self.threads["prepare_rank"] = threading.current_thread()

    def new_rank(self, space, *a, **kw):
        self.threads["new_rank"] = threading.current_thread()
        return super().new_rank(space, *a, **kw)


def test_a_backend_that_makes_ranks_on_the_loop_prepares_them_on_a_worker_thread():
    with serving(backend_cls=ThreadsBackend) as d:
        a = attached_client(d.run_dir)
        topk_ok(a)
        assert d.backend.threads["new_rank"] is d.thread  # the loop's thread
        assert d.backend.threads["prepare_rank"].name.startswith("heavy")  # not the loop's
        a.close()


def _call(r: Raw, t, fields=None, arrays=None) -> tuple[dict, dict]:
    """A request and its reply's (header, arrays)."""
    req = r.send(t, fields, arrays)
    assert r.sock.poll(10000)
    h, out = decode(r.sock.recv_multipart())
    assert h["id"] == req and h["ok"], h
    return h, out


def warm_session(raw, run_dir: str):
    """A raw session of engine "w" whose step 6 has put rows 5-8 and 1-4 in its two
    regions; (session, state rows, that top-k)."""
    b = raw(run_dir)
    b.hello()
    _call(b, MsgType.ATTACH, {"engine": "w", "layout": LAYOUT.to_wire()})
    rows, topk = np.arange(2, dtype=np.int32), np.array([[5, 6, 7, 8], [1, 2, 3, 4]], np.int32)
    _call(b, MsgType.STEP, {"step": 6}, {"state_rows": rows})
    assert _call(b, MsgType.TOPK, {"step": 6, "group": 0}, {"topk": topk})[0]["hits"] == 0
    return b, rows, topk


def held_off_the_loop(d, a: Client, b, gate: Gate, threads: list, first: int, topk_req: int) -> dict:
    """``b``'s request ``first`` is held at ``gate`` on a worker thread, not the loop's:
    engine "a"'s client is served meanwhile while ``b``'s replies wait; once the gate
    opens, ``first``'s reply (returned), then that of TOPK ``topk_req`` (the warm top-k
    again), which saw row 5's copy gone and every other row hit."""
    assert gate.entered.wait(10) and threads[0] is not d.thread
    topk_ok(a)
    assert b.recv(timeout_s=0.2) is None
    gate.open()
    h = b.recv()
    assert h["id"] == first and h["ok"], h
    assert b.sock.poll(10000)
    ht, out = decode(b.sock.recv_multipart())
    assert ht["id"] == topk_req and ht["ok"] and ht["hits"] == 7 and out["misses"].tolist() == [1, 0], (ht, out)
    return h


def test_a_heavy_cpu_step_runs_off_the_loop_and_its_sessions_topk_waits_for_it(raw, monkeypatch):
    """Found by an adversarial review: one STEP invalidating 2,048 rows in each of 4,096
    regions held every client (and the stats socket) for 3-9 s on the loop. From
    ``heavy_slots`` of host work on it runs on a worker thread: another engine's client is
    served meanwhile, and the session's TOPK after it waits and sees its invalidation."""
    gate, real, threads = Gate(), engine_mod.RankState.begin_step, []

    def held(self, step, *a, **kw):
        if step == 7:
            threads.append(threading.current_thread())
            gate.wait()
        return real(self, step, *a, **kw)

    monkeypatch.setattr(engine_mod.RankState, "begin_step", held)
    with serving() as d:
        d.engine_requests.heavy_slots = 1  # every STEP with invalidations is heavy
        a = attached_client(d.run_dir)
        b, rows, topk = warm_session(raw, d.run_dir)
        inv = np.array([[5], [-1]], np.int32)  # row 5 rewritten: batch row 0's copy goes
        rs = b.send(MsgType.STEP, {"step": 7}, {"state_rows": rows, "invalidate": inv})
        rt = b.send(MsgType.TOPK, {"step": 7, "group": 0}, {"topk": topk})
        held_off_the_loop(d, a, b, gate, threads, rs, rt)
        assert a.stats()["steps"] >= 3
        a.close()


def test_a_heavy_cpu_topk_prefetches_before_its_sessions_next_request(monkeypatch):
    """A TOPK run on a worker thread (every one here) runs its prefetch there too, before
    its reply and so before the session's next TOPK reaches the rank: the misses of every
    group equal those of the same steps served on the loop."""
    real, threads = engine_mod.RankState.run_prefetch, []

    def recorded(self):
        threads.append(threading.current_thread())
        return real(self)

    monkeypatch.setattr(engine_mod.RankState, "run_prefetch", recorded)
    groups = ((0,), (1,), (2,))
    lay = helpers.layout(num_layers=3, top_k=4, region_stride=8, max_reqs=2, host_rows=64, index_groups=groups)
    rng = np.random.default_rng(4)
    results = []
    for slots in (1, 1 << 40):  # every TOPK on a worker thread, then none
        with serving() as d, Client(d.run_dir, name="pf", timeout_s=10) as c:
            d.engine_requests.heavy_slots = slots
            c.attach(lay, engine="pf", prefetch=True)
            helpers.fill(c, lay)
            misses = []
            for t in range(4):
                c.step(t, [0, 1])
                base = np.stack([rng.choice(64, 4, replace=False) for _ in range(2)]).astype(np.int32)
                for g in range(3):
                    misses.append(int(c.topk(t, g, base).misses.sum()))
            results.append((misses, c.stats()["prefetch_hits"]))
            ran = [t is not d.thread for t in threads]  # (d.thread: the daemon's loop)
            threads.clear()
            assert ran and set(ran) == {slots == 1}, ran  # heavy: every one on a worker; else every one on the loop
        rng = np.random.default_rng(4)
    assert results[0] == results[1] and results[0][1] > 0, results


def test_a_tp_ranks_step_stays_on_the_loop_whatever_its_size():
    """Found by a review: a TP rank's work on a worker thread raced the uid's TP ledger
    (shared by its engines) and its peers' leaving (on the loop): it is never heavy."""
    from types import SimpleNamespace

    from sparsekv.daemon.engine_requests import EngineRequests

    er = EngineRequests.__new__(EngineRequests)
    er.heavy_slots = 1
    lay = SimpleNamespace(num_groups=2, region_stride=8)
    rows, inv = np.arange(2, dtype=np.int32), np.zeros((2, 1), np.int32)
    plain = SimpleNamespace(host_memory=True, tp=None, residency=SimpleNamespace(layout=lay))
    assert er._host_heavy(plain, rows, None, inv)
    assert not er._host_heavy(SimpleNamespace(host_memory=True, tp=object(), residency=plain.residency), rows, None, inv)
    assert not er._host_heavy(SimpleNamespace(host_memory=False, tp=None, residency=plain.residency), rows, None, inv)


def test_a_narrow_topk_counts_the_regions_its_batch_rows_scan():
    """Found by an adversarial review: a TOPK of 4,096 rows of one id each in regions of
    32,768 slots is 4,096 ids but 134M region slots sorted; counted by its ids it ran on
    the loop and held every client 1.5 s. Its estimate counts each batch row's region."""
    from types import SimpleNamespace

    from sparsekv.daemon.engine_requests import EngineRequests

    er = EngineRequests.__new__(EngineRequests)
    er.heavy_slots = 1 << 20
    wide = SimpleNamespace(host_memory=True, tp=None,
                           residency=SimpleNamespace(layout=SimpleNamespace(num_groups=1, region_stride=32768)))
    narrow = np.zeros((4096, 1), np.int32)
    assert er._host_heavy(wide, None, None, None, narrow)  # 4,096 × 32,768 slots
    assert not er._host_heavy(wide, None, None, None, narrow[:31])  # 31 × 32,769 < 1M
    assert er._host_heavy(wide, None, None, None, narrow[:32])  # 32 × 32,769 ≥ 1M
    small = SimpleNamespace(host_memory=True, tp=None,
                            residency=SimpleNamespace(layout=SimpleNamespace(num_groups=1, region_stride=8)))
    assert not er._host_heavy(small, None, None, None, np.zeros((64, 4), np.int32))
    assert er._host_heavy(small, None, None, None, np.zeros(1 << 20, np.int32).reshape(1 << 18, 4))


def test_a_small_write_whose_drop_scans_much_state_runs_off_the_loop(raw, monkeypatch):
    """Found by an adversarial review: a one-row WRITE to an engine of 128M cpu slots
    scanned them all on the loop (0.8 s held every client). From ``heavy_slots`` of state
    the copy and the drop of hot copies run on a worker thread holding the engine: another
    engine's client is served meanwhile, the writer's next TOPK waits and misses the row."""
    gate, real, threads = Gate(), engine_mod.EngineSpace.drop_rewritten, []

    def held(self, rows):
        if self.name == "w":
            threads.append(threading.current_thread())
            gate.wait()
        return real(self, rows)

    monkeypatch.setattr(engine_mod.EngineSpace, "drop_rewritten", held)
    with serving() as d:
        a = attached_client(d.run_dir)
        d.engine_requests.heavy_slots = LAYOUT.num_groups * LAYOUT.max_reqs * LAYOUT.region_stride  # one rank's
        b, rows, topk = warm_session(raw, d.run_dir)
        data = np.full((1, 1, LAYOUT.row_bytes), 9, np.uint8)  # 1 row: far below heavy_bytes
        rw = b.send(MsgType.WRITE, {"layers": [0]}, {"rows": np.array([5], np.int32), "data": data})
        rt = b.send(MsgType.TOPK, {"step": 6, "group": 0}, {"topk": topk})
        assert held_off_the_loop(d, a, b, gate, threads, rw, rt)["invalidated"] == 1
        a.close()
    threads.clear()
    with serving() as d:  # below heavy_slots: on the loop
        d.engine_requests.heavy_slots = 1 << 40
        c = attached_client(d.run_dir, engine="w")
        gate.open()
        c.write(np.array([5], np.int32), np.zeros((LAYOUT.num_layers, 1, LAYOUT.row_bytes), np.uint8))
        assert threads and set(threads) == {d.thread}
        c.close()


def test_a_large_write_to_a_tp_group_copies_off_the_loop_and_drops_on_it(monkeypatch):
    """Found by a review: a write of heavy_bytes ran its drop on the worker thread with its
    copy, also where the drop must stay on the loop (a TP group's shared state, a cuda
    rank's kernel: ``drop_scan_slots`` 0). The copy goes; the drop stays."""
    real_copy, real_drop, where = engine_mod.EngineSpace.copy_rows, engine_mod.EngineSpace.drop_rewritten, {}

    def copy(self, *a):
        where["copy"] = threading.current_thread()
        return real_copy(self, *a)

    def drop(self, rows):
        where["drop"] = threading.current_thread()
        return real_drop(self, rows)

    monkeypatch.setattr(engine_mod.EngineSpace, "copy_rows", copy)
    monkeypatch.setattr(engine_mod.EngineSpace, "drop_rewritten", drop)
    with serving() as d, Client(d.run_dir, rank=0) as c0, Client(d.run_dir, rank=1) as c1:
        for c in (c0, c1):
            c.attach(LAYOUT, engine="t", tp_size=2)
        assert d.engines.space("t").drop_scan_slots() == 0
        d.engine_requests.heavy_bytes, d.engine_requests.heavy_slots = 1, 1
        c0.write(np.array([3], np.int32), np.ones((LAYOUT.num_layers, 1, LAYOUT.row_bytes), np.uint8))
        assert where["copy"] is not d.thread and where["drop"] is d.thread


@pytest.mark.parametrize("off_loop", [False, True])
def test_a_write_whose_hot_copies_cannot_be_dropped_stops_the_daemon(monkeypatch, off_loop):
    """Found by a review: a drop that raised after the copy answered INTERNAL and served on,
    a rank still hitting the rewritten row's stale copy. It stops the daemon (exit 70),
    on the loop or on the worker thread."""
    real, armed = engine_mod.EngineSpace.drop_rewritten, []

    def failing(self, rows):
        if armed:
            raise MemoryError("boom")
        return real(self, rows)

    monkeypatch.setattr(engine_mod.EngineSpace, "drop_rewritten", failing)
    with serving() as d:
        d.engine_requests.heavy_slots = 1 if off_loop else 1 << 40
        c = attached_client(d.run_dir, engine="w")
        armed.append(True)
        with pytest.raises(Exception, match="dropping the hot copies of rewritten or freed rows failed: MemoryError"):
            c.write(np.array([3], np.int32), np.zeros((LAYOUT.num_layers, 1, LAYOUT.row_bytes), np.uint8))
        d.thread.join(10)
        assert not d.thread.is_alive() and d.exit_code == 70 and "MemoryError: boom" in d.fatal_reason
        c.close()
