"""What ``InprocSwapIn`` (embedded/inproc_cuda.py) enqueues at its hand-off points
(``_rang``: the group's resolve, the gather of all its layers, with prefetch the prefetch
into the next group; ``_ready``: nothing), run on the kernel emulator: the real ``DeviceStep``
over a residency and a mover whose launches run ``skv_resolve``, ``skv_prefetch`` and
``skv_gather`` on NumPy arrays laid out as ``RankBuffers`` lays them out.

The engine's order is the one ``client/step_order.py`` accepts and client/README.md
describes: a follower layer of group g may be swapped in after group g + 1's leader ("an
index stays valid until the group leader's next swap_in"). After each layer's swap_in, the
rows its indices name must be in that layer's slab, and the residency state and prefetch
counters ``CpuResidency``'s (daemon/residency/cpu.py) after the same resolves and prefetches.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

import cpu_kernels
from kernel_traces import layout
from sparsekv.bench.verify import pattern
from sparsekv.client.step_order import StepOrder
from sparsekv.daemon.cuda.buffers import prefetch_layers
from sparsekv.daemon.cuda.step import DeviceStep
from sparsekv.daemon.residency.cpu import CpuResidency
from sparsekv.daemon.residency.cuda import prefetch_workspace_bytes
from sparsekv.embedded.inproc_cuda import InprocSwapIn
from sparsekv.proto import Layout
from sparsekv.proto.step_block import BlockView, block_ints, write_topk

pytestmark = pytest.mark.skipif(cpu_kernels.compiler() is None, reason="no C++ compiler for the kernel emulator")

P, i32 = ctypes.c_void_p, ctypes.c_int


def _p(a):
    return a.ctypes.data_as(P)


class EmuResidency:
    """``CudaResidency``'s launch_resolve / launch_prefetch on the emulator's state."""

    def __init__(self, emu):
        self.emu, self.layout, self.pf_counters = emu, emu.lay, emu.pf

    def launch_resolve(self, desc, state_rows, topk, slots, misses, plan_rows, plan_slots, counters, cpg, err,
                       workspace, max_batch, stream, clear=0):
        e, lay = self.emu, self.layout
        e.lib.run_skv_resolve(
            i32(max_batch), i32(e.threads), i32(e.ws_bytes), _p(desc), _p(e.owner), _p(e.lru), i32(lay.num_groups),
            i32(lay.max_reqs), i32(lay.region_stride), i32(lay.host_rows), i32(lay.top_k), i32(max_batch),
            _p(state_rows), _p(topk), i32(lay.top_k), _p(slots), _p(misses), _p(plan_rows), _p(plan_slots),
            _p(counters), i32(cpg), _p(err), P(0), ctypes.c_longlong(0), P(0), _p(e.fresh), _p(e.pf))

    def launch_prefetch(self, desc, state_rows, topk, plan_rows, plan_slots, counts, err, max_batch, stream,
                        group_offset=0):
        e, lay = self.emu, self.layout
        e.pf_lib.run_skv_prefetch(
            i32(max_batch), i32(e.threads), i32(prefetch_workspace_bytes(lay.top_k, lay.region_stride)), _p(desc),
            i32(group_offset), _p(e.owner), _p(e.lru), _p(e.fresh), i32(lay.num_groups), i32(lay.max_reqs),
            i32(lay.region_stride), i32(lay.host_rows), i32(lay.top_k), i32(max_batch), _p(state_rows), _p(topk),
            i32(lay.top_k), _p(plan_rows), _p(plan_slots), _p(counts), _p(e.pf), _p(err))


class EmuMover:
    """``CudaMover.launch_gather`` on the emulator: pool -> the daemon's flat slab."""

    def __init__(self, lay, pool, slab):
        self.lay, self.pool, self.slab = lay, pool, slab
        groups = lay.groups
        self.table = np.full((len(groups), 1 + max(map(len, groups))), -1, np.int32)
        for g, layers in enumerate(groups):
            self.table[g, 0] = len(layers)
            self.table[g, 1:1 + len(layers)] = layers

    def launch_gather(self, desc, plan_rows, plan_slots, misses, max_batch, stream, group_layers=None, ready=0,
                      arrivals=0, after_resolve=False, mark_slots=False):
        # after_resolve (a programmatic launch on a GPU) changes nothing here: the
        # emulator runs each kernel to its end before the next.
        table = self.table if group_layers is None else np.ascontiguousarray(group_layers)
        cpu_kernels.gather(desc, self.pool, self.slab, self.slab.shape[1], table, plan_rows, plan_slots, misses,
                           mark_slots=mark_slots)


