"""Can the decode gather go past the SMs' ceiling by the Tensor Memory Accelerator, or by
loads that ask the L2 for whole 256-byte pieces? (issue 8: the SM gather tops out near
0.82 of a bulk copy even on adjacent rows.)

In one process, from one pinned pool of GIB GiB (the daemon's HostPool, registered in
4 GiB chunks), on the bench's realistic step plans (batch 64, top-k 2048, 656 B rows, ~10 %
misses, each request's rows in its own 64-row blocks): the daemon's gather (16-byte SM
loads, 32 blocks x 256 threads), its load flavours and grids, against csrc/copy.cu's TMA gather (SKV_COPY_TMA: a bulk
asynchronous copy a row into shared memory and one out) at several grids, threads and
buffers a thread; each TMA layout's slab compared byte for byte with the SM gather's first;
then both on adjacent rows, and a bulk cudaMemcpyAsync of 4 GiB for the link.

Run on its own process (a TMA fault would end the CUDA context): prints one line a
variant and, last, a JSON object. Usage: python3 tests/gpu/probe_tma_gather.py [GIB]
"""

import json
import sys
import time

import numpy as np

GIB = 1 << 30
LAYERS = 61
# TMA layouts (blocks, threads, buffers a thread; the buffers of a block must fit 227 KiB);
# session 16's first run: 22-24 GB/s for every layout, against 42 for the SM gather.
VARIANTS = ((32, 128, 2), (132, 64, 2))
# The SM gather's load flavours (csrc/copy.cu SKV_COPY_LOAD: 3 / 4 ask the L2 for 256 / 128
# bytes around each load) and grids.
SM_VARIANTS = ((32, 1), (32, 3), (32, 4), (64, 3), (16, 3))


