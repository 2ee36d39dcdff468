"""``skv_gather``'s split of a small batch over the grid (csrc/copy.cu ``skv_gather_rows``:
fewer rows than blocks, gridDim / rows blocks a row) at its edges, on the emulator: every
grid from 1 to 18 blocks against batches of 0 to 8 rows (grids not a multiple of the
rows, idle blocks), counts negative, 0, past ld and at the int32 limits (clamped to
[0, ld]), entries of -1 or outside the pool (skipped); rows of several chunks of a
block's loads. The slab is exactly the plan's rows, the ready word 1 and the arrival
counter 0 after every launch."""

from __future__ import annotations

import numpy as np
import pytest

import cpu_kernels
from sparsekv.daemon.residency.cuda.device import make_desc

pytestmark = pytest.mark.skipif(cpu_kernels.compiler() is None, reason="no C++ compiler for the kernel emulator")


@pytest.mark.parametrize("batch", range(9))
def test_the_gather_split_copies_exactly_the_plan_at_every_grid(batch):
    rng = np.random.default_rng(batch)
    L, host_rows, rb, B, ld, slots_n = 2, 100, 48, 8, 20, 200
    pool = rng.integers(0, 256, size=(L, host_rows, rb), dtype=np.uint8)
    groups = np.array([[2, 0, 1]], np.int32)
    for grid in range(1, 19):
        counts = rng.choice([-5, 0, 1, 7, ld, ld + 7, 2**31 - 1, -2**31], size=B).astype(np.int32)
        rows = rng.integers(-2, host_rows + 2, size=(B, ld)).astype(np.int32)
        slots = rng.permutation(slots_n)[: B * ld].reshape(B, ld).astype(np.int32)
        slots[rng.random((B, ld)) < 0.1] = -1
        slab = rng.integers(0, 256, size=(L, slots_n, rb), dtype=np.uint8)
        want = slab.copy()
        for b in range(batch):
            for i in range(min(max(int(counts[b]), 0), ld)):
                if 0 <= rows[b, i] < host_rows and slots[b, i] >= 0:
                    want[:, slots[b, i]] = pool[:, rows[b, i]]
        ready, arrivals = np.zeros(1, np.uint32), np.zeros(1, np.uint32)
        # 32 threads, one load in flight: a row of 20 entries x 3 vectors is two chunks
        cpu_kernels.gather(make_desc(batch, ld, 0), pool, slab, slots_n, groups, rows, slots, counts, grid=grid,
                           threads=32, ready=ready, arrivals=arrivals, defines={"SKV_COPY_UNROLL": 1})
        np.testing.assert_array_equal(slab, want, err_msg=f"grid {grid}")
        assert ready[0] == 1 and arrivals[0] == 0, f"grid {grid}"
