"""``skv_map_positions_*`` (csrc/handle.cu, through ``skv_host_row`` of
csrc/positions.cuh) on the fiber emulator agrees with ``proto.positions.host_rows``, the
host rule, case by case. The same comparison runs on the GPU in
tests/client/test_map_positions.py (marked cuda)."""

from __future__ import annotations

import numpy as np
import pytest

import cpu_kernels
from sparsekv.proto.positions import INT32_MAX, UNMAPPED, host_rows

pytestmark = pytest.mark.skipif(cpu_kernels.compiler() is None, reason="no C++ compiler for the kernel emulator")


def expected(pos, table, bs, reqs):
    """host_rows, with a token whose table row is outside [0, rows) mapping nothing (the
    kernel's rule; host_rows refuses such a row)."""
    inside = (reqs >= 0) & (reqs < table.shape[0])
    want = host_rows(pos, table, bs, table_rows=np.where(inside, reqs, -1))
    return np.where(inside[:, None], want, UNMAPPED)


def test_the_kernel_maps_random_batches_as_host_rows():
    """Random tables (null blocks, blocks whose rows pass int32), positions (negative, past
    the table), block sizes (powers of two and not), request rows (padding, past the
    table, several tokens on one row), int32 and int64 inputs, one and several blocks."""
    rng = np.random.default_rng(11)
    for case in range(60):
        bs = int(rng.choice([1, 3, 16, 1000, 2**20]))
        rows_n, max_blocks, k, tokens = (int(rng.integers(1, 6)), int(rng.integers(1, 9)), int(rng.integers(1, 12)),
                                         int(rng.integers(1, 7)))
        tdt, pdt = rng.choice([np.int32, np.int64]), rng.choice([np.int32, np.int64])
        hi = min(np.iinfo(tdt).max, (INT32_MAX // bs + 3) if case % 3 == 0 else 40)
        table = rng.integers(-1, hi, (rows_n, max_blocks), endpoint=True).astype(tdt)
        pos = rng.integers(-2 * bs, max_blocks * bs + 2 * bs, (tokens, k)).astype(pdt)
        reqs = rng.integers(-1, rows_n + 1, tokens).astype(np.int32)
        got = cpu_kernels.map_positions(1 + case % 3, 32, pos, table, bs, reqs)
        np.testing.assert_array_equal(got, expected(pos, table, bs, reqs), err_msg=f"case {case}: bs {bs}")


def test_rows_past_int32_never_wrap_and_the_last_int32_row_maps():
    table = np.array([[2**30 - 1, 2**30, INT32_MAX, 2**62, -1]], np.int64)
    pos = np.array([[0, 1, 2, 3, 5, 7, 9, -1, 10]], np.int64)
    got = cpu_kernels.map_positions(1, 32, pos, table, 2, np.zeros(1, np.int32))
    assert got.tolist() == [[INT32_MAX - 1, INT32_MAX] + [UNMAPPED] * 7]
