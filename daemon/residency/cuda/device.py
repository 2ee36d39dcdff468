"""What the CUDA residency and mover share: the error record of ``csrc/common.cuh``, the
resolve's output buffers (:class:`ResolveOutput`), the workspace size, launch helpers.
``cupy`` is imported lazily (:func:`cp_module`).
"""

from __future__ import annotations

import contextlib

import numpy as np

from sparsekv.proto.device_errors import ERROR_KINDS  # the record's kinds, shared with clients
from sparsekv.proto.layout import Layout
from sparsekv.proto.step_block import DESC_INTS, write_desc

from ..base import ResidencyError

SETUP_BLOCKS = 1024  # cap for the grid-stride reset/invalidate kernels
STEP_BLOCKS = 128  # fixed grid of skv_begin_step (blocks stride over batch rows x groups)

ERR_INTS = 32  # the error record (csrc/common.cuh): int32[ERR_INTS]
E_DUPLICATE_IDS, E_CORRUPT_STATE, E_BAD_STATE_ROW, E_TOO_MANY_TOKENS, E_BAD_STEP = range(5)
# Bits of ResolveOutput.read_counters()["errors"]: 1 << kind.
ERR_DUPLICATE_IDS = 1 << E_DUPLICATE_IDS
ERR_CORRUPT_STATE = 1 << E_CORRUPT_STATE
ERR_BAD_STATE_ROW = 1 << E_BAD_STATE_ROW
# Indices into the per-group counters (u64 [3] used of 4).
HITS, MISSES, OUT_OF_RANGE = range(3)
COUNTERS_PER_GROUP = 4
# Indices into the prefetch counters (u64 [4], csrc/common.cuh SKV_PF_*), one set for all
# groups: skv_prefetch counts the first, skv_resolve the hits, every kernel that empties or
# refills a fresh slot the wasted.
PF_PREFETCHED, PF_HITS, PF_WASTED = range(3)
PF_COUNTERS = 4


def cp_module():
    """``cupy``, imported on first use."""
    import cupy

    return cupy


def error_bits(err) -> int:
    """The bits (1 << kind) of the kinds an error record (host int32 [ERR_INTS]) counted."""
    return sum(1 << e for e in range(len(ERROR_KINDS)) if int(err[e]))


def make_desc(batch: int = 0, k: int = 0, group: int = 0, inv_n: int = 0, step: int = 0, seq: int = 0) -> np.ndarray:
    """A step descriptor (host int32 [DESC_INTS])."""
    d = np.zeros(DESC_INTS, np.int32)
    write_desc(d, seq=seq, step=step, batch=batch, k=k, group=group, inv_n=inv_n)
    return d


def rows_block(rows, cap: int | None = None) -> np.ndarray:
    """``[n, rows sorted ascending...]`` (int32; negative rows dropped), the input of
    ``skv_invalidate``, padded with -1 to ``1 + cap`` entries when ``cap`` is given."""
    rows = np.asarray(rows, dtype=np.int32).reshape(-1)
    rows = np.sort(rows[rows >= 0])
    n = 1 + (cap if cap is not None else rows.size)
    out = np.full(n, -1, np.int32)
    out[0] = rows.size
    out[1 : 1 + rows.size] = rows
    return out


