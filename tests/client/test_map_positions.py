"""``swap_in_kernels.map_positions`` (csrc/handle.cu's ``skv_map_positions_*`` on the GPU)
agrees with ``proto.positions.host_rows``, case by case: the device rule against the host
rule (tests/csrc/test_positions_on_cpu.py runs the same kernel on the CPU emulator)."""

from __future__ import annotations

import numpy as np
import pytest

import position_cases
from sparsekv.proto.positions import INT32_MAX, UNMAPPED

pytestmark = pytest.mark.cuda
torch = pytest.importorskip("torch")
pytest.importorskip("cupy")
from sparsekv.client.swap_in_kernels import map_positions  # noqa: E402 - after the skip


def _on_gpu(pos, table, bs, reqs):
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
    got = map_positions(t(pos), t(table), bs, t(reqs))
    assert got.dtype == torch.int32 and got.is_cuda
    return got.cpu().numpy()


def test_agrees_with_host_rows_on_random_batches():
    """position_cases.cases, powers of two and other block sizes."""
    for case, bs, pos, table, reqs in position_cases.cases(400, [1, 2, 3, 6, 16, 64, 1000, 2**20]):
        np.testing.assert_array_equal(_on_gpu(pos, table, bs, reqs), position_cases.expected(pos, table, bs, reqs),
                                      err_msg=f"case {case}: bs {bs} {pos.dtype} {table.dtype}")


def test_rows_past_int32_never_wrap_and_the_last_int32_row_maps():
    table = np.array([[2**30 - 1, 2**30, INT32_MAX, 2**62, -1]], np.int64)
    pos = np.array([[0, 1, 2, 3, 5, 7, 9, -1, 10]], np.int64)
    got = _on_gpu(pos, table, 2, np.zeros(1, np.int32))
    assert got.tolist() == [[INT32_MAX - 1, INT32_MAX] + [UNMAPPED] * 7]
