"""Kernel launches that may overlap the kernel before them on the stream (Hopper's
programmatic dependent launch): ``cuLaunchKernelEx`` with
``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``, through the driver API (a CuPy
kernel call takes no launch attributes). Captured into a CUDA graph, the launch becomes a
kernel node with a programmatic edge from the kernel before it.

The kernel launched so must call ``skv_pdl_wait()`` (csrc/common.cuh) before it reads
anything the kernel before it writes; that kernel lets it start early with
``skv_pdl_launch_dependents()``. On GPUs before compute capability 9.0 (no such launch)
:func:`launch` launches plainly, which the same kernels also accept; so it does for a
kernel whose machine code was built for a capability below 9.0.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from .device import cp_module

ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
MIN_CAPABILITY = 90  # sm_90: griddepcontrol
ATTR_PTX_VERSION = 5  # CUfunction_attribute CU_FUNC_ATTRIBUTE_PTX_VERSION
ATTR_BINARY_VERSION = 6  # CU_FUNC_ATTRIBUTE_BINARY_VERSION


class _Attr(ctypes.Structure):
    """CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _Config(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("numAttrs", ctypes.c_uint)]


@functools.cache
def _lib():
    return ctypes.CDLL("libcuda.so.1")


@functools.cache
def _driver():
    fn = _lib().cuLaunchKernelEx
    fn.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def compiled_capability(func_ptr: int) -> int:
    """The capability a kernel was compiled for, e.g. 90: the lower of its machine code's
    (CU_FUNC_ATTRIBUTE_BINARY_VERSION) and its PTX's (CU_FUNC_ATTRIBUTE_PTX_VERSION; code
    built from PTX for an older virtual architecture reports the device's binary version),
    0 when the driver does not say. A kernel whose PTX is for below 9.0 has no
    ``griddepcontrol.wait`` in it (csrc/common.cuh leaves it out): launched
    programmatically it would read the plan before the resolve ends."""
    fn = _lib().cuFuncGetAttribute
    fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    out = []
    for attr in (ATTR_BINARY_VERSION, ATTR_PTX_VERSION):
        v = ctypes.c_int(0)
        out.append(v.value if fn(ctypes.byref(v), attr, ctypes.c_void_p(func_ptr)) == 0 else 0)
    return min(out)


@functools.cache
def supported(device: int) -> bool:
    """Whether ``device`` takes programmatic launches (compute capability 9.0 or later)."""
    cp = cp_module()
    return int(cp.cuda.Device(device).compute_capability) >= MIN_CAPABILITY


def _param(a):
    """A kernel argument as a ctypes object holding its bytes: a device array's address
    (8 bytes) or a NumPy scalar's own bytes (its width is the parameter's)."""
    if isinstance(a, np.generic):
        return ctypes.create_string_buffer(a.tobytes(), a.nbytes)
    data = getattr(a, "data", None)
    if data is not None and hasattr(data, "ptr"):
        return ctypes.c_uint64(int(data.ptr))
    raise TypeError(f"a kernel argument must be a device array or a NumPy scalar, got {type(a).__name__}")


def launch(fn, grid: int, block: int, args, stream, device: int, shared_mem: int = 0) -> None:
    """Launch CuPy kernel ``fn`` on ``stream`` (a CuPy stream) with a programmatic
    dependency on the kernel before it there (plainly where ``device`` has none).
    ``args``: device arrays and NumPy scalars, in the kernel's parameter order. Plainly
    too where the kernel was compiled for a capability below 9.0 (``compiled_capability``)."""
    func = None
    if supported(device):
        with cp_module().cuda.Device(device):
            # A RawKernel's CUfunction on this device (compiled on first use), or a Function's.
            func = fn.kernel if hasattr(fn, "kernel") else fn
            if compiled_capability(int(func.ptr)) < MIN_CAPABILITY:
                func = None
    if func is None:
        with stream:
            fn((grid,), (block,), args, shared_mem=shared_mem)
        return
    params = [_param(a) for a in args]
    ptrs = (ctypes.c_void_p * len(params))(*[ctypes.cast(ctypes.pointer(p), ctypes.c_void_p) for p in params])
    attr = _Attr(id=ATTR_PROGRAMMATIC_STREAM_SERIALIZATION,
                 value=np.array([1], dtype=np.int32).tobytes().ljust(64, b"\0"))
    cfg = _Config(gridDimX=int(grid), gridDimY=1, gridDimZ=1, blockDimX=int(block), blockDimY=1, blockDimZ=1,
                  sharedMemBytes=int(shared_mem), hStream=ctypes.c_void_p(int(stream.ptr)),
                  attrs=ctypes.pointer(attr), numAttrs=1)
    with cp_module().cuda.Device(device):
        rc = _driver()(ctypes.byref(cfg), ctypes.c_void_p(int(func.ptr)), ptrs, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx of {getattr(fn, 'name', fn)!r} failed: CUresult {rc}")
