"""The CUDA backend against the NumPy engine, bit for bit, on random traces; byte checks of
the mover; memory safety on corrupt state; the pinned region; the kernel cache.

Every test needs a GPU (marked ``cuda``; skipped on CPU machines unless ``--require-cuda``).
``SPARSEKV_CUDA_BENCH=1`` also runs the timing table (resolve, gather, bulk H2D copy).

Longer than 600 lines: one module a kernel family's GPU checks share (the traces, the fixtures
that compile and the pinned pool they gather from); split, each part would repeat them.
"""

from __future__ import annotations

import mmap
import os
import zlib
from pathlib import Path

import numpy as np
import pytest

from sparsekv.daemon import kernels
from sparsekv.daemon.pinned import CudaHostRuntime, PinError, PinnedRegion, plan_chunks
from sparsekv.daemon.residency.base import Plan, ResidencyError
from sparsekv.daemon.residency.contract import RegionModel
from sparsekv.daemon.residency import cuda
from sparsekv.daemon.residency.cpu import CpuMover, CpuResidency
from sparsekv.proto.layout import Layout
from sparsekv.proto.slab import SlabGeometry
from sparsekv.proto.step_block import D_BATCH, D_GROUP, D_K, DESC_INTS

from kernel_traces import assert_same, assert_state, gen_batch, gen_row, junk_values, layout, run_trace  # noqa: F401,E501 - shared with tests/csrc

pytestmark = pytest.mark.cuda

@pytest.fixture(scope="session")
def kc(tmp_path_factory):
    return kernels.KernelCache(tmp_path_factory.mktemp("kernel-cache"))


def device_sync():
    """Wait for every stream: set-up work issued on the legacy default stream does not
    order against the backend's non-blocking streams."""
    import cupy as cp

    cp.cuda.runtime.deviceSynchronize()


# id, top_k, stride, host_rows, max_reqs, groups, batch, steps, overlap, threads, workspace
TRACES = [
    ("tiny", 4, 8, 24, 3, 2, 5, 80, 0.5, 32, "auto"),
    ("tiny-exact", 5, 5, 12, 2, 1, 3, 80, 0.6, 32, "auto"),
    ("tiles", 100, 300, 400, 4, 2, 8, 30, 0.7, 32, "auto"),
    ("tiles-global", 100, 300, 400, 4, 2, 8, 30, 0.7, 64, "global"),
    ("odd", 37, 111, 90, 3, 3, 6, 40, 0.5, 64, "auto"),
    ("big", 2048, 4096, 1 << 20, 64, 2, 64, 12, 0.7, 1024, "auto"),
    ("big-768threads", 2048, 4096, 1 << 20, 64, 2, 64, 12, 0.7, 768, "auto"),  # the candidate default
    ("stride32k-768threads", 2048, 32768, 1 << 20, 4, 1, 6, 6, 0.7, 768, "auto"),
    ("big-64threads", 2048, 4096, 200_000, 8, 1, 12, 8, 0.7, 64, "auto"),
    ("big-global", 2048, 4096, 200_000, 8, 1, 12, 8, 0.7, 1024, "global"),
    ("stride32k", 2048, 32768, 1 << 20, 4, 1, 6, 6, 0.7, 1024, "auto"),
    ("topk32k", 32768, 32768, 1 << 20, 2, 1, 2, 4, 0.7, 1024, "auto"),
]


WORKSPACE_OPTS = [{"hash_scale": 2, "lru_smem": False, "owner_smem": False},
                  {"hash_scale": 4, "lru_smem": False, "owner_smem": False},
                  {"hash_scale": 2, "lru_smem": True, "owner_smem": True},
                  {"hash_scale": 4, "lru_smem": True, "owner_smem": True}]


@pytest.mark.parametrize("opts", WORKSPACE_OPTS, ids=["x2", "x4", "x2-rows", "x4-rows"])
@pytest.mark.parametrize("case", [t for t in TRACES if t[0] in ("tiles", "big", "big-global")], ids=lambda t: t[0])
def test_resolve_with_each_workspace_option_matches_cpu(case, kc, opts):
    """The hash table's size (SKV_HASH_SCALE), the new lru and the owners in the workspace
    (SKV_LRU_SMEM, SKV_OWNER_SMEM), given explicitly (the default takes every one that
    fits): the workspace grows with them, the results stay the cpu backend's."""
    name, k, stride, host_rows, reqs, groups, batch, steps, overlap, threads, ws = case
    lay = layout(k, stride, host_rows, reqs, groups=groups, max_batch=batch)
    gpu = cuda.CudaResidency(lay, kernels=kc, threads=threads, workspace=ws, **opts)
    assert (gpu.hash_scale, gpu.lru_smem, gpu.owner_smem) == tuple(opts.values())
    assert gpu.workspace_bytes == cuda.resolve_workspace_bytes(k, stride, **opts)
    run_trace(CpuResidency(lay), gpu, lay, seed=zlib.crc32(name.encode()) % 1000, steps=steps, batch=batch,
              overlap=overlap, state_every=1 if k < 1000 else 4)


def test_the_default_workspace_takes_the_x4_table_then_the_rows_where_they_fit_in_shared_memory(kc):
    """Batch 64 x top-k 2048 x region 4096 (the reference step): the x4 table fits in the
    H200's 227 KiB, and then the owner and new lru rows too; a global workspace keeps the
    x2 table and the rows in global memory; with a region of 32768 neither the x4 table
    nor a row more fits."""
    lay = layout(2048, 4096, 1 << 20, 64, max_batch=64)
    gpu = cuda.CudaResidency(lay, kernels=kc)
    assert (gpu.hash_scale, gpu.lru_smem, gpu.owner_smem, gpu.workspace_global) == (4, True, True, False)
    assert gpu.resolve_smem == cuda.resolve_workspace_bytes(2048, 4096, 4, True, True)
    asked = cuda.CudaResidency(lay, kernels=kc, lru_smem=False)
    assert (asked.hash_scale, asked.lru_smem, asked.owner_smem) == (4, False, True)
    wide = cuda.CudaResidency(layout(2048, 32768, 1 << 20, 4, max_batch=4), kernels=kc)
    assert (wide.hash_scale, wide.lru_smem, wide.owner_smem, wide.workspace_global) == (2, False, False, False)
    glob = cuda.CudaResidency(lay, kernels=kc, workspace="global")
    assert (glob.hash_scale, glob.lru_smem, glob.owner_smem, glob.workspace_global) == (2, False, False, True)


