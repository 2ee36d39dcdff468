"""Logical positions -> host rows with torch, on the positions' own device.

The same rule as :func:`sparsekv.proto.positions.host_rows` (DESIGN §6), for a caller
whose top-k is a tensor on the GPU: the portable handle (``client/swap_in.py``) maps there
and copies only the rows to the host, instead of the top-k and the block table, and does
not run a dozen NumPy passes over ``tokens x k`` values per index group on the host.
``tests/client/test_torch_positions.py`` checks the two functions against each other.

Every look-up stays inside the tensors it reads whatever the values (a bad index on the
GPU would end the caller's CUDA context): positions outside the table go to a column of
-1, a table row outside ``[0, rows)`` to a row of -1.
"""

from __future__ import annotations

from sparsekv.proto.positions import INT32_MAX, UNMAPPED


def is_int_dtype(dtype) -> bool:
    """Whether a torch dtype holds integers (not floating, complex or bool): what a
    top-k, a block table or request ids must be."""
    return not (dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool")


def torch_host_rows(positions, block_table, block_size: int, table_rows=None):
    """``host_rows`` on torch tensors: ``positions`` int [batch, k] (any device),
    ``block_table`` int [rows, max_blocks] (moved to the positions' device when it is not
    there), ``table_rows`` int [batch] (-1: none) or None (row ``b`` for batch row ``b``);
    returns int32 [batch, k] on the positions' device, :data:`UNMAPPED` where a position
    does not map. Does not wait for the device.

    Raises ValueError for a shape or dtype ``host_rows`` refuses, or a ``block_size``
    outside ``[1, 2**31)``; values are not checked against each other on the host (that
    would wait for the device): a ``table_rows`` entry outside ``[-1, rows)`` maps
    nothing, where ``host_rows`` raises."""
    import torch  # noqa: PLC0415 - only callers with tensors reach this

    if positions.dim() != 2:
        raise ValueError(f"positions must be [batch, k], got shape {tuple(positions.shape)}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [rows, max_blocks], got {tuple(block_table.shape)}")
    if not (is_int_dtype(positions.dtype) and is_int_dtype(block_table.dtype)):
        raise ValueError(f"positions and block_table must be integer tensors, got {positions.dtype} and "
                         f"{block_table.dtype}")
    bs = int(block_size)
    if not 0 < bs <= INT32_MAX:
        raise ValueError(f"block_size must lie in [1, 2**31), got {block_size}")
    batch = positions.shape[0]
    dev = positions.device
    if table_rows is None:
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must be [batch, max_blocks] with batch {batch}, got "
                             f"{tuple(block_table.shape)}")
        trow = torch.arange(batch, device=dev, dtype=torch.int64)
    else:
        if tuple(table_rows.shape) != (batch,):
            raise ValueError(f"table_rows must be integers [batch={batch}], got {tuple(table_rows.shape)}")
        trow = table_rows.to(device=dev, dtype=torch.int64)
    rows_n, max_blocks = block_table.shape
    if max_blocks == 0 or rows_n == 0 or positions.numel() == 0:
        return torch.full(tuple(positions.shape), UNMAPPED, dtype=torch.int32, device=dev)
    # The table padded with a row and a column of -1, flat: every position that maps to
    # nothing looks up a -1 there.
    padded = torch.full((rows_n + 1, max_blocks + 1), -1, dtype=torch.int64, device=dev)
    padded[:rows_n, :max_blocks] = block_table
    pos = positions.to(torch.int64)
    blk = torch.div(pos, bs, rounding_mode="floor")
    off = pos - blk * bs
    blk.clamp_(max=max_blocks).masked_fill_(pos < 0, max_blocks)
    trow = trow.masked_fill((trow < 0) | (trow >= rows_n), rows_n)
    blk += (trow * (max_blocks + 1))[:, None]
    hb = padded.view(-1)[blk]
    ok = hb >= 0
    hb.clamp_(max=INT32_MAX // bs + 1)  # a block whose rows all pass int32 stays past it
    hb.mul_(bs).add_(off)
    ok &= hb <= INT32_MAX
    return hb.masked_fill_(~ok, UNMAPPED).to(torch.int32)