def inproc(lay, prefetch: bool, seed: int = 0):
    """A stand-in for InprocSwapIn's self: its buffers (RankBuffers' doorbell and pf_*
    sections as NumPy arrays) and a real DeviceStep over the emulated launches."""
    rng = np.random.default_rng(seed)
    G, L, B, K = lay.num_groups, lay.num_layers, lay.max_batch, lay.top_k
    emu = cpu_kernels.Resolve(lay, threads=32, prefetch=True)
    pool = rng.integers(0, 256, size=(L, lay.host_rows, 32), dtype=np.uint8)
    slab = np.zeros((L, lay.max_reqs * lay.region_stride, 32), np.uint8)
    db_layers = np.zeros((L, G, 2), np.int32)
    for g, layers in enumerate(lay.groups):
        for layer in layers:
            db_layers[layer, g] = (1, layer)
    b = SimpleNamespace(
        db_topk=[BlockView(np.zeros(block_ints(B, K), np.int32), B) for _ in range(G)],
        db_slots=np.full((G, B, K), -1, np.int32), db_misses=np.zeros((G, B), np.int32), db_layers=db_layers,
        plan_rows=np.zeros((B, K), np.int32), plan_slots=np.zeros((B, K), np.int32),
        counters=np.zeros((G, 4), np.uint64), err=np.zeros(32, np.int32), workspace=None, max_batch=B,
        prefetch=prefetch, pf_rows=np.zeros((B, K), np.int32), pf_slots=np.zeros((B, K), np.int32),
        pf_counts=np.zeros(B, np.int32), pf_err=np.zeros(32, np.int32), pf_layers=prefetch_layers(lay))
    dstep = object.__new__(DeviceStep)
    dstep.residency, dstep.mover, dstep.buffers, dstep.layout = EmuResidency(emu), EmuMover(lay, pool, slab), b, lay
    dstep.enqueue_stats_out = lambda stream: None
    # The emulator runs each launch at once: the prefetch's stream and its fork and join
    # events order nothing here (the GPU tests check them).
    event = SimpleNamespace(record=lambda stream: None)
    h = SimpleNamespace(layout=lay, buffers=b, dstep=dstep, _ext=lambda ptr: SimpleNamespace(wait_event=lambda e: None),
                        pool=pool, slab=slab, emu=emu, _pf_stream=SimpleNamespace(wait_event=lambda e: None),
                        _pf_events=[(event, event)] * G, _pf_pending=[])
    h._join_prefetch = lambda stream: InprocSwapIn._join_prefetch(h, stream)
    return h


def run_step(h, order, step, state_rows, topk_of):
    """One decode step in the engine's layer ``order`` (checked by StepOrder): a leader's
    swap_in writes its group's top-k block and rings (``_rang``), every swap_in then makes
    its layer ready (``_ready``); right after, that layer's rows are read (attention).
    Returns the (layer, token, column) whose slab row is not the named pool row."""
    lay, b = h.layout, h.buffers
    so = StepOrder(lay.groups)
    so.began()
    wrong = []
    S = lay.region_stride
    for layer in order:
        g = so.group_of[layer]
        if so.check_layer(layer):
            write_topk(b.db_topk[g], step, step, g, state_rows, topk_of[g])
            InprocSwapIn._rang(h, g, 0)
            so.rang(g)
        InprocSwapIn._ready(h, layer, g, 0)
        so.ready(layer)
        ids = topk_of[g]
        for t, s in enumerate(state_rows):
            for c, row in enumerate(ids[t]):
                if s >= 0 and 0 <= row < lay.host_rows:
                    slot = int(b.db_slots[g, t, c])
                    if not (h.slab[layer, s * S + slot] == h.pool[layer, row]).all():
                        wrong.append((layer, t, c))
    assert not h.emu.err[:8].any()
    return wrong


