"""The host pool: one pre-faulted mapping that holds every engine's KV rows.

The pool is an anonymous private mapping in transparent huge pages that children do not
inherit (``MADV_DONTFORK``, ``MADV_HUGEPAGE``; the default) or, with ``pool_backing =
"memfd"``, a memfd in small pages. Neither has a name in any file system, so a crashed
daemon never leaves it behind. Engines get byte ranges of it (``allocate``), laid out
``[num_layers, host_rows, row_bytes]`` so one request's rows of one layer stay close
(DESIGN §2).

A released range is zeroed before it is handed out again, so an engine never sees the rows
of the one before it: on the pool's own threads, off the request path (``memset``;
``madvise(MADV_REMOVE)`` is far slower and would hand the pre-faulted pages back), or at
once up to ``INLINE_ZERO_BYTES``. Only an ``allocate`` that finds no room waits for it.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from sparsekv.proto.cgroups import memory_room
from sparsekv.proto.settings import format_size

from .ranges import RangeAllocator, RangeFull

log = logging.getLogger("sparsekv.pool")

ALIGN_BYTES = 2 << 20  # engine ranges start on 2 MiB boundaries (huge-page friendly)
PREFAULT_CHUNK_BYTES = 64 << 20
ZERO_CHUNK_BYTES = 256 << 20  # one memset of a released range
ZERO_THREADS = 2  # memory-bound: more threads mostly take cores from the engines
INLINE_ZERO_BYTES = 8 << 20  # zeroed in release() itself: less than the hop to a thread
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_MADV_DONTFORK = 10
_MADV_HUGEPAGE = 14
BACKINGS = ("anon_thp", "memfd")


THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str | None:
    """The host's transparent huge page mode (``always``, ``madvise``, ``never``), or None
    when it cannot be read."""
    try:
        with open(THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def anon_huge_bytes(address: int | None = None, nbytes: int = 0) -> int:
    """Anonymous memory in transparent huge pages (``AnonHugePages``): of the mappings of
    this process that overlap ``[address, address + nbytes)``, each counted at most as far
    as it overlaps (the kernel may merge the pool's mapping with a neighbour's), or of the
    whole process when ``address`` is None; 0 when it cannot be read."""
    path = "/proc/self/smaps_rollup" if address is None else "/proc/self/smaps"
    total, inside, overlap = 0, address is None, None
    try:
        with open(path) as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
                    if address is not None:
                        lo, hi = (int(x, 16) for x in head.split("-"))
                        overlap = min(hi, address + nbytes) - max(lo, address)
                        inside = overlap > 0
                elif inside and head == "AnonHugePages:":
                    n = int(line.split()[1]) * 1024
                    total += n if overlap is None else min(n, overlap)
    except (OSError, ValueError, IndexError):
        return 0
    return total


def _madvise(address: int, nbytes: int, advice: int, what: str, required: bool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(address, nbytes, advice) != 0:
        err = ctypes.get_errno()
        if required:
            raise PoolError(f"madvise({what}) on the pool failed: {os.strerror(err)}")
        log.warning("madvise(%s) on the pool failed (%s): it stays in small pages", what, os.strerror(err))


VMSTAT_KEYS = ("thp_fault_alloc", "thp_fault_fallback", "compact_stall", "compact_fail", "pgmajfault",
               "allocstall_normal", "pgscan_direct")


def vmstat(keys=VMSTAT_KEYS, path: str = "/proc/vmstat") -> dict[str, int]:
    """The kernel's counters ``keys`` from /proc/vmstat (those it has; {} where it cannot be
    read), for the pool's pre-fault figures."""
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name in keys:
                    out[name] = int(value)
    except (OSError, ValueError):
        return {}
    return out


def vmstat_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """``after - before`` for the counters both have."""
    return {k: after[k] - before[k] for k in after if k in before}


class PoolError(RuntimeError):
    """The pool cannot be created or has no room; the message says what to change."""


