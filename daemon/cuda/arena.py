"""The daemon's device memory on one GPU, shared with client processes through CUDA IPC.

:class:`DeviceArena`: one plain ``cudaMalloc`` per GPU (an IPC handle names a whole
allocation, and a caching pool could hand the same memory to two owners). Ranks' buffers
are views at 256-byte aligned offsets, reserved until their rank detaches; clients open
the arena's handle once and address it by offset.
"""

from __future__ import annotations

from ..ranges import RangeAllocator, RangeFull

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


