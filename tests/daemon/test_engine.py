"""RankState and EngineSpace: step ordering (resets, then invalidations, then top-k), the
write path (pool first, then every rank's hot copies dropped), and input checks that
leave the state unchanged."""

import numpy as np
import pytest

import helpers
from sparsekv.daemon.engine import EngineSpace, RankState, check_layers
from sparsekv.daemon.residency.base import as_ids
from sparsekv.daemon.residency.base import ResidencyError
from sparsekv.daemon.residency.cpu import CpuMover, CpuResidency


def engine(ranks=1, **kw):
    lay = helpers.layout(**kw)
    pool = np.zeros((lay.num_layers, lay.host_rows, lay.row_bytes), np.uint8)
    for layer in range(lay.num_layers):
        pool[layer] = helpers.gen_pattern(layer, np.arange(lay.host_rows), lay.row_bytes)
    space = EngineSpace("e", lay, pool)
    states = []
    for cid in range(ranks):
        slab = np.zeros((lay.num_layers, lay.max_reqs, lay.region_stride, lay.row_bytes), np.uint8)
        st = RankState(cid, "cpu", CpuResidency(lay), CpuMover(lay, pool, slab, None), slab, None)
        space.ranks[cid] = st
        states.append(st)
    return lay, space, states


def test_resets_and_invalidations_of_a_step_apply_before_its_topk():
    lay, _, (st,) = engine()
    st.begin_step(0, [0], None, None)
    st.topk(0, 0, [[1, 2, 3, 4]])
    st.begin_step(1, [0], [True], [[9, -1]])
    assert (st.residency.owner[:, 0] == -1).all()
    res, _ = st.topk(1, 0, [[1, 2, 3, 4]])
    assert res.misses.tolist() == [4]


def test_step_invalidation_applies_to_its_batch_rows_state_row_only():
    lay, _, (st,) = engine()
    st.begin_step(0, [0, 1], None, None)
    st.topk(0, 0, [[1, 2, -1, -1], [1, 2, -1, -1]])
    st.begin_step(1, [0, 1], None, [[2, -1], [-1, -1]])
    res, _ = st.topk(1, 0, [[1, 2, -1, -1], [1, 2, -1, -1]])
    assert res.misses.tolist() == [1, 0]


def test_padding_batch_rows_ignore_their_reset_and_invalidate():
    lay, _, (st,) = engine()
    st.begin_step(0, [0], None, None)
    st.topk(0, 0, [[1, 2, 3, -1]])
    before = st.residency.owner.copy()
    st.begin_step(1, [-1], [True], [[1, 2]])
    assert np.array_equal(st.residency.owner, before)


@pytest.mark.parametrize(
    "state_rows, reset, invalidate, code, words",
    [
        ([0, 9], None, None, "BAD_STATE_ROW", "state row 9"),
        ([[0]], None, None, "BAD_ARGUMENT", "state_rows must have 1 dimension"),
        ([0, 1], [True], None, "BAD_ARGUMENT", "reset must be"),
        ([0, 1], np.array([np.nan, 0.0]), None, "BAD_ARGUMENT", "reset must be bool"),
        ([0, 1], np.array([7, 0], np.int32), None, "BAD_ARGUMENT", "reset must be bool"),
        ([0, 1], [True, True], [[1]], "BAD_ARGUMENT", "invalidate must be"),
        ([0, 1], [True, True], [1, 2], "BAD_ARGUMENT", "invalidate must have 2 dimension"),
        (np.array([0.0]), None, None, "BAD_ARGUMENT", "must hold integers"),
        (np.array([2**40]), None, None, "BAD_ARGUMENT", "outside int32"),
        # invalidated host rows: -1 (none) or in [0, host_rows); found by an adversarial review
        ([0, 1], None, [[1], [64]], "BAD_ARGUMENT", "invalidate holds 64"),
        ([0, 1], None, [[-7], [1]], "BAD_ARGUMENT", "invalidate holds -7"),
    ],
)
def test_bad_step_is_rejected_without_state_change(state_rows, reset, invalidate, code, words):
    lay, _, (st,) = engine()
    st.begin_step(0, [0, 1], None, None)
    st.topk(0, 0, [[1, 2, 3, 4], [5, 6, 7, 8]])
    owner, step = st.residency.owner.copy(), st.step
    with pytest.raises(ResidencyError) as ei:
        st.begin_step(1, state_rows, reset, invalidate)
    assert ei.value.code == code and words in str(ei.value)
    assert np.array_equal(st.residency.owner, owner) and st.step == step