class HostPool:
    """A mapping of ``size_bytes`` backed as ``backing`` says (one of :data:`BACKINGS`),
    pre-faulted by several threads.

    Attributes:
        size_bytes: bytes of the mapping.
        array: the whole pool as a uint8 NumPy array (no copy).
        address: host virtual address of byte 0 (for cudaHostRegister).
        fault_s: seconds the pre-fault took (with ``on_faulted``: its calls included).
        faulted_s: seconds until every page was faulted (the last chunk's touch done).
    """

    def __init__(self, size_bytes: int, threads: int = 0, progress: Callable[[float], None] | None = None,
                 name: str = "sparsekv-pool", on_faulted: Callable[[int, int], None] | None = None,
                 backing: str = "anon_thp"):
        if backing not in BACKINGS:
            raise PoolError(f"pool backing must be one of {', '.join(BACKINGS)}, got {backing!r}")
        avail, what = memory_room()
        if size_bytes > avail:
            raise PoolError(f"pool of {format_size(size_bytes)} does not fit in {what} "
                            f"({format_size(avail)}); lower pool_size (--pool-size, SPARSEKV_POOL_SIZE or the "
                            "config file)")
        self.size_bytes = int(size_bytes)
        self._ranges = RangeAllocator(self.size_bytes, ALIGN_BYTES)
        # Released ranges waiting to be zeroed: offset -> (length, chunk futures). Only the
        # owner thread touches ``_ranges``; zeroing threads only write the bytes.
        self._lengths: dict[int, int] = {}
        self._zeroing: dict[int, tuple[int, list]] = {}
        self._zeroer: ThreadPoolExecutor | None = None
        self._mm = None
        self.backing = backing
        # Bytes of the pool the kernel gave in transparent huge pages, once it is
        # pre-faulted (0 for a memfd, None before).
        self.huge_bytes: int | None = None
        self._fd = -1
        self._map(name)
        try:
            self._prefault(threads or min(16, os.cpu_count() or 1), progress, on_faulted)
        except BaseException:
            self.close()
            raise

    def _map(self, name: str) -> None:
        """Create the mapping (``_mm``, ``array``, ``address``). An anonymous one that
        cannot be kept out of children gives way to a memfd, with a warning."""
        if self.backing == "anon_thp":
            mm = mmap.mmap(-1, self.size_bytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, mmap.PROT_READ | mmap.PROT_WRITE)
            arr = np.frombuffer(mm, dtype=np.uint8)
            try:
                # Never in a child (no copy-on-write of pages the GPU reads), and in 2 MiB pages.
                _madvise(arr.ctypes.data, self.size_bytes, _MADV_DONTFORK, "MADV_DONTFORK", required=True)
            except PoolError as e:
                del arr
                mm.close()
                log.warning("%s: the pool is a memfd instead (as with SPARSEKV_POOL_BACKING=memfd)", e)
                self.backing = "memfd"
            else:
                self._mm, self.array, self.address = mm, arr, arr.ctypes.data
                _madvise(self.address, self.size_bytes, _MADV_HUGEPAGE, "MADV_HUGEPAGE", required=False)
                if thp_mode() == "never":
                    log.warning("transparent huge pages are off on this host (%s is [never]): the pool stays "
                                "in 4 KiB pages, and pre-faulting it is several times slower", THP_ENABLED)
                return
        self._fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, self.size_bytes)
            self._mm = mmap.mmap(self._fd, self.size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except Exception:
            os.close(self._fd)
            self._fd = -1
            raise
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        self.address = self.array.ctypes.data

    def _prefault(self, threads: int, progress, on_faulted=None) -> None:
        """Touch every page once, in parallel. ``on_faulted(address, nbytes)``, called on
        this thread as the faulted prefix grows, lets the caller page-lock that prefix
        while the other threads fault the rest."""
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
        touched = [t0]  # when the last touch ended (a list: written by the fault threads)

        def timed_touch(chunk) -> None:
            touch(chunk)
            now = time.monotonic()
            if now > touched[0]:
                touched[0] = now

        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="prefault") as ex:
            for _ in ex.map(timed_touch, chunks):
                done += 1
                if on_faulted is not None:
                    off, n = chunks[done - 1]
                    on_faulted(self.address, off + n)
                now = time.monotonic()
                if progress and (now - last > 1.0 or done == len(chunks)):
                    last = now
                    progress(done / len(chunks))
        dt = time.monotonic() - t0
        self.fault_s, self.faulted_s = dt, touched[0] - t0
        huge = ""
        self.huge_bytes = 0
        if self.backing == "anon_thp":
            self.huge_bytes = got = anon_huge_bytes(self.address, self.size_bytes)
            huge = f", {got * 100 // max(1, self.size_bytes)} % in huge pages"
        log.info("pool %s pre-faulted in %.2f s with %d threads (%.1f GiB/s%s)", format_size(self.size_bytes), dt,
                 threads, self.size_bytes / max(dt, 1e-9) / (1 << 30), huge)

    # -- allocation of engine ranges -------------------------------------------------
    def allocate(self, nbytes: int) -> int:
        """Reserve ``nbytes`` (rounded up to 2 MiB, first fit, all zeros); return the offset.
        When no free range fits, waits for released ones being zeroed and tries again."""
        self._collect()
        try:
            offset = self._ranges.allocate(nbytes)
        except RangeFull:
            offset = None
            if self._zeroing:
                t0 = time.monotonic()
                pending = self.zeroing_bytes
                self.wait_zeroed()
                log.info("waited %.1f ms for %s of released ranges to be zeroed",
                         (time.monotonic() - t0) * 1e3, format_size(pending))
                try:
                    offset = self._ranges.allocate(nbytes)
                except RangeFull:
                    pass
            if offset is None:
                raise PoolError(
                    f"host pool has no free range of {format_size(self._ranges.rounded(nbytes))} "
                    f"(pool {format_size(self.size_bytes)}, free {format_size(self.free_bytes)})"
                ) from None
        self._lengths[offset] = self._ranges.rounded(nbytes)
        return offset

    def release(self, offset: int, *, zero: bool = True) -> None:
        """Give back the range at ``offset``. With ``zero`` its bytes are zeroed first; until
        that is done the range is neither used nor free (``zeroing_bytes``). ``zero=False``
        only for a range nothing wrote to: free ranges always hold zeros."""
        length = self._lengths.pop(offset)
        if not zero or length <= INLINE_ZERO_BYTES:
            if zero:
                _zero(self.address + offset, length)
            self._ranges.release(offset)
            return
        if self._zeroer is None:
            self._zeroer = ThreadPoolExecutor(max_workers=ZERO_THREADS, thread_name_prefix="pool-zero")
        chunks = [self._zeroer.submit(_zero, self.address + o, min(ZERO_CHUNK_BYTES, offset + length - o))
                  for o in range(offset, offset + length, ZERO_CHUNK_BYTES)]
        self._zeroing[offset] = (length, chunks)
        self._collect()

    def _collect(self) -> None:
        """Hand every range whose zeroing is done back to the allocator (owner thread)."""
        for offset, (length, chunks) in list(self._zeroing.items()):
            if not all(c.done() for c in chunks):
                continue
            del self._zeroing[offset]
            errors = ["cancelled" if c.cancelled() else c.exception() for c in chunks
                      if c.cancelled() or c.exception() is not None]
            if errors:  # never reuse bytes that may not be zero; the range stays out of use
                log.error("zeroing a released range of %s failed (%r); it is not reused",
                          format_size(length), errors[0])
                continue
            self._ranges.release(offset)

    def range_bytes(self, nbytes: int) -> int:
        """The bytes an engine range of ``nbytes`` takes (rounded up to 2 MiB)."""
        return self._ranges.rounded(nbytes)

    def fits_after(self, nbytes: int, held: Iterable[int] = ()) -> bool:
        """Whether ``allocate(nbytes)`` will find a free range once the ranges being zeroed
        and the held ranges at the offsets ``held`` are free (contiguity counted, not bytes)."""
        self._collect()
        return self._ranges.fits_with(nbytes, [*self._zeroing, *held])

    def zeroing_to_wait_for(self, nbytes: int) -> list:
        """The futures ``allocate(nbytes)`` would wait for now (empty when it would not), for
        a worker thread to wait on before an ATTACH allocates."""
        self._collect()
        if not self._zeroing or self._ranges.fits(nbytes):
            return []
        return [c for _, chunks in self._zeroing.values() for c in chunks]

    def wait_zeroed(self) -> None:
        """Block until every released range is zeroed and free again (tests; allocate
        when the pool is otherwise full)."""
        for _, chunks in list(self._zeroing.values()):
            for c in chunks:
                try:
                    c.result()
                except BaseException:  # noqa: BLE001 - reported by _collect
                    pass
        self._collect()

    @property
    def zeroing_bytes(self) -> int:
        """Bytes of released ranges not zeroed yet: neither used nor free."""
        self._collect()
        return sum(length for length, _ in self._zeroing.values())

    @property
    def used_bytes(self) -> int:
        """Bytes of the ranges engines hold (not those being zeroed)."""
        return self._ranges.used_bytes - self.zeroing_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes that ``allocate`` may hand out now (zeroed, not held)."""
        self._collect()
        return self._ranges.free_bytes

    def view(self, offset: int, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape))
        return self.array[offset : offset + n].reshape(shape)

    def close(self) -> None:
        """Unmap and free the pool. Idempotent; views must be dropped first."""
        if self._mm is None:
            return
        if self._zeroer is not None:  # no thread may write into the mapping once it is gone
            self._zeroer.shutdown(wait=True, cancel_futures=True)
            self._zeroer = None
        self.array = None
        try:
            self._mm.close()
        except BufferError:
            log.warning("pool still has live views at close; leaving the mapping to the OS")
        self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _zero(address: int, nbytes: int) -> None:
    """Write zeros over ``nbytes`` at ``address`` (ctypes drops the GIL for the call)."""
    ctypes.memset(address, 0, nbytes)
