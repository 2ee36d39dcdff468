"""The striped gather of a TP group on the emulator (csrc/copy.cu): ``skv_gather`` with a
stripe, ``skv_push`` of that stripe into a peer's slab, and the ready word completed by
``expect`` block arrivals. Random per-row plans (batch 1..64, 1..8 stripes, empty rows,
counts negative and past ld, entries outside the pool or the slab) against the NumPy
rule (``base.stripe_bounds`` / ``stripe_plan``) and the full gather."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import cpu_kernels
from sparsekv.daemon.kernels import copy_defines
from sparsekv.daemon.residency.base import stripe_plan
from sparsekv.daemon.residency.cpu import CpuMover
from sparsekv.daemon.residency.cuda import CudaMover, SlabTarget
from sparsekv.daemon.residency.cuda.device import make_desc
from sparsekv.proto import Layout
from sparsekv.proto.slab import SlabGeometry

pytestmark = pytest.mark.skipif(cpu_kernels.compiler() is None, reason="no C++ compiler for the kernel emulator")

L, HOST_ROWS, RB, B, LD = 3, 400, 48, 64, 10
SLOTS = B * LD + 8  # room for every entry's own slot, and some never named
GROUPS = np.array([[2, 0, 2], [1, 1, -1]], np.int32)  # group 0: layers 0 and 2; group 1: layer 1


def random_plan(rng, bad: bool):
    """A descriptor and per-row plans: batch 1..64 rows, counts of every kind (clamped to
    [0, LD] by the kernels), rows sorted within a row, slots distinct over the plan (the
    bytes then do not depend on write order); with ``bad``, entries naming a row outside
    the pool or a slot outside the slab (both skipped)."""
    batch = int(rng.integers(1, B + 1))
    group = int(rng.integers(2))
    counts = rng.integers(0, LD + 1, size=B).astype(np.int32)
    odd = rng.random(B) < 0.3
    counts[odd] = rng.choice([-7, 0, 0, LD + 3, 2**31 - 1, -2**31], size=int(odd.sum()))
    rows = np.sort(rng.integers(0, HOST_ROWS, size=(B, LD)), axis=1).astype(np.int32)
    slots = rng.permutation(SLOTS)[: B * LD].reshape(B, LD).astype(np.int32)
    if bad:
        out = rng.random((B, LD)) < 0.1
        rows[out] = rng.choice([-1, -5, HOST_ROWS, HOST_ROWS + 9], size=int(out.sum()))
        off = rng.random((B, LD)) < 0.05
        slots[off] = rng.choice([-1, SLOTS, SLOTS + 3], size=int(off.sum()))
    return make_desc(batch, LD, group), group, batch, rows, slots, counts


def applied(slab, pool, group, plan):
    """``slab`` with ``plan`` gathered into the group's layers (the NumPy reference)."""
    out = slab.copy()
    keep = (plan.rows < HOST_ROWS) & (plan.slots < SLOTS)  # stripe_plan dropped the negative ones
    for layer in GROUPS[group, 1:1 + GROUPS[group, 0]]:
        out[layer, plan.slots[keep]] = pool[layer, plan.rows[keep]]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_stripes_of_a_plan_copy_each_entry_exactly_once(seed):
    """N gathers, stripe s of N each into a zeroed slab of its own: each slab holds exactly
    the NumPy rule's stripe (stripe_plan), no slot is written by two stripes, and together
    they hold the full gather's rows (pool bytes are never 0, so a written row shows)."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(1, 256, size=(L, HOST_ROWS, RB), dtype=np.uint8)
    for trial in range(4):
        n = int(rng.integers(1, 9))
        desc, group, batch, rows, slots, counts = random_plan(rng, bad=False)
        full = np.zeros((L, SLOTS, RB), np.uint8)
        cpu_kernels.gather(desc, pool, full, SLOTS, GROUPS, rows, slots, counts, grid=int(rng.integers(1, 9)))
        written = np.zeros(SLOTS, np.int64)
        union = np.zeros_like(full)
        for s in range(n):
            part = np.zeros_like(full)
            cpu_kernels.gather(desc, pool, part, SLOTS, GROUPS, rows, slots, counts, grid=int(rng.integers(1, 9)),
                               stripe=s, stripes=n)
            plan = stripe_plan(rows[:batch], slots[:batch], counts[:batch], s, n)
            np.testing.assert_array_equal(part, applied(np.zeros_like(full), pool, group, plan),
                                          err_msg=f"trial {trial}, stripe {s} of {n}")
            hit = part.any(axis=(0, 2))
            written += hit
            union[:, hit] = part[:, hit]
        assert written.max() <= 1, f"trial {trial}: a slot copied by two of {n} stripes"
        want = (np.clip(counts[:batch], 0, LD)).sum()
        assert written.sum() == want, f"trial {trial}: {written.sum()} entries copied of {want}"
        np.testing.assert_array_equal(union, full, err_msg=f"trial {trial}")


@pytest.mark.parametrize("seed", range(6))
def test_each_rank_gathering_its_stripe_and_pushing_it_to_its_peers_ends_with_the_full_gather(seed):
    """N slabs, each with bytes of its own: slab s gets stripe s from the pool, then pushes
    it into every other slab. Every slab then equals its own start with the full gather
    applied: every planned row landed, nothing else changed (entries outside the pool or
    the slab skipped by the pushes as by the gathers), whatever the order of the pushes."""
    rng = np.random.default_rng(100 + seed)
    pool = rng.integers(0, 256, size=(L, HOST_ROWS, RB), dtype=np.uint8)
    for trial in range(3):
        n = int(rng.integers(1, 9))
        desc, group, batch, rows, slots, counts = random_plan(rng, bad=True)
        start = rng.integers(0, 256, size=(n, L, SLOTS, RB), dtype=np.uint8)
        slabs = start.copy()
        for s in range(n):
            cpu_kernels.gather(desc, pool, slabs[s], SLOTS, GROUPS, rows, slots, counts,
                               grid=int(rng.integers(1, 9)), stripe=s, stripes=n)
        pairs = [(s, d) for s in range(n) for d in range(n) if s != d]
        for i in rng.permutation(len(pairs)):
            s, d = pairs[i]
            cpu_kernels.push(desc, HOST_ROWS, slabs[s], slabs[d], SLOTS, GROUPS, rows, slots, counts, s, n,
                             grid=int(rng.integers(1, 9)))
        for d in range(n):
            want = start[d].copy()
            cpu_kernels.gather(desc, pool, want, SLOTS, GROUPS, rows, slots, counts)
            np.testing.assert_array_equal(slabs[d], want, err_msg=f"trial {trial}, slab {d} of {n}")


def test_a_push_into_an_engine_owned_paged_slab_writes_its_rows_where_the_gather_would():
    """skv_push to a destination laid out by the engine-slab geometry (blocks of 4 rows
    with a gap after each): the same bytes as the gather of that stripe into it, the
    gaps untouched."""
    rng = np.random.default_rng(7)
    pool = rng.integers(0, 256, size=(L, HOST_ROWS, RB), dtype=np.uint8)
    block_rows, gap = 4, 3
    stride = (block_rows + gap) * RB
    per_layer = -(-SLOTS // block_rows) * stride
    layer_off = (np.arange(L) * per_layer).astype(np.int64)
    for n in (1, 2, 5):
        desc, group, batch, rows, slots, counts = random_plan(rng, bad=True)
        src = rng.integers(0, 256, size=(L, SLOTS, RB), dtype=np.uint8)
        dst = rng.integers(0, 256, size=L * per_layer, dtype=np.uint8)
        before, want = dst.copy(), dst.copy()
        s = n - 1
        cpu_kernels.gather(desc, pool, src, SLOTS, GROUPS, rows, slots, counts, stripe=s, stripes=n)
        cpu_kernels.gather(desc, pool, want, SLOTS, GROUPS, rows, slots, counts, layer_off=layer_off,
                           block_rows=block_rows, block_stride=stride, stripe=s, stripes=n)
        cpu_kernels.push(desc, HOST_ROWS, src, dst, SLOTS, GROUPS, rows, slots, counts, s, n, layer_off=layer_off,
                         block_rows=block_rows, block_stride=stride)
        np.testing.assert_array_equal(dst, want, err_msg=f"stripe {s} of {n}")
        assert (dst != before).any()


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_the_ready_word_is_set_only_by_the_last_of_the_n_contributions_to_a_slab(n):
    """Slab 0's layer group gets its own stripe's gather and the pushes of N - 1 peers,
    each kernel with a grid of its own, one ready word and one arrival counter for all,
    expect = the blocks of all N: the word stays 0 after any N - 1 of them (counter at
    their blocks), is 1 after the last (counter back to 0), and the next group's round
    (the engine cleared the word) completes the same way. The rows are the full gather's
    at that point. An out-of-range descriptor or stripe copies nothing but still arrives."""
    rng = np.random.default_rng(n)
    pool = rng.integers(0, 256, size=(L, HOST_ROWS, RB), dtype=np.uint8)
    ready, arrivals = np.zeros(1, np.uint32), np.zeros(1, np.uint32)
    for round_ in range(3):
        desc, group, batch, rows, slots, counts = random_plan(rng, bad=False)
        peers = rng.integers(0, 256, size=(n, L, SLOTS, RB), dtype=np.uint8)
        for s in range(1, n):  # each peer's slab already has its stripe
            cpu_kernels.gather(desc, pool, peers[s], SLOTS, GROUPS, rows, slots, counts, stripe=s, stripes=n)
        slab = rng.integers(0, 256, size=(L, SLOTS, RB), dtype=np.uint8)
        want = slab.copy()
        cpu_kernels.gather(desc, pool, want, SLOTS, GROUPS, rows, slots, counts)
        grids = [int(g) for g in rng.integers(1, 7, size=n)]
        expect = sum(grids)
        bad_desc = round_ == 2  # the last round: one contribution out of range (nothing copied)
        order = rng.permutation(n)
        for j, s in enumerate(order):
            d = make_desc(batch, LD, 9) if bad_desc and j == 0 else desc
            if s == 0:
                cpu_kernels.gather(d, pool, slab, SLOTS, GROUPS, rows, slots, counts, grid=grids[s], stripe=0,
                                   stripes=n, ready=ready, arrivals=arrivals, expect=expect)
            else:
                cpu_kernels.push(d, HOST_ROWS, peers[s], slab, SLOTS, GROUPS, rows, slots, counts, int(s), n,
                                 grid=grids[s], ready=ready, arrivals=arrivals, expect=expect)
            done = sum(grids[int(x)] for x in order[: j + 1])
            if j < n - 1:
                assert ready[0] == 0 and arrivals[0] == done, f"round {round_}: after {j + 1} of {n}"
        assert ready[0] == 1 and arrivals[0] == 0, f"round {round_}"
        if not bad_desc:
            np.testing.assert_array_equal(slab, want, err_msg=f"round {round_}")
        ready[0] = 0  # the engine clears it before the next round (skv_db_indices' clear)
    # a stripe out of range: nothing copied, the grid still arrives and rings
    slab = np.zeros((L, SLOTS, RB), np.uint8)
    for stripe, stripes in ((n, n), (-1, n), (0, 0)):
        cpu_kernels.gather(desc, pool, slab, SLOTS, GROUPS, rows, slots, counts, grid=3, stripe=stripe,
                           stripes=stripes, ready=ready, arrivals=arrivals, expect=3)
        assert ready[0] == 1 and arrivals[0] == 0 and not slab.any()
        ready[0] = 0


class _Launch:
    """A CuPy kernel stand-in: a launch's grid, block and argument tuple, run on the emulator."""

    def __init__(self, entry: str, defines: dict):
        self.entry, self.defines = entry, defines

    def __call__(self, grid, block, args, shared_mem=0):
        cpu_kernels.run_raw("copy.cu", self.entry, grid[0], block[0], args, self.defines)