@pytest.mark.parametrize("case", TRACES, ids=[t[0] for t in TRACES])
def test_resolve_matches_cpu(case, kc):
    name, k, stride, host_rows, reqs, groups, batch, steps, overlap, threads, ws = case
    lay = layout(k, stride, host_rows, reqs, groups=groups, max_batch=batch)
    cpu = CpuResidency(lay)
    gpu = cuda.CudaResidency(lay, kernels=kc, threads=threads, workspace=ws)
    if name == "topk32k":
        assert gpu.workspace_global  # 644 KiB per block cannot live in shared memory
    run_trace(cpu, gpu, lay, seed=zlib.crc32(name.encode()) % 1000, steps=steps, batch=batch, overlap=overlap,
              state_every=1 if k < 1000 else 4)


def test_matches_reference_model(kc):
    """One state row, long random sequence, against contract.RegionModel directly."""
    lay = layout(6, 12, 30, 1)
    gpu = cuda.CudaResidency(lay, kernels=kc, threads=32)
    model = RegionModel(lay.region_stride)
    rng = np.random.default_rng(7)
    memory: dict[int, np.ndarray] = {}
    for step in range(150):
        if rng.random() < 0.05:
            gpu.reset(np.array([0], np.int32))
            model.reset()
        if rng.random() < 0.2:
            rows = rng.integers(0, 30, size=3).astype(np.int32)
            gpu.invalidate(0, rows)
            model.invalidate(rows.tolist())
        row = gen_row(rng, lay, memory.get(0), 0.5, 0.1)
        ok = row[(row >= 0) & (row < lay.host_rows)]
        memory[0] = ok.astype(np.int64)
        got = gpu.resolve(0, np.array([0], np.int32), row[None, :])
        slots, plan, oor = model.resolve(row.tolist(), lay.host_rows)
        assert got.slots[0].tolist() == slots, step
        assert sorted(zip(got.plan.rows.tolist(), got.plan.slots.tolist())) == sorted(plan), step
        assert got.out_of_range == oor
        owner, lru = gpu.state()
        assert owner[0, 0].tolist() == model.owner and lru[0, 0].tolist() == model.lru, step


def test_eviction_order_small(kc):
    """A hand-checked LRU sequence: oldest evictable first, hits move to the back."""
    lay = layout(2, 4, 10, 1)
    gpu = cuda.CudaResidency(lay, kernels=kc, threads=32)
    cpu = CpuResidency(lay)
    # (ids, slots): e.g. step 2: 1 hits slot 0; evictables in LRU order are 2, 3, 1, so the
    # miss 3 takes slot 2 and the new lru is [3, 1] + [2] + [0].
    seq = [([1, 2], [0, 1]), ([3, 1], [2, 0]), ([4, 5], [3, 1]), ([1, 6], [0, 2]), ([-1, 7], [-1, 3]),
           ([7, 3], [3, 1])]
    for ids, slots in seq:
        tk = np.array([ids], np.int32)
        got = gpu.resolve(0, np.array([0], np.int32), tk)
        assert got.slots[0].tolist() == slots
        assert_same(cpu.resolve(0, np.array([0], np.int32), tk), got)
        assert_state(cpu, gpu)
    owner, lru = gpu.state()
    assert owner[0, 0].tolist() == [1, 3, 6, 7] and lru[0, 0].tolist() == [2, 0, 1, 3]


# -- device path ----------------------------------------------------------------------


def test_device_path_counters_padding_and_short_rows(kc):
    import cupy as cp

    lay = layout(8, 16, 100, 4, groups=2)
    gpu = cuda.CudaResidency(lay, kernels=kc, threads=32)
    cpu = CpuResidency(lay)
    out = gpu.new_output(6)
    rng = np.random.default_rng(3)
    memory: dict = {}
    total = {"hits": 0, "misses": 0, "out_of_range": 0}
    for step in range(6):
        sr, tk = gen_batch(rng, lay, memory, 5, 0.6, junk_p=0.2)
        tk = tk[:, :6]  # fewer columns than top_k: columns 6..8 of slots are -1
        want = cpu.resolve(step % 2, sr, tk)
        with gpu.stream:
            gpu.resolve_async(step % 2, cp.asarray(sr), cp.asarray(tk), out)
        gpu.stream.synchronize()
        assert out.batch == 5 and out.k == 6 and out.group == step % 2
        slots = out.slots.get()
        np.testing.assert_array_equal(slots[:5, :6], want.slots)
        assert (slots[:5, 6:] == -1).all()
        misses = out.misses.get()[:5]
        np.testing.assert_array_equal(misses, want.misses)
        pr, ps = out.plan_rows.get(), out.plan_slots.get()
        pairs = []
        for b in range(5):
            rows = pr[b, : misses[b]]
            assert (np.diff(rows) > 0).all(), "per-row plan sorted by host row"
            pairs += list(zip(rows.tolist(), ps[b, : misses[b]].tolist()))
        assert sorted(pairs) == sorted(zip(want.plan.rows.tolist(), want.plan.slots.tolist()))
        total["hits"] += want.hits
        total["misses"] += int(want.misses.sum())
        total["out_of_range"] += want.out_of_range
        c = out.read_counters(gpu.stream)
        assert {k: c[k] for k in total} == total  # accumulated across resolves
        assert c["errors"] == 0
    out.zero_counters(gpu.stream)
    assert out.read_counters(gpu.stream)["hits"] == 0


