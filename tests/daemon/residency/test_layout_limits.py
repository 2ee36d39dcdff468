"""What one rank costs the daemon, and the limits a request cannot exceed: the residency
state (owner and lru, int32 each per slot and index group) counts with the hot slab, so a
layout of tiny rows cannot turn a 256 MiB slab into 2 GiB of daemon memory unchecked;
a top-k batch longer than the layout's ``max_batch`` is refused before any work (padding
rows cost as much as live ones)."""

import numpy as np
import pytest

import helpers
from sparsekv.daemon.residency.base import ResidencyError, check_batch, check_layout_limits, rank_bytes
from sparsekv.daemon.residency.cpu import CpuResidency
from sparsekv.proto import Layout

MiB, GiB = 1 << 20, 1 << 30


def test_tiny_rows_cost_nine_times_their_slab_in_state():
    # 256 MiB of one-byte rows, one index group per layer: 2.25 GiB of owner, lru and marks.
    lay = Layout(num_layers=64, row_bytes=1, top_k=64, region_stride=4096, max_reqs=1024, host_rows=4096).validate()
    parts = rank_bytes(lay)
    state = 9 * 256 * MiB
    assert parts == {"slab": 256 * MiB, "staging": 0, "state": state, "total": 256 * MiB + state}
    with pytest.raises(ResidencyError) as ei:
        check_layout_limits(lay, 1 * GiB)
    assert ei.value.code == "TOO_LARGE"
    assert "2.5GiB (hot slab 256MiB, staging 0B, residency state 2.2GiB)" in str(ei.value)
    assert "max_slab_bytes of 1GiB" in str(ei.value)
    assert check_layout_limits(lay, 3 * GiB) == parts
    # Found by an operator's review: a limit under 1 MiB read "0 MiB"; the limit is named exactly
    with pytest.raises(ResidencyError, match="more than the daemon's max_slab_bytes of 1001B;"):
        check_layout_limits(lay, 1001)


def test_state_bytes_are_what_the_cpu_backend_allocates():
    lay = helpers.layout(num_layers=4, index_groups=((0, 1), (2, 3)), staging_rows=3)
    r = CpuResidency(lay)
    parts = rank_bytes(lay)
    assert parts["state"] == r.owner.nbytes + r.lru.nbytes + r.fresh.nbytes
    assert parts["slab"] == lay.slab_bytes and parts["staging"] == lay.staging_bytes


def test_a_batch_longer_than_max_batch_is_too_large_even_all_padding():
    lay = helpers.layout(max_reqs=4)  # max_batch 4
    r = CpuResidency(lay)
    rows = np.full(32768, -1, np.int32)
    with pytest.raises(ResidencyError) as ei:
        r.resolve(0, rows, np.zeros((32768, 4), np.int32))
    assert ei.value.code == "TOO_LARGE" and "batch of 32768 rows exceeds max_batch 4" in str(ei.value)
    check_batch(lay, 0, rows[:4], np.full((4, 4), -1, np.int32))  # at the limit: fine
