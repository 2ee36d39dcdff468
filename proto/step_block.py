"""The step block: a decode step as the daemon's kernels read it (checking every value). int32 entries:

    [desc: DESC_INTS] [rows: max_batch] [aux: max_batch] [payload: max_batch * top_k]

* ``desc``: ``SEQ`` (request number, for error reports), ``STEP``, ``BATCH`` (rows),
  ``K`` (top-k columns), ``GROUP`` (index group), ``INV_N`` (invalidate columns),
  ``SLOTS`` (a doorbell TOPK block: 0 as the engine writes it; the daemon's first gather
  of the group sets it to 1 once the block's slots are written); the rest 0;
* ``rows``: the state row of each batch row (-1 = padding);
* ``aux``: a STEP block's reset flag per batch row (0/1);
* ``payload``: a TOPK block's ids ``[batch, K]``, a STEP block's invalidate rows
  ``[batch, INV_N]``, contiguous from the start.

``csrc/common.cuh`` declares the same numbers for the kernels.
"""

from __future__ import annotations

import numpy as np

DESC_INTS = 16
D_SEQ, D_STEP, D_BATCH, D_K, D_GROUP, D_INV_N, D_SLOTS = range(7)


def block_ints(max_batch: int, top_k: int) -> int:
    """int32 entries of one step block."""
    return DESC_INTS + 2 * max_batch + max_batch * top_k


class BlockView:
    """The sections of one step block (a device or host array of ``block_ints`` entries)."""

    def __init__(self, block, max_batch: int):
        self.block = block
        self.desc = block[:DESC_INTS]
        self.rows = block[DESC_INTS: DESC_INTS + max_batch]
        self.aux = block[DESC_INTS + max_batch: DESC_INTS + 2 * max_batch]
        self.payload = block[DESC_INTS + 2 * max_batch:]


def write_desc(d, *, seq: int = 0, step: int = 0, batch: int = 0, k: int = 0, group: int = 0,
               inv_n: int = 0) -> None:
    """Fill a descriptor (host int32 [DESC_INTS], e.g. a block's ``desc``)."""
    d[D_SEQ], d[D_STEP], d[D_BATCH], d[D_K], d[D_GROUP], d[D_INV_N] = \
        seq & 0x7FFFFFFF, step & 0x7FFFFFFF, batch, k, group, inv_n


def write_topk(blk: BlockView, seq: int, step: int, group: int, state_rows: np.ndarray, topk: np.ndarray) -> None:
    """Fill a TOPK block (host memory)."""
    write_topk_head(blk, seq, step, group, state_rows, *topk.shape)
    blk.payload[: topk.size] = topk.reshape(-1)


def write_topk_head(blk: BlockView, seq: int, step: int, group: int, state_rows: np.ndarray, batch: int,
                    k: int) -> None:
    """A TOPK block's descriptor and state rows; its payload (``batch * k`` ids from the
    start of ``blk.payload``) is the caller's to write (a copy from the GPU)."""
    write_desc(blk.desc, seq=seq, step=step, batch=batch, k=k, group=group)
    blk.rows[:batch] = state_rows


def write_step(blk: BlockView, seq: int, step: int, state_rows: np.ndarray, reset, invalidate) -> None:
    """Fill a STEP block (host memory); ``reset`` and ``invalidate`` may be None."""
    batch = state_rows.shape[0]
    n = 0 if invalidate is None else invalidate.shape[1]
    write_desc(blk.desc, seq=seq, step=step, batch=batch, inv_n=n)
    blk.rows[:batch] = state_rows
    blk.aux[:batch] = 0 if reset is None else reset
    if n:
        blk.payload[: batch * n] = invalidate.reshape(-1)