def main(gib: float) -> dict:
    import cupy as cp

    from sparsekv.bench.kernels import BATCH, PLANS, ROW_BYTES, TOP_K, STRIDE, EventTimer, _device_plans, \
        step_plans
    from sparsekv.daemon.kernels import get_cache
    from sparsekv.daemon.pinned import PinnedRegion
    from sparsekv.daemon.pool import HostPool
    from sparsekv.daemon.residency.cuda import CudaMover, allocate_device_buffers
    from sparsekv.proto import Layout

    nbytes = int(gib * GIB) // (1 << 21) * (1 << 21)
    t0 = time.perf_counter()
    pool = HostPool(nbytes, 16)
    region = PinnedRegion(pool.address, nbytes, 16, 4 * GIB)
    print(f"probe_tma: pool {nbytes / GIB:.0f} GiB ready in {time.perf_counter() - t0:.1f} s", flush=True)
    host_rows = nbytes // (LAYERS * ROW_BYTES)
    lay = Layout(num_layers=LAYERS, row_bytes=ROW_BYTES, top_k=TOP_K, region_stride=STRIDE, max_reqs=BATCH,
                 host_rows=host_rows, max_batch=BATCH).validate()
    layer = LAYERS // 2
    rng = np.random.default_rng(5)
    view = pool.view(layer * host_rows * ROW_BYTES, (host_rows, ROW_BYTES))
    view[...] = rng.integers(0, 256, size=view.shape, dtype=np.uint8)  # one layer's rows, distinct bytes
    prow, pslot, pmiss = step_plans(rng, host_rows, PLANS)
    plans = _device_plans(cp, cp.cuda.Stream.null, prow, pslot, pmiss, layer)
    crow = prow.copy()
    for i in range(PLANS):
        for b in range(BATCH):
            m = int(pmiss[i, b])
            crow[i, b, :m] = np.arange(m, dtype=np.int32) + (i * BATCH + b) * m
    adjacent = _device_plans(cp, cp.cuda.Stream.null, crow, pslot, pmiss, layer)
    step_bytes = int(pmiss[0].sum()) * ROW_BYTES
    kc = get_cache()
    s = cp.cuda.Stream(non_blocking=True)
    timer = EventTimer(cp, s)
    bufs = allocate_device_buffers(lay)
    out: dict = {"probe_tma_pool_GiB": round(nbytes / GIB, 1), "probe_tma_step_bytes": step_bytes}

    big = 4 * GIB
    bulk = cp.empty(big, dtype=cp.uint8)
    src = region.device_address(0, big)
    t, _ = timer.median_us(lambda i: cp.cuda.runtime.memcpyAsync(bulk.data.ptr, src, big, 1, s.ptr), 1, rounds=3)
    bulk_gbps = big / t / 1e3
    out["probe_tma_bulk_h2d_GBps"] = round(bulk_gbps, 2)
    print(f"probe_tma: bulk pinned H2D 4 GiB: {bulk_gbps:.1f} GB/s", flush=True)
    bulk = None
    cp.get_default_memory_pool().free_all_blocks()

    def timed(mv, p) -> float:
        d_desc, d_rows, d_slots, d_miss = p
        t, _ = timer.median_us(lambda i: mv.launch_gather(d_desc, d_rows[i], d_slots[i], d_miss[i], BATCH, s), PLANS)
        return step_bytes / t / 1e3

    def slab_after(mv, p, i: int):
        d_desc, d_rows, d_slots, d_miss = p
        bufs.slab[layer].fill(0)
        mv.launch_gather(d_desc, d_rows[i], d_slots[i], d_miss[i], BATCH, s)
        s.synchronize()
        return bufs.slab[layer].copy()

    sm = CudaMover(lay, region, buffers=bufs, kernels=kc, stream=s, blocks=32)
    want = [slab_after(sm, plans, i) for i in (0, 1)]
    want_adj = slab_after(sm, adjacent, 2)
    for blocks, load in SM_VARIANTS:
        name = f"sm_{blocks}x256_load{load}"
        mv = CudaMover(lay, region, buffers=bufs, kernels=kc, stream=s, blocks=blocks, load=load)
        same = all(bool(cp.array_equal(slab_after(mv, plans, i), want[i])) for i in (0, 1))
        g, ga = timed(mv, plans), timed(mv, adjacent)
        out[f"probe_tma_{name}_GBps"] = round(g, 2)
        out[f"probe_tma_{name}_adjacent_GBps"] = round(ga, 2)
        print(f"probe_tma: {name}: {g:.1f} GB/s ({g / bulk_gbps:.3f} of bulk), adjacent rows {ga:.1f} "
              f"({ga / bulk_gbps:.3f}){'' if same else ' WRONG BYTES'}", flush=True)
    for blocks, threads, stages in VARIANTS:
        name = f"tma_{blocks}x{threads}x{stages}"
        try:
            mv = CudaMover(lay, region, buffers=bufs, kernels=kc, stream=s, blocks=blocks, threads=threads,
                           tma_stages=stages)
            same = all(bool(cp.array_equal(slab_after(mv, plans, i), want[i])) for i in (0, 1))
            same = same and bool(cp.array_equal(slab_after(mv, adjacent, 2), want_adj))
        except Exception as e:  # noqa: BLE001 - a layout that does not fit must not lose the rest
            print(f"probe_tma: {name}: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        out[f"probe_tma_{name}_same_bytes"] = int(same)
        if not same:
            print(f"probe_tma: {name}: WRONG BYTES", flush=True)
            continue
        g = timed(mv, plans)
        ga = timed(mv, adjacent)
        out[f"probe_tma_{name}_GBps"] = round(g, 2)
        out[f"probe_tma_{name}_adjacent_GBps"] = round(ga, 2)
        print(f"probe_tma: {name}: {g:.1f} GB/s ({g / bulk_gbps:.3f} of bulk), adjacent rows {ga:.1f} "
              f"({ga / bulk_gbps:.3f}); same bytes as the SM gather", flush=True)
    view = None
    region.close()
    pool.close()
    return out


if __name__ == "__main__":
    print(json.dumps(main(float(sys.argv[1]) if len(sys.argv) > 1 else 16.0), sort_keys=True))
