"""CpuMover: the gather copies exactly the plan for every layer of the index group (and
nothing else), prefill staging copies whole rows to the front of the staging buffer; a
TP group's striped plan (``base.stripe_bounds`` / ``stripe_plan``) and the push of a
gathered stripe into a peer's slab (``CpuMover.push``, the NumPy reference of skv_push)."""

import numpy as np
import pytest

from sparsekv.daemon.residency.base import Plan, ResidencyError, stripe_bounds, stripe_plan
from sparsekv.daemon.residency.cpu import CpuMover, CpuResidency
from sparsekv.proto import Layout
from sparsekv.proto.slab import SlabGeometry

SENTINEL = 0xEE


def setup(staging_rows=0, **kw):
    base = dict(num_layers=4, row_bytes=32, top_k=3, region_stride=6, max_reqs=3, host_rows=40,
                index_groups=((0, 2), (1, 3)), staging_rows=staging_rows)
    base.update(kw)
    lay = Layout(**base).validate()
    rng = np.random.default_rng(1)
    pool = rng.integers(0, 256, (lay.num_layers, lay.host_rows, lay.row_bytes), dtype=np.uint8)
    slab = np.full((lay.num_layers, lay.max_reqs, lay.region_stride, lay.row_bytes), SENTINEL, np.uint8)
    staging = np.full((lay.num_layers, lay.staging_rows, lay.row_bytes), SENTINEL, np.uint8) if staging_rows else None
    return lay, pool, slab, staging, CpuMover(lay, pool, slab, staging), CpuResidency(lay)


def test_gather_copies_the_plan_for_every_layer_of_the_group_and_nothing_else():
    lay, pool, slab, _, mover, res = setup()
    state_rows = np.array([2, 0], np.int32)
    topk = np.array([[5, 17, -1], [39, 0, 5]], np.int32)
    r = res.resolve(0, state_rows, topk)
    moved = mover.gather(r.plan, lay.groups[0])
    assert moved == 5 * 2 * lay.row_bytes  # 5 misses x 2 layers
    expect = np.full_like(slab, SENTINEL)
    for b, s in enumerate(state_rows):
        for col, g in enumerate(topk[b]):
            if g >= 0:
                for layer in (0, 2):
                    expect[layer, s, r.slots[b, col]] = pool[layer, g]
    assert np.array_equal(slab, expect)  # layers 1 and 3 and every other slot untouched


def test_gather_of_a_hit_step_moves_nothing():
    lay, pool, slab, _, mover, res = setup()
    r = res.resolve(1, np.array([1], np.int32), np.array([[3, 4, 5]], np.int32))
    mover.gather(r.plan, lay.groups[1])
    before = slab.copy()
    pool[:] = 0  # a second copy would now write zeros
    r = res.resolve(1, np.array([1], np.int32), np.array([[5, 3, 4]], np.int32))
    assert len(r.plan) == 0
    assert mover.gather(r.plan, lay.groups[1]) == 0
    assert np.array_equal(slab, before)


def test_gather_writes_flat_slots_into_the_state_rows_region():
    lay, pool, slab, _, mover, _ = setup()
    plan = Plan(rows=np.array([7], np.int32), slots=np.array([2 * lay.region_stride + 4], np.int32))
    mover.gather(plan, (3,))
    assert np.array_equal(slab[3, 2, 4], pool[3, 7])
    assert (np.delete(slab[3].reshape(-1, lay.row_bytes), 2 * lay.region_stride + 4, axis=0) == SENTINEL).all()


def test_stage_copies_rows_to_the_front_of_staging_for_the_given_layers():
    lay, pool, _, staging, mover, _ = setup(staging_rows=4)
    rows = np.array([8, 9, 10], np.int32)
    assert mover.stage(rows, (1, 2)) == 3 * 2 * lay.row_bytes
    for layer in (1, 2):
        assert np.array_equal(staging[layer, :3], pool[layer, rows])
        assert (staging[layer, 3] == SENTINEL).all()
    assert (staging[[0, 3]] == SENTINEL).all()


