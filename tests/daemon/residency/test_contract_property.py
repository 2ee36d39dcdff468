"""The NumPy engine against the reference model, on random batches with prefetches between
them (hypothesis)."""

import numpy as np
from hypothesis import given, settings, strategies as st

import helpers

from sparsekv.daemon.residency.contract import RegionModel
from sparsekv.daemon.residency.cpu import CpuResidency
from sparsekv.proto.layout import Layout


@st.composite
def rows(draw, top_k: int, host_rows: int):
    """A top-k row: unique ids, fillers and out-of-range values, shuffled."""
    ids = draw(st.lists(st.integers(0, host_rows - 1), min_size=0, max_size=top_k, unique=True))
    junk = draw(st.lists(st.sampled_from([-1, -7, host_rows, host_rows + 3]), max_size=top_k - len(ids),
                         min_size=top_k - len(ids)))
    return list(draw(st.permutations(ids + junk)))


@st.composite
def scenarios(draw):
    top_k = draw(st.integers(1, 6))
    tokens = draw(st.integers(1, 2))
    region_stride = draw(st.integers(top_k * tokens, top_k * tokens + 5))
    host_rows = draw(st.integers(top_k, 24))
    max_reqs = draw(st.integers(1, 3))
    steps = []
    for _ in range(draw(st.integers(1, 12))):
        batch = []
        used = {}
        for _ in range(draw(st.integers(1, 4))):
            s = draw(st.integers(-1, max_reqs - 1))
            if s >= 0 and used.get(s, 0) >= tokens:
                s = -1
            used[s] = used.get(s, 0) + 1
            batch.append((s, draw(rows(top_k, host_rows))))
        # a prefetch into the same regions (the next group's, as the daemon's) after the batch
        ahead = [(s, draw(rows(top_k, host_rows))) for s, _ in batch] if draw(st.booleans()) else None
        reset = draw(st.lists(st.integers(0, max_reqs - 1), max_size=2))
        inval = draw(st.lists(st.tuples(st.integers(0, max_reqs - 1), st.integers(0, host_rows - 1)), max_size=3))
        steps.append((reset, inval, batch, ahead))
    # max_batch 4: batches of up to 4 rows (padding and several tokens of one request).
    return Layout(num_layers=1, row_bytes=16, top_k=top_k, region_stride=region_stride,
                  max_reqs=max_reqs, host_rows=host_rows, max_batch=4), steps


@settings(max_examples=helpers.examples(50, 5000), deadline=None)
@given(scenarios())
def test_numpy_engine_equals_reference(scenario):
    layout, steps = scenario
    eng = CpuResidency(layout)
    model = [RegionModel(layout.region_stride) for _ in range(layout.max_reqs)]
    for reset, inval, batch, ahead in steps:
        eng.reset(np.array(reset, dtype=np.int32))
        for s in reset:
            model[s].reset()
        for s, row in inval:
            eng.invalidate(s, np.array([row]))
            model[s].invalidate([row])
        state_rows = np.array([s for s, _ in batch], dtype=np.int32)
        topk = np.array([r for _, r in batch], dtype=np.int32)
        got = eng.resolve(0, state_rows, topk)
        want_plan = []
        for b, (s, row) in enumerate(batch):
            if s < 0:
                assert (got.slots[b] == -1).all() and got.misses[b] == 0
                continue
            slots, plan, _ = model[s].resolve(row, layout.host_rows)
            assert got.slots[b].tolist() == slots
            assert got.misses[b] == len(plan)
            want_plan += [(g, s * layout.region_stride + slot) for g, slot in plan]
        assert sorted(zip(got.plan.rows.tolist(), got.plan.slots.tolist())) == sorted(want_plan)
        assert list(got.plan.rows) == sorted(got.plan.rows)
        if ahead is not None:
            got = eng.prefetch(0, state_rows, np.array([r for _, r in ahead], dtype=np.int32))
            want_plan = [(g, s * layout.region_stride + slot) for s, row in ahead if s >= 0
                         for g, slot in model[s].prefetch(row, layout.host_rows, layout.top_k)]
            last = {slot: g for g, slot in want_plan}  # a later token may retake a slot: its row is copied
            assert sorted(zip(got.rows.tolist(), got.slots.tolist())) == sorted((g, slot) for slot, g in last.items())
        for s in range(layout.max_reqs):
            assert eng.owner[0, s].tolist() == model[s].owner
            assert eng.lru[0, s].tolist() == model[s].lru
        assert eng.prefetched == sum(m.prefetched for m in model)
        assert eng.prefetch_hits == sum(m.prefetch_hits for m in model)
        assert eng.prefetch_wasted == sum(m.prefetch_wasted for m in model)