def test_device_path_bad_state_row_is_padding(kc):
    import cupy as cp

    lay = layout(4, 8, 50, 2)
    gpu = cuda.CudaResidency(lay, kernels=kc, threads=32)
    out = gpu.new_output(3)
    before = gpu.state()
    with gpu.stream:
        gpu.resolve_async(0, cp.asarray(np.array([5, -3, -1], np.int32)),
                          cp.asarray(np.arange(12, dtype=np.int32).reshape(3, 4)), out)
    c = out.read_counters(gpu.stream)
    assert c["errors"] == cuda.ERR_BAD_STATE_ROW and c["hits"] == c["misses"] == 0
    assert (out.slots.get()[:3] == -1).all() and (out.misses.get()[:3] == 0).all()
    after = gpu.state()
    np.testing.assert_array_equal(before[0], after[0])
    np.testing.assert_array_equal(before[1], after[1])
    with pytest.raises(ResidencyError) as e:
        gpu.resolve(0, np.array([5], np.int32), np.zeros((1, 4), np.int32))
    assert e.value.code == "BAD_STATE_ROW"


def test_duplicates_host_raises_device_refuses_the_row(kc):
    import cupy as cp

    lay = layout(6, 12, 40, 2)
    gpu = cuda.CudaResidency(lay, kernels=kc, threads=32)
    cpu = CpuResidency(lay)
    warm = np.array([[1, 2, 3, 4, 5, 6]], np.int32)
    cpu.resolve(0, np.array([0], np.int32), warm)
    gpu.resolve(0, np.array([0], np.int32), warm)
    dup = np.array([[9, 3, 9, 7, 3, 9], [1, 2, 3, -1, -1, -1]], np.int32)
    sr = np.array([0, 1], np.int32)
    before = gpu.state()
    with pytest.raises(ResidencyError) as e:
        gpu.resolve(0, sr, dup)
    assert e.value.code == "DUPLICATE_IDS"
    after = gpu.state()
    np.testing.assert_array_equal(before[0], after[0])
    np.testing.assert_array_equal(before[1], after[1])
    # Device path: the row with duplicates is refused (slots -1, no misses, its state
    # untouched, the error record names it); the other row resolves as on the CPU.
    want = cpu.resolve(0, sr[1:], dup[1:])
    out = gpu.new_output(2)
    with gpu.stream:
        gpu.resolve_async(0, cp.asarray(sr), cp.asarray(dup), out)
    c = out.read_counters(gpu.stream)
    assert c["errors"] == cuda.ERR_DUPLICATE_IDS
    err = out.err.get()
    assert err[cuda.E_DUPLICATE_IDS] == 1 and err[8 + cuda.E_DUPLICATE_IDS] == 0  # batch row 0
    assert (out.slots.get()[0] == -1).all() and out.misses.get()[0] == 0
    np.testing.assert_array_equal(out.slots.get()[1:2], want.slots)
    np.testing.assert_array_equal(out.misses.get()[1:2], want.misses)
    assert c["hits"] == want.hits
    assert_state(cpu, gpu)


def test_garbage_owner_matches_cpu(kc):
    """Owner rows holding junk (repeats, out-of-range values) still resolve exactly as the
    NumPy engine does (a repeated owner: the lowest slot is the hit)."""
    lay = layout(16, 48, 60, 3, groups=2)
    cpu = CpuResidency(lay)
    gpu = cuda.CudaResidency(lay, kernels=kc, threads=32)
    rng = np.random.default_rng(11)
    owner = rng.integers(-5, 70, size=cpu.owner.shape).astype(np.int32)
    lru = np.stack([[rng.permutation(lay.region_stride) for _ in range(3)] for _ in range(2)]).astype(np.int32)
    cpu.owner[...] = owner
    cpu.lru[...] = lru
    gpu.load_state(owner, lru)
    run_trace(cpu, gpu, lay, seed=5, steps=20, batch=4, overlap=0.5)


def _guarded(cp, shape, dtype, fill, guard=4096):
    """A device array inside a larger one whose margins hold a canary."""
    n = int(np.prod(shape))
    canary = np.array(0x5A5A5A5A, dtype=np.int64).astype(dtype) if np.dtype(dtype).itemsize >= 4 else 0x5A
    big = cp.full(n + 2 * guard, canary, dtype=dtype)
    view = big[guard: guard + n].reshape(shape)
    view[...] = fill
    return big, view, canary, guard


def _intact(big, canary, guard, n):
    h = big.get()
    return (h[:guard] == canary).all() and (h[guard + n:] == canary).all()


def test_corrupt_state_never_writes_out_of_bounds(kc):
    import cupy as cp

    lay = layout(32, 64, 500, 3, groups=2, layers_per_group=2, row_bytes=48)
    gpu = cuda.CudaResidency(lay, kernels=kc, threads=32)
    shape = gpu.owner.shape
    rng = np.random.default_rng(13)
    guards = []
    for attr in ("owner", "lru"):
        big, view, canary, guard = _guarded(cp, shape, np.int32, 0)
        setattr(gpu, attr, view)
        guards.append((big, canary, guard, view.size))
    out = gpu.new_output(6)
    for attr in ("slots", "misses", "plan_rows", "plan_slots"):
        a = getattr(out, attr)
        big, view, canary, guard = _guarded(cp, a.shape, np.int32, -1)
        setattr(out, attr, view)
        guards.append((big, canary, guard, view.size))
    # Slab inside a guarded allocation; pool is a plain pinned mapping.
    big_slab, slab, scan, sguard = _guarded(cp, (lay.num_layers, lay.max_reqs, lay.region_stride, lay.row_bytes),
                                            np.uint8, 0, guard=1 << 16)
    device_sync()
    bufs = cuda.DeviceBuffers(memory=None, slab=slab, staging=None, staging_offset=0)
    m, pool = _pinned_pool(lay.pool_bytes)
    with PinnedRegion(pool.ctypes.data, lay.pool_bytes, lay.row_bytes) as region:
        mover = cuda.CudaMover(lay, region, buffers=bufs, kernels=kc, stream=gpu.stream, blocks=4, threads=64)
        for trial in range(12):
            bad_lru = rng.integers(-40, 100, size=shape).astype(np.int32)
            if trial % 3 == 0:  # every entry the same slot: almost no evictables
                bad_lru[...] = rng.integers(0, lay.region_stride)
            bad_owner = rng.integers(-3, 520, size=shape).astype(np.int32)
            with gpu.stream:
                gpu.owner[...] = cp.asarray(bad_owner)
                gpu.lru[...] = cp.asarray(bad_lru)
            sr, tk = gen_batch(rng, lay, {}, 6, 0.0, junk_p=0.1)
            out.zero_counters(gpu.stream)
            with gpu.stream:
                gpu.resolve_async(int(trial % 2), cp.asarray(sr), cp.asarray(tk), out)
                mover.gather_async(out, lay.groups[trial % 2])
            c = out.read_counters(gpu.stream)
            assert c["errors"] & cuda.ERR_CORRUPT_STATE
            slots, misses = out.slots.get(), out.misses.get()
            assert ((slots >= -1) & (slots < lay.region_stride)).all()
            assert ((misses >= 0) & (misses <= lay.top_k)).all()
            ps = out.plan_slots.get()
            for b in range(6):
                p = ps[b, : misses[b]]
                assert ((p >= 0) & (p < lay.max_reqs * lay.region_stride)).all()
            for big, canary, guard, n in guards:
                assert _intact(big, canary, guard, n), trial
            assert _intact(big_slab, scan, sguard, slab.size), trial
            # State stays in range where it was written: lru positions form a permutation.
            lru_after = gpu.lru.get()
            assert lru_after.shape == shape


