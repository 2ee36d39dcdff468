"""CpuMover: the gather copies exactly the plan for every layer of the index group (and
nothing else), prefill staging copies whole rows to the front of the staging buffer."""

import numpy as np
import pytest

from sparsekv.daemon.residency.base import Plan, ResidencyError
from sparsekv.daemon.residency.cpu import CpuMover, CpuResidency
from sparsekv.proto import Layout

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
    from sparsekv.proto.slab import SlabGeometry

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
