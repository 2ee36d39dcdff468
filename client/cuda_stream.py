"""A stream someone else owns (torch's current stream) as a CuPy stream object, for
launching CuPy kernels on it: the device handle (``doorbell.py``), the in-process handle
(``inproc_cuda.py``) and the portable handle's kernels (``swap_in_kernels.py``)."""

from __future__ import annotations


class StreamRef:
    """A raw ``cudaStream_t`` offered through the CUDA stream protocol (``__cuda_stream__``:
    version 0 and the handle)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = int(ptr)

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def external_stream(cp, stream_ptr: int):
    """``Stream.from_external`` where CuPy has it (``ExternalStream`` is deprecated there),
    CuPy's own objects for the default streams 0 and 2 (``null``, ``ptds``), else
    ``ExternalStream`` (handle 1, ``cudaStreamLegacy``, and older CuPy)."""
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    ptr = int(stream_ptr)
    if from_external is not None:
        if ptr > 2:
            return from_external(StreamRef(ptr))
        own = {0: getattr(cp.cuda.Stream, "null", None), 2: getattr(cp.cuda.Stream, "ptds", None)}.get(ptr)
        if own is not None:
            return own
    return cp.cuda.ExternalStream(ptr)
