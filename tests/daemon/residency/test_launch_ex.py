"""The driver-API pieces of the programmatic gather launch (daemon/residency/cuda/launch_ex.py):
the structures' layout must be CUDA's (cuda.h's CUlaunchConfig / CUlaunchAttribute), and
each argument must carry exactly its parameter's bytes. The launch itself runs in the
cuda tests (every doorbell and in-process step gathers through it)."""

import ctypes
import struct
from types import SimpleNamespace

import numpy as np
import pytest

from sparsekv.daemon.residency.cuda import launch_ex


def test_structures_have_the_driver_layout():
    assert ctypes.sizeof(launch_ex._Attr) == 72  # 4-byte id, padding, a 64-byte value union
    assert launch_ex._Attr.value.offset == 8
    cfg = launch_ex._Config
    assert ctypes.sizeof(cfg) == 56
    assert (cfg.sharedMemBytes.offset, cfg.hStream.offset, cfg.attrs.offset, cfg.numAttrs.offset) == (24, 32, 40, 48)


def test_scalars_keep_their_width_and_arrays_pass_their_address():
    p = launch_ex._param(np.int32(-2))
    assert ctypes.sizeof(p) == 4 and p.raw == struct.pack("<i", -2)
    p = launch_ex._param(np.int64(1 << 40))
    assert ctypes.sizeof(p) == 8 and p.raw == struct.pack("<q", 1 << 40)
    assert launch_ex._param(np.uint32(7)).raw == struct.pack("<I", 7)
    arr = SimpleNamespace(data=SimpleNamespace(ptr=0xDEAD0000))
    assert launch_ex._param(arr).value == 0xDEAD0000


@pytest.mark.parametrize("bad", [5, 1.5, None, "x"])
def test_an_argument_of_unknown_width_is_refused(bad):
    with pytest.raises(TypeError, match="device array or a NumPy scalar"):
        launch_ex._param(bad)


def test_launch_hands_the_driver_the_config_attribute_and_arguments(monkeypatch):
    """``launch`` through a stand-in driver: the grid, block, stream, the programmatic
    attribute set to 1, the function of the kernel on its device, each argument's bytes."""
    import contextlib

    seen = {}

    def driver(cfg_ref, func, params, extra):
        cfg = cfg_ref._obj
        seen["dims"] = (cfg.gridDimX, cfg.gridDimY, cfg.blockDimX, cfg.sharedMemBytes, cfg.hStream, cfg.numAttrs)
        attr = cfg.attrs[0]
        seen["attr"] = (attr.id, struct.unpack("<i", bytes(attr)[8:12])[0])
        seen["func"] = func.value
        seen["args"] = (ctypes.cast(params[0], ctypes.POINTER(ctypes.c_uint64))[0],
                        ctypes.cast(params[1], ctypes.POINTER(ctypes.c_int32))[0])
        return 0

    fake_cp = SimpleNamespace(cuda=SimpleNamespace(Device=lambda d: contextlib.nullcontext()))
    monkeypatch.setattr(launch_ex, "_driver", lambda: driver)
    monkeypatch.setattr(launch_ex, "supported", lambda device: True)
    monkeypatch.setattr(launch_ex, "compiled_capability", lambda ptr: 90)
    monkeypatch.setattr(launch_ex, "cp_module", lambda: fake_cp)
    kernel = SimpleNamespace(kernel=SimpleNamespace(ptr=0x1234))  # a RawKernel's compiled function
    arr = SimpleNamespace(data=SimpleNamespace(ptr=0xBEEF00))
    launch_ex.launch(kernel, 32, 256, (arr, np.int32(-7)), SimpleNamespace(ptr=0x5000), device=0)
    assert seen["dims"] == (32, 1, 256, 0, 0x5000, 1)
    assert seen["attr"] == (launch_ex.ATTR_PROGRAMMATIC_STREAM_SERIALIZATION, 1)
    assert seen["func"] == 0x1234
    assert seen["args"] == (0xBEEF00, -7)

    monkeypatch.setattr(launch_ex, "_driver", lambda: lambda *a: 1)  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(RuntimeError, match="CUresult 1"):
        launch_ex.launch(kernel, 1, 32, (), SimpleNamespace(ptr=0), device=0)


def test_a_kernel_built_below_sm90_is_launched_plainly(monkeypatch):
    """Found by review: a module built for a capability below 9.0 (CuPy's own compile, say)
    has no griddepcontrol.wait; launched programmatically on an H100 its gather would read
    the plan before the resolve ends. The launch checks the function's binary version."""
    import contextlib

    calls = []
    monkeypatch.setattr(launch_ex, "_driver", lambda: lambda *a: calls.append("pdl") or 0)
    monkeypatch.setattr(launch_ex, "supported", lambda device: True)
    monkeypatch.setattr(launch_ex, "cp_module",
                        lambda: SimpleNamespace(cuda=SimpleNamespace(Device=lambda d: contextlib.nullcontext())))

    class Kernel:
        kernel = SimpleNamespace(ptr=0x1234)

        def __call__(self, grid, block, args, shared_mem=0):
            calls.append(("plain", grid, block))

    stream = contextlib.nullcontext()
    stream.ptr = 0
    for version, want in ((75, ("plain", (8,), (32,))), (80, ("plain", (8,), (32,))), (0, ("plain", (8,), (32,))),
                          (90, "pdl")):
        calls.clear()
        monkeypatch.setattr(launch_ex, "compiled_capability", lambda ptr, v=version: v)
        launch_ex.launch(Kernel(), 8, 32, (), stream, device=0)
        assert calls == [want], version


@pytest.mark.cuda
def test_the_gather_on_this_gpu_is_built_for_its_capability(tmp_path):
    """On the GPU: the kernel cache builds skv_gather for the device's own capability, which
    ``compiled_capability`` reads back; from 9.0 the gather is launched programmatically."""
    import cupy as cp

    from sparsekv.daemon import kernels

    fn = kernels.KernelCache(tmp_path).function("copy.cu", "skv_gather", kernels.copy_defines(656))
    cc = int(cp.cuda.Device().compute_capability)
    func = fn.kernel if hasattr(fn, "kernel") else fn  # a RawKernel: its CUfunction on this device
    assert launch_ex.compiled_capability(int(func.ptr)) == cc
    assert launch_ex.supported(cp.cuda.Device().id) == (cc >= launch_ex.MIN_CAPABILITY)


def test_the_capability_is_the_lower_of_the_machine_codes_and_the_ptxs(monkeypatch):
    """Found by review: PTX for 8.0 that the driver compiled on an H100 reports binary
    version 90 (its PTX version 80) and has no griddepcontrol.wait: the lower one counts;
    an attribute the driver does not give counts as 0 (a plain launch)."""
    answers = {}

    def get_attribute(out, attr, func):
        value = answers.get(attr)
        if value is None:
            return 1  # CUDA_ERROR_INVALID_VALUE
        out._obj.value = value
        return 0

    monkeypatch.setattr(launch_ex, "_lib", lambda: SimpleNamespace(cuFuncGetAttribute=get_attribute))
    for ptr, (binary, ptx, want) in enumerate([(90, 80, 80), (90, 90, 90), (90, None, 0), (80, 90, 80)], 1):
        answers.clear()
        answers.update({launch_ex.ATTR_BINARY_VERSION: binary, launch_ex.ATTR_PTX_VERSION: ptx})
        assert launch_ex.compiled_capability(0xF000 + ptr) == want, (binary, ptx)
