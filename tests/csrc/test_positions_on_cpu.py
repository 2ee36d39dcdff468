"""``skv_map_positions_*`` (csrc/handle.cu, through ``skv_host_row`` of
csrc/positions.cuh) on the fiber emulator agrees with ``proto.positions.host_rows``, the
host rule, case by case. The same comparison runs on the GPU in
tests/client/test_map_positions.py (marked cuda)."""

from __future__ import annotations

import numpy as np
import pytest

import cpu_kernels
import position_cases
from sparsekv.proto.positions import INT32_MAX, UNMAPPED

pytestmark = pytest.mark.skipif(cpu_kernels.compiler() is None, reason="no C++ compiler for the kernel emulator")


def test_the_kernel_maps_random_batches_as_host_rows():
    """position_cases.cases (powers of two and other block sizes), one and several blocks."""
    for case, bs, pos, table, reqs in position_cases.cases(60, [1, 3, 16, 1000, 2**20]):
        got = cpu_kernels.map_positions(1 + case % 3, 32, pos, table, bs, reqs)
        np.testing.assert_array_equal(got, position_cases.expected(pos, table, bs, reqs),
                                      err_msg=f"case {case}: bs {bs}")


def test_rows_past_int32_never_wrap_and_the_last_int32_row_maps():
    table = np.array([[2**30 - 1, 2**30, INT32_MAX, 2**62, -1]], np.int64)
    pos = np.array([[0, 1, 2, 3, 5, 7, 9, -1, 10]], np.int64)
    got = cpu_kernels.map_positions(1, 32, pos, table, 2, np.zeros(1, np.int32))
    assert got.tolist() == [[INT32_MAX - 1, INT32_MAX] + [UNMAPPED] * 7]
