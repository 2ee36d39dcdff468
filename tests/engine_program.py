"""One engine (RankState + EngineSpace + the NumPy residency and mover) over a random pool,
driven beside the reference model per (index group, state row): what the engine and
prefetch property tests share (``tests/daemon/test_engine_property.py``,
``test_prefetch_sequences.py``)."""

from __future__ import annotations

import numpy as np

from sparsekv.daemon.engine import EngineSpace, RankState
from sparsekv.daemon.residency.contract import RegionModel
from sparsekv.daemon.residency.cpu import CpuMover, CpuResidency


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