def emu_mover(lay, pool, slab, blocks: int) -> CudaMover:
    """A CudaMover whose real launch code (launch_gather, launch_push) runs its kernels on
    the emulator over NumPy arrays (no GPU: its constructor's device set-up replaced)."""
    mv = object.__new__(CudaMover)
    mv.layout, mv.blocks, mv.threads = lay, blocks, 32
    mv.pool_address, mv.slab, mv.engine_owned = pool.ctypes.data, slab, False
    mv._geo = (np.uint64(0), np.int64(1), np.int64(0))
    table = np.full((lay.num_groups, 1 + max(map(len, lay.groups))), -1, np.int32)
    for g, layers in enumerate(lay.groups):
        table[g, 0], table[g, 1:1 + len(layers)] = len(layers), layers
    mv.group_layers = table
    defines = copy_defines(lay.row_bytes, 32)
    mv._gather, mv._push = _Launch("skv_gather", defines), _Launch("skv_push", defines)
    return mv


@pytest.mark.parametrize("n", [1, 2, 4])
def test_the_movers_striped_launches_give_every_rank_and_an_engine_slab_the_full_gather(n):
    """CudaMover.launch_gather with a stripe and launch_push (their argument tuples against
    the kernels' parameters, on the emulator): rank s gathers stripe s and pushes it into
    every other rank's slab and an engine-owned paged buffer (a SlabTarget with its
    geometry); every slab then equals the cpu mover's full gather of the plan (stripe 0 of
    1 of stripe_plan), each destination's ready word is set and its counter back at 0."""
    lay = Layout(num_layers=L, row_bytes=RB, top_k=LD, region_stride=80, max_reqs=8, host_rows=HOST_ROWS,
                 index_groups=((0, 2), (1,)), max_batch=B).validate()
    assert lay.max_reqs * lay.region_stride == 640 <= SLOTS
    rng = np.random.default_rng(40 + n)
    pool = rng.integers(0, 256, size=(L, HOST_ROWS, RB), dtype=np.uint8)
    br, gap = 4, 2
    stride = (br + gap) * RB
    per_layer = 640 // br * stride
    geo = SlabGeometry.paged(lay, [i * per_layer for i in range(L)], first_block=0, block_size=br,
                             block_stride=stride, buffer_bytes=L * per_layer).check(lay)
    layer_off = np.array(geo.layer_offsets, np.int64)
    blocks = 3
    for trial in range(3):
        desc, group, batch, rows, slots, counts = random_plan(rng, bad=False)
        keep = slots < 640
        slots = np.where(keep, slots, -1).astype(np.int32)  # the layout's 640 slots
        slabs = rng.integers(0, 256, size=(n, *lay.slab_shape), dtype=np.uint8)
        engine = rng.integers(0, 256, size=L * per_layer, dtype=np.uint8)
        want = [slab.copy() for slab in slabs]
        want_engine = engine.copy()
        plan = stripe_plan(rows[:batch], slots[:batch], counts[:batch], 0, 1)
        for w in want:
            CpuMover(lay, pool, w, None).gather(plan, lay.groups[group])
        CpuMover(lay, pool, want_engine, None, geometry=geo).gather(plan, lay.groups[group])
        movers = [emu_mover(lay, pool, slabs[s], blocks) for s in range(n)]
        targets = [SlabTarget(slabs[d].ctypes.data, (np.uint64(0), np.int64(1), np.int64(0))) for d in range(n)]
        targets.append(SlabTarget(engine.ctypes.data, (layer_off, np.int64(br), np.int64(stride))))
        ready, arrivals = np.zeros(n + 1, np.uint32), np.zeros(n + 1, np.uint32)

        def signal(d):
            return {"ready": ready.ctypes.data + 4 * d, "arrivals": arrivals.ctypes.data + 4 * d,
                    "expect": n * blocks}

        for s, mv in enumerate(movers):
            mv.launch_gather(desc, rows, slots, counts, B, contextlib.nullcontext(), stripe=s, stripes=n,
                             **signal(s))
        for s, mv in enumerate(movers):
            for d in range(n + 1):
                if d != s:
                    mv.launch_push(desc, rows, slots, counts, B, contextlib.nullcontext(), targets[d], stripe=s,
                                   stripes=n, **signal(d))
        for d in range(n):
            np.testing.assert_array_equal(slabs[d], want[d], err_msg=f"trial {trial}, rank {d} of {n}")
        np.testing.assert_array_equal(engine, want_engine, err_msg=f"trial {trial}, engine slab")
        assert ready.tolist() == [1] * (n + 1) and not arrivals.any(), f"trial {trial}"


