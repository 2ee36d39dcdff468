"""Logical token positions -> host rows (DESIGN §6): the one rule every path follows.

An engine that speaks positions gives, per batch row, a block table (the host block of
each logical block of its request, -1 = none) and a block size. A top-k column holding
position ``p`` names host row::

    block_table[b, p // block_size] * block_size + p % block_size

A position < 0, past the table, or on a -1 block becomes :data:`UNMAPPED` (-2): the
residency treats it like any out-of-range id (slot -1, not a miss, counted in
``out_of_range``, never read). Host-row top-k batches use -1 for "no id" (not counted);
position batches have no such value: every negative position is counted.

The device handle (``csrc/handle.cu``, ``skv_db_topk``) applies the same rule on the GPU;
the host paths (replay and the portable swap-in over zmq or in process) call
:func:`host_rows`.
"""

from __future__ import annotations

import numpy as np

UNMAPPED = -2  # an id the residency counts as out of range (< -1), never a miss


def host_rows(positions, block_table, block_size: int) -> np.ndarray:
    """Map ``positions`` int [batch, k] through ``block_table`` int [batch, max_blocks]
    (row ``b`` of the table serves row ``b`` of the positions) with ``block_size`` tokens
    per block; returns int32 [batch, k] host rows, :data:`UNMAPPED` where a position does
    not map (negative, past the table, on a -1 block, or a row beyond int32).

    Raises ValueError naming the argument whose shape or value is wrong."""
    pos = np.asarray(positions)
    table = np.asarray(block_table)
    if pos.ndim != 2:
        raise ValueError(f"positions must be [batch, k], got shape {pos.shape}")
    if table.ndim != 2 or table.shape[0] != pos.shape[0]:
        raise ValueError(f"block_table must be [batch, max_blocks] with batch {pos.shape[0]}, got {table.shape}")
    if not np.issubdtype(pos.dtype, np.integer) or not np.issubdtype(table.dtype, np.integer):
        raise ValueError(f"positions and block_table must be integer arrays, got {pos.dtype} and {table.dtype}")
    bs = int(block_size)
    if bs <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    pos = pos.astype(np.int64, copy=False)
    max_blocks = table.shape[1]
    blk = np.where(pos >= 0, pos // bs, -1)
    ok = (pos >= 0) & (blk < max_blocks)
    safe_blk = np.where(ok, blk, 0)
    if max_blocks:
        hb = np.take_along_axis(table.astype(np.int64, copy=False), safe_blk, axis=1)
    else:
        hb = np.full(pos.shape, -1, dtype=np.int64)
    ok &= hb >= 0
    rows = hb * bs + np.where(ok, pos % bs, 0)
    ok &= rows <= np.iinfo(np.int32).max
    return np.where(ok, rows, UNMAPPED).astype(np.int32)
