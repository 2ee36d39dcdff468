"""``swap_in_kernels.map_positions`` (csrc/handle.cu's ``skv_map_positions_*`` on the GPU)
agrees with ``proto.positions.host_rows``, case by case: the device rule against the host
rule (tests/csrc/test_positions_on_cpu.py runs the same kernel on the CPU emulator)."""

from __future__ import annotations

import numpy as np
import pytest

from sparsekv.proto.positions import INT32_MAX, UNMAPPED, host_rows

pytestmark = pytest.mark.cuda
torch = pytest.importorskip("torch")
pytest.importorskip("cupy")
from sparsekv.client.swap_in_kernels import map_positions  # noqa: E402 - after the skip


def _on_gpu(pos, table, bs, reqs):
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
    got = map_positions(t(pos), t(table), bs, t(reqs))
    assert got.dtype == torch.int32 and got.is_cuda
    return got.cpu().numpy()


def _expected(pos, table, bs, reqs):
    inside = (reqs >= 0) & (reqs < table.shape[0])  # outside the table: maps nothing
    want = host_rows(pos, table, bs, table_rows=np.where(inside, reqs, -1))
    return np.where(inside[:, None], want, UNMAPPED)


def test_agrees_with_host_rows_on_random_batches():
    """Random tables (null blocks, blocks whose rows pass int32), positions (negative, past
    the table), block sizes (powers of two and not), request rows (padding, past the
    table, several tokens on one row), int32 and int64 inputs."""
    rng = np.random.default_rng(11)
    for case in range(400):
        bs = int(rng.choice([1, 2, 3, 6, 16, 64, 1000, 2**20]))
        rows_n, max_blocks, k, tokens = (int(rng.integers(1, 6)), int(rng.integers(1, 9)), int(rng.integers(1, 12)),
                                         int(rng.integers(1, 7)))
        tdt, pdt = rng.choice([np.int32, np.int64]), rng.choice([np.int32, np.int64])
        hi = min(np.iinfo(tdt).max, (INT32_MAX // bs + 3) if case % 3 == 0 else 40)
        table = rng.integers(-1, hi, (rows_n, max_blocks), endpoint=True).astype(tdt)
        pos = rng.integers(-2 * bs, max_blocks * bs + 2 * bs, (tokens, k)).astype(pdt)
        reqs = rng.integers(-1, rows_n + 1, tokens).astype(np.int32)
        np.testing.assert_array_equal(_on_gpu(pos, table, bs, reqs), _expected(pos, table, bs, reqs),
                                      err_msg=f"case {case}: bs {bs} {pdt} {tdt}")


def test_rows_past_int32_never_wrap_and_the_last_int32_row_maps():
    table = np.array([[2**30 - 1, 2**30, INT32_MAX, 2**62, -1]], np.int64)
    pos = np.array([[0, 1, 2, 3, 5, 7, 9, -1, 10]], np.int64)
    got = _on_gpu(pos, table, 2, np.zeros(1, np.int32))
    assert got.tolist() == [[INT32_MAX - 1, INT32_MAX] + [UNMAPPED] * 7]
