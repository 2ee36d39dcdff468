"""The portable handle's kernels on a cuda rank (``csrc/handle.cu``), one launch each on
the current torch stream, nothing waited for: :func:`map_positions` (positions -> host
rows, the rule of ``proto/positions.py``) and :func:`indices` (a reply's device slots ->
attention indices, ``skv_db_indices`` without resident blocks).

Used by ``swap_in.py`` for inputs on the GPU, where CuPy is installed (:func:`available`):
a dozen torch operations each would cost more host time per layer (docs/PERF.md).
"""

from __future__ import annotations

import functools
import importlib.util

import numpy as np

from sparsekv.csrc.build import get_cache

from sparsekv.proto.positions import UNMAPPED

from .cuda_stream import external_stream

_TYPES = {"torch.int32": "i32", "torch.int64": "i64"}
_GRID_MAX = 65535  # blocks (grid-stride over tokens beyond)
THREADS = 256  # per block (skv_db_indices: a multiple of 32, at most 1024)


@functools.cache
def available() -> bool:
    """Whether CuPy, which launches these kernels, is installed (not imported here)."""
    return importlib.util.find_spec("cupy") is not None


@functools.cache
def _function(name: str, device: int):
    import cupy as cp  # noqa: PLC0415

    with cp.cuda.Device(device):
        return get_cache().module("handle.cu").get_function(name)


def _launch(name: str, device: int, grid: int, args) -> None:
    import cupy as cp  # noqa: PLC0415
    import torch  # noqa: PLC0415

    stream = torch.cuda.current_stream(device).cuda_stream
    fn = _function(name, device)
    with cp.cuda.Device(device), external_stream(cp, stream):
        fn((max(1, min(grid, _GRID_MAX)),), (THREADS,),
           tuple(np.uint64(a) if isinstance(a, int) else a for a in args))


def map_positions(topk, table, block_size: int, reqs):
    """Host rows int32 ``[tokens, k]`` of ``topk`` (positions, ``[tokens, k]`` on a GPU)
    through ``table`` (``[rows, max_blocks]``, same GPU), token ``t`` reading table row
    ``reqs[t]`` (int32 ``[tokens]``, same GPU; outside ``[0, rows)``: maps nothing);
    ``block_size`` in ``[1, 2**31)``. Narrower integers are widened to int32 on the GPU
    first (lossless); None for a dtype that int64 cannot hold losslessly (uint64)."""
    import torch  # noqa: PLC0415

    topk, table = _widened(torch, topk), _widened(torch, table)
    pt, tt = _TYPES.get(str(topk.dtype)), _TYPES.get(str(table.dtype))
    if pt is None or tt is None:
        return None
    topk, table = topk.contiguous(), table.contiguous()
    tokens, k = topk.shape
    rows_n, max_blocks = table.shape
    out = torch.empty((tokens, k), dtype=torch.int32, device=topk.device)
    if not tokens or not k:
        return out
    if not rows_n or not max_blocks:
        return out.fill_(UNMAPPED)
    i32 = np.int32
    _launch(f"skv_map_positions_{pt}_{tt}", topk.device.index, tokens,
            (out.data_ptr(), reqs.data_ptr(), i32(tokens), table.data_ptr(), i32(rows_n), i32(max_blocks),
             topk.data_ptr(), i32(k), np.int64(block_size)))
    return out


def _widened(torch, t):
    """``t`` as int32 (8- and 16-bit integers) or int64 (uint32), on its GPU; else as is."""
    if t.dtype in (torch.int8, torch.uint8, torch.int16) or str(t.dtype) == "torch.uint16":
        return t.to(torch.int32)
    if str(t.dtype) == "torch.uint32":
        return t.to(torch.int64)
    return t


def indices(slots, reqs, region_stride: int, hot_base: int, max_reqs: int, out, valid) -> None:
    """``out[t, j]`` (int32 ``[tokens, k]``, contiguous) = ``hot_base + reqs[t] * region_stride
    + slots[t, j]`` where the slot is >= 0, else -1 (and -1 for a token whose ``reqs[t]`` is
    outside ``[0, max_reqs)``); ``valid`` (int32 ``[tokens]`` or None): the count of indices
    >= 0 per token. ``slots``: ``[tokens, k]`` rows of a ``[.., ld]`` array; all on one GPU."""
    tokens, k = slots.shape
    if not tokens:
        return
    i32 = np.int32
    _launch("skv_db_indices", slots.device.index, tokens,
            (slots.data_ptr(), i32(slots.stride(0)), reqs.data_ptr(), i32(tokens), 0, i32(k), 0, i32(0),
             i32(max_reqs), i32(1), i32(region_stride), np.int64(hot_base), np.int64(0), 0, 0,
             out.data_ptr(), valid.data_ptr() if valid is not None else 0, 0, 0, 0))
