"""sparsekv bench kernels' scattered workloads: the plans it times (windows, runs, the share
of new rows, distinct rows and slots), the variants' keys and builds, and (cuda) that every
gather variant moves exactly the plan."""

import mmap

import numpy as np
import pytest

from sparsekv.bench import kernels_scattered as ks
from sparsekv.daemon.kernels import get_cache
from sparsekv.daemon.pinned import PinnedRegion
from sparsekv.daemon.residency.cuda import CudaMover, allocate_device_buffers
from sparsekv.proto import Layout


def _check_plans(rows, slots, misses, pool_rows, window, run, spread, batch, top_k, stride):
    """Each request's rows distinct, sorted, inside its own window (side by side, or
    spread to the pool's end), in run-aligned runs of ``run`` rows (the last one maybe cut);
    -1 past its misses; its slots distinct in its own region."""
    gap = (pool_rows - window) // (batch - 1) if spread else window
    for i in range(rows.shape[0]):
        for b in range(batch):
            m = int(misses[i, b])
            r = rows[i, b, :m].astype(np.int64)
            assert (np.diff(r) > 0).all(), "sorted, no row twice"
            assert r.min() >= b * gap and r.max() < b * gap + window
            assert (rows[i, b, m:] == -1).all() and (slots[i, b, m:] == -1).all()
            sl = slots[i, b, :m]
            assert len(set(sl.tolist())) == m and (sl // stride == b).all()
            runs, counts = np.unique((r - b * gap) // run, return_counts=True)
            assert (counts[:-1] == run).all() and 1 <= counts[-1] <= run and len(runs) == -(-m // run)
    if spread:  # the last window ends near the pool's end
        assert rows[:, -1].max() >= pool_rows - window - batch


@pytest.mark.parametrize("window, run, spread", [(4096, 1, False), (4096, 1, True), (4096, 8, False),
                                                 (2048, 16, False), (4096, 64, True)])
def test_scattered_plans_keep_each_request_in_its_window_in_runs(window, run, spread):
    rng = np.random.default_rng(5)
    batch, top_k, stride, pool_rows = 8, 512, 1024, 200_000
    rows, slots, misses = ks.scattered_plans(rng, pool_rows, 4, window, run, spread, batch=batch, top_k=top_k,
                                             miss_rate=0.1, stride=stride)
    assert rows.shape == slots.shape == (4, batch, top_k) and misses.shape == (4, batch)
    assert rows.dtype == slots.dtype == misses.dtype == np.int32
    _check_plans(rows, slots, misses, pool_rows, window, run, spread, batch, top_k, stride)


def test_the_headline_workload_is_a_decode_steps_new_rows():
    """The issue's shape at its real size: batch 64, top-k 2048, 131,072-row windows side by
    side, ~10 % new rows a request (about 13.1k rows, 8.6 MB a step), counts that vary."""
    shape = ks.SCATTERED_SHAPES[0]
    assert (shape.name, shape.window, shape.run, shape.spread) == ("w128k", 131072, 1, False)
    pool_rows = (64 << 30) // ks.ROW_BYTES
    rng = np.random.default_rng(7)
    rows, slots, misses = ks.scattered_plans(rng, pool_rows, 4, shape.window)
    _check_plans(rows, slots, misses, pool_rows, shape.window, 1, False, ks.BATCH, ks.TOP_K, ks.STRIDE)
    share = misses.sum(axis=1) / (ks.BATCH * ks.TOP_K)
    assert np.abs(share - ks.MISS_RATE).max() < 0.01
    assert 0.05 < misses.min() / ks.TOP_K and misses.max() / ks.TOP_K < 0.15 and len(set(misses.ravel())) > 10
    assert 8.0e6 < misses.sum(axis=1).mean() * ks.ROW_BYTES < 9.2e6


def test_every_shape_fits_the_default_pool_and_a_too_small_one_is_refused():
    pool_rows = (64 << 30) // ks.ROW_BYTES
    names = [s.name for s in ks.SCATTERED_SHAPES]
    assert len(set(names)) == len(names)
    for s in ks.SCATTERED_SHAPES:
        rows, _, _ = ks.scattered_plans(np.random.default_rng(0), pool_rows, 1, s.window, s.run, s.spread)
        assert rows.max() < pool_rows
    with pytest.raises(ValueError, match="64 windows of 131072 rows need 8388608 rows; the pool has 1000000"):
        ks.scattered_plans(np.random.default_rng(0), 1_000_000, 1, 131072)
    with pytest.raises(ValueError, match="multiple of the run"):
        ks.scattered_plans(np.random.default_rng(0), pool_rows, 1, 1000, run=16)


def test_variants_have_distinct_keys_and_build_from_the_daemons_sources():
    """Each variant: a distinct key, options CudaMover takes (threads), a grid (blocks) and
    csrc/copy.cu defines; a variant's build is the daemon's constants with its own added."""
    keys = [ks.variant_key(k) for k, _, _ in ks.GATHER_VARIANTS]
    assert len(set(keys)) == len(keys) and all(k == ks.variant_key(k) for k in keys)
    for _, _, opts in ks.GATHER_VARIANTS:
        assert set(opts) <= {"threads", "blocks", "defines"} and opts

    class Cache:
        def function(self, source, name, defines=None, smem_bytes=0):
            return source, name, defines, smem_bytes

    got = ks.VariantKernels(Cache(), {"SKV_COPY_UNROLL": 2}).function(
        "copy.cu", "skv_gather", {"SKV_ROW_VECS": 41, "SKV_COPY_THREADS": 512}, smem_bytes=520)
    assert got == ("copy.cu", "skv_gather", {"SKV_ROW_VECS": 41, "SKV_COPY_THREADS": 512, "SKV_COPY_UNROLL": 2}, 520)


@pytest.mark.cuda
@pytest.mark.parametrize("variant", [None, *[k for k, _, _ in ks.GATHER_VARIANTS]])
def test_each_gather_variant_moves_exactly_the_plan_on_the_gpu(variant):
    """skv_gather built as the daemon builds it and as each variant, from a pinned pool:
    every planned row lands in its slot, every other slot keeps its bytes."""
    import cupy as cp

    opts = dict(next(o for k, _, o in ks.GATHER_VARIANTS if k == variant)) if variant else {}
    defines = opts.pop("defines", None)
    blocks = opts.pop("blocks", ks.DEFAULT_BLOCKS)
    batch, top_k, stride, rb, window = 8, 256, 512, ks.ROW_BYTES, 4096
    pool_rows = batch * window + 100
    lay = Layout(num_layers=1, row_bytes=rb, top_k=top_k, region_stride=stride, max_reqs=batch,
                 host_rows=pool_rows, max_batch=batch).validate()
    rng = np.random.default_rng(9)
    mapping = mmap.mmap(-1, pool_rows * rb)  # page-aligned, as a pool's is
    pool = np.frombuffer(mapping, dtype=np.uint8).reshape(pool_rows, rb)
    pool[...] = rng.integers(0, 256, size=pool.shape, dtype=np.uint8)
    rows, slots, misses = ks.scattered_plans(rng, pool_rows, 1, window, 1, True, batch=batch, top_k=top_k,
                                             miss_rate=0.3, stride=stride)
    s = cp.cuda.Stream(non_blocking=True)
    kc = get_cache()
    with PinnedRegion(pool.ctypes.data, pool.nbytes, rb) as region:
        bufs = allocate_device_buffers(lay)
        with s:
            bufs.slab[...] = 7
        desc, d_rows, d_slots, d_miss = ks.device_plans(cp, s, rows, slots, misses, 0)
        mv = CudaMover(lay, region, buffers=bufs, kernels=ks.VariantKernels(kc, defines) if defines else kc,
                       stream=s, blocks=blocks, **opts)
        mv.launch_gather(desc, d_rows[0], d_slots[0], d_miss[0], batch, s)
        s.synchronize()
        got = cp.asnumpy(bufs.slab).reshape(batch * stride, rb)
    want = np.full_like(got, 7)
    for b in range(batch):
        m = int(misses[0, b])
        want[slots[0, b, :m]] = pool[rows[0, b, :m]]
    np.testing.assert_array_equal(got, want)