def pow2(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


def _a16(n: int) -> int:
    return (n + 15) & ~15


def resolve_workspace_bytes(k: int, region_stride: int, hash_scale: int = 2, lru_smem: bool = False,
                            owner_smem: bool = False) -> int:
    """Bytes of one resolve block's workspace for ``k`` columns (mirrors ``skv_ws`` of
    csrc/resolve.cu, built with ``hash_scale``, ``lru_smem``, ``owner_smem``)."""
    kp = pow2(k)
    rows = 1 + int(bool(lru_smem)) + int(bool(owner_smem))
    base = _a16(kp * 8) + 2 * _a16(k * 4) + 3 * _a16((region_stride + 31) // 32 * 4) + rows * _a16(region_stride * 4)
    return base + _a16(2 * hash_scale * kp * 4)


def prefetch_workspace_bytes(k: int, region_stride: int) -> int:
    """Dynamic shared memory of one ``skv_prefetch`` block for ``k`` columns (mirrors
    ``skv_pf_ws`` of csrc/prefetch.cu): the table ``2 x 2 pow2(k)`` ints, two ``int[k]``,
    a slot bitmask, the old lru row and the slots' takers ``int[S]`` each."""
    s = region_stride
    return 2 * _a16(2 * pow2(k) * 4) + 2 * _a16(k * 4) + _a16((s + 31) // 32 * 4) + 2 * _a16(s * 4)


def fresh_marks(shape: tuple[int, ...], xp=np):
    """The prefetch marks (uint8 ``shape``, zero) in an allocation padded to a multiple of
    4 bytes: the kernels clear a mark with an atomic on its aligned 32-bit word."""
    n = int(np.prod(shape))
    return xp.zeros(-(-n // 4) * 4, dtype=xp.uint8)[:n].reshape(shape)


def null_ptr():
    return np.uint64(0)


class ResolveOutput:
    """Device buffers of one resolve, fixed shapes ``[max_batch, top_k]``: ``slots``,
    ``misses`` and the per-row plans ``plan_rows`` / ``plan_slots`` as ``skv_resolve``
    writes them (csrc/resolve.cu); ``counters`` (uint64 [4]: hits, misses, out-of-range
    ids, **accumulated** until :meth:`zero_counters`); ``err``, the error record; ``desc``,
    the last resolve's descriptor. ``batch``, ``k`` and ``group`` (host ints) record the
    last resolve for ``gather_async``.
    """

    def __init__(self, layout: Layout, max_batch: int, workspace_bytes: int = 0, stream=None):
        cp = cp_module()
        if max_batch <= 0:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        self.max_batch = int(max_batch)
        self.top_k = layout.top_k
        with stream if stream is not None else contextlib.nullcontext():
            self.slots = cp.full((max_batch, layout.top_k), -1, dtype=cp.int32)
            self.misses = cp.zeros(max_batch, dtype=cp.int32)
            self.plan_rows = cp.full((max_batch, layout.top_k), -1, dtype=cp.int32)
            self.plan_slots = cp.full((max_batch, layout.top_k), -1, dtype=cp.int32)
            self.counters = cp.zeros(4, dtype=cp.uint64)
            self.err = cp.zeros(ERR_INTS, dtype=cp.int32)
            self.desc = cp.zeros(DESC_INTS, dtype=cp.int32)
            # Global scratch for strides whose workspace does not fit in shared memory.
            self.workspace = cp.empty(max_batch * workspace_bytes, dtype=cp.uint8) if workspace_bytes else None
        self.workspace_bytes = int(workspace_bytes)
        self.batch = 0
        self.k = 0
        self.group = -1

    def zero_counters(self, stream=None) -> None:
        with stream if stream is not None else contextlib.nullcontext():
            self.counters.fill(0)
            self.err.fill(0)

    def read_counters(self, stream=None) -> dict:
        """Synchronise ``stream`` and return the counters and the error bits (tests)."""
        if stream is not None:
            stream.synchronize()
        c = self.counters.get()
        return {"hits": int(c[HITS]), "misses": int(c[MISSES]), "out_of_range": int(c[OUT_OF_RANGE]),
                "errors": error_bits(self.err.get())}


def grid_blocks(total: int, threads: int, cap: int) -> int:
    return max(1, min(cap, -(-total // threads)))


def device_i32(a, name: str, ndim: int):
    """A C-contiguous int32 device array. A device array of that kind passes through; any
    other integer array is converted (on the current stream; a host array is uploaded)."""
    cp = cp_module()
    if a.ndim != ndim:
        raise ResidencyError("BAD_ARGUMENT", f"{name} must have {ndim} dimension(s), got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise ResidencyError("BAD_ARGUMENT", f"{name} must hold integers, got {a.dtype}")
    a = cp.asarray(a)
    if a.dtype != cp.int32:
        a = a.astype(cp.int32)
    return cp.ascontiguousarray(a)


def smem_limit(kernel) -> int:
    """Dynamic shared memory a block of ``kernel`` may opt in to."""
    cp = cp_module()
    rt = cp.cuda.runtime
    dev = cp.cuda.Device().id
    optin = rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)
    return int(optin) - int(kernel.shared_size_bytes)
