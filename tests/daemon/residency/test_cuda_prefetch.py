"""The prefetch on a GPU (``skv_prefetch`` of csrc/prefetch.cu, the prefetch marks of the
residency kernels) through ``CudaResidency(prefetch=True)``, against the NumPy engine bit
for bit: the random programs of ``kernel_traces.run_prefetch_program`` (the emulator runs
the same ones in ``tests/csrc/test_prefetch_on_cpu.py``), the per-row plans of the device
path, the layouts refused. Every test needs a GPU (marked ``cuda``).
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_traces import assert_marks, layout, run_prefetch_program
from sparsekv.daemon import kernels
from sparsekv.daemon.residency import cuda
from sparsekv.daemon.residency.base import ResidencyError
from sparsekv.daemon.residency.cpu import CpuResidency

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def kc(tmp_path_factory):
    return kernels.KernelCache(tmp_path_factory.mktemp("kernel-cache"))


def gpu_begin_step(gpu, rows, reset, inv):
    """``skv_begin_step`` of a STEP block through the device path, then synchronised."""
    import cupy as cp

    lay = gpu.layout
    n, m = inv.shape
    sr = np.full(lay.max_batch, -1, np.int32)
    sr[:n] = rows
    rs = np.zeros(lay.max_batch, np.int32)
    rs[:n] = reset
    with gpu.stream:
        err = cp.zeros(cuda.ERR_INTS, cp.int32)
        gpu.launch_begin_step(cp.asarray(cuda.make_desc(batch=n, inv_n=m)), cp.asarray(sr), cp.asarray(rs),
                              cp.asarray(np.ascontiguousarray(inv)), err, lay.max_batch, gpu.stream)
    gpu.stream.synchronize()
    assert not err.get().any()


# name, top_k, stride, host_rows, max_reqs, groups, batch, steps, threads
PROGRAMS = [
    ("tiny", 4, 12, 40, 3, 3, 6, 80, 32),
    ("three-tokens", 8, 24, 80, 4, 2, 8, 60, 64),
    ("odd", 13, 40, 120, 3, 3, 7, 50, 96),
    ("wide", 64, 200, 2_000, 4, 2, 10, 30, 128),
    ("kept-none", 6, 6, 30, 3, 2, 5, 30, 32),
    ("big", 2048, 4096, 1 << 20, 16, 2, 32, 8, 1024),  # the reference shape: 80.5 KiB a block
]


@pytest.mark.parametrize("case", PROGRAMS, ids=[p[0] for p in PROGRAMS])
def test_prefetch_programs_on_the_gpu_equal_the_numpy_engine(case, kc):
    name, k, stride, host_rows, reqs, groups, batch, steps, threads = case
    lay = layout(k, stride, host_rows, reqs, groups=groups, max_batch=batch)
    gpu = cuda.CudaResidency(lay, kernels=kc, threads=threads, prefetch=True)
    run_prefetch_program(CpuResidency(lay), gpu, lay, sum(map(ord, name)), steps, batch, gpu_begin_step)
    assert gpu.last_errors == 0


def test_the_device_path_plan_drops_a_slot_a_later_token_retook(kc):
    """launch_prefetch (no read-back) with the source group's descriptor and group_offset 1:
    two tokens of one request, the second retaking every
    slot the first took: the first row's entries are (-1, -1), the second's hold its rows,
    counts 4 and 4; the marks and counters are the NumPy engine's."""
    import cupy as cp

    lay = layout(4, 8, 100, 2, groups=2, max_batch=3)
    cpu = CpuResidency(lay)
    gpu = cuda.CudaResidency(lay, kernels=kc, threads=32, prefetch=True)
    warm = np.array([[1, 2, 3, 4]], np.int32)
    for r in (cpu, gpu):
        r.resolve(1, np.array([0], np.int32), warm)
    sr = np.array([0, 0], np.int32)
    tk = np.array([[10, 11, 12, 13], [20, 21, 22, 23]], np.int32)
    want = cpu.prefetch(1, sr, tk)
    out = gpu.new_output()
    with gpu.stream:
        out.desc.set(cuda.make_desc(2, 4, 0), stream=gpu.stream)  # group 0's top-k block: target 0 + 1
        gpu.launch_prefetch(out.desc, cp.asarray(sr), cp.asarray(tk), out.plan_rows, out.plan_slots, out.misses,
                            out.err, out.max_batch, gpu.stream, group_offset=1)
    gpu.stream.synchronize()
    with gpu.stream:
        prow, pslot, counts = out.plan_rows.get(), out.plan_slots.get(), out.misses.get()
    assert counts[:2].tolist() == [4, 4]
    assert (prow[0, :4] == -1).all() and (pslot[0, :4] == -1).all()
    assert sorted(zip(prow[1, :4].tolist(), pslot[1, :4].tolist())) == sorted(zip(want.rows.tolist(),
                                                                                    want.slots.tolist()))
    assert_marks(cpu, gpu, "two tokens")


def test_a_prefetch_workspace_beyond_shared_memory_is_refused_and_off_needs_no_marks(kc):
    """top_k 2048 with a region of 32768: 308 KiB a block, more than the H200's 227 KiB:
    refused at construction. Without prefetch: no marks, prefetch refused as on a backend
    without it, counters 0."""
    with pytest.raises(ValueError, match="prefetch workspace"):
        cuda.CudaResidency(layout(2048, 32768, 1 << 20, 4, max_batch=4), kernels=kc, prefetch=True)
    off = cuda.CudaResidency(layout(4, 8, 100, 2, groups=2, max_batch=3), kernels=kc)
    assert off.fresh is None and off.prefetched == 0
    with pytest.raises(ResidencyError, match="no prefetch"):
        off.prefetch(1, np.array([0], np.int32), np.array([[1, 2, 3, 4]], np.int32))
