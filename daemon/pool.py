"""The host pool: one shared, pre-faulted mapping that holds every engine's KV rows.

The pool is a memfd: it has no name in any file system, so a crashed daemon can never
leave it behind to break the next start. Engines get byte ranges of it (``allocate``);
an engine's range is laid out ``[num_layers, host_rows, row_bytes]`` so one request's rows
of one layer stay close (the GPU gather slows when ids scatter; DESIGN §2).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import psutil

from .config import format_size
from .ranges import RangeAllocator, RangeFull

log = logging.getLogger("sparsekv.pool")

ALIGN_BYTES = 2 << 20  # engine ranges start on 2 MiB boundaries (huge-page friendly)
PREFAULT_CHUNK_BYTES = 64 << 20
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14


class PoolError(RuntimeError):
    """The pool cannot be created or has no room; the message says what to change."""


class HostPool:
    """A shared anonymous mapping of ``size_bytes``, pre-faulted by several threads.

    Attributes:
        size_bytes: bytes of the mapping.
        array: the whole pool as a uint8 NumPy array (no copy).
        address: host virtual address of byte 0 (for cudaHostRegister).
    """

    def __init__(
        self,
        size_bytes: int,
        threads: int = 0,
        progress: Callable[[float], None] | None = None,
        name: str = "sparsekv-pool",
    ):
        avail = psutil.virtual_memory().available
        if size_bytes > avail:
            raise PoolError(
                f"pool of {format_size(size_bytes)} does not fit in available RAM "
                f"({format_size(avail)}); lower --pool-size"
            )
        self.size_bytes = int(size_bytes)
        self._ranges = RangeAllocator(self.size_bytes, ALIGN_BYTES)
        self._fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, self.size_bytes)
            self._mm = mmap.mmap(self._fd, self.size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except Exception:
            os.close(self._fd)
            raise
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        self.address = self.array.ctypes.data
        try:
            self._prefault(threads or min(16, os.cpu_count() or 1), progress)
        except BaseException:
            self.close()
            raise

    def _prefault(self, threads: int, progress) -> None:
        """Touch every page once, in parallel: first touch of fresh shared memory runs at
        ~1.5 GiB/s on one thread (DESIGN §2), far too slow for a large pool."""
        t0 = time.monotonic()
        chunks = [(o, min(PREFAULT_CHUNK_BYTES, self.size_bytes - o)) for o in range(0, self.size_bytes, PREFAULT_CHUNK_BYTES)]
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        populate_ok = [True]

        def touch(chunk) -> None:
            off, n = chunk
            # ctypes drops the GIL during the call, so threads fault pages in parallel.
            if populate_ok[0] and libc.madvise(self.address + off, n, _MADV_POPULATE_WRITE) == 0:
                return
            populate_ok[0] = False
            self.array[off : off + n : mmap.PAGESIZE] = 0  # older kernels: write one byte a page

        done = 0
        last = 0.0
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="prefault") as ex:
            for _ in ex.map(touch, chunks):
                done += 1
                now = time.monotonic()
                if progress and (now - last > 1.0 or done == len(chunks)):
                    last = now
                    progress(done / len(chunks))
        dt = time.monotonic() - t0
        log.info(
            "pool %s pre-faulted in %.2f s with %d threads (%.1f GiB/s)",
            format_size(self.size_bytes), dt, threads, self.size_bytes / max(dt, 1e-9) / (1 << 30),
        )

    # -- allocation of engine ranges -------------------------------------------------
    def allocate(self, nbytes: int) -> int:
        """Reserve ``nbytes`` (rounded up to 2 MiB); return the offset. First fit."""
        try:
            return self._ranges.allocate(nbytes)
        except RangeFull:
            raise PoolError(
                f"host pool has no free range of {format_size(self._ranges.rounded(nbytes))} "
                f"(pool {format_size(self.size_bytes)}, free {format_size(self.free_bytes)})"
            ) from None

    def release(self, offset: int) -> None:
        self._ranges.release(offset)

    @property
    def used_bytes(self) -> int:
        return self._ranges.used_bytes

    @property
    def free_bytes(self) -> int:
        return self._ranges.free_bytes

    def view(self, offset: int, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape))
        return self.array[offset : offset + n].reshape(shape)

    def close(self) -> None:
        """Unmap and free the pool. Idempotent; views must be dropped first."""
        if self._mm is None:
            return
        self.array = None
        try:
            self._mm.close()
        except BufferError:
            log.warning("pool still has live views at close; leaving the mapping to the OS")
        self._mm = None
        os.close(self._fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
