"""Stream memory operations (CUDA driver API), the doorbell transport's primitives (beside
the engine's polling ``skv_db_indices`` at a few tokens, client/doorbell.py).

A 32-bit store or wait on the GPU's front end, in stream order: no kernel, no CPU, and
capturable into CUDA graphs. Each doorbell word (a group's bell, a layer's ready word) is a
flip-flop: one side sets 1, the other waits for 1 (or polls it) and resets 0, so every value is a
constant and a captured graph replays every step unchanged.

Called through ``ctypes`` on ``libcuda.so.1`` (the driver itself): ``cuda-python`` is no
dependency of CuPy or torch. The ``_v2`` entry points (CUDA 11.7+) need no device
attribute to be enabled.
"""

from __future__ import annotations

import ctypes
import functools

CU_STREAM_WAIT_VALUE_GEQ = 0x0  # (int32)(*addr - value) >= 0: cyclic, wraps around
CU_STREAM_WAIT_VALUE_EQ = 0x1
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0


class StreamOpError(RuntimeError):
    pass


@functools.cache
def _load() -> tuple:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise StreamOpError(f"cannot load the CUDA driver (libcuda.so.1): {e}") from None
    fns = []
    for name in ("cuStreamWriteValue32_v2", "cuStreamWaitValue32_v2", "cuGraphLaunch"):
        try:
            f = getattr(lib, name)
        except AttributeError:
            raise StreamOpError(f"the CUDA driver lacks {name} (needs CUDA 11.7 or newer)") from None
        f.restype = ctypes.c_int
        if name == "cuGraphLaunch":
            f.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        else:
            f.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fns.append(f)
    return tuple(fns)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise StreamOpError(f"{what} failed with CUresult {rc}")


def write32(stream_ptr: int, address: int, value: int) -> None:
    """Enqueue ``*(uint32*)address = value`` on the stream (a ``CUstream``/``cudaStream_t``)."""
    rc = _load()[0](ctypes.c_void_p(int(stream_ptr)), int(address), int(value) & 0xFFFFFFFF,
                    CU_STREAM_WRITE_VALUE_DEFAULT)
    _check(rc, "cuStreamWriteValue32")


def _wait(stream_ptr: int, address: int, value: int, flags: int) -> None:
    rc = _load()[1](ctypes.c_void_p(int(stream_ptr)), int(address), int(value) & 0xFFFFFFFF, flags)
    _check(rc, "cuStreamWaitValue32")


def wait32(stream_ptr: int, address: int, value: int) -> None:
    """Enqueue a wait until ``*(uint32*)address == value`` on the stream."""
    _wait(stream_ptr, address, value, CU_STREAM_WAIT_VALUE_EQ)


def wait32_geq(stream_ptr: int, address: int, value: int) -> None:
    """Enqueue a wait until ``*(uint32*)address`` has reached ``value``, as a cyclic
    comparison (``(int32)(word - value) >= 0``): for a counter that only grows, and may wrap."""
    _wait(stream_ptr, address, value, CU_STREAM_WAIT_VALUE_GEQ)


def graph_launch(graph_exec: int, stream_ptr: int) -> None:
    """Launch an instantiated graph (``cudaGraphExec_t``, e.g. CuPy's ``Graph.graphExec``) on a
    stream. Through ctypes, so the GIL is released: a launch onto a full stream queue blocks
    until it has room, and must not stop the daemon's other threads meanwhile."""
    rc = _load()[2](ctypes.c_void_p(int(graph_exec)), ctypes.c_void_p(int(stream_ptr)))
    _check(rc, "cuGraphLaunch")