def test_stage_more_rows_than_the_staging_buffer_is_too_large():
    lay, _, _, staging, mover, _ = setup(staging_rows=2)
    with pytest.raises(ResidencyError) as ei:
        mover.stage(np.arange(3, dtype=np.int32), (0,))
    assert ei.value.code == "TOO_LARGE" and "staging buffer of 2" in str(ei.value)
    assert (staging == SENTINEL).all()


def test_stage_without_staging_buffer_is_a_clear_error():
    _, _, _, _, mover, _ = setup(staging_rows=0)
    with pytest.raises(ResidencyError) as ei:
        mover.stage(np.arange(1, dtype=np.int32), (0,))
    assert ei.value.code == "BAD_ARGUMENT" and "staging_rows = 0" in str(ei.value)


@pytest.mark.parametrize("block_stride", [3 * 32, 5 * 32])  # rows back to back / each block followed by a gap
def test_gather_into_an_engine_owned_paged_slab_writes_exactly_the_plans_rows(block_stride):
    """An engine-owned slab (proto/slab.py): 3-row blocks, layers interleaved or with gaps
    between blocks; the same rows land where the geometry puts them, and every other
    byte of the engine's buffer (its other blocks, the gaps, the bytes around) is kept."""
    lay, pool, slab, _, mover, res = setup()
    rows_per_layer = lay.max_reqs * lay.region_stride  # 18 rows = 6 blocks of 3
    layer_span = 6 * block_stride + 64
    geo = SlabGeometry.paged(lay, [64 + layer * layer_span for layer in range(lay.num_layers)], first_block=0,
                             block_size=3, block_stride=block_stride,
                             buffer_bytes=64 + lay.num_layers * layer_span + 64).check(lay)
    buf = np.full(geo.buffer_bytes, SENTINEL, np.uint8)
    engine = CpuMover(lay, pool, buf, None, geometry=geo)
    state_rows = np.array([2, 0, 1], np.int32)
    topk = np.array([[5, 17, -1], [39, 0, 5], [1, 2, 3]], np.int32)
    r = res.resolve(1, state_rows, topk)
    assert engine.gather(r.plan, lay.groups[1]) == mover.gather(r.plan, lay.groups[1])
    expect = np.full_like(buf, SENTINEL)
    for layer in range(lay.num_layers):
        for h in range(rows_per_layer):
            if layer in lay.groups[1]:
                off = int(geo.row_offsets(lay, layer, [h])[0])
                req, slot = divmod(h, lay.region_stride)
                expect[off: off + lay.row_bytes] = slab[layer, req, slot]
    assert np.array_equal(buf, expect)
    assert (buf != SENTINEL).sum() > 0


