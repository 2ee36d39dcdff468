"""One engine (RankState + EngineSpace + the NumPy residency and mover) over a random pool,
driven beside the reference model per (index group, state row), and the random programs
that drive it: what the engine and prefetch property tests share (``tests/daemon/test_engine_property.py``,
``test_prefetch_sequences.py``)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from sparsekv.daemon.engine import EngineSpace, RankState
from sparsekv.daemon.residency.contract import RegionModel
from sparsekv.daemon.residency.cpu import CpuMover, CpuResidency
from sparsekv.proto import Layout


@st.composite
def programs(draw, groupings, spare_slots: int, max_host_rows: int, inval, ordered: bool = False):
    """(layout, steps, seed): 3 layers in one of ``groupings``, top_k 1-4, 1-3 query tokens
    of a request a step, ``region_stride`` up to ``spare_slots`` above what they need; up
    to 10 steps of (writes, batch of 1-4 state rows (-1: padding), resets, invalidations
    (``inval(lay)``: a strategy of one batch row's), every group's top-k as (group, rows)),
    the groups in index order when ``ordered``, else in any order."""
    top_k = draw(st.integers(1, 4))
    tokens = draw(st.integers(1, 3))  # query tokens per request and step
    lay = Layout(num_layers=3, row_bytes=16, top_k=top_k,
                 region_stride=draw(st.integers(top_k * tokens, top_k * tokens + spare_slots)),
                 max_reqs=draw(st.integers(1, 3)), host_rows=draw(st.integers(top_k + 1, max_host_rows)),
                 index_groups=draw(st.sampled_from(groupings)), max_batch=4).validate()  # batches of 1..4 rows
    steps = []
    for _ in range(draw(st.integers(1, 10))):
        writes = draw(st.lists(st.integers(0, lay.host_rows - 1), max_size=3, unique=True))
        batch, used = [], {}
        for _ in range(draw(st.integers(1, 4))):
            s = draw(st.integers(-1, lay.max_reqs - 1))
            if s >= 0 and used.get(s, 0) >= tokens:
                s = -1
            used[s] = used.get(s, 0) + 1
            batch.append(s)
        reset = [draw(st.booleans()) for _ in batch]
        invalidate = [draw(inval(lay)) for _ in batch]
        groups = range(lay.num_groups) if ordered else draw(st.permutations(range(lay.num_groups)))
        group_topk = []
        for g in groups:
            rows = []
            for _ in batch:
                ids = draw(st.lists(st.integers(0, lay.host_rows - 1), max_size=top_k, unique=True))
                ids += draw(st.lists(st.sampled_from([-1, -3, lay.host_rows]), min_size=top_k - len(ids),
                                     max_size=top_k - len(ids)))
                rows.append(draw(st.permutations(ids)))
            group_topk.append((g, rows))
        steps.append((writes, batch, reset, invalidate, group_topk))
    return lay, steps, draw(st.integers(0, 2**16))


class ProgramEngine:
    def __init__(self, lay, seed: int):
        self.lay = lay
        self.rng = np.random.default_rng(seed)
        self.pool = self.rng.integers(0, 256, (lay.num_layers, lay.host_rows, lay.row_bytes), dtype=np.uint8)
        self.slab = np.zeros((lay.num_layers, lay.max_reqs, lay.region_stride, lay.row_bytes), np.uint8)
        self.space = EngineSpace("e", lay, self.pool)
        self.rank = self.space.ranks[1] = RankState(0, "cpu", CpuResidency(lay), CpuMover(lay, self.pool, self.slab, None),
                                                    self.slab, None)
        self.model = [[RegionModel(lay.region_stride) for _ in range(lay.max_reqs)] for _ in range(lay.num_groups)]

    def begin(self, t: int, writes, batch, reset, inval) -> np.ndarray | None:
        """Step ``t``'s writes (random bytes into the pool, as an engine's prefill; returned)
        and then its STEP, on the engine and the model in the daemon's order."""
        data = None
        if writes:
            rows = np.array(writes, np.int32)
            data = self.rng.integers(0, 256, (self.lay.num_layers, rows.size, self.lay.row_bytes), dtype=np.uint8)
            self.space.write(None, rows, data)
            for regions in self.model:
                for m in regions:
                    m.invalidate(writes)
        self.rank.begin_step(t, np.array(batch, np.int32), np.array(reset), np.array(inval, np.int32))
        for b, s in enumerate(batch):
            if s >= 0 and reset[b]:
                for regions in self.model:
                    regions[s].reset()
        for b, s in enumerate(batch):
            if s >= 0:
                for regions in self.model:
                    regions[s].invalidate([r for r in inval[b] if r >= 0])
        return data
