"""The daemon's CUDA kernel modules: their entry points, their constants, and ``warm``
(compile every module at start, before READY). Compiling and the on-disk cubin cache are
``sparsekv.csrc.build`` (shared with the client's handle kernels); its names are
re-exported here.

This module imports ``cupy`` only when a kernel is first needed: importing it on a machine
without CUDA works.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from sparsekv.csrc import build
from sparsekv.csrc.build import (  # noqa: F401 - re-exported
    CACHE_ENV,
    DEFAULT_CACHE_DIR,
    DEFAULT_SMEM_BYTES,
    OPTIONS,
    cache_dir,
    csrc_dir,
    load_source,
)

# Kernel entry points by source file; warm() compiles every module listed here.
SOURCES: dict[str, tuple[str, ...]] = {
    "resolve.cu": ("skv_resolve", "skv_reset", "skv_invalidate", "skv_begin_step"),
    "copy.cu": ("skv_copy_rows", "skv_gather", "skv_fetch", "skv_merge_plan", "skv_gather_merged"),
    "signal.cu": ("skv_wait_word", "skv_set_word"),
}

# One block per batch row. 1024 threads since session 17: with a collective's warp totals
# summed by warp reductions (csrc/common.cuh SKV_WARP_TOTALS_REDUX) the resolve fits 64
# registers a thread, and at batch 64, top-k 2048, region 4096 it timed 13.8 us against
# 14.3 at 768 (one H200 run; docs/PERF.md). Before that, 768 was faster (sessions 9-10:
# 17.9 / 18.6 / 17.9 us against 19.2 / 20.0 / 19.7 at 1024, which spilled).
RESOLVE_THREADS = 1024
COPY_THREADS = 256
COPY_LOAD = 1  # __ldg: the source of a copy is never written while it runs
COPY_LOADS = (0, 1, 2, 3, 4)  # csrc/copy.cu SKV_COPY_LOAD
MERGE_THREADS = 1024  # skv_merge_plan: one block per batch row
TMA_MAX_STAGES = 8  # csrc/copy.cu SKV_TMA_STAGES: one-row buffers per thread of a TMA gather


RESOLVE_LOOKUPS = {"sort": 0, "hash": 1}  # csrc/resolve.cu SKV_RESOLVE_LOOKUP
# csrc/resolve.cu without the defaults of sessions 16-17 (fused passes, one barrier a
# collective, phase 1 in waves, the lru's seen marks set in phase 1, warp totals by warp
# reductions): what `sparsekv bench kernels` times the default against (at session 15's
# 768 threads), and what tests/csrc checks beside it.
RESOLVE_PLAIN = {"SKV_FUSE": 0, "SKV_ONE_BARRIER": 0, "SKV_P1_BATCH": 0, "SKV_SEEN_COVER": 0,
                 "SKV_WARP_TOTALS_REDUX": 0}
RESOLVE_PLAIN_THREADS = 768


HASH_SCALES = (2, 4)  # csrc/resolve.cu SKV_HASH_SCALE: table entries per power-of-two column
DEFAULT_HASH_SCALE = 2


def resolve_defines(threads: int = RESOLVE_THREADS, lookup: str = "sort", hash_scale: int = DEFAULT_HASH_SCALE,
                    lru_smem: bool = False, owner_smem: bool = False, ws_smem: bool = False) -> dict:
    """Constants of the residency module (csrc/resolve.cu): threads per block, how a row's
    columns are found from the region's owners (``sort`` or ``hash``), the hash
    table's size (``hash_scale`` entries per power-of-two column), and whether the new lru
    row and the owner row live in the workspace (``lru_smem``, ``owner_smem``);
    ``ws_smem``: the workspace is in shared memory, known when the module is built (its
    accesses then compile to shared-memory instructions; the launch passes no global
    workspace)."""
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"resolve threads must be a multiple of 32 in [32, 1024], got {threads}")
    if lookup not in RESOLVE_LOOKUPS:
        raise ValueError(f"resolve lookup must be one of {', '.join(RESOLVE_LOOKUPS)}, got {lookup!r}")
    if hash_scale not in HASH_SCALES:
        raise ValueError(f"hash scale must be one of {HASH_SCALES}, got {hash_scale!r}")
    out = {"SKV_RESOLVE_THREADS": int(threads)}
    if lookup != "sort":  # the default module keeps its cache key
        out["SKV_RESOLVE_LOOKUP"] = RESOLVE_LOOKUPS[lookup]
        if hash_scale != DEFAULT_HASH_SCALE:
            out["SKV_HASH_SCALE"] = int(hash_scale)
    if lru_smem:  # the defaults keep the module's cache key
        out["SKV_LRU_SMEM"] = 1
    if owner_smem:
        out["SKV_OWNER_SMEM"] = 1
    if ws_smem:
        out["SKV_WS_SMEM"] = 1
    return out


def copy_defines(row_bytes: int, threads: int = COPY_THREADS, load: int = COPY_LOAD, tma_stages: int = 0) -> dict:
    """Constants of the copy module: 16-byte vectors per row, threads, load flavour
    (0 plain, 1 ``__ldg``, 2 ``__ldcs``, 3 / 4 ``ld.global.nc`` with an L2 fetch of 256 /
    128 bytes; csrc/copy.cu); ``tma_stages`` > 0: the decode gather moves rows by bulk
    asynchronous copies (sm_90's TMA), that many one-row buffers a thread (csrc/copy.cu
    ``SKV_COPY_TMA``)."""
    if row_bytes % 16 or row_bytes <= 0:
        raise ValueError(f"row_bytes {row_bytes} must be a positive multiple of 16")
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"copy threads must be a multiple of 32 in [32, 1024], got {threads}")
    if load not in COPY_LOADS:
        raise ValueError(f"load must be one of {COPY_LOADS}, got {load}")
    if not 0 <= tma_stages <= TMA_MAX_STAGES:
        raise ValueError(f"tma_stages must be in [0, {TMA_MAX_STAGES}], got {tma_stages}")
    out = {"SKV_ROW_VECS": row_bytes // 16, "SKV_COPY_THREADS": int(threads), "SKV_COPY_LOAD": int(load),
           "SKV_MERGE_THREADS": MERGE_THREADS}
    if tma_stages:  # the default module keeps its cache key
        out["SKV_COPY_TMA"] = 1
        out["SKV_TMA_STAGES"] = int(tma_stages)
    return out


def tma_gather_smem(row_bytes: int, threads: int, stages: int, max_batch: int) -> int:
    """Dynamic shared memory of a TMA gather block (csrc/copy.cu ``skv_copy_body_tma``):
    the per-row prefix (128-aligned), the threads' row buffers, their mbarriers."""
    head = -(-(max_batch + 1) * 8 // 128) * 128
    return head + threads * stages * row_bytes + threads * stages * 8


class KernelCache(build.KernelCache):
    """:class:`sparsekv.csrc.build.KernelCache` plus :meth:`warm` for the daemon's modules."""

    def warm(
        self,
        row_bytes: Iterable[int] = (656,),
        resolve_threads: Iterable[int] | None = None,
        copy_threads: Iterable[int] | None = None,
    ) -> list[str]:
        """Compile every module up front (at daemon start, not on the first decode step).

        Returns the function names loaded. ``row_bytes`` lists the row sizes of the
        layouts to serve (the copy kernel is specialised on ``row_bytes / 16``).
        """
        from .residency.cuda import resolve_lookup  # noqa: PLC0415 - it imports this module

        names = []
        lookup = resolve_lookup()
        # The residency modules CudaResidency builds for that lookup: the workspace in
        # shared memory with the x4 table and the owner and lru rows (most layouts), the
        # x4 table alone or the x2 (wider regions), and in global memory (the widest).
        rows = {"ws_smem": True, "lru_smem": True, "owner_smem": True}
        variants = [{"hash_scale": 4, **rows}, {"hash_scale": 4, "ws_smem": True}, {"hash_scale": 2, "ws_smem": True},
                    {"hash_scale": 2}] if lookup == "hash" else [rows, {"ws_smem": True}, {}]
        for threads in resolve_threads or (RESOLVE_THREADS,):
            for v in variants:
                for fn in SOURCES["resolve.cu"]:
                    self.function("resolve.cu", fn, resolve_defines(threads, lookup, **v))
                    names.append(fn)
        for rb in row_bytes:
            for threads in copy_threads or (COPY_THREADS,):
                for fn in SOURCES["copy.cu"]:
                    self.function("copy.cu", fn, copy_defines(rb, threads))
                    names.append(fn)
        for fn in SOURCES["signal.cu"]:
            self.function("signal.cu", fn)
            names.append(fn)
        return names


def get_cache(cache_dir_: str | os.PathLike | None = None) -> KernelCache:
    """The process-wide daemon :class:`KernelCache` for a cache directory."""
    return build.get_cache(cache_dir_, KernelCache)


def warm(cache_dir_: str | os.PathLike | None = None, row_bytes: Iterable[int] = (656,)) -> list[str]:
    """Compile every kernel module into the cache (see :meth:`KernelCache.warm`)."""
    return get_cache(cache_dir_).warm(row_bytes=row_bytes)
