"""sparsekv bench kernels' striped gather (cuda): the section runs on the GPUs the machine
has (or two slabs on one) and gives its ratio under the key that names them."""

import mmap

import numpy as np
import pytest

from sparsekv.bench import kernels_scattered as ks
from sparsekv.bench.kernels_striped import striped_section
from sparsekv.daemon.kernels import get_cache
from sparsekv.daemon.pinned import PinnedRegion


@pytest.mark.cuda
def test_the_striped_section_times_both_ways_under_its_key():
    import cupy as cp

    gpus = min(cp.cuda.runtime.getDeviceCount(), 8)
    key = f"striped_gather_vs_per_rank_{gpus}gpu" if gpus > 1 else "striped_gather_vs_per_rank_1gpu_2slabs"
    window = ks.TOP_K  # the smallest window the bench's top-k fits: a pool of 64 x 2048 rows
    pool_rows = ks.BATCH * window
    mapping = mmap.mmap(-1, pool_rows * ks.ROW_BYTES)
    pool = np.frombuffer(mapping, dtype=np.uint8)
    out: dict = {}
    rows: list = []
    with PinnedRegion(pool.ctypes.data, pool.nbytes, ks.ROW_BYTES) as region:
        striped_section(out, lambda *r: rows.append(r), cp, get_cache(), region, pool.nbytes,
                        np.random.default_rng(3), rounds=2, window=window)
    if rows and rows[0][1] == "skipped":
        pytest.skip(rows[0][2])  # GPUs without peer access
    assert len(rows) == 2 and out[key] > 0 and out[f"{key}_step_us"] > 0
