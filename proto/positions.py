"""Logical token positions -> host rows (DESIGN §6): the one rule every path follows.

An engine that speaks positions gives, per batch row, a block table (the host block of
each logical block of its request, -1 = none) and a block size. A top-k column holding
position ``p`` names host row::

    block_table[b, p // block_size] * block_size + p % block_size

A position < 0, past the table, or on a -1 block becomes :data:`UNMAPPED` (-2), an
out-of-range id (slot -1, not a miss, counted in ``out_of_range``). Host-row top-k batches
use -1 for "no id" (not counted); position batches have none: every negative position counts.

On the GPU the same rule is ``skv_host_row`` (``csrc/positions.cuh``), which every kernel
that maps positions calls; the host paths (replay, the portable handle with a top-k on the
host or without CuPy) call :func:`host_rows`.
"""

from __future__ import annotations

import numpy as np

from .args import whole_number

UNMAPPED = -2  # an id the residency counts as out of range (< -1), never a miss
INT32_MAX = int(np.iinfo(np.int32).max)


def host_rows(positions, block_table, block_size: int, table_rows=None) -> np.ndarray:
    """Map ``positions`` int [batch, k] through ``block_table`` int [rows, max_blocks]
    with ``block_size`` tokens per block; returns int32 [batch, k] host rows,
    :data:`UNMAPPED` where a position does not map (negative, past the table, on a -1
    block, or a row beyond int32). Row ``b`` of the positions uses table row
    ``table_rows[b]`` (int [batch]; -1: none, every position unmapped), or row ``b`` when
    ``table_rows`` is None (the table then has ``batch`` rows).

    Raises ValueError naming the argument whose shape or value is wrong."""
    pos = np.asarray(positions)
    table = np.asarray(block_table)
    if pos.ndim != 2:
        raise ValueError(f"positions must be [batch, k], got shape {pos.shape}")
    if table_rows is None:
        if table.ndim != 2 or table.shape[0] != pos.shape[0]:
            raise ValueError(f"block_table must be [batch, max_blocks] with batch {pos.shape[0]}, got {table.shape}")
    else:
        table_rows = np.asarray(table_rows)
        if table.ndim != 2:
            raise ValueError(f"block_table must be [rows, max_blocks], got {table.shape}")
        if table_rows.shape != pos.shape[:1] or not np.issubdtype(table_rows.dtype, np.integer):
            raise ValueError(f"table_rows must be integers [batch={pos.shape[0]}], got {table_rows.dtype} "
                             f"{table_rows.shape}")
        if table_rows.size and (int(table_rows.min()) < -1 or int(table_rows.max()) >= table.shape[0]):
            raise ValueError(f"table_rows must lie in [-1, {table.shape[0]}) (the block table's rows)")
    if not np.issubdtype(pos.dtype, np.integer) or not np.issubdtype(table.dtype, np.integer):
        raise ValueError(f"positions and block_table must be integer arrays, got {pos.dtype} and {table.dtype}")
    bs = whole_number("block_size", block_size)  # 4.5, "4" or True: no cast
    if bs <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    batch, max_blocks = pos.shape[0], table.shape[1]
    if max_blocks == 0 or pos.size == 0 or table.size == 0:
        return np.full(pos.shape, UNMAPPED, dtype=np.int32)
    # Few passes, 32-bit where the values allow (this runs per index group each step:
    # docs/PERF.md). The table gets a column of -1 (where every position outside it goes)
    # and a row of -1 (table row -1's), so one look-up and one test leave only real blocks.
    rows_n = table.shape[0]
    top = int(table.max())
    narrow = (pos.dtype.itemsize < 4 or pos.dtype == np.int32) and table.dtype.itemsize <= 4 and bs <= INT32_MAX \
        and top <= (INT32_MAX - (bs - 1)) // bs  # hb * bs + off never passes int32
    wide = np.int32 if narrow else np.int64
    padded = np.full((rows_n + 1, max_blocks + 1), -1, dtype=wide)
    padded[:rows_n, :max_blocks] = table
    pos = pos.astype(wide, copy=False)
    if bs & (bs - 1) == 0:
        blk, off = pos >> (bs.bit_length() - 1), pos & (bs - 1)
    else:
        blk, off = np.divmod(pos, bs)
    # A negative block (a negative position) is huge unsigned: one clip sends both it and
    # a block past the table to the column of -1.
    ublk = blk.view(np.uint32 if narrow else np.uint64)
    np.minimum(ublk, max_blocks, out=ublk)
    trow = np.arange(batch, dtype=np.intp) if table_rows is None else \
        np.where(table_rows < 0, rows_n, table_rows).astype(np.intp)
    flat = ublk.astype(np.intp)
    flat += (trow * (max_blocks + 1))[:, None]
    hb = padded.reshape(-1).take(flat)
    ok = hb >= 0
    if not narrow:  # a block whose rows are all past int32 stays past it (no wrap-around)
        np.minimum(hb, INT32_MAX // bs + 1, out=hb)
    hb *= bs
    hb += off
    if not narrow:
        ok &= hb <= INT32_MAX
    return np.where(ok, hb, UNMAPPED).astype(np.int32, copy=False)