def steps(lay, n, seed):
    """Per step: state rows (one token a request) and each group's top-k: the first
    group's fresh, each next group's half of the previous group's rows (what a prefetch
    then hits)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        sr = np.arange(lay.max_batch, dtype=np.int32) % lay.max_reqs
        tk = [np.stack([rng.permutation(lay.host_rows)[:lay.top_k] for _ in sr]).astype(np.int32)]
        for _ in lay.groups[1:]:
            nxt = tk[-1].copy()
            for row in nxt:
                swap = rng.random(row.size) < 0.5
                row[swap] = np.setdiff1d(rng.permutation(lay.host_rows), row)[:int(swap.sum())]
            tk.append(nxt)
        out.append((sr, tk))
    return out


@pytest.mark.parametrize("prefetch", [False, True])
def test_inproc_in_layer_order_reads_the_named_rows(prefetch):
    """Contiguous groups in layer order (what every test of the in-process handle does):
    each layer's rows are there when it is swapped in."""
    lay = layout(4, 8, 64, 2, groups=3, layers_per_group=2, max_batch=2)
    h = inproc(lay, prefetch)
    for t, (sr, tk) in enumerate(steps(lay, 4, 1)):
        assert run_step(h, range(lay.num_layers), t, sr, tk) == []
    assert (h.emu.prefetch_hits > 0) == prefetch


@pytest.mark.parametrize("prefetch", [False, True])
def test_inproc_follower_after_the_next_leader_reads_the_named_rows(prefetch):
    """Index groups ((0, 2), (1, 3)) swapped in layer order 0, 1, 2, 3: StepOrder accepts
    it (layer 2 follows its leader 0; group 1 was rung after group 0). Layer 2's rows must
    be group 0's: the in-process handle gathers every layer of a group at its leader,
    before group 1's resolve reuses the plan buffer (and forks group 0's prefetch there,
    before group 1's resolve, as DESIGN §4 orders)."""
    lay = layout(4, 8, 64, 2, groups=2, layers_per_group=2, max_batch=2)
    lay = type(lay)(**{**lay.__dict__, "index_groups": ((0, 2), (1, 3))}).validate()
    h = inproc(lay, prefetch)
    for t, (sr, tk) in enumerate(steps(lay, 3, 2)):
        assert run_step(h, [0, 1, 2, 3], t, sr, tk) == [], f"step {t}"


@pytest.mark.cuda
@pytest.mark.parametrize("prefetch", [False, True])
def test_on_the_gpu_inproc_follower_after_the_next_leader_reads_its_rows(prefetch):
    """The same on the GPU through InprocSwapIn itself: index groups ((0, 2), (1, 3)),
    swap_in in layer order; each layer's indices point at the bytes of the host rows its
    top-k names."""
    import torch

    lay = Layout(num_layers=4, row_bytes=656, top_k=32, region_stride=64, max_reqs=4, host_rows=2048,
                 index_groups=((0, 2), (1, 3)), max_batch=4).validate()
    h = InprocSwapIn(lay, prefetch=prefetch)
    rng = np.random.default_rng(3)
    try:
        for layer in range(lay.num_layers):
            h.pool[layer] = pattern(layer, np.arange(lay.host_rows), lay.row_bytes)
        state = torch.tensor([0, 1, 2, -1], dtype=torch.int32).cuda()
        for t in range(4):
            h.begin_step(state, torch.tensor([t == 0] * 4, dtype=torch.bool).cuda())
            topk = [np.stack([rng.permutation(lay.host_rows)[:lay.top_k] for _ in range(4)]).astype(np.int32)
                    for _ in lay.groups]
            for layer in range(lay.num_layers):
                ids = topk[0 if layer in lay.groups[0] else 1]
                idx = h.swap_in(state, None, torch.as_tensor(ids).cuda(), layer=layer)
                torch.cuda.synchronize()
                idx = idx.cpu().numpy()
                ok = idx >= 0
                got = h.kv(layer)[torch.as_tensor(idx[ok]).long().cuda()].cpu().numpy()
                want = pattern(layer, ids[ok], lay.row_bytes)
                np.testing.assert_array_equal(got, want, err_msg=f"step {t} layer {layer}")
            h.check()
    finally:
        h.close()


