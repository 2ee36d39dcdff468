"""Device memory and events the daemon shares with client processes through CUDA IPC.

* :class:`DeviceArena`: one plain ``cudaMalloc`` per GPU (not a caching allocator: an IPC
  handle names a whole allocation, and a caching pool could hand the same memory to two
  owners). Hot slabs, staging buffers and result rings are views at 256-byte aligned
  offsets; clients open the arena's handle once and address it by offset.
* :class:`EventRing`: interprocess events, one per in-flight request of a rank. The daemon
  records entry ``k`` on its copy stream after request ``k``'s gather; the client's stream
  waits on it before attention reads the rows.

The importing side (:class:`ImportedArena`, :class:`ImportedEvents`) is here too: clients
open the daemon's arena and events with it, and the daemon opens a client's fence events
(recorded after attention read the slab) with it.

Lifetimes: ranges and rings stay reserved until their rank detaches or its process is
reaped; only then can another rank reuse them (the export registry is the backend's map
of client id -> resources, see cuda_backend.py).
"""

from __future__ import annotations

from .ranges import RangeAllocator, RangeFull

ALIGN_BYTES = 256


class ArenaFull(RuntimeError):
    pass


class DeviceArena:
    def __init__(self, device: int, nbytes: int):
        import cupy as cp  # noqa: PLC0415

        self._cp = cp
        self.device = device
        self.nbytes = int(nbytes)
        with cp.cuda.Device(device):
            self.ptr = cp.cuda.runtime.malloc(self.nbytes)
            try:
                self.handle = bytes(cp.cuda.runtime.ipcGetMemHandle(self.ptr))
            except Exception:
                cp.cuda.runtime.free(self.ptr)
                raise
        self._mem = cp.cuda.UnownedMemory(self.ptr, self.nbytes, self, device)
        self._ranges = RangeAllocator(self.nbytes, ALIGN_BYTES)
        self._closed = False

    def allocate(self, nbytes: int) -> int:
        try:
            return self._ranges.allocate(nbytes)
        except RangeFull:
            raise ArenaFull(
                f"device {self.device} arena has no free range of {self._ranges.rounded(nbytes) >> 20} MiB "
                f"(arena {self.nbytes >> 20} MiB, used {self.used_bytes >> 20} MiB); raise --device-arena-size"
            ) from None

    def release(self, offset: int) -> None:
        self._ranges.release(offset)

    def view(self, offset: int, shape: tuple[int, ...], dtype="uint8"):
        """A CuPy array over ``[offset, offset + nbytes)`` of the arena (no copy)."""
        cp = self._cp
        return cp.ndarray(shape, dtype=dtype, memptr=cp.cuda.MemoryPointer(self._mem, offset))

    @property
    def used_bytes(self) -> int:
        return self._ranges.used_bytes

    def close(self) -> None:
        """Free the allocation once. Importers must have closed their handles (the daemon
        only closes an arena at shutdown, after every client was detached)."""
        if self._closed:
            return
        self._closed = True
        with self._cp.cuda.Device(self.device):
            self._cp.cuda.runtime.free(self.ptr)


class EventRing:
    """``n`` interprocess events on one device (``cudaEventInterprocess`` needs
    ``cudaEventDisableTiming``)."""

    def __init__(self, device: int, n: int):
        import cupy as cp  # noqa: PLC0415

        with cp.cuda.Device(device):
            self.events = [cp.cuda.Event(block=False, disable_timing=True, interprocess=True) for _ in range(n)]
            self.handles = [bytes(cp.cuda.runtime.ipcGetEventHandle(e.ptr)) for e in self.events]
        self.device = device
        self.next = 0

    def take(self) -> int:
        """The next entry, round robin."""
        k = self.next
        self.next = (k + 1) % len(self.events)
        return k

    def record(self, k: int, stream) -> None:
        self.events[k].record(stream)

    def __len__(self) -> int:
        return len(self.events)


# -- importing side ---------------------------------------------------------------

def _cp():
    import cupy as cp  # noqa: PLC0415

    return cp


def device_for_bus_id(bus_id: str) -> int:
    """Local ordinal of the GPU with this PCI bus id (CUDA_VISIBLE_DEVICES may renumber)."""
    cp = _cp()
    for i in range(cp.cuda.runtime.getDeviceCount()):
        if cp.cuda.runtime.deviceGetPCIBusId(i).lower() == bus_id.lower():
            return i
    raise RuntimeError(f"no visible GPU has PCI bus id {bus_id}; check CUDA_VISIBLE_DEVICES")


class ImportedArena:
    def __init__(self, handle: bytes, nbytes: int, device: int):
        cp = _cp()
        self.device, self.nbytes = device, nbytes
        with cp.cuda.Device(device):
            self.ptr = cp.cuda.runtime.ipcOpenMemHandle(handle, cp.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
        self._mem = cp.cuda.UnownedMemory(self.ptr, nbytes, self, device)
        self._closed = False

    def cupy(self, offset: int, shape, dtype="uint8"):
        cp = _cp()
        return cp.ndarray(tuple(shape), dtype=dtype, memptr=cp.cuda.MemoryPointer(self._mem, offset))

    def torch(self, offset: int, shape, dtype="uint8"):
        import torch  # noqa: PLC0415

        return torch.from_dlpack(self.cupy(offset, shape, dtype))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            cp = _cp()
            with cp.cuda.Device(self.device):
                cp.cuda.runtime.ipcCloseMemHandle(self.ptr)


class ImportedEvents:
    def __init__(self, handles: list[bytes], device: int):
        cp = _cp()
        self.device = device
        with cp.cuda.Device(device):
            self.ptrs = [cp.cuda.runtime.ipcOpenEventHandle(h) for h in handles]

    def wait(self, k: int, stream_ptr: int) -> None:
        """Make ``stream_ptr`` wait (on the GPU, not the CPU) for entry ``k``. The device
        is made current: stream 0 means the current device's default stream."""
        cp = _cp()
        with cp.cuda.Device(self.device):
            cp.cuda.runtime.streamWaitEvent(stream_ptr, self.ptrs[k], 0)

    def synchronize(self, k: int) -> None:
        _cp().cuda.runtime.eventSynchronize(self.ptrs[k])

    def close(self) -> None:
        cp = _cp()
        for p in self.ptrs:
            cp.cuda.runtime.eventDestroy(p)
        self.ptrs = []
