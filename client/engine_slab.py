"""A hot slab the engine owns: its hot region inside its own KV cache (``proto/slab.py``).

The engine allocates the memory, describes where each layer's hot rows are
(:class:`~sparsekv.proto.slab.SlabGeometry`), and attaches with it::

    kv = EngineSlab.shared_memory(nbytes)            # cpu: a sealed memfd, mapped here
    geo = SlabGeometry.paged(layout, layer_bases, first_block=F, block_size=B, buffer_bytes=nbytes)
    c.attach(layout, engine="glm", slab=kv.with_geometry(geo))
    h = HostSwapIn(c, hot_base=F * B)                # indices into the engine's own rows

The daemon gathers into exactly the geometry's rows; the engine's other rows (its
resident blocks) stay its own, and one index array addresses both. cpu: a memfd sealed
against resizing, deposited over the fd socket right before ATTACH. cuda: a contiguous
torch tensor on the rank's GPU (:meth:`EngineSlab.from_tensor`; memory of ``cudaMalloc``,
not ``expandable_segments``), exported through CUDA IPC and referenced here while the
rank is attached, so torch cannot hand its memory to something else. Either process may
die without faulting the other.
"""

from __future__ import annotations

import fcntl
import mmap
import os

import numpy as np

from sparsekv.proto import ErrorCode
from sparsekv.proto.layout import Layout, LayoutError
from sparsekv.proto.slab import SlabGeometry

from .errors import BadRequest

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class EngineSlab:
    """An engine-owned buffer (``array``: its bytes, uint8 ``[nbytes]``, NumPy or a view of
    the tensor) and, once given, the geometry of its hot rows."""

    def __init__(self, fd: int, mm: mmap.mmap | None, geometry: SlabGeometry | None = None, tensor=None):
        self.fd, self._mm = fd, mm
        self.tensor = tensor  # cuda: the engine's tensor (kept alive while attached)
        if tensor is not None:
            import torch  # noqa: PLC0415

            self.array = tensor.view(-1).view(torch.uint8)  # uint8 [nbytes], the same memory
            self.nbytes = int(self.array.numel())
            self.device = tensor.device.index
        else:
            self.array = np.frombuffer(mm, dtype=np.uint8)
            self.nbytes = len(mm)
            self.device = None
        self.geometry = geometry

    @classmethod
    def from_tensor(cls, tensor) -> "EngineSlab":
        """A contiguous torch tensor on a GPU as an engine-owned slab (its bytes, whatever
        its dtype)."""
        import torch  # noqa: PLC0415

        if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda or not tensor.is_contiguous():
            raise BadRequest("an engine slab on a GPU must be a contiguous torch tensor on it", ErrorCode.BAD_ARGUMENT)
        if tensor.data_ptr() % 16:
            raise BadRequest("the engine slab tensor must start on a 16-byte boundary", ErrorCode.BAD_ARGUMENT)
        return cls(-1, None, tensor=tensor)

    @property
    def cuda(self) -> bool:
        return self.tensor is not None

    def export(self) -> dict:
        """cuda: the IPC handle and offset of the tensor's bytes (``proto/cuda_ipc``)."""
        from sparsekv.proto.cuda_ipc import export_buffer  # noqa: PLC0415

        return export_buffer(self.tensor.data_ptr(), self.nbytes, self.device)

    @classmethod
    def shared_memory(cls, nbytes: int, name: str = "sparsekv-engine-slab") -> "EngineSlab":
        """``nbytes`` of anonymous shared memory (a memfd whose pages are reserved now,
        sealed against any change of size), mapped in this process."""
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise BadRequest(f"nbytes must be a positive integer, got {nbytes!r}", ErrorCode.BAD_ARGUMENT)
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, mm)

    def with_geometry(self, geometry: SlabGeometry) -> "EngineSlab":
        """This buffer with ``geometry`` (its ``buffer_bytes`` must be this buffer's size
        or less)."""
        if geometry.buffer_bytes > self.nbytes:
            raise BadRequest(f"the geometry's buffer_bytes {geometry.buffer_bytes} exceed the buffer's {self.nbytes}",
                             ErrorCode.BAD_ARGUMENT)
        self.geometry = geometry
        return self

    def check(self, layout: Layout) -> SlabGeometry:
        """The geometry, checked against ``layout`` (BadRequest naming the fault); rows
        16-byte aligned for a GPU slab."""
        if self.geometry is None:
            raise BadRequest("this engine slab has no geometry: call with_geometry(SlabGeometry(...)) first",
                             ErrorCode.BAD_ARGUMENT)
        try:
            return self.geometry.check(layout, align=16 if self.tensor is not None else 1)
        except LayoutError as e:
            raise BadRequest(str(e), ErrorCode.BAD_LAYOUT) from None

    def layer_rows(self, layout: Layout, layer: int, hot_base: int = 0) -> np.ndarray:
        """A view of ``layer``'s rows in the engine's index space (index ``hot_base + h`` is
        hot row ``h``): ``[rows, row_bytes]`` uint8 when a layer's rows follow each other,
        else ``[blocks, block_rows, row_bytes]`` (index ``i`` is ``[i // block_rows, i % block_rows]``)."""
        geo, rb = self.check(layout), layout.row_bytes
        br, stride = geo.block_rows, geo.block_stride
        if hot_base % br:
            raise BadRequest(f"hot_base {hot_base} must be a multiple of block_rows {br} (whole blocks)",
                             ErrorCode.BAD_ARGUMENT)
        origin = geo.layer_offsets[layer] - (hot_base // br) * stride
        if origin < 0:
            raise BadRequest(f"hot_base {hot_base} puts index 0 of layer {layer} before the buffer's start",
                             ErrorCode.BAD_ARGUMENT)
        buf, size = self.array, self.nbytes
        if geo.is_linear(layout):
            n = (size - origin) // rb
            return buf[origin: origin + n * rb].reshape(n, rb)
        nb = (size - origin - br * rb) // stride + 1
        if self.tensor is not None:
            import torch  # noqa: PLC0415

            return torch.as_strided(buf, (nb, br, rb), (stride, rb, 1), storage_offset=buf.storage_offset() + origin)
        return np.lib.stride_tricks.as_strided(buf[origin:], shape=(nb, br, rb), strides=(stride, rb, 1))

    def frozen(self) -> "EngineSlab":
        """This buffer with the geometry it has now, for an attachment: the rows the daemon
        gathers into stay those an index of the attachment's handles reads, whatever
        :meth:`with_geometry` does to this object later (its descriptor stays this one's)."""
        copy = EngineSlab.__new__(EngineSlab)
        copy.__dict__.update(self.__dict__)
        copy.fd = -1  # not the copy's to close
        return copy

    def close(self) -> None:
        """Close this process's descriptor (the mapping stays while ``array`` is used)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