# -- mover ----------------------------------------------------------------------------


def _pinned_pool(nbytes):
    """An anonymous mapping (page-aligned) and a byte view of it, filled with random bytes."""
    m = mmap.mmap(-1, max(nbytes, 1))
    a = np.frombuffer(m, dtype=np.uint8, count=nbytes)
    rng = np.random.default_rng(nbytes % 1000)
    a[...] = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    return m, a


@pytest.mark.parametrize("row_bytes", [16, 656])
def test_gather_stage_bytes(kc, row_bytes):
    import cupy as cp

    lay = layout(64, 128, 3000, 4, groups=2, layers_per_group=3, row_bytes=row_bytes, staging_rows=200)
    cpu = CpuResidency(lay)
    gpu = cuda.CudaResidency(lay, kernels=kc, threads=64)
    offset = 3 * 4096 + 16 * 7  # the engine's region starts inside a larger shared pool
    m, shared = _pinned_pool(offset + lay.pool_bytes + 4096)
    chunk = 2 * int(np.lcm(row_bytes, mmap.PAGESIZE))
    with PinnedRegion(shared.ctypes.data, shared.size, lay.row_bytes, max_chunk_bytes=chunk) as region:
        assert len(region.chunks) > 1
        pool = shared[offset: offset + lay.pool_bytes].reshape(lay.num_layers, lay.host_rows, row_bytes)
        mover = cuda.CudaMover(lay, region, pool_offset=offset, kernels=kc, stream=gpu.stream, blocks=8,
                               threads=64)
        mover.slab.fill(0)
        mover.staging.fill(0)
        device_sync()
        host_slab = np.zeros(mover.slab.shape, np.uint8)
        host_staging = np.zeros(mover.staging.shape, np.uint8)
        ref = CpuMover(lay, pool, host_slab, host_staging)
        rng = np.random.default_rng(17)
        memory: dict = {}
        out = gpu.new_output(8)
        for step in range(8):
            sr, tk = gen_batch(rng, lay, memory, 8, 0.5)
            group = step % lay.num_groups
            want = cpu.resolve(group, sr, tk)
            layers = lay.groups[group]
            if step % 2:
                got = gpu.resolve(group, sr, tk)
                assert_same(want, got)
                assert mover.gather(got.plan, layers) == ref.gather(want.plan, layers)
            else:
                with gpu.stream:
                    gpu.resolve_async(group, cp.asarray(sr), cp.asarray(tk), out)
                    mover.gather_async(out, layers)
                ref.gather(want.plan, layers)
                gpu.stream.synchronize()
            np.testing.assert_array_equal(mover.slab.get(), host_slab, err_msg=f"slab step {step}")
        # Every live column's slot holds its row, for every layer of the group.
        slab = mover.slab.get()
        for b, s in enumerate(sr):
            if s < 0:
                continue
            for c, g in enumerate(tk[b]):
                if 0 <= g < lay.host_rows:
                    slot = want.slots[b, c]
                    for layer in lay.groups[group]:
                        assert (slab[layer, s, slot] == pool[layer, g]).all()
        # Stage: whole rows to the front of the staging buffer.
        rows = rng.choice(lay.host_rows, size=150, replace=False).astype(np.int32)
        assert mover.stage(rows, (0, 4, 5)) == ref.stage(rows, (0, 4, 5))
        np.testing.assert_array_equal(mover.staging.get(), host_staging)
        with pytest.raises(ResidencyError) as e:
            mover.stage(np.arange(201, dtype=np.int32), (0,))
        assert e.value.code == "TOO_LARGE"
        # Rewritten rows (padding -1 skipped) dropped everywhere.
        wrows = rng.choice(lay.host_rows, size=40, replace=False).astype(np.int32)
        wrows[::7] = -1
        assert gpu.invalidate_everywhere(wrows) == cpu.invalidate_everywhere(wrows)
        assert_state(cpu, gpu)


def test_gather_host_plan_matches_cpu_mover(kc):
    lay = layout(32, 64, 5000, 2, groups=1, layers_per_group=4, row_bytes=656)
    m, pool_bytes = _pinned_pool(lay.pool_bytes)
    with PinnedRegion(pool_bytes.ctypes.data, lay.pool_bytes, lay.row_bytes) as region:
        pool = pool_bytes.reshape(lay.num_layers, lay.host_rows, lay.row_bytes)
        mover = cuda.CudaMover(lay, region, kernels=kc, blocks=3, threads=64)
        mover.slab.fill(0)
        device_sync()
        host_slab = np.zeros(mover.slab.shape, np.uint8)
        ref = CpuMover(lay, pool, host_slab, None)
        rng = np.random.default_rng(19)
        n = 100
        plan = Plan(rows=np.sort(rng.choice(lay.host_rows, size=n, replace=False)).astype(np.int32),
                    slots=rng.choice(lay.max_reqs * lay.region_stride, size=n, replace=False).astype(np.int32))
        assert mover.gather(plan, (0, 2, 3)) == ref.gather(plan, (0, 2, 3)) == n * 3 * 656
        np.testing.assert_array_equal(mover.slab.get(), host_slab)
        assert mover.gather(Plan(np.empty(0, np.int32), np.empty(0, np.int32)), (0,)) == 0