def regrouped(lay, groups):
    return type(lay)(**{**lay.__dict__, "index_groups": groups}).validate()


def ring(h, ref, g, step, state_rows, topk):
    """A group's TOPK block and ``_rang``, and what the cpu backend does for it (the
    resolve, then with prefetch the prefetch of its rows into the next group)."""
    write_topk(h.buffers.db_topk[g], step, step, g, state_rows, topk)
    InprocSwapIn._rang(h, g, 0)
    want = ref.resolve(g, state_rows, topk)
    if h.buffers.prefetch and g + 1 < h.layout.num_groups:
        ref.prefetch(g + 1, state_rows, topk)
    return want


def run_checked_step(h, ref, order, step, state_rows, topk_of, stop_after=None):
    """``run_step`` against the cpu backend: after each swap_in, the layer's rows are the
    named pool rows and its group's slots the backend's. ``stop_after``: the step is
    interrupted after that many swap_ins and ended as ``finish_step`` ends it (the groups
    not rung rung with an empty batch, the layers not swapped in made ready)."""
    lay, b = h.layout, h.buffers
    so = StepOrder(lay.groups)
    so.began()
    wrong = []
    S = lay.region_stride
    for n, layer in enumerate(order):
        if n == stop_after:
            break
        g = so.group_of[layer]
        if so.check_layer(layer):
            want = ring(h, ref, g, step, state_rows, topk_of[g])
            np.testing.assert_array_equal(b.db_slots[g, :len(state_rows)], want.slots, err_msg=f"step {step} group {g}")
            so.rang(g)
        InprocSwapIn._ready(h, layer, g, 0)
        so.ready(layer)
        for t, s in enumerate(state_rows):
            for c, row in enumerate(topk_of[g][t]):
                if s >= 0 and 0 <= row < lay.host_rows:
                    slot = int(b.db_slots[g, t, c])
                    if not (h.slab[layer, s * S + slot] == h.pool[layer, row]).all():
                        wrong.append((layer, t, c))
    groups, layers = so.pending()
    for g in groups:
        ring(h, ref, g, step, state_rows[:0], topk_of[g][:0])
        so.rang(g)
    for layer in layers:
        InprocSwapIn._ready(h, layer, so.group_of[layer], 0)
        so.ready(layer)
    assert so.complete
    assert not h.emu.err[:8].any()
    return wrong


def assert_state_is_the_backends(h, ref, where):
    emu = h.emu
    np.testing.assert_array_equal(emu.owner.reshape(ref.owner.shape), ref.owner, err_msg=where)
    np.testing.assert_array_equal(emu.lru.reshape(ref.lru.shape), ref.lru, err_msg=where)
    np.testing.assert_array_equal(emu.fresh.reshape(ref.fresh.shape).astype(bool), ref.fresh, err_msg=where)
    assert (emu.prefetched, emu.prefetch_hits, emu.prefetch_wasted) == \
        (ref.prefetched, ref.prefetch_hits, ref.prefetch_wasted), where


# name, index groups, swap_in order of every step, swap_ins before an interruption (None: none)
ORDERS = [
    ("leaders-not-first-layers", ((3, 0, 4), (1, 5), (2,)), [3, 1, 0, 2, 4, 5], None),
    ("followers-last", ((0, 3, 4), (1, 5), (2,)), [0, 1, 2, 3, 4, 5], None),
    ("followers-late-reversed", ((0, 1), (2, 3), (4, 5)), [0, 2, 4, 5, 3, 1], None),
    ("interrupted-after-a-leader", ((0, 1), (2, 3), (4, 5)), [0, 1, 2, 3, 4, 5], 1),
    ("interrupted-mid-group", ((0, 1), (2, 3), (4, 5)), [0, 1, 2, 3, 4, 5], 3),
    ("a-group-never-rung", ((0, 1), (2, 3), (4, 5)), [0, 1, 2, 3, 4, 5], 4),
    ("interrupted-before-any", ((0, 1), (2, 3), (4, 5)), [0, 1, 2, 3, 4, 5], 0),
]


