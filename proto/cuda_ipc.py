"""CUDA IPC objects both sides of the protocol open: interprocess events and imported
device memory. The daemon exports its arena and per-rank event rings, clients import them;
a client exports fence events the daemon imports. Handles travel in the ATTACH reply and
request as bytes. ``cupy`` is imported lazily: importing this module needs no GPU.
"""

from __future__ import annotations

import os


def _cp():
    import cupy as cp  # noqa: PLC0415

    return cp


class EventRing:
    """``n`` interprocess events on one device, one per in-flight request of a rank: the
    daemon records entry ``k`` after request ``k``'s gather, the client's stream waits on
    it before attention reads the rows."""

    def __init__(self, device: int, n: int):
        cp = _cp()
        with cp.cuda.Device(device):  # cudaEventInterprocess needs cudaEventDisableTiming
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


def mps_running() -> bool:
    """Whether an NVIDIA MPS control daemon listens where this process's CUDA looks."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipe, "control"))


def device_count() -> int:
    """GPUs this process sees."""
    return _cp().cuda.runtime.getDeviceCount()


def device_for_bus_id(bus_id: str) -> int:
    """Local ordinal of the GPU with this PCI bus id (CUDA_VISIBLE_DEVICES may renumber)."""
    cp = _cp()
    for i in range(cp.cuda.runtime.getDeviceCount()):
        if cp.cuda.runtime.deviceGetPCIBusId(i).lower() == bus_id.lower():
            return i
    raise RuntimeError(f"no visible GPU has PCI bus id {bus_id}; check CUDA_VISIBLE_DEVICES")


def allocation_range(ptr: int) -> tuple[int, int]:
    """``(base, size)`` of the device allocation that holds address ``ptr``
    (``cuMemGetAddressRange``; the caller's current device must own it)."""
    import ctypes  # noqa: PLC0415

    _cp().cuda.runtime.getDevice()  # the runtime's context is current on this thread
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuMemGetAddressRange_v2
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    rc = fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(int(ptr)))
    if rc != 0:
        raise RuntimeError(f"cuMemGetAddressRange({int(ptr):#x}) failed with CUresult {rc}: not device memory of "
                           "this GPU")
    return int(base.value), int(size.value)


def export_buffer(ptr: int, nbytes: int, device: int) -> dict:
    """What another process needs to map ``nbytes`` of device memory at ``ptr`` (on GPU
    ``device``): its allocation's IPC handle and the offset in it. ``cudaMalloc`` memory (torch's
    default allocator) exports; virtual-memory API memory (``expandable_segments``) does not."""
    cp = _cp()
    with cp.cuda.Device(device):
        base, size = allocation_range(ptr)
        if int(ptr) + int(nbytes) > base + size:
            raise ValueError(f"{nbytes} bytes at {int(ptr):#x} pass the end of their allocation")
        handle = cp.cuda.runtime.ipcGetMemHandle(base)
    return {"ipc_handle": bytes(handle), "ipc_offset": int(ptr) - base, "bytes": int(nbytes),
            "bus_id": cp.cuda.runtime.deviceGetPCIBusId(device).lower()}


def open_mem_handle(handle: bytes) -> int:
    """``cudaIpcOpenMemHandle`` (lazy peer access) on the current device. A handle whose
    exporter has exited can never be opened (cudaErrorInvalidResourceHandle), even while
    others still map its memory: the caller asks whether the exporter is still there."""
    cp = _cp()
    return cp.cuda.runtime.ipcOpenMemHandle(handle, cp.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)


class ImportedBuffer:
    """Device memory another process exported (:func:`export_buffer`), opened on
    ``device``: ``ptr`` is its first byte. Checks that ``nbytes`` from there lie inside
    the exporter's allocation. Imported memory stays valid after its exporter exits."""

    def __init__(self, handle: bytes, offset: int, nbytes: int, device: int):
        cp = _cp()
        self.device = device
        with cp.cuda.Device(device):
            self._base = open_mem_handle(handle)
            try:
                base, size = allocation_range(self._base)
                self.alloc_bytes = base + size - self._base  # the allocation's bytes from the handle's start
                if offset < 0 or offset + nbytes > self.alloc_bytes:
                    raise ValueError(f"the exported allocation has {base + size - self._base} bytes; "
                                     f"offset {offset} + {nbytes} bytes do not fit")
            except BaseException:
                cp.cuda.runtime.ipcCloseMemHandle(self._base)
                raise
        self.ptr = self._base + int(offset)
        self.nbytes = int(nbytes)
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            cp = _cp()
            with cp.cuda.Device(self.device):
                cp.cuda.runtime.ipcCloseMemHandle(self._base)


class ImportedArena(ImportedBuffer):
    """The daemon's whole arena (its own allocation), with array views into it."""

    def __init__(self, handle: bytes, nbytes: int, device: int):
        cp = _cp()
        self.device, self.nbytes = device, nbytes
        with cp.cuda.Device(device):
            self._base = self.ptr = open_mem_handle(handle)
        self._mem = cp.cuda.UnownedMemory(self.ptr, nbytes, self, device)
        self._closed = False

    def cupy(self, offset: int, shape, dtype="uint8"):
        cp = _cp()
        return cp.ndarray(tuple(shape), dtype=dtype, memptr=cp.cuda.MemoryPointer(self._mem, offset))

    def torch(self, offset: int, shape, dtype="uint8"):
        import torch  # noqa: PLC0415

        return torch.from_dlpack(self.cupy(offset, shape, dtype))


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

    def done(self, k: int) -> bool:
        """Whether entry ``k``'s last recorded work is done (never waits)."""
        return _cp().cuda.runtime.eventQuery(self.ptrs[k]) == 0

    def close(self) -> None:
        cp = _cp()
        for p in self.ptrs:
            cp.cuda.runtime.eventDestroy(p)
        self.ptrs = []
