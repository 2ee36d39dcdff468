"""The decode step's two kernels, a few launches each, for Nsight Compute (issue 8: "profile
it, with Nsight Compute if it is on the machine"): skv_resolve of batch 64, top-k 2048,
region 4096 in the steady state (the cycle of ``bench_kernels.resolve_sequence``), and
skv_gather of a realistic step's misses (``bench_kernels.step_plans``) from a pinned pool.
Run on the GPU machine, outside MPS (Nsight Compute does not profile MPS clients):

    CUDA_MPS_PIPE_DIRECTORY=/tmp/no-mps ncu --clock-control none \\
        --kernel-name regex:'skv_resolve|skv_gather' --launch-skip 8 --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \\
        python3 tests/gpu/ncu_kernels.py [POOL_GIB]

(``tests/gpu/device_run.sh ncu`` does that and keeps the text report.)
"""

import sys

import numpy as np


def main(pool_gib: float = 8.0) -> int:
    import cupy as cp

    from sparsekv.bench.kernels import BATCH, PLANS, ROW_BYTES, STRIDE, TOP_K, resolve_sequence, step_plans
    from sparsekv.daemon.kernels import get_cache
    from sparsekv.daemon.pinned import PinnedRegion
    from sparsekv.daemon.pool import HostPool
    from sparsekv.daemon.residency.cuda import CudaMover, CudaResidency, allocate_device_buffers, make_desc
    from sparsekv.proto import Layout

    kc = get_cache()
    s = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)

    # Resolve: the steady state first (the cycle twice), then the profiled launches.
    rlay = Layout(num_layers=1, row_bytes=16, top_k=TOP_K, region_stride=STRIDE, max_reqs=BATCH,
                  host_rows=BATCH * 65536, max_batch=BATCH).validate()
    res = CudaResidency(rlay, kernels=kc, stream=s)
    ro = res.new_output(BATCH)
    with s:
        seq = [cp.asarray(x) for x in resolve_sequence(rng)]
        sr = cp.asarray(np.arange(BATCH, dtype=np.int32))
    for x in seq * 2:
        res.resolve_async(0, sr, x, ro, stream=s)
    s.synchronize()
    print(f"resolve: {res.lookup} lookup, {res.threads} threads, workspace {res.workspace_bytes} B "
          f"({'global' if res.workspace_global else 'shared'})")

    # Gather: one layer of a pinned pool of pool_gib, 10 % misses per request.
    layers = 8
    nbytes = int(pool_gib * (1 << 30)) // (1 << 21) * (1 << 21)
    host_rows = nbytes // (layers * ROW_BYTES)
    lay = Layout(num_layers=layers, row_bytes=ROW_BYTES, top_k=TOP_K, region_stride=STRIDE, max_reqs=BATCH,
                 host_rows=host_rows, max_batch=BATCH).validate()
    pool = HostPool(nbytes)
    region = PinnedRegion(pool.address, -(-lay.pool_bytes // 4096) * 4096, ROW_BYTES, max_chunk_bytes=1 << 40)
    prow, pslot, pmiss = step_plans(rng, host_rows, PLANS)
    desc = make_desc(BATCH, TOP_K, layers // 2)
    with s:
        d_desc = cp.asarray(desc)
        plans = [(cp.asarray(prow[i]), cp.asarray(pslot[i]), cp.asarray(pmiss[i])) for i in range(PLANS)]
    mv = CudaMover(lay, region, buffers=allocate_device_buffers(lay), kernels=kc, stream=s, order="request")
    for i in range(12):
        r, sl, m = plans[i % PLANS]
        mv.launch_gather(d_desc, r, sl, m, BATCH, s)
    s.synchronize()
    print(f"gather: {mv.blocks} blocks x {mv.threads} threads, {int(pmiss[0].sum())} rows of {ROW_BYTES} B a launch")
    region.close()
    pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(*(float(a) for a in sys.argv[1:2])))
