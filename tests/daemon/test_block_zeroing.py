"""The zeroing of a block store's freed blocks (found by an adversarial test: a dead
client's million private blocks, all freed at once, zeroed one by one, held the daemon's
loop for 1.3 s): a run of consecutive blocks at a time, exactly the blocks named."""

import numpy as np

from sparsekv.daemon.engine import EngineSpace
from sparsekv.proto import Layout


def test_zeroing_freed_blocks_zeroes_exactly_them_run_by_run():
    lay = Layout(num_layers=2, row_bytes=16, top_k=4, region_stride=8, max_reqs=1, host_rows=64,
                 index_groups=((0, 1),)).validate()
    rng = np.random.default_rng(0)
    pool = rng.integers(1, 256, size=(2, 64, 16), dtype=np.uint8)
    space = EngineSpace("e", lay, pool)
    space.block_size = 4  # 16 blocks
    space.keys = rng.integers(1, 256, size=(16, 2, 4, 8), dtype=np.uint8)
    before, keys = pool.copy(), space.keys.copy()
    named = [9, 3, 4, 5, 12, 4, 15]  # runs 3-5, then 9, 12, 15; one named twice, out of order
    space.zero_blocks(named)
    gone = np.zeros(16, bool)
    gone[named] = True
    rows = np.repeat(gone, 4)
    assert (pool[:, rows] == 0).all() and (space.keys[gone] == 0).all()
    np.testing.assert_array_equal(pool[:, ~rows], before[:, ~rows])
    np.testing.assert_array_equal(space.keys[~gone], keys[~gone])
    space.zero_blocks([])  # nothing named: nothing changes
    np.testing.assert_array_equal(pool[:, ~rows], before[:, ~rows])