def test_topk_for_a_step_that_was_not_begun_is_an_error():
    _, _, (st,) = engine()
    st.begin_step(3, [0], None, None)
    with pytest.raises(ResidencyError) as ei:
        st.topk(4, 0, [[1, 2, 3, 4]])
    assert ei.value.code == "BAD_ARGUMENT" and "send STEP first" in str(ei.value)
    # with explicit state rows no STEP is needed
    res, _ = st.topk(4, 0, [[1, 2, 3, 4]], state_rows=[1])
    assert res.misses.tolist() == [4]


def test_topk_gathers_current_pool_bytes_into_the_slab():
    lay, space, (st,) = engine()
    st.begin_step(0, [2], None, None)
    res, moved = st.topk(0, 1, [[10, 63, -1, 0]])
    assert moved == 3 * lay.row_bytes
    assert helpers.bad_rows(st.slab, lay.groups[1], np.array([2]), np.array([[10, 63, -1, 0]]), res.slots,
                            lay.host_rows) == 0
    assert (st.slab[0] == 0).all()  # group 0 (layer 0) not touched


def test_write_lands_in_the_pool_and_drops_hot_copies_in_every_rank():
    lay, space, ranks = engine(ranks=2)
    topk = [[5, 6, 7, -1]]
    for st in ranks:
        st.begin_step(0, [1], None, None)
        st.topk(0, 0, topk)
    gen = np.zeros(lay.host_rows, np.int64)
    gen[6] = 1
    data = np.stack([helpers.gen_pattern(layer, [6], lay.row_bytes, gen) for layer in range(lay.num_layers)])
    nbytes, dropped = space.write(None, [6], data)
    assert nbytes == lay.num_layers * lay.row_bytes
    assert dropped == 2  # one slot in each rank (group 0 only held it)
    assert np.array_equal(space.read([0, 1], [6]), data)
    for st in ranks:
        st.begin_step(1, [1], None, None)
        res, _ = st.topk(1, 0, topk)
        assert res.misses.tolist() == [1] and res.slots[0, 1] >= 0
        assert helpers.bad_rows(st.slab, (0,), np.array([1]), np.array(topk), res.slots, lay.host_rows, gen) == 0


def test_write_of_some_layers_leaves_the_others():
    lay, space, _ = engine()
    before = space.pool.copy()
    space.write([1], [3], np.full((1, 1, lay.row_bytes), 7, np.uint8))
    assert (space.pool[1, 3] == 7).all()
    assert np.array_equal(space.pool[0], before[0])


@pytest.mark.parametrize(
    "layers, rows, shape, dtype, words",
    [
        (None, [64], (2, 1, 32), np.uint8, "write rows must lie in [0, 64)"),
        (None, [-1], (2, 1, 32), np.uint8, "write rows must lie"),
        (None, [1], (1, 1, 32), np.uint8, "write data must be uint8 [2, 1, 32]"),
        (None, [1], (2, 1, 32), np.int32, "write data must be uint8"),
        ([2], [1], (1, 1, 32), np.uint8, "layers must lie in [0, 2)"),
        ("x", [1], (1, 1, 32), np.uint8, "layers must be a list"),
    ],
)
def test_bad_write_is_rejected_and_the_pool_is_unchanged(layers, rows, shape, dtype, words):
    lay, space, _ = engine()
    before = space.pool.copy()
    with pytest.raises(ResidencyError) as ei:
        space.write(layers, rows, np.ones(shape, dtype))
    assert ei.value.code == "BAD_ARGUMENT" and words in str(ei.value)
    assert np.array_equal(space.pool, before)


def test_as_ids_and_check_layers():
    assert as_ids("x", np.array([1, 2], np.int64), 1).dtype == np.int32
    assert check_layers(helpers.layout(num_layers=3), None) == (0, 1, 2)
    assert check_layers(helpers.layout(num_layers=3), [2, 0]) == (2, 0)
    assert check_layers(helpers.layout(num_layers=3), np.array([1, 2])) == (1, 2)
    # A layer named twice would be copied twice (a list of them multiplied a STAGE's work;
    # on cuda, WRITE_STAGED overflowed its layer table: INTERNAL); floats and bools are no
    # layer numbers (1.5 was taken as 1).
    for bad, words in (([0, 0], "names a layer twice"), ([1.5], "integers"), ([True], "integers"),
                       (["1"], "integers"), ("01", "a list of layer numbers"), (3, "a list of layer numbers"),
                       (np.array(0), "a list of layer numbers"), (np.array([0.0]), "integers"),
                       ([np.bool_(True)], "integers")):
        with pytest.raises(ResidencyError, match=words):
            check_layers(helpers.layout(num_layers=3), bad)
