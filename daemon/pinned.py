"""Page-lock an existing host mapping for the GPU, in chunks, with a lifetime object.

:class:`PinnedRegion` registers ``[address, address + nbytes)`` with
``cudaHostRegister(portable | mapped)`` in chunks of at most ``max_chunk_bytes`` (one
call for a 100+ GiB pool is slow and all-or-nothing; DESIGN.md §2). A failure part-way
unregisters the chunks already registered, then raises.

The region does not own the mapping (``daemon/pool.py`` does); it must be closed before
the mapping goes away. The CUDA runtime is reached through :class:`CudaHostRuntime`, so
tests can put a fake at this boundary.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable: pinned for every context
HOST_REGISTER_MAPPED = 0x02  # cudaHostRegisterMapped: kernels may address it
DEFAULT_MAX_CHUNK_BYTES = 64 << 30


class PinError(RuntimeError):
    """Registering the host mapping failed; nothing stays registered."""


class CudaHostRuntime:
    """The four CUDA calls a :class:`PinnedRegion` needs (CuPy runtime + driver API)."""

    def __init__(self):
        import cupy  # initialises the CUDA runtime and the primary context

        runtime = cupy.cuda.runtime
        self._rt = runtime
        dev = runtime.getDevice()
        # With this attribute set the device address of registered memory equals its host
        # address; else ask the driver per chunk.
        attr = runtime.cudaDevAttrCanUseHostPointerForRegisteredMem
        self._same_address = bool(runtime.deviceGetAttribute(attr, dev))
        self._cuda = None

    def register(self, address: int, nbytes: int, flags: int) -> None:
        self._rt.hostRegister(address, nbytes, flags)

    def unregister(self, address: int) -> None:
        self._rt.hostUnregister(address)

    def device_pointer(self, address: int) -> int:
        if self._same_address:
            return address
        if self._cuda is None:
            self._cuda = ctypes.CDLL("libcuda.so.1")
        dptr = ctypes.c_uint64()
        rc = self._cuda.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ctypes.c_void_p(address), 0)
        if rc != 0:
            raise PinError(f"cuMemHostGetDevicePointer failed with CUresult {rc}")
        return int(dptr.value)


@dataclass(frozen=True)
class Chunk:
    """One registered piece: host bytes ``[offset, offset + nbytes)`` of the region."""

    offset: int
    nbytes: int
    host_address: int
    device_address: int


def plan_chunks(address: int, nbytes: int, row_bytes: int, max_chunk_bytes: int, page_bytes: int) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` of each chunk: every boundary is a multiple of
    ``lcm(row_bytes, page_bytes)`` from the start, so no row or page is in two chunks."""
    if nbytes <= 0 or row_bytes <= 0 or max_chunk_bytes <= 0:
        raise ValueError(f"nbytes {nbytes}, row_bytes {row_bytes} and max_chunk_bytes {max_chunk_bytes} must be positive")
    if nbytes <= max_chunk_bytes:
        return [(0, nbytes)]
    if address % page_bytes:
        raise ValueError(f"address {address:#x} is not page-aligned ({page_bytes} B): "
                         "chunk boundaries would split pages")
    unit = math.lcm(row_bytes, page_bytes)
    chunk = max_chunk_bytes // unit * unit
    if chunk == 0:
        raise ValueError(f"max_chunk_bytes {max_chunk_bytes} is below lcm(row_bytes, page) = {unit}: "
                         "no chunk can hold whole rows")
    return [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]


