"""The daemon's CUDA kernel modules: their entry points, their constants, and ``warm``
(compile every module at start, before READY). Compiling and the on-disk cubin cache are
``sparsekv.csrc.build``; ``cupy`` is imported only when a kernel is first needed.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from sparsekv.csrc import build
from sparsekv.csrc.build import CACHE_ENV, DEFAULT_CACHE_DIR, DEFAULT_SMEM_BYTES, cache_dir, load_source  # noqa: F401

# Kernel entry points by source file; warm() compiles every module listed here.
SOURCES: dict[str, tuple[str, ...]] = {
    "resolve.cu": ("skv_resolve", "skv_reset", "skv_invalidate", "skv_begin_step"),
    "copy.cu": ("skv_copy_rows", "skv_gather", "skv_push", "skv_fetch"),
    "prefetch.cu": ("skv_prefetch",),
    "tp.cu": ("skv_tp_check_step", "skv_tp_follow"),
}

RESOLVE_THREADS = 1024
COPY_THREADS = 256

HASH_SCALES = (2, 4)  # csrc/resolve.cu SKV_HASH_SCALE: table entries per power-of-two column
DEFAULT_HASH_SCALE = 2


def resolve_defines(threads: int = RESOLVE_THREADS, hash_scale: int = DEFAULT_HASH_SCALE,
                    lru_smem: bool = False, owner_smem: bool = False, ws_smem: bool = False) -> dict:
    """Constants of the residency module (csrc/resolve.cu): threads per block, the hash
    table's size (``hash_scale`` entries per power-of-two column), whether the new lru row
    and the owner row live in the workspace (``lru_smem``, ``owner_smem``), and whether
    the workspace is in shared memory (``ws_smem``: the launch passes no global one)."""
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"resolve threads must be a multiple of 32 in [32, 1024], got {threads}")
    if hash_scale not in HASH_SCALES:
        raise ValueError(f"hash scale must be one of {HASH_SCALES}, got {hash_scale!r}")
    out = {"SKV_RESOLVE_THREADS": int(threads), "SKV_HASH_SCALE": int(hash_scale)}
    if lru_smem:  # the defaults keep the module's cache key
        out["SKV_LRU_SMEM"] = 1
    if owner_smem:
        out["SKV_OWNER_SMEM"] = 1
    if ws_smem:
        out["SKV_WS_SMEM"] = 1
    return out


def copy_defines(row_bytes: int, threads: int = COPY_THREADS) -> dict:
    """Constants of the copy module (csrc/copy.cu): 16-byte vectors per row, threads."""
    if row_bytes % 16 or row_bytes <= 0:
        raise ValueError(f"row_bytes {row_bytes} must be a positive multiple of 16")
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"copy threads must be a multiple of 32 in [32, 1024], got {threads}")
    return {"SKV_ROW_VECS": row_bytes // 16, "SKV_COPY_THREADS": int(threads)}


class KernelCache(build.KernelCache):
    """:class:`sparsekv.csrc.build.KernelCache` plus :meth:`warm` for the daemon's modules."""

    def warm(self, row_bytes: Iterable[int] = (656,)) -> list[str]:
        """Compile every module up front (at daemon start, not on the first decode step).

        Returns the function names loaded. ``row_bytes`` lists the row sizes of the
        layouts to serve (the copy kernel is specialised on ``row_bytes / 16``).
        """
        names = []
        # Every residency module CudaResidency may build (its options follow the layout's
        # top-k and region): an attach then loads none (a load waits for every stream).
        shapes = [{"hash_scale": h, "ws_smem": w, "lru_smem": lru, "owner_smem": own}
                  for h in (4, 2) for w in (True, False) for lru in (True, False) for own in (True, False)]
        for shape in shapes:
            for fn in SOURCES["resolve.cu"]:
                self.function("resolve.cu", fn, resolve_defines(**shape))
                names.append(fn)
        for fn in SOURCES["prefetch.cu"]:  # CudaResidency(prefetch=True): the block size only
            self.function("prefetch.cu", fn, resolve_defines())
            names.append(fn)
        for fn in SOURCES["tp.cu"]:  # a TP group's doorbell step (cuda/tp_doorbell.py)
            self.function("tp.cu", fn, {})
            names.append(fn)
        for rb in row_bytes:
            for fn in SOURCES["copy.cu"]:
                self.function("copy.cu", fn, copy_defines(rb))
                names.append(fn)
        return names


def get_cache(cache_dir_: str | os.PathLike | None = None) -> KernelCache:
    """The process-wide daemon :class:`KernelCache` for a cache directory."""
    return build.get_cache(cache_dir_, KernelCache)
