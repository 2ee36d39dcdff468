"""Random programs of steps, top-k batches and writes on one engine (RankState +
EngineSpace + the NumPy residency and mover), checked against the reference model per
(index group, state row), and the gather invariant: every hot slot holds, in every layer
of its group, the current pool bytes of the row it owns."""

import numpy as np
from hypothesis import given, settings, strategies as st

import helpers
from engine_program import ProgramEngine, programs

GROUPINGS = [((0,), (1,), (2,)), ((0, 1, 2),), ((0, 2), (1,))]


@settings(max_examples=helpers.examples(30, 2500), deadline=None)
@given(programs(GROUPINGS, spare_slots=3, max_host_rows=20,
                inval=lambda lay: st.lists(st.integers(0, lay.host_rows - 1), min_size=1, max_size=1).map(
                    lambda r: r + [-1])))
def test_engine_equals_reference_and_hot_slots_hold_current_pool_bytes(program):
    lay, steps, seed = program
    eng = ProgramEngine(lay, seed)
    pool, slab, rank, model = eng.pool, eng.slab, eng.rank, eng.model
    for t, (writes, batch, reset, inval, group_topk) in enumerate(steps):
        data = eng.begin(t, writes, batch, reset, inval)
        if writes:
            assert np.array_equal(pool[:, np.array(writes)], data)
        for g, rows in group_topk:
            res, moved = rank.topk(t, g, np.array(rows, np.int32))
            n_miss = 0
            for b, s in enumerate(batch):
                if s < 0:
                    assert (res.slots[b] == -1).all()
                    continue
                want, plan, _ = model[g][s].resolve(rows[b], lay.host_rows)
                assert res.slots[b].tolist() == want
                n_miss += len(plan)
            assert int(res.misses.sum()) == n_miss
            assert moved == n_miss * len(lay.groups[g]) * lay.row_bytes
        res_owner = rank.residency.owner
        for g, layers in enumerate(lay.groups):
            for s in range(lay.max_reqs):
                assert res_owner[g, s].tolist() == model[g][s].owner
                assert rank.residency.lru[g, s].tolist() == model[g][s].lru
                for slot in np.flatnonzero(res_owner[g, s] >= 0):
                    row = res_owner[g, s, slot]
                    for layer in layers:
                        assert np.array_equal(slab[layer, s, slot], pool[layer, row]), (g, s, slot, layer)