@pytest.mark.parametrize("block_stride_rows", [4, 7])  # rows back to back / a gap after each block
def test_gather_into_an_engine_owned_paged_slab_matches_the_cpu_mover_and_keeps_guards(kc, block_stride_rows):
    """An engine-owned slab (proto/slab.py) inside a larger device buffer: the host plan,
    the device resolve + gather and the fixed-grid step gather write exactly what
    CpuMover writes into the same geometry; every other byte of the buffer (guards before
    and after, the gaps between blocks, the engine's other blocks) is untouched."""
    import cupy as cp

    lay = layout(32, 64, 3000, 2, groups=2, layers_per_group=2, row_bytes=656)
    br = 4
    stride = block_stride_rows * lay.row_bytes
    blocks = lay.max_reqs * lay.region_stride // br
    resident = 3  # the engine's own blocks before the hot ones, in each layer
    layer_span = (resident + blocks) * stride + 4096
    bases = [4096 + layer * layer_span for layer in range(lay.num_layers)]
    nbytes = 4096 + lay.num_layers * layer_span + 4096
    geo = SlabGeometry.paged(lay, bases, first_block=resident, block_size=br, block_stride=stride,
                             buffer_bytes=nbytes).check(lay)
    cpu = CpuResidency(lay)
    gpu = cuda.CudaResidency(lay, kernels=kc, threads=64)
    m, pool_bytes = _pinned_pool(lay.pool_bytes)
    with PinnedRegion(pool_bytes.ctypes.data, lay.pool_bytes, lay.row_bytes) as region:
        pool = pool_bytes.reshape(lay.num_layers, lay.host_rows, lay.row_bytes)
        rng = np.random.default_rng(23)
        start = rng.integers(0, 256, nbytes, dtype=np.uint8)  # the engine's bytes, guards included
        with gpu.stream:
            dev = cp.asarray(start)
        gpu.stream.synchronize()
        mover = cuda.CudaMover(lay, region, kernels=kc, stream=gpu.stream, blocks=8, threads=64,
                               engine_slab=(dev.data.ptr, geo))
        host = start.copy()
        ref = CpuMover(lay, pool, host, None, geometry=geo)
        memory: dict = {}
        out = gpu.new_output(8)
        for step in range(9):
            sr, tk = gen_batch(rng, lay, memory, 8, 0.5)
            group = step % lay.num_groups
            want = cpu.resolve(group, sr, tk)
            layers = lay.groups[group]
            if step % 3 == 0:
                got = gpu.resolve(group, sr, tk)
                assert_same(want, got)
                assert mover.gather(got.plan, layers) == ref.gather(want.plan, layers)
            elif step % 3 == 1:
                with gpu.stream:
                    gpu.resolve_async(group, cp.asarray(sr), cp.asarray(tk), out)
                    mover.gather_async(out, layers)
                ref.gather(want.plan, layers)
            else:  # the device step's gather: plan counts per batch row, fixed grid
                got = gpu.resolve(group, sr, tk)
                assert_same(want, got)
                plan_rows = np.full((lay.max_batch, lay.top_k), -1, np.int32)
                plan_slots = np.full((lay.max_batch, lay.top_k), -1, np.int32)
                misses = np.zeros(lay.max_batch, np.int32)
                k = lay.top_k  # the plan in rows of at most top_k entries, as the device step lays it out
                chunks = max(1, -(-len(got.plan) // k))
                assert chunks <= lay.max_batch
                for i in range(chunks):
                    part = slice(i * k, min((i + 1) * k, len(got.plan)))
                    n = part.stop - part.start
                    plan_rows[i, :n] = got.plan.rows[part]
                    plan_slots[i, :n] = got.plan.slots[part]
                    misses[i] = n

                desc = np.zeros(DESC_INTS, np.int32)

                desc[D_BATCH], desc[D_GROUP], desc[D_K] = chunks, group, lay.top_k
                with gpu.stream:
                    mover.launch_gather(cp.asarray(desc), cp.asarray(plan_rows), cp.asarray(plan_slots),
                                        cp.asarray(misses), lay.max_batch, gpu.stream)
                ref.gather(got.plan, layers)
            gpu.stream.synchronize()
            np.testing.assert_array_equal(dev.get(), host, err_msg=f"step {step}")
        assert (host != start).any()
        touched = np.zeros(nbytes, bool)
        for layer in range(lay.num_layers):
            for h in range(lay.max_reqs * lay.region_stride):
                off = int(geo.row_offsets(lay, layer, [h])[0])
                touched[off: off + lay.row_bytes] = True
        np.testing.assert_array_equal(dev.get()[~touched], start[~touched])  # guards, gaps, resident blocks


@pytest.mark.parametrize("stripes", [2, 3])
def test_striped_gathers_and_pushes_between_slabs_on_one_gpu_equal_the_full_gather(kc, stripes):
    """A TP group of ``stripes`` ranks on one GPU, a slab each, one device resolve a step
    whose per-row plans every rank reads: rank s gathers stripe s from the pinned pool
    into its slab and pushes it into every other rank's slab and into an engine-owned
    paged buffer (device to device), each on its own stream; every destination's ready
    word counts ``stripes x blocks`` arrivals. After each step every slab equals, bit for
    bit, the slab of a rank that gathered the whole plan (CudaMover, stripe 0 of 1) and
    the cpu backend's; the engine buffer the cpu mover's in its geometry (gaps and other
    blocks untouched); each ready word is 1 and its counter 0."""
    import cupy as cp

    lay = layout(32, 64, 3000, 2, groups=2, layers_per_group=2, row_bytes=656)
    br, stride = 4, 6 * lay.row_bytes  # blocks of 4 rows, a 2-row gap after each
    layer_span = lay.max_reqs * lay.region_stride // br * stride + 4096
    nbytes = 4096 + lay.num_layers * layer_span
    geo = SlabGeometry.paged(lay, [4096 + i * layer_span for i in range(lay.num_layers)], first_block=0,
                             block_size=br, block_stride=stride, buffer_bytes=nbytes).check(lay)
    cpu = CpuResidency(lay)
    gpu = cuda.CudaResidency(lay, kernels=kc, threads=64)
    m, pool_bytes = _pinned_pool(lay.pool_bytes)
    with PinnedRegion(pool_bytes.ctypes.data, lay.pool_bytes, lay.row_bytes) as region:
        pool = pool_bytes.reshape(lay.num_layers, lay.host_rows, lay.row_bytes)
        rng = np.random.default_rng(29 + stripes)
        start = rng.integers(0, 256, lay.slab_shape, dtype=np.uint8)
        engine_start = rng.integers(0, 256, nbytes, dtype=np.uint8)
        ranks = [cuda.CudaMover(lay, region, kernels=kc, stream=cp.cuda.Stream(non_blocking=True), blocks=6,
                                threads=64) for _ in range(stripes)]
        full = cuda.CudaMover(lay, region, kernels=kc, stream=gpu.stream, blocks=6, threads=64)
        engine = cp.asarray(engine_start)
        for mv in (*ranks, full):
            mv.slab[...] = cp.asarray(start)
        targets = [[mv.slab_target(peer.slab) for peer in ranks] + [mv.slab_target(engine.data.ptr, geo)]
                   for mv in ranks]
        ready = cp.zeros(stripes + 1, cp.uint32)  # one word and one counter a destination
        arrivals = cp.zeros(stripes + 1, cp.uint32)
        device_sync()
        host = start.copy()
        host_engine = engine_start.copy()
        ref, ref_engine = CpuMover(lay, pool, host, None), CpuMover(lay, pool, host_engine, None, geometry=geo)
        expect = stripes * 6
        memory: dict = {}
        out = gpu.new_output(8)
        for step in range(8):
            sr, tk = gen_batch(rng, lay, memory, 8, 0.5)
            group = step % lay.num_groups
            want = cpu.resolve(group, sr, tk)
            ref.gather(want.plan, lay.groups[group])
            ref_engine.gather(want.plan, lay.groups[group])
            with gpu.stream:
                gpu.resolve_async(group, cp.asarray(sr), cp.asarray(tk), out)
            resolved = gpu.stream.record()
            full.launch_gather(out.desc, out.plan_rows, out.plan_slots, out.misses, out.max_batch, gpu.stream)
            for s, mv in enumerate(ranks):
                mv.stream.wait_event(resolved)
                sig = {"ready": ready.data.ptr + 4 * s, "arrivals": arrivals.data.ptr + 4 * s, "expect": expect}
                mv.launch_gather(out.desc, out.plan_rows, out.plan_slots, out.misses, out.max_batch, mv.stream,
                                 stripe=s, stripes=stripes, **sig)
                for d in [*range(stripes), stripes]:
                    if d == s:
                        continue
                    sig = {"ready": ready.data.ptr + 4 * d, "arrivals": arrivals.data.ptr + 4 * d, "expect": expect}
                    mv.launch_push(out.desc, out.plan_rows, out.plan_slots, out.misses, out.max_batch, mv.stream,
                                   targets[s][d], stripe=s, stripes=stripes, **sig)
            device_sync()
            np.testing.assert_array_equal(full.slab.get(), host, err_msg=f"full gather, step {step}")
            for d, mv in enumerate(ranks):
                np.testing.assert_array_equal(mv.slab.get(), host, err_msg=f"rank {d} of {stripes}, step {step}")
            np.testing.assert_array_equal(engine.get(), host_engine, err_msg=f"engine slab, step {step}")
            assert ready.get().tolist() == [1] * (stripes + 1) and not arrivals.get().any(), f"step {step}"
            ready.fill(0)
            device_sync()  # the legacy stream's fill before the rank streams' next step
        assert (host != start).any()


def test_striped_launches_refuse_bad_arguments_before_launching(kc):
    """Stripe out of range, a ready word of several arrivals without its counter, a push
    target of the wrong shape, a push from a mover writing an engine's slab: BAD_ARGUMENT."""
    import cupy as cp

    lay = layout(8, 16, 200, 2, groups=1, layers_per_group=1, row_bytes=32)
    m, pool_bytes = _pinned_pool(lay.pool_bytes)
    with PinnedRegion(pool_bytes.ctypes.data, lay.pool_bytes, lay.row_bytes) as region:
        mv = cuda.CudaMover(lay, region, kernels=kc, blocks=4, threads=64)
        plan = cp.zeros((4, lay.top_k), cp.int32)
        misses, desc, word = cp.zeros(4, cp.int32), cp.zeros(DESC_INTS, cp.int32), cp.zeros(2, cp.uint32)
        target = mv.slab_target(mv.slab)
        calls = {
            "stripe 2 of 2": lambda: mv.launch_gather(desc, plan, plan, misses, 4, mv.stream, stripe=2, stripes=2),
            "0 stripes": lambda: mv.launch_push(desc, plan, plan, misses, 4, mv.stream, target, stripe=0, stripes=0),
            "no counter": lambda: mv.launch_gather(desc, plan, plan, misses, 4, mv.stream, ready=word.data.ptr),
            "no counter, expect": lambda: mv.launch_push(desc, plan, plan, misses, 4, mv.stream, target, stripe=0,
                                                         stripes=1, ready=word.data.ptr, expect=8),
            "shape": lambda: mv.slab_target(cp.zeros((2, 3), cp.uint8)),
            "not a target": lambda: mv.launch_push(desc, plan, plan, misses, 4, mv.stream, mv.slab, stripe=0,
                                                   stripes=1),
        }
        for name, call in calls.items():
            with pytest.raises(ResidencyError) as e:
                call()
            assert e.value.code == "BAD_ARGUMENT", name
        geo = SlabGeometry.paged(lay, [0], first_block=0, block_size=lay.max_reqs * lay.region_stride,
                                 buffer_bytes=lay.slab_bytes).check(lay)
        buf = cp.zeros(lay.slab_bytes, cp.uint8)
        engine = cuda.CudaMover(lay, region, kernels=kc, blocks=4, threads=64, engine_slab=(buf.data.ptr, geo))
        with pytest.raises(ResidencyError) as e:
            engine.launch_push(desc, plan, plan, misses, 4, engine.stream, target, stripe=0, stripes=1)
        assert e.value.code == "BAD_ARGUMENT" and "engine" in str(e.value)
        mv.stream.synchronize()
        assert not word.get().any()  # nothing was launched


# -- pinned region --------------------------------------------------------------------


def test_plan_chunks_rules():
    page = 4096
    chunks = plan_chunks(0x10000, 10 << 20, 656, 1 << 20, page)
    unit = np.lcm(656, page)
    assert sum(n for _, n in chunks) == 10 << 20
    assert all(off % unit == 0 and off % 656 == 0 for off, _ in chunks)
    assert all(n <= 1 << 20 for _, n in chunks)
    assert plan_chunks(0x10008, 1000, 16, 4096, page) == [(0, 1000)]  # one chunk: no alignment need
    with pytest.raises(ValueError):
        plan_chunks(0x10008, 1 << 20, 16, 4096, page)  # several chunks from an unaligned start
    with pytest.raises(ValueError):
        plan_chunks(0x10000, 1 << 20, 656, 100_000, page)  # lcm(656, page) > max chunk


class _FailingRuntime:
    """The real runtime, failing the n-th registration."""

    def __init__(self, fail_at):
        self.rt = CudaHostRuntime()
        self.fail_at = fail_at
        self.calls = 0
        self.unregistered = []

    def register(self, address, nbytes, flags):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected failure")
        self.rt.register(address, nbytes, flags)

    def unregister(self, address):
        self.unregistered.append(address)
        self.rt.unregister(address)

    def device_pointer(self, address):
        return self.rt.device_pointer(address)


def test_pinned_region_chunks_close_and_rollback():
    nbytes = 8 << 20
    m = mmap.mmap(-1, nbytes)
    a = np.frombuffer(m, dtype=np.uint8)
    addr = a.ctypes.data
    region = PinnedRegion(addr, nbytes, 656, max_chunk_bytes=1 << 20)
    unit = int(np.lcm(656, mmap.PAGESIZE))
    assert len(region.chunks) == -(-nbytes // ((1 << 20) // unit * unit))
    for c in region.chunks:
        assert c.offset % 656 == 0 and c.nbytes <= 1 << 20
    assert region.contiguous
    assert region.device_address(0) == region.chunks[0].device_address
    off = region.chunks[2].offset + 656 * 3
    assert region.device_address(off, 656) == region.chunks[2].device_address + 656 * 3
    region.close()
    region.close()  # idempotent
    assert region.closed
    with pytest.raises(PinError):
        region.device_address(0)
    # Rollback: the 4th chunk fails; the 3 done are unregistered, then it raises.
    rt = _FailingRuntime(fail_at=4)
    with pytest.raises(PinError):
        PinnedRegion(addr, nbytes, 656, max_chunk_bytes=1 << 20, runtime=rt)
    assert len(rt.unregistered) == 3
    # Nothing stays registered: the whole mapping registers again in one go.
    real = CudaHostRuntime()
    real.register(addr, nbytes, 3)
    real.unregister(addr)


# -- kernel cache ---------------------------------------------------------------------


def test_kernel_cache_dir_and_warm(tmp_path, monkeypatch):
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path / "env"))
    assert kernels.cache_dir() == tmp_path / "env"
    assert kernels.cache_dir(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv(kernels.CACHE_ENV)
    assert kernels.cache_dir() == Path(kernels.DEFAULT_CACHE_DIR).expanduser()
    src = kernels.load_source("resolve.cu", {"SKV_RESOLVE_THREADS": 64})
    assert "#include" not in src and "#define SKV_RESOLVE_THREADS 64" in src
    kc = kernels.KernelCache(tmp_path / "c")
    names = kc.warm(row_bytes=(656, 32))
    assert "skv_resolve" in names and "skv_copy_rows" in names and "skv_prefetch" in names and "skv_tp_follow" in names
    files = sorted(p.name for p in (tmp_path / "c").glob("*.cubin"))
    # resolve: every shape CudaResidency may pick (table x2 / x4, workspace in shared or
    # global memory, lru and owner rows copied or not: 16); the prefetch; the TP group's
    # checks; copy for two row sizes
    assert len(files) == 16 + 1 + 1 + 2, files
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "c").glob("*.cubin")}
    kc2 = kernels.KernelCache(tmp_path / "c")
    kc2.warm(row_bytes=(656, 32))  # a new process: from disk
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "c").glob("*.cubin")} == mtimes
    # What an attach takes is warm already (regions of 4096: the x4 table and both rows;
    # 32768: x2, no row).

    for stride in (4096, 32768):
        lay = Layout(num_layers=1, row_bytes=16, top_k=2048, region_stride=stride, max_reqs=2, host_rows=1 << 16,
                     max_batch=2).validate()
        res = cuda.CudaResidency(lay, kernels=kc2)
        assert (res.hash_scale, res.lru_smem, res.owner_smem) == ((4, True, True) if stride == 4096 else (2, False, False))
        assert not res.workspace_global
        if stride == 4096:  # (a prefetch workspace for 32768 exceeds shared memory)
            cuda.CudaResidency(lay, kernels=kc2, prefetch=True)
    assert sorted(p.name for p in (tmp_path / "c").glob("*.cubin")) == files  # nothing new was built