class PinnedRegion:
    """A host mapping registered with CUDA (portable, mapped), chunk by chunk.

    Args:
        address, nbytes: the bytes to register (an mmap's: page-aligned).
        row_bytes: the row size whose rows must not straddle chunks.
        max_chunk_bytes: the largest single ``cudaHostRegister`` call.
        runtime: the CUDA boundary (default :class:`CudaHostRuntime`); page_bytes: the system's.
        deferred: register nothing yet (:meth:`register_through`, then :meth:`finish`).
    """

    def __init__(self, address: int, nbytes: int, row_bytes: int, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, *,
                 runtime=None, page_bytes: int | None = None, deferred: bool = False):
        self.address = int(address)
        self.nbytes = int(nbytes)
        self.row_bytes = int(row_bytes)
        self.max_chunk_bytes = int(max_chunk_bytes)
        page = page_bytes or mmap.PAGESIZE
        self._plan = plan_chunks(self.address, self.nbytes, self.row_bytes, self.max_chunk_bytes, page)
        self._rt = runtime if runtime is not None else CudaHostRuntime()
        self._lock = threading.Lock()
        self._closed = False
        self._done: list[Chunk] = []
        self.chunks: tuple[Chunk, ...] = ()
        self.contiguous = False
        self.register_s = 0.0  # seconds spent in the runtime's register calls
        if not deferred:
            self.finish()

    # -- registering (at once, or as the pool's pre-fault goes: ``deferred=True``) ------
    def register_through(self, nbytes_ready: int) -> None:
        """Register every planned chunk that ends within the first ``nbytes_ready`` bytes.
        On a failure everything registered so far is unregistered, the region is closed,
        and :class:`PinError` says where it failed."""
        if self._closed:
            raise PinError("the pinned region is closed")
        while len(self._done) < len(self._plan):
            off, n = self._plan[len(self._done)]
            if off + n > nbytes_ready:
                return
            host = self.address + off
            t0 = time.monotonic()
            try:
                self._rt.register(host, n, HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED)
            except BaseException as e:
                at = len(self._done) + 1
                self._roll_back()
                if isinstance(e, Exception):
                    raise PinError(
                        f"registering {self.nbytes} B at {self.address:#x} failed at chunk "
                        f"{at} of {len(self._plan)} (done ones rolled back): {e}"
                    ) from e
                raise
            self.register_s += time.monotonic() - t0
            try:
                dev = int(self._rt.device_pointer(host))
            except BaseException:
                self._done.append(Chunk(off, n, host, 0))
                self._roll_back()
                raise
            self._done.append(Chunk(off, n, host, dev))

    def finish(self) -> "PinnedRegion":
        """Register whatever is left; the region is usable from here on."""
        self.register_through(self.nbytes)
        self.chunks = tuple(self._done)
        # One device span when every chunk keeps the host-to-device address delta.
        delta = {c.device_address - c.host_address for c in self.chunks}
        self.contiguous = len(delta) == 1
        return self

    @property
    def registered_bytes(self) -> int:
        return sum(c.nbytes for c in self._done)

    def _roll_back(self) -> None:
        """Unregister what was registered (newest first); the region ends closed."""
        for c in reversed(self._done):
            try:
                self._rt.unregister(c.host_address)
            except Exception as ue:  # noqa: BLE001 - keep rolling back the rest
                log.error("rollback: cudaHostUnregister(%#x) failed: %s", c.host_address, ue)
        self._done = []
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def chunk_of(self, offset: int) -> Chunk:
        """The chunk holding host byte ``offset`` of the region."""
        if not self.chunks:
            raise PinError("the pinned region is not registered yet (finish())")
        if not 0 <= offset < self.nbytes:
            raise ValueError(f"offset {offset} outside the region of {self.nbytes} B")
        if len(self.chunks) == 1:
            return self.chunks[0]
        step = self.chunks[0].nbytes  # every chunk but the last has this size
        return self.chunks[min(offset // step, len(self.chunks) - 1)]

    def device_address(self, offset: int, nbytes: int = 1) -> int:
        """Device address of host byte ``offset``; ``[offset, offset + nbytes)`` must be one
        device span (inside one chunk, or anywhere when the chunks are contiguous)."""
        if self._closed:
            raise PinError("the pinned region is closed")
        if nbytes < 1 or offset + nbytes > self.nbytes:
            raise ValueError(f"span [{offset}, {offset + nbytes}) outside the region of {self.nbytes} B")
        c = self.chunk_of(offset)
        if not self.contiguous and offset + nbytes > c.offset + c.nbytes:
            raise ValueError(f"span [{offset}, {offset + nbytes}) crosses chunks whose device addresses "
                             "are not contiguous")
        return c.device_address + (offset - c.offset)

    def host_spans(self, offset: int, nbytes: int) -> list[tuple[int, int]]:
        """``(host address, bytes)`` of host bytes ``[offset, offset + nbytes)``, cut where a
        registered chunk ends: each span lies in one registration (one DMA copy)."""
        if self._closed:
            raise PinError("the pinned region is closed")
        if nbytes < 1 or offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"span [{offset}, {offset + nbytes}) outside the region of {self.nbytes} B")
        spans, end = [], offset + nbytes
        while offset < end:
            c = self.chunk_of(offset)
            n = min(end, c.offset + c.nbytes) - offset
            spans.append((c.host_address + (offset - c.offset), n))
            offset += n
        return spans

    @property
    def device_base(self) -> int:
        """Device address of the first byte; every byte is reachable from it (contiguous)."""
        return self.device_address(0, self.nbytes)

    def close(self) -> None:
        """Unregister every chunk, exactly once. Safe to call again."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            errors = []
            for c in reversed(self._done):
                try:
                    self._rt.unregister(c.host_address)
                except Exception as e:  # noqa: BLE001 - unregister the rest regardless
                    errors.append(f"{c.host_address:#x}: {e}")
            if errors:
                raise PinError("cudaHostUnregister failed for " + "; ".join(errors))

    def __enter__(self) -> "PinnedRegion":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self.chunks)} chunk(s)"
        return f"PinnedRegion({self.address:#x}, {self.nbytes} B, {state})"


class PoolPinner:
    """Page-lock a host pool at the daemon's start: pass it as ``HostPool``'s
    ``on_faulted``. With ``while_faulting`` each call registers the chunks that the faulted
    prefix now covers; :meth:`finish` registers the rest and returns the whole pool's
    :class:`PinnedRegion`. Chunk boundaries fall on pages only (engines of any row size
    share the pool): no single bulk DMA copy of pool rows may cross one."""

    def __init__(self, size_bytes: int, max_chunk_bytes: int, runtime=None, while_faulting: bool = True):
        self.size_bytes = int(size_bytes)
        self.max_chunk_bytes = int(max_chunk_bytes)
        self.while_faulting = bool(while_faulting)
        self._runtime = runtime
        self.region: PinnedRegion | None = None

    def __call__(self, address: int, faulted: int) -> None:
        if self.region is None:
            self.region = PinnedRegion(address, self.size_bytes, 16, self.max_chunk_bytes, runtime=self._runtime,
                                       deferred=True)
        if self.while_faulting:
            self.region.register_through(faulted)

    def finish(self, progress: Callable[[float], None] | None = None) -> PinnedRegion:
        """Register what is left, chunk by chunk; ``progress(fraction registered)`` after each."""
        if self.region is None:
            raise PinError("no pool was faulted through this pinner")
        r = self.region
        step = self.max_chunk_bytes
        for end in range(min(step, self.size_bytes), self.size_bytes + step, step):
            r.register_through(min(end, self.size_bytes))
            if progress is not None:
                progress(r.registered_bytes / max(1, self.size_bytes))
        return r.finish()


class PinnedView:
    """An engine's range of a :class:`PinnedRegion`; its ``close`` leaves the region
    registered (the pool's owner closes it)."""

    def __init__(self, region: PinnedRegion, offset: int, nbytes: int):
        if offset < 0 or nbytes <= 0 or offset + nbytes > region.nbytes:
            raise ValueError(f"view [{offset}, {offset + nbytes}) outside the region of {region.nbytes} B")
        self.region, self.offset, self.nbytes = region, int(offset), int(nbytes)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed or self.region.closed

    def device_address(self, offset: int, nbytes: int = 1) -> int:
        if self.closed:
            raise PinError("the pinned view is closed")
        if nbytes < 1 or offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"span [{offset}, {offset + nbytes}) outside the view of {self.nbytes} B")
        return self.region.device_address(self.offset + offset, nbytes)

    def host_spans(self, offset: int, nbytes: int) -> list[tuple[int, int]]:
        if self.closed:
            raise PinError("the pinned view is closed")
        if nbytes < 1 or offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"span [{offset}, {offset + nbytes}) outside the view of {self.nbytes} B")
        return self.region.host_spans(self.offset + offset, nbytes)

    def close(self) -> None:
        self._closed = True

    def __repr__(self) -> str:
        return f"PinnedView({self.region!r}, +{self.offset}, {self.nbytes} B)"