@pytest.mark.parametrize("stripes", range(1, 9))
def test_the_stripes_of_a_row_partition_its_entries_into_contiguous_runs(stripes):
    """Stripe s of N of a row of m entries is [m * s // N, m * (s + 1) // N): the stripes
    follow each other from 0 to m, each m // N or m // N + 1 long, also for counts near
    the int32 limit (int64 arithmetic, no overflow)."""
    m = np.array([0, 1, 2, 7, 8, 2047, 2048, 2**31 - 1], np.int64)
    bounds = [stripe_bounds(m, s, stripes) for s in range(stripes)]
    np.testing.assert_array_equal(bounds[0][0], 0)
    np.testing.assert_array_equal(bounds[-1][1], m)
    for (_, hi), (lo, _) in zip(bounds, bounds[1:]):
        np.testing.assert_array_equal(hi, lo)
    for lo, hi in bounds:
        assert ((hi - lo == m // stripes) | (hi - lo == m // stripes + 1)).all()


@pytest.mark.parametrize("stripe, stripes", [(0, 0), (-1, 2), (2, 2), (0, -3), (0.5, 2), (0, None)])
def test_a_stripe_out_of_range_is_a_bad_argument(stripe, stripes):
    with pytest.raises(ResidencyError) as ei:
        stripe_bounds(np.array([4]), stripe, stripes)
    assert ei.value.code == "BAD_ARGUMENT" and "stripe" in str(ei.value)


def test_stripe_bounds_refuse_negative_counts():
    with pytest.raises(ResidencyError) as ei:
        stripe_bounds(np.array([3, -1]), 0, 2)
    assert ei.value.code == "BAD_ARGUMENT" and "clamp" in str(ei.value)


def test_the_stripe_plans_of_per_row_plans_together_are_the_plan():
    """stripe_plan: counts clamped to [0, ld], entries of -1 left out, each stripe sorted
    by host row; the stripes' entries, together, are every entry of the plan once."""
    rows = np.array([[1, 4, 6, 9], [2, 3, -1, 8], [5, 7, 0, 0]], np.int32)
    slots = np.array([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]], np.int32)
    counts = np.array([99, 3, -4], np.int32)  # 4 (clamped), 3 (one -1), 0 (clamped)
    parts = [stripe_plan(rows, slots, counts, s, 3) for s in range(3)]
    for p in parts:
        assert (np.diff(p.rows) >= 0).all()
    got = sorted(zip(np.concatenate([p.rows for p in parts]).tolist(), np.concatenate([p.slots for p in parts]).tolist()))
    assert got == [(1, 10), (2, 20), (3, 21), (4, 11), (6, 12), (9, 13)]
    assert stripe_plan(rows, slots, counts, 0, 3).slots.tolist() == [10, 20]  # row 0: entry 0 of 4; row 1: 0 of 3
    with pytest.raises(ResidencyError):
        stripe_plan(rows, slots[:2], counts, 0, 1)


@pytest.mark.parametrize("engine", [False, True])
def test_push_gives_a_peer_the_rows_of_the_plan_and_nothing_else(engine):
    """Each of 3 ranks gathers its stripe, then pushes it to the other two: every slab ends
    as a full gather leaves it (rank 2's slab the daemon's, or an engine's paged buffer),
    the bytes outside the plan untouched."""
    lay, pool, _, _, _, res = setup()
    r = res.resolve(0, np.array([2, 0, 1], np.int32), np.array([[5, 17, -1], [39, 0, 5], [1, 2, 3]], np.int32))
    geo = SlabGeometry.paged(lay, [64 + layer * 800 for layer in range(lay.num_layers)], first_block=0,
                             block_size=3, block_stride=3 * 32 + 32, buffer_bytes=64 + lay.num_layers * 800).check(lay)
    layers = lay.groups[0]
    slabs, movers, want = [], [], []
    for rank in range(3):
        paged = engine and rank == 2
        slab = np.full(geo.buffer_bytes if paged else lay.slab_shape, SENTINEL - rank, np.uint8)
        ref = slab.copy()
        CpuMover(lay, pool, ref, None, geometry=geo if paged else None).gather(r.plan, layers)
        slabs.append(slab)
        movers.append(CpuMover(lay, pool, slab, None, geometry=geo if paged else None))
        want.append(ref)
    parts = [stripe_plan(r.plan.rows[None], r.plan.slots[None], [len(r.plan)], s, 3) for s in range(3)]
    assert sum(len(p) for p in parts) == len(r.plan) == 8
    for s in range(3):
        movers[s].gather(parts[s], layers)
    for s in range(3):
        for d in range(3):
            if d != s:
                assert movers[s].push(parts[s], layers, movers[d]) == len(parts[s]) * 2 * lay.row_bytes
    for d in range(3):
        np.testing.assert_array_equal(slabs[d], want[d], err_msg=f"rank {d}")
        assert (slabs[d] != SENTINEL - d).any()