# -- timing table (SPARSEKV_CUDA_BENCH=1) --------------------------------------------


@pytest.mark.skipif(os.environ.get("SPARSEKV_CUDA_BENCH") != "1", reason="set SPARSEKV_CUDA_BENCH=1")
def test_bench_table(kc, capsys):
    """Resolve time (B=64, k=2048, S=4096) and gather GB/s of 2048 x 64 random 656 B rows
    from a 5 GiB pinned pool, beside a bulk pinned H2D copy, all timed with CUDA events.
    Rows print as they are measured; a failing row prints its error and the rest go on."""
    import cupy as cp

    s = cp.cuda.Stream(non_blocking=True)
    failures = []

    def row(what, value, note=""):
        with capsys.disabled():
            print(f"| {what} | {value} | {note} |", flush=True)

    def section(label, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - report and continue with the next row
            failures.append(label)
            row(label, "FAILED", f"{type(e).__name__}: {e}")

    from sparsekv.bench.kernels import EventTimer

    timer = EventTimer(cp, s)

    def timed(fn, per, rounds=7):
        """Median and min over ``rounds`` of the mean time (us) of ``per`` back-to-back calls."""
        return timer.median_us(lambda i: fn(), per, rounds=rounds)

    with capsys.disabled():
        print("\n\n| what | value | note |\n| --- | --- | --- |", flush=True)
    rb, batch, k, stride = 656, 64, 2048, 4096
    pool_bytes = 5 << 30
    host_rows = pool_bytes // rb
    lay = Layout(num_layers=1, row_bytes=rb, top_k=k, region_stride=stride, max_reqs=batch,
                 host_rows=host_rows).validate()
    rng = np.random.default_rng(0)
    sr = cp.asarray(np.arange(batch, dtype=np.int32))
    n_batches = 16
    fresh_h = [np.stack([rng.choice(host_rows, k, replace=False) for _ in range(batch)]).astype(np.int32)
               for _ in range(n_batches)]
    steady_h = [fresh_h[0]]
    keep = int(0.7 * k)
    for i in range(1, n_batches):  # 70 % of each request's ids carry over from its last step
        nxt = fresh_h[i].copy()
        nxt[:, :keep] = steady_h[-1][:, k - keep:]
        steady_h.append(rng.permuted(nxt, axis=1))
    fresh = [cp.asarray(x) for x in fresh_h]
    steady = [cp.asarray(x) for x in steady_h]
    device_sync()
    counter = iter(range(1 << 40))

    def resolve_rows(threads):
        gpu = cuda.CudaResidency(lay, kernels=kc, stream=s, threads=threads)
        out = gpu.new_output(batch)

        def go(batches):
            gpu.resolve_async(0, sr, batches[next(counter) % n_batches], out, stream=s)

        t = timed(lambda: go(fresh), per=n_batches)
        row(f"resolve B=64 k=2048 S=4096, fresh ids (all miss), {threads} threads", f"{t[0]:.1f} us",
            f"min {t[1]:.1f} us")
        t = timed(lambda: go(steady), per=n_batches)
        out.zero_counters(s)
        for _ in range(n_batches):
            go(steady)
        c = out.read_counters(s)
        hit = c["hits"] / max(1, c["hits"] + c["misses"])
        row(f"resolve B=64 k=2048 S=4096, 70% carry-over (hit rate {hit:.0%}), {threads} threads",
            f"{t[0]:.1f} us", f"min {t[1]:.1f} us")

    for threads in (1024, 512, 256):
        section(f"resolve {threads} threads", lambda: resolve_rows(threads))

    m = mmap.mmap(-1, pool_bytes)
    pool = np.frombuffer(m, dtype=np.uint8)
    pool[::4096] = 1  # fault every page in
    nbytes = batch * k * rb
    with PinnedRegion(pool.ctypes.data, pool_bytes, rb, max_chunk_bytes=4 << 30) as region:
        gpu = cuda.CudaResidency(lay, kernels=kc, stream=s)
        out = gpu.new_output(batch)
        gpu.resolve_async(0, sr, fresh[1], out, stream=s)  # all miss: 131072 rows, sorted per request
        assert out.read_counters(s)["misses"] == batch * k

        def gather_rows(blocks_list, threads=256):
            mover = cuda.CudaMover(lay, region, kernels=kc, stream=s, threads=threads)
            for blocks in blocks_list:
                t = timed(lambda: mover.gather_async(out, (0,), stream=s, blocks=blocks), per=4, rounds=5)
                row(f"gather 2048 x 64 rows of 656 B (sorted per request), {blocks} blocks x {threads} threads",
                    f"{nbytes / t[0] / 1e3:.1f} GB/s", f"{t[0]:.0f} us")

        section("gather default", lambda: gather_rows((16, 32, 66, 132, 264)))
        section("gather 512 threads", lambda: gather_rows((32,), threads=512))

        def gather_order():
            mover = cuda.CudaMover(lay, region, kernels=kc, stream=s)
            rows = cp.asarray(rng.choice(host_rows, batch * k, replace=False).astype(np.int32))
            flat = cp.asarray(rng.permutation(batch * stride)[: batch * k].astype(np.int32))
            sorted_rows = cp.sort(rows)
            device_sync()
            for label, r in (("unsorted", rows), ("globally sorted", sorted_rows)):
                for blocks in (32, 132):
                    t = timed(lambda: mover._launch(s, blocks, mover._pool(), host_rows, host_rows, 1, mover.slab,
                                                    batch * stride, batch * stride, 1, (0,), 3, r, flat, None, 1,
                                                    batch * k), per=4, rounds=5)
                    row(f"gather 131072 rows of 656 B ({label}), {blocks} blocks", f"{nbytes / t[0] / 1e3:.1f} GB/s",
                        f"{t[0]:.0f} us")

        section("gather order", gather_order)

        def step():
            g2 = cuda.CudaResidency(lay, kernels=kc, stream=s)
            o2 = g2.new_output(batch)
            mover = cuda.CudaMover(lay, region, kernels=kc, stream=s, blocks=32)

            def go():
                g2.resolve_async(0, sr, steady[next(counter) % n_batches], o2, stream=s)
                mover.gather_async(o2, (0,), stream=s)

            for _ in range(n_batches):
                go()
            o2.zero_counters(s)
            t = timed(go, per=n_batches)
            c = o2.read_counters(s)
            hit = c["hits"] / max(1, c["hits"] + c["misses"])
            row(f"decode step (resolve + gather of the misses, 1 layer), 70% carry-over (hit {hit:.0%}), 32 blocks",
                f"{t[0]:.1f} us", f"min {t[1]:.1f} us")

        section("step", step)

        def bulk():
            n = region.chunks[0].nbytes  # a DMA copy must stay inside one registration
            dst = cp.empty(n, dtype=cp.uint8)
            host = region.device_address(0, n)

            def go():
                cp.cuda.runtime.memcpyAsync(dst.data.ptr, host, n, cp.cuda.runtime.memcpyHostToDevice, s.ptr)

            t = timed(go, per=1, rounds=5)
            row(f"bulk pinned H2D copy {n / 2**30:.2f} GiB (cudaMemcpyAsync)", f"{n / t[0] / 1e3:.1f} GB/s",
                f"{t[0] / 1e3:.1f} ms")

        section("bulk", bulk)
        s.synchronize()
    assert not failures, failures
