"""The doorbell transport and the engine's handle (client/doorbell.py) on the GPU: every
index ``swap_in`` returns equals the cpu backend's slot for that column (through the same
contract), every row it points at holds its host row's bytes, a whole decode step
captures into one CUDA graph, a killed daemon never hangs the engine's stream.

Marked ``cuda`` except the last tests (refusals a cpu daemon gives).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from sparsekv.client import BadRequest, Client
from sparsekv.client.errors import DaemonUnavailable
from sparsekv.embedded.inproc import InprocClient
from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.bench.verify import fill_pool, pattern
from sparsekv.proto import ErrorCode, Layout, MsgType
from sparsekv.proto.positions import host_rows as map_positions
from sparsekv.proto.settings import TEST_DAEMON_LOG

ARENA = ["--device-arena-size", "2GiB"]
DAEMON_LOG = TEST_DAEMON_LOG.get() or None
BLOCK = 16


def layout(**kw) -> Layout:
    base = dict(num_layers=3, row_bytes=656, top_k=64, region_stride=128, max_reqs=8, host_rows=8 * 1024,
                index_groups=((0, 1), (2,)), max_batch=8)
    base.update(kw)
    return Layout(**base).validate()


def steps(lay: Layout, n: int, seed: int = 0, positions: bool = False, spec: bool = False):
    """Decode steps: (state_rows, reset, invalidate, req_ids, topk per group, block table).
    Requests 0..5 live throughout (request 5 restarts at step n // 2); padding token at
    the end; with ``spec`` request 1 has two tokens. Positional: each request's context
    is 40 blocks of BLOCK rows from its own host range, shuffled, block 7 is null."""
    rng = np.random.default_rng(seed)
    span = lay.host_rows // lay.max_reqs
    table = np.full((lay.max_reqs, 48), -1, np.int32)
    for r in range(lay.max_reqs):
        blocks = rng.permutation(span // BLOCK)[:40] + r * span // BLOCK
        table[r, :40] = blocks
        table[r, 7] = -1
    out = []
    prev = {}
    for t in range(n):
        reqs = [0, 1, 2, 3, 4, 5]
        state = np.array(reqs + [-1], np.int32)
        reset = np.zeros(len(state), bool)
        if t == 0:
            reset[:6] = True
        if t == n // 2:
            reset[5] = True
        inval = np.full((len(state), 2), -1, np.int32)
        inval[2, 0] = 2 * span + int(rng.integers(0, 200))
        tok = reqs + ([1] if spec else []) + [-1]
        req_ids = np.array(tok, np.int32)
        per_group = []
        for g in range(lay.num_groups):
            rows = np.full((len(tok), lay.top_k), -1, np.int32)
            for i, r in enumerate(tok):
                if r < 0:
                    rows[i] = rng.integers(-3, 50, lay.top_k)  # junk on a padding token
                    continue
                hi = 40 * BLOCK if positions else 600
                keep = prev.get((g, i))
                fresh = rng.permutation(hi)[: lay.top_k]
                if keep is not None:
                    fresh = np.concatenate([keep[: lay.top_k // 2], np.setdiff1d(fresh, keep[: lay.top_k // 2])])
                    fresh = fresh[: lay.top_k]
                prev[(g, i)] = fresh
                ids = fresh.astype(np.int32)
                if not positions:
                    ids = ids + r * span
                ids = ids.copy()
                ids[rng.integers(0, lay.top_k)] = -1 if not positions else 40 * BLOCK + 5  # none / past table
                rows[i] = ids
            per_group.append(rows)
        out.append((state, reset, inval, req_ids, per_group, table if positions else None))
    return out


def reference(lay: Layout, plan, positions: bool):
    """Expected indices per (step, layer) from the cpu backend in process."""
    S = lay.region_stride
    want = []
    with InprocClient(backend="cpu") as c:
        c.attach(lay, engine="ref")
        for t, (state, reset, inval, req, per_group, table) in enumerate(plan):
            c.step(t, state, reset, inval)
            by_layer = {}
            for g, layers in enumerate(lay.groups):
                ids = per_group[g]
                if positions:
                    rows_table = np.where(req[:, None] >= 0, table[np.maximum(req, 0)], -1)
                    ids = map_positions(ids, rows_table, BLOCK)
                r = c.topk(t, g, ids, state_rows=req)
                slots = np.asarray(r.slots)
                idx = np.where((slots >= 0) & (req[:, None] >= 0), req[:, None] * S + slots, -1).astype(np.int32)
                for layer in layers:
                    by_layer[layer] = (idx, ids)
            want.append(by_layer)
    return want


@pytest.fixture
def cuda_daemon():
    lay = layout()
    with PrivateDaemon(pool_bytes=lay.pool_bytes + (8 << 20), backend="cuda", extra_args=ARENA,
                       log_path=DAEMON_LOG) as d:
        yield d


def attach(run_dir, lay, fill=True, engine="db"):
    c = Client(run_dir, name="doorbell-test", device="cuda:0").connect()
    c.attach(lay, engine=engine, transport="doorbell")
    if fill:
        fill_pool(c, lay)
    h = c.doorbell_handle()
    assert h._bells_local is True  # a rank of no TP group: only this GPU's stream waits on its bells
    return c, h


def dev(a, torch):
    return torch.as_tensor(np.ascontiguousarray(a)).cuda()


def check_layer(h, lay, want, t, layer, idx, torch):
    """Step ``t``'s indices of ``layer`` (host array) equal the cpu backend's, and every
    one points at its host row's bytes."""
    exp, ids = want[t][layer]
    np.testing.assert_array_equal(idx, exp, err_msg=f"step {t} layer {layer}")
    check_bytes(h, lay, idx, ids, layer, torch)
    return exp


def check_bytes(h, lay, idx, ids, layer, torch):
    """Every index >= 0 points at its host row's bytes."""
    ok = idx >= 0
    if not ok.any():
        return
    got = h.kv(layer)[torch.as_tensor(idx[ok]).long().cuda()].cpu().numpy()
    np.testing.assert_array_equal(got, pattern(layer, ids[ok], lay.row_bytes))


@pytest.mark.cuda
@pytest.mark.parametrize("positions,spec,few", [(False, False, False), (True, False, False), (True, True, False),
                                               (True, False, True)])
def test_swap_in_equals_the_cpu_backend_and_rows_hold_their_bytes(cuda_daemon, positions, spec, few):
    """``few``: 3 tokens a layer (requests 0-2), so each skv_db_indices polls its ready
    word itself (client/doorbell.py POLL_TOKENS); else 7 or 8, the stream waits."""
    import torch

    lay = layout()
    plan = steps(lay, 12, seed=3, positions=positions, spec=spec)
    if few:
        plan = [(st, rs, iv, req[:3], [g[:3] for g in pg], tb) for st, rs, iv, req, pg, tb in plan]
    want = reference(lay, plan, positions)
    c, h = attach(cuda_daemon.run_dir, lay)
    try:
        for t, (state, reset, inval, req, per_group, table) in enumerate(plan):
            h.begin_step(dev(state, torch), dev(reset, torch), dev(inval, torch))
            for g, layers in enumerate(lay.groups):
                for layer in layers:
                    idx, valid = h.swap_in(dev(req, torch), None if table is None else dev(table, torch),
                                           dev(per_group[g], torch), layer=layer, block_size=BLOCK,
                                           return_valid_counts=True)
                    torch.cuda.synchronize()
                    exp = check_layer(h, lay, want, t, layer, idx.cpu().numpy(), torch)
                    np.testing.assert_array_equal(valid.cpu().numpy(), (exp >= 0).sum(1))
            h.check()
    finally:
        h.close()
        c.close()


def run_steps(h, lay, plan, want, ts, torch):
    """Steps ``ts`` of ``plan`` through handle ``h``, each layer's indices checked."""
    for t in ts:
        state, reset, inval, req, per_group, _table = plan[t]
        h.begin_step(dev(state, torch), dev(reset, torch), dev(inval, torch))
        for g, layers in enumerate(lay.groups):
            for layer in layers:
                idx = h.swap_in(dev(req, torch), None, dev(per_group[g], torch), layer=layer)
                torch.cuda.synchronize()
                check_layer(h, lay, want, t, layer, idx.cpu().numpy(), torch)
        h.check()


def held(stats) -> tuple[int, int]:
    a = stats["arenas"]["cuda:0"]
    return a["deferred_frees"], a["deferred_free_bytes"]


@pytest.mark.cuda
def test_a_detach_beside_a_parked_doorbell_rank_returns_and_its_frees_wait_for_the_last_one():
    """Two engines' doorbell ranks on one GPU: B's stream is parked on its next bell while
    A detaches. A's detach replies (unregistering A's pinned blocks would wait for B's
    stream: they are kept, counted in the stats), B's steps stay exact after it; A
    restarted takes A's old blocks (zeroed) and its steps are exact too; once both detach
    nothing is held."""
    lay = layout()
    plan = steps(lay, 8, seed=5)
    want = reference(lay, plan, positions=False)
    with PrivateDaemon(pool_bytes=2 * lay.pool_bytes + (8 << 20), backend="cuda", extra_args=ARENA,
                       log_path=DAEMON_LOG) as d:
        two_engines_one_detaching(d, lay, plan, want)


def two_engines_one_detaching(cuda_daemon, lay, plan, want):
    import torch

    ca, ha = attach(cuda_daemon.run_dir, lay, engine="a")
    cb, hb = attach(cuda_daemon.run_dir, lay, engine="b")
    try:
        run_steps(ha, lay, plan, want, range(2), torch)
        run_steps(hb, lay, plan, want, range(4), torch)  # B's stream now waits on step 4's bell
        t0 = time.monotonic()
        ca.detach()  # a reply, or the client's timeout raises
        assert time.monotonic() - t0 < 10
        frees, nbytes = held(cb.stats())
        assert frees >= 1 and nbytes > 0
        run_steps(hb, lay, plan, want, range(4, 8), torch)
        ca2, ha2 = attach(cuda_daemon.run_dir, lay, engine="a")  # A restarted: same owner, GPU, size
        try:
            assert held(cb.stats())[0] == frees - 1  # A's spare blocks taken, not new ones registered
            run_steps(ha2, lay, plan, want, range(8), torch)
        finally:
            ha2.close()
            ca2.close()
        cb.detach()
        with Client(cuda_daemon.run_dir, name="doorbell-test-stats").connect() as cs:
            assert held(cs.stats()) == (0, 0)
    finally:
        for h, c in ((ha, ca), (hb, cb)):
            h.close()
            c.close()


@pytest.mark.cuda
@pytest.mark.parametrize("few", [False, True])
def test_a_whole_decode_step_captures_into_one_cuda_graph(few):
    """The engine's whole step (its kernels ringing the bells, the waits for the ready
    words the daemon's gathers set) captures and replays exactly: 7 tokens a layer (the
    stream waits, then skv_db_indices), or with ``few`` 3 (skv_db_indices polls)."""
    import torch

    lay = layout()
    plan = steps(lay, 10, seed=5, positions=True)
    if few:
        plan = [(st, rs, iv, req[:3], [g[:3] for g in pg], tb) for st, rs, iv, req, pg, tb in plan]
    want = reference(lay, plan, True)
    with PrivateDaemon(pool_bytes=lay.pool_bytes + (8 << 20), backend="cuda", extra_args=ARENA,
                       log_path=DAEMON_LOG) as d:
        _capture_and_replay(d, lay, plan, want, torch)


def _capture_and_replay(d, lay, plan, want, torch):
    c, h = attach(d.run_dir, lay)
    state, reset, inval, req, per_group, table = plan[0]
    s_state, s_reset, s_inval, s_req = (dev(x, torch) for x in (state, reset, inval, req))
    s_table = dev(table, torch)
    s_topk = [dev(x, torch) for x in per_group]
    outs = {layer: torch.empty((len(req), lay.top_k), dtype=torch.int32, device="cuda") for layer in range(3)}

    def one_step():
        h.begin_step(s_state, s_reset, s_inval)
        for g, layers in enumerate(lay.groups):
            for layer in layers:
                h.swap_in(s_req, s_table, s_topk[g], layer=layer, block_size=BLOCK, attention_indices_out=outs[layer])

    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # global capture mode: any sync or readback fails it
            one_step()
        for t, (state, reset, inval, req, per_group, table) in enumerate(plan):
            for dst, src in ((s_state, state), (s_reset, reset), (s_inval, inval), (s_req, req), (s_table, table)):
                dst.copy_(torch.as_tensor(src))
            for g in range(lay.num_groups):
                s_topk[g].copy_(torch.as_tensor(per_group[g]))
            graph.replay()
            torch.cuda.synchronize()
            for layer in range(3):
                check_layer(h, lay, want, t, layer, outs[layer].cpu().numpy(), torch)
        h.check()
    finally:
        h.close()
        c.close()


@pytest.mark.cuda
def test_duplicate_positions_are_refused_and_check_raises_them():
    import torch

    lay = layout(index_groups=((0, 1, 2),))
    with PrivateDaemon(pool_bytes=lay.pool_bytes + (8 << 20), backend="cuda", extra_args=ARENA,
                       log_path=DAEMON_LOG) as d:
        c, h = attach(d.run_dir, lay, fill=False)
        try:
            state = np.array([0, 1], np.int32)
            topk = np.tile(np.arange(lay.top_k, dtype=np.int32), (2, 1))
            topk[1, 5] = topk[1, 6]  # row 1 names host row 6 twice
            h.begin_step(dev(state, torch), dev(np.ones(2, bool), torch))
            idx = [h.swap_in(dev(state, torch), None, dev(topk, torch), layer=layer) for layer in range(3)]
            torch.cuda.synchronize()
            with pytest.raises(BadRequest) as e:
                h.check()
            assert e.value.code == ErrorCode.DUPLICATE_IDS
            assert "batch row 1" in str(e.value)
            assert (idx[0][1] == -1).all().item() and (idx[0][0] >= 0).all().item()
            h.check()  # reported once
        finally:
            h.close()
            c.close()


@pytest.mark.cuda
def test_a_killed_daemon_releases_the_engine_stream_and_check_says_so():
    import torch

    lay = layout()
    d = PrivateDaemon(pool_bytes=lay.pool_bytes + (8 << 20), backend="cuda", extra_args=ARENA, log_path=DAEMON_LOG)
    with d:
        c, h = attach(d.run_dir, lay, fill=False)
        plan = steps(lay, 2, seed=1)
        state, reset, inval, req, per_group, _ = plan[0]
        h.begin_step(dev(state, torch), dev(reset, torch))
        for g, layers in enumerate(lay.groups):
            for layer in layers:
                h.swap_in(dev(req, torch), None, dev(per_group[g], torch), layer=layer)
        torch.cuda.synchronize()
        h.check()
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait(10)
        # The next step waits on ready words nobody will set, unless the handle does.
        state, reset, inval, req, per_group, _ = plan[1]
        h.begin_step(dev(state, torch), None)
        last = None
        for g, layers in enumerate(lay.groups):
            for layer in layers:
                last = h.swap_in(dev(req, torch), None, dev(per_group[g], torch), layer=layer)
        done = threading.Event()
        t0 = time.monotonic()
        threading.Thread(target=lambda: (torch.cuda.synchronize(), done.set()), daemon=True).start()
        assert done.wait(20), "the engine's stream still waits on the dead daemon"
        released_s = time.monotonic() - t0
        with pytest.raises(DaemonUnavailable):
            h.check()
        assert (last == -1).all().item()  # nothing points at rows nobody gathered
        print(f"stream released {released_s * 1e3:.0f} ms after the wait began")
        h.close()
        c._sock = None  # the daemon is gone: nothing to say goodbye to
        c.close()


@pytest.mark.cuda
def test_an_interrupted_step_is_finished_and_the_next_step_reads_fresh_rows(cuda_daemon):
    """A step broken off after its first layer (an exception in the engine's model): the
    next begin_step is refused (a skipped layer's ready word would release it one step
    early: rows of the previous step); finish_step ends it; the step after is exact."""
    import torch

    from sparsekv.client.errors import NotAttached

    lay = layout()
    plan = steps(lay, 3, seed=7)
    # The cpu reference: step 1 resolves group 0 only (finish_step rings group 1 empty).
    want = {}
    with InprocClient(backend="cpu") as ref:
        ref.attach(lay, engine="ref")
        for t, (state, reset, inval, req, per_group, _) in enumerate(plan):
            ref.step(t, state, reset, inval)
            for g, layers in enumerate(lay.groups):
                if t == 1 and g > 0:
                    break
                slots = np.asarray(ref.topk(t, g, per_group[g], state_rows=req).slots)
                idx = np.where((slots >= 0) & (req[:, None] >= 0), req[:, None] * lay.region_stride + slots, -1)
                for layer in layers:
                    want[t, layer] = (idx.astype(np.int32), per_group[g])
    c, h = attach(cuda_daemon.run_dir, lay)
    try:
        for t, (state, reset, inval, req, per_group, _) in enumerate(plan):
            h.begin_step(dev(state, torch), dev(reset, torch), dev(inval, torch))
            for g, layers in enumerate(lay.groups):
                for layer in layers:
                    if t == 1 and layer > 0:
                        continue
                    idx = h.swap_in(dev(req, torch), None, dev(per_group[g], torch), layer=layer)
                    torch.cuda.synchronize()
                    exp, ids = want[t, layer]
                    np.testing.assert_array_equal(idx.cpu().numpy(), exp, err_msg=f"step {t} layer {layer}")
                    check_bytes(h, lay, exp, ids, layer, torch)
                    if t == 1:
                        with pytest.raises(BadRequest, match="twice"):
                            h.swap_in(dev(req, torch), None, dev(per_group[g], torch), layer=layer)
            if t == 1:
                with pytest.raises(BadRequest, match=r"not complete .*layers 1-2 without swap_in"):
                    h.begin_step(dev(state, torch))
                h.finish_step()
                torch.cuda.synchronize()
        h.check()
        c.detach()
        with pytest.raises(NotAttached, match="closed"):
            h.begin_step(dev(plan[0][0], torch))
    finally:
        c.close()


@pytest.mark.cuda
def test_the_handle_refuses_bad_arguments_before_anything_runs(cuda_daemon):
    import torch

    lay = layout()
    c, h = attach(cuda_daemon.run_dir, lay)
    try:
        state, reset, inval, req, per_group, table = steps(lay, 1, seed=2, positions=True)[0]
        with pytest.raises(BadRequest, match="begin_step"):
            h.swap_in(dev(req, torch), None, dev(per_group[0], torch), layer=0)
        wide = np.full((len(state), h.inv_cap + 1), -1, np.int32)
        with pytest.raises(BadRequest, match=f"at most {h.inv_cap}") as e:
            h.begin_step(dev(state, torch), None, dev(wide, torch))
        assert e.value.code == ErrorCode.TOO_LARGE
        h.begin_step(dev(state, torch), dev(reset, torch))
        with pytest.raises(BadRequest, match="group 0"):
            h.swap_in(dev(req, torch), None, dev(per_group[1], torch), layer=2)  # group 1 before group 0
        for bs, what in ((2.5, "block_size must be an integer"), (True, "block_size must be an integer"),
                         (0, r"block_size must lie in \[1, 2\*\*31\)"), (2**31, "block_size must lie in")):
            for tab in (dev(table, torch), None):  # (without a table too: the kernels take it all the same)
                with pytest.raises(BadRequest, match=what):  # (int() took 2.5 for 2; the kernels an int32)
                    h.swap_in(dev(req, torch), tab, dev(per_group[0], torch), layer=0, block_size=bs)
        bad_valid = torch.empty((len(req), 2), dtype=torch.int32, device="cuda")[:, 0]  # not contiguous
        with pytest.raises(BadRequest, match="valid_counts_out must be a contiguous int32"):
            h.swap_in(dev(req, torch), dev(table, torch), dev(per_group[0], torch), layer=0, block_size=BLOCK,
                      valid_counts_out=bad_valid)
        # A table with no blocks: every position maps to no row (never read as host rows).
        empty = torch.empty((lay.max_reqs, 0), dtype=torch.int32, device="cuda")
        idx = h.swap_in(dev(req, torch), empty, dev(per_group[0], torch), layer=0, block_size=BLOCK)
        h.swap_in(dev(req, torch), empty, dev(per_group[0], torch), layer=1, block_size=BLOCK)
        h.swap_in(dev(req, torch), empty, dev(per_group[1], torch), layer=2, block_size=BLOCK)
        torch.cuda.synchronize()
        assert (idx == -1).all().item()
        h.check()
    finally:
        c.close()
    with pytest.raises(BadRequest, match="int32"):
        c2, h2 = attach(cuda_daemon.run_dir, lay, fill=False)
        try:
            type(h2)(c2, hot_base=2**31 - 16)
        finally:
            c2.close()


@pytest.mark.cuda
@pytest.mark.parametrize("gap_rows", [0, 3])
def test_an_engine_owned_slab_inside_a_larger_tensor_is_exact_and_its_neighbours_untouched(cuda_daemon, gap_rows):
    """The hot region inside the engine's own KV tensor (issue: the hot slab inside the
    engine's KV cache): per layer, 5 resident blocks then the hot blocks, `gap_rows` rows
    of other data after each block, guard bytes around everything. swap_in's indices
    (from hot_base) equal the cpu backend's, read the right bytes through kv(), and no
    byte outside the hot blocks changes."""
    import torch

    from sparsekv.client.engine_slab import EngineSlab
    from sparsekv.proto.slab import SlabGeometry

    lay = layout()
    rb = lay.row_bytes
    stride = (BLOCK + gap_rows) * rb
    hot_blocks = lay.max_reqs * lay.region_stride // BLOCK
    first = 5
    layer_span = (first + hot_blocks) * stride + 4096
    guard = 8192
    nbytes = lay.num_layers * layer_span
    big = torch.randint(0, 256, (guard + nbytes + guard,), dtype=torch.uint8, device="cuda")
    start = big.clone()
    kv = EngineSlab.from_tensor(big[guard: guard + nbytes])
    geo = SlabGeometry.paged(lay, [layer * layer_span for layer in range(lay.num_layers)], first_block=first,
                             block_size=BLOCK, block_stride=stride, buffer_bytes=nbytes)
    kv.with_geometry(geo)
    hot_base = first * BLOCK
    plan = steps(lay, 8, seed=11, positions=True)
    want = reference(lay, plan, True)
    c = Client(cuda_daemon.run_dir, name="engine-slab", device="cuda:0").connect()
    try:
        att = c.attach(lay, engine="own", transport="doorbell", slab=kv)
        assert att.slab is None
        fill_pool(c, lay)
        h = c.doorbell_handle(hot_base=hot_base)
        for t, (state, reset, inval, req, per_group, table) in enumerate(plan):
            h.begin_step(dev(state, torch), dev(reset, torch), dev(inval, torch))
            for g, layers in enumerate(lay.groups):
                for layer in layers:
                    idx = h.swap_in(dev(req, torch), dev(table, torch), dev(per_group[g], torch), layer=layer,
                                    block_size=BLOCK).cpu().numpy()
                    exp, ids = want[t][layer]
                    np.testing.assert_array_equal(idx, np.where(exp >= 0, exp + hot_base, -1),
                                                  err_msg=f"step {t} layer {layer}")
                    ok = idx >= 0
                    if ok.any():
                        rows = h.kv(layer)
                        i = torch.as_tensor(idx[ok]).long().cuda()
                        got = rows[i] if gap_rows == 0 else rows[i // BLOCK, i % BLOCK]
                        np.testing.assert_array_equal(got.cpu().numpy(), pattern(layer, ids[ok], rb))
            h.check()
        torch.cuda.synchronize()
        touched = torch.zeros_like(big, dtype=torch.bool)
        for layer in range(lay.num_layers):
            offs = geo.row_offsets(lay, layer, np.arange(lay.max_reqs * lay.region_stride))
            for off in offs:
                touched[guard + int(off): guard + int(off) + rb] = True
        assert torch.equal(big[~touched], start[~touched])  # guards, gaps, resident blocks
    finally:
        c.close()


def test_a_cpu_daemon_refuses_the_doorbell_transport(daemon):
    lay = layout()
    c = Client(daemon.run_dir, name="cpu").connect()
    try:
        with pytest.raises(BadRequest, match="cuda rank"):
            c.attach(lay, transport="doorbell")  # refused here: a cpu rank
        with pytest.raises(BadRequest, match="transport"):
            c.attach(lay, transport="pigeon")
        with pytest.raises(BadRequest, match="cuda backend") as e:  # and by the daemon
            c._call(MsgType.ATTACH, {"engine": "x", "layout": lay.to_wire(), "transport": "doorbell"})
        assert e.value.code == ErrorCode.BAD_ARGUMENT
        with pytest.raises(BadRequest, match="transport") as e:
            c._call(MsgType.ATTACH, {"engine": "x", "layout": lay.to_wire(), "transport": 7})
        # Nothing of the refused attaches stayed: engine "x" takes another layout.
        c.attach(layout(max_reqs=4), engine="x")
    finally:
        c.close()


@pytest.mark.cuda
@pytest.mark.parametrize("kw", [{}, {"block_size": 16}, {"block_size": 16, "spec": 0.3, "region_stride": 256},
                                {"block_size": 16, "spec": 0.3, "slab": "engine"}, {"ranks": 2}])
def test_replay_through_the_doorbell_equals_inproc_and_verifies(kw):
    from sparsekv.bench.replay import replay
    from sparsekv.bench.synth import synth

    base = dict(steps=30, batch=6, top_k=128, region_stride=256, max_reqs=10, host_rows=10 * 2048, num_layers=2,
                context=1200, lifetime=12, overlap=0.7, invalidate=0.2, out_of_range=0.01, seed=4)
    kw = dict(kw)
    slab = kw.pop("slab", "daemon")  # engine: the hot rows in a tensor of this process, guards around them
    ranks = kw.pop("ranks", 1)  # two doorbell ranks on one GPU: a detach beside a parked stream
    base.update(kw)
    trace = synth(**base)
    want, want_res = replay(trace, transport="inproc", backend="cpu")
    got, got_res = replay(trace, transport="doorbell", backend="cuda", verify=True, daemon_log=DAEMON_LOG, slab=slab,
                          ranks=ranks)
    np.testing.assert_array_equal(got_res["slots"], want_res["slots"])
    np.testing.assert_array_equal(got_res["misses"], want_res["misses"])
    assert got["mismatched_rows"] == 0
    assert got["guard_bytes_changed"] == (0 if slab == "engine" else None)
    assert (got["hits"], got["out_of_range"]) == (want["hits"], want["out_of_range"])


def test_replay_refuses_the_doorbell_without_the_cuda_backend():
    from sparsekv.bench.replay import replay
    from sparsekv.bench.synth import synth

    trace = synth(steps=2, batch=2, top_k=16, region_stride=32, max_reqs=4, host_rows=4 * 256, context=100)
    with pytest.raises(ValueError, match="--backend cuda"):
        replay(trace, transport="doorbell", backend="cpu")


def test_an_engine_stream_is_wrapped_through_the_stream_protocol_where_cupy_has_it():
    """CuPy's ExternalStream is deprecated: Stream.from_external with an object offering
    ``__cuda_stream__`` (version 0, the handle); CuPy's own null and per-thread default
    stream objects for handles 0 and 2; ExternalStream only for handle 1 (legacy) and for
    a CuPy without from_external."""
    import types

    from sparsekv.client.cuda_stream import external_stream

    seen = []
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Stream=types.SimpleNamespace(from_external=lambda obj: seen.append(("from", obj.__cuda_stream__())) or "s",
                                     null="null", ptds="ptds"),
        ExternalStream=lambda ptr: seen.append(("ext", ptr)) or "e"))
    assert external_stream(fake, 0x7F00AB) == "s"
    assert external_stream(fake, 0) == "null" and external_stream(fake, 2) == "ptds" and external_stream(fake, 1) == "e"
    assert seen == [("from", (0, 0x7F00AB)), ("ext", 1)]
    del fake.cuda.Stream.ptds  # a CuPy without the per-thread stream object
    assert external_stream(fake, 2) == "e" and seen[-1] == ("ext", 2)
    del fake.cuda.Stream.from_external  # older CuPy
    assert external_stream(fake, 0x7F00AB) == "e" and seen[-1] == ("ext", 0x7F00AB)
    assert external_stream(fake, 0) == "e" and seen[-1] == ("ext", 0)
