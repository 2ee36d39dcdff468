"""client/torch_positions.py: the torch twin of proto.positions.host_rows agrees with it."""

from __future__ import annotations

import numpy as np
import pytest

from sparsekv.proto.positions import INT32_MAX, UNMAPPED, host_rows

torch = pytest.importorskip("torch")
from sparsekv.client.torch_positions import torch_host_rows  # noqa: E402 - after the skip

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _both(pos, table, bs, table_rows, device):
    want = host_rows(pos, table, bs, table_rows=table_rows)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    got = torch_host_rows(t(pos), t(table), bs, None if table_rows is None else t(table_rows))
    assert got.dtype == torch.int32 and got.device.type == device
    return want, got.cpu().numpy()


@pytest.mark.parametrize("device", DEVICES)
def test_agrees_with_host_rows_on_random_batches(device):
    """Random tables (null blocks, values up to and past int32 rows, 16- to 64-bit),
    positions (negative, past the table), block sizes (powers of two and not) and table
    rows (-1 padding tokens, several tokens on one row): the same rows, case by case."""
    rng = np.random.default_rng(11)
    dtypes = [np.int16, np.int32, np.int64, np.uint8]
    for case in range(400):
        bs = int(rng.choice([1, 2, 3, 6, 16, 64, 1000, 2**20]))
        rows_n, max_blocks, k = int(rng.integers(1, 6)), int(rng.integers(0, 9)), int(rng.integers(0, 12))
        batch = int(rng.integers(0, 7))
        tdt, pdt = rng.choice(dtypes[:3]), rng.choice(dtypes)
        hi = min(np.iinfo(tdt).max, (INT32_MAX // bs + 3) if case % 3 == 0 else 40)
        table = rng.integers(-1, hi, (rows_n, max_blocks), endpoint=True).astype(tdt)
        lo = 0 if np.dtype(pdt).kind == "u" else -2 * bs
        top = min(np.iinfo(pdt).max, max_blocks * bs + 2 * bs)
        pos = rng.integers(lo, max(lo + 1, top), (batch, k)).astype(pdt)
        table_rows = None
        if case % 2:
            table_rows = rng.integers(-1, rows_n, batch).astype(np.int32)
        elif rows_n != batch:
            table = np.resize(table, (batch, max_blocks)).astype(tdt)
        want, got = _both(pos, table, bs, table_rows, device)
        np.testing.assert_array_equal(got, want, err_msg=f"case {case}: bs {bs} {pdt} {tdt}")


@pytest.mark.parametrize("device", DEVICES)
def test_rows_past_int32_never_wrap_and_the_last_int32_row_maps(device):
    table = np.array([[2**30 - 1, 2**30, INT32_MAX, 2**62, -1]], np.int64)
    pos = np.array([[0, 1, 2, 3, 5, 7, 9, -1, 10]], np.int64)
    want, got = _both(pos, table, 2, None, device)
    np.testing.assert_array_equal(got, want)
    assert got.tolist() == [[INT32_MAX - 1, INT32_MAX] + [UNMAPPED] * 7]


def test_table_rows_outside_the_table_map_nothing_without_reading_past_it():
    """host_rows refuses such rows; the torch twin cannot check values without waiting for
    the device, so it maps nothing (and never indexes outside the table)."""
    table = torch.tensor([[3, 4]], dtype=torch.int32)
    got = torch_host_rows(torch.tensor([[0, 5], [0, 5], [1, 6]]), table, 4, torch.tensor([1, -7, 0]))
    assert got.tolist() == [[UNMAPPED, UNMAPPED], [UNMAPPED, UNMAPPED], [13, 18]]


@pytest.mark.parametrize(
    "pos, table, bs, rows, words",
    [
        (torch.zeros(3, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32), 4, None, "positions must be [batch, k]"),
        (torch.zeros(2, 3, dtype=torch.int32), torch.zeros(3, 2, dtype=torch.int32), 4, None,
         "block_table must be [batch, max_blocks] with batch 2"),
        (torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), 4, None, "block_table must be [rows"),
        (torch.zeros(1, 3), torch.zeros(1, 2, dtype=torch.int32), 4, None, "must be integer tensors"),
        (torch.zeros(1, 3, dtype=torch.bool), torch.zeros(1, 2, dtype=torch.int32), 4, None, "must be integer tensors"),
        (torch.zeros(1, 3, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32), 0, None, "block_size must lie"),
        (torch.zeros(1, 3, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32), 2**31, None, "block_size must lie"),
        (torch.zeros(2, 3, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32), 4, torch.zeros(3, dtype=torch.int32),
         "table_rows must be integers [batch=2]"),
    ],
)
def test_wrong_shapes_and_types_raise_naming_the_argument(pos, table, bs, rows, words):
    with pytest.raises(ValueError) as ei:
        torch_host_rows(pos, table, bs, rows)
    assert words in str(ei.value)