@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
@pytest.mark.parametrize("case", ORDERS, ids=[c[0] for c in ORDERS])
def test_inproc_in_orders_step_order_accepts_equals_the_cpu_backend(case, prefetch):
    """Orders StepOrder accepts (leaders that are not their group's first layer, several
    followers each, followers after later groups' leaders, a step interrupted and ended
    as ``finish_step`` ends it, every other step): each layer's rows are the named pool
    rows when it is swapped in; each group's slots, the regions' owners, lru and fresh
    marks and the prefetch counters are ``CpuResidency``'s doing the same."""
    name, groups, order, stop = case
    lay = regrouped(layout(4, 8, 64, 2, groups=3, layers_per_group=2, max_batch=2), groups)
    h, ref = inproc(lay, prefetch), CpuResidency(lay)
    for t, (sr, tk) in enumerate(steps(lay, 6, 7)):
        assert run_checked_step(h, ref, order, t, sr, tk, stop_after=stop if t % 2 else None) == [], f"step {t}"
        assert_state_is_the_backends(h, ref, f"{name} step {t}")
    assert (ref.prefetched > 0) == prefetch


@pytest.mark.cuda
@pytest.mark.parametrize("prefetch", [False, True])
def test_on_the_gpu_inproc_interrupted_steps_and_late_followers_equal_the_cpu_backend(prefetch):
    """InprocSwapIn itself, index groups ((0, 3, 4), (1, 5), (2,)) in layer order, every
    other step interrupted after two swap_ins and ended by ``finish_step``: each layer's
    indices point at the bytes of its top-k's host rows, and the handle's counters (hits,
    misses, prefetched, prefetch hits and wasted) are CpuResidency's after the same resolves
    and prefetches (a ring of ``finish_step`` resolves an empty batch: nothing)."""
    import torch

    lay = Layout(num_layers=6, row_bytes=656, top_k=32, region_stride=64, max_reqs=4, host_rows=2048,
                 index_groups=((0, 3, 4), (1, 5), (2,)), max_batch=4).validate()
    h, ref = InprocSwapIn(lay, prefetch=prefetch), CpuResidency(lay)
    so = StepOrder(lay.groups)
    hits = misses = 0
    try:
        for layer in range(lay.num_layers):
            h.pool[layer] = pattern(layer, np.arange(lay.host_rows), lay.row_bytes)
        for t, (sr, tk) in enumerate(steps(lay, 6, 9)):
            state = torch.as_tensor(sr).cuda()
            h.begin_step(state)
            for layer in range(lay.num_layers)[:2 if t % 2 else None]:
                g = so.group_of[layer]
                if layer == lay.groups[g][0]:
                    want = ref.resolve(g, sr, tk[g])
                    hits, misses = hits + want.hits, misses + int(want.misses.sum())
                    if prefetch and g + 1 < lay.num_groups:
                        ref.prefetch(g + 1, sr, tk[g])
                idx = h.swap_in(state, None, torch.as_tensor(tk[g]).cuda(), layer=layer)
                torch.cuda.synchronize()
                idx = idx.cpu().numpy()
                ok = idx >= 0
                got = h.kv(layer)[torch.as_tensor(idx[ok]).long().cuda()].cpu().numpy()
                np.testing.assert_array_equal(got, pattern(layer, tk[g][ok], lay.row_bytes),
                                              err_msg=f"step {t} layer {layer}")
            h.finish_step()
            h.check()
            c = h.counters()
            assert (c["hits"], c["misses"], c["prefetched"], c["prefetch_hits"], c["prefetch_wasted"]) == \
                (hits, misses, ref.prefetched, ref.prefetch_hits, ref.prefetch_wasted), f"step {t}"
        assert (ref.prefetch_hits > 0) == prefetch
    finally:
        h.close()