def test_a_launch_argument_of_the_wrong_width_is_refused_as_on_a_gpu_it_would_shift_the_rest():
    """run_raw (which the mover test above runs the launchers through) checks each scalar's
    width against its parameter: an int32 for an i64, an int64 or a Python int (8 bytes
    through CuPy) for an int."""
    lay = Layout(num_layers=L, row_bytes=RB, top_k=LD, region_stride=80, max_reqs=8, host_rows=HOST_ROWS,
                 index_groups=((0, 2), (1,)), max_batch=B).validate()
    mv = emu_mover(lay, np.zeros((L, HOST_ROWS, RB), np.uint8), np.zeros(lay.slab_shape, np.uint8), 2)
    desc, _, _, rows, slots, counts = random_plan(np.random.default_rng(1), bad=False)
    launch = mv._gather
    for i, wrong in ((2, np.int32(HOST_ROWS)), (3, np.int64(L)), (3, L)):  # host_rows i64; num_layers int
        def bad(grid, block, args, shared_mem=0, i=i, wrong=wrong):
            launch(grid, block, args[:i] + (wrong,) + args[i + 1:], shared_mem)

        mv._gather = bad
        with pytest.raises(TypeError, match="bytes"):
            mv.launch_gather(desc, rows, slots, counts, B, contextlib.nullcontext())
