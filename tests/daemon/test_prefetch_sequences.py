"""Prefetch (DESIGN §4) on one engine (RankState + EngineSpace + the NumPy residency and
mover) over random programs of writes, steps (resets, invalidations, padding rows, several
tokens of a request) and every index group's top-k: equal to the reference model per
(index group, state row) with its counters, every hot slot holding the pool's current
bytes of the row it owns, and every slot a top-k of the step named still holding its
row when the step ends (the engine reads them all before the next step)."""

import numpy as np
from hypothesis import given, settings, strategies as st

import helpers
from engine_program import ProgramEngine, programs

GROUPINGS = [((0,), (1,), (2,)), ((0, 2), (1,)), ((0,), (1, 2))]


def inval(lay):
    return st.lists(st.integers(-1, lay.host_rows - 1), min_size=2, max_size=2)


def run(program) -> int:
    """Run ``program`` with prefetch on, checking the model and the slab invariant as it
    goes; return the slots named in a step that no longer held their row's bytes at the
    step's end."""
    lay, steps, seed = program
    eng = ProgramEngine(lay, seed)
    pool, slab, rank, model = eng.pool, eng.slab, eng.rank, eng.model
    rank.prefetch = True
    prefetched = hits = wasted = stale = 0
    for t, (writes, batch, reset, inval, group_topk) in enumerate(steps):
        eng.begin(t, writes, batch, reset, inval)
        told = []  # (group, batch row, host row, slot) the engine was told this step
        for g, rows in group_topk:
            res, _ = rank.topk(t, g, np.array(rows, np.int32))
            for b, s in enumerate(batch):
                if s < 0:
                    continue
                want, _, _ = model[g][s].resolve(rows[b], lay.host_rows)
                assert res.slots[b].tolist() == want
                told += [(g, s, r, slot) for r, slot in zip(rows[b], want) if slot >= 0]
            if rank.pending_prefetch is not None:  # as the daemon: once the reply is out
                deltas = rank.run_prefetch()
                prefetched += deltas["prefetched"]
                hits += deltas["prefetch_hits"]
                wasted += deltas["prefetch_wasted"]
                want_plan = [p for b, s in enumerate(batch) if s >= 0
                             for p in model[g + 1][s].prefetch(rows[b], lay.host_rows, lay.top_k)]
                assert deltas["prefetched"] == len(want_plan)
        for g, layers in enumerate(lay.groups):
            for s in range(lay.max_reqs):
                assert rank.residency.owner[g, s].tolist() == model[g][s].owner
                assert rank.residency.lru[g, s].tolist() == model[g][s].lru
                for slot in np.flatnonzero(rank.residency.owner[g, s] >= 0):
                    row = rank.residency.owner[g, s, slot]
                    for layer in layers:
                        assert np.array_equal(slab[layer, s, slot], pool[layer, row]), (g, s, slot, layer)
        stale += sum(any(not np.array_equal(slab[layer, s, slot], pool[layer, r]) for layer in lay.groups[g])
                     for g, s, r, slot in told)
    r = rank.residency
    assert r.prefetch_hits == sum(m.prefetch_hits for regions in model for m in regions)
    assert r.prefetch_wasted == sum(m.prefetch_wasted for regions in model for m in regions)
    d = rank.prefetch_outcomes()  # what the counters have not reported yet (a write's, a reset's)
    assert (hits + d["prefetch_hits"], wasted + d["prefetch_wasted"]) == (r.prefetch_hits, r.prefetch_wasted)
    assert r.prefetch_hits + r.prefetch_wasted <= prefetched
    return stale


@settings(max_examples=helpers.examples(60, 2500), deadline=None)
@given(programs(GROUPINGS, spare_slots=4, max_host_rows=24, inval=inval, ordered=True))
def test_prefetch_in_group_order_equals_the_model_and_never_spoils_a_named_slot(program):
    assert run(program) == 0


@settings(max_examples=helpers.examples(60, 2500), deadline=None)
@given(programs(GROUPINGS, spare_slots=4, max_host_rows=24, inval=inval))
def test_prefetch_with_the_groups_of_a_step_in_any_order_never_spoils_a_named_slot(program):
    assert run(program) == 0
