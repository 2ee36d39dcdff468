"""``skv_resolve`` at batch 1 alone, as the serving bench's offloaded modes build it (top-k
2048, regions of 2560 rows, 90 % of the ids kept step to step), for a profiler to look
at: each variant's time as a CUDA graph, then ``--launches`` more plain launches (the
ones ``ncu --launch-skip`` lands on).

    python3 tests/gpu/probe_resolve.py [--region-rows 2560] [--prefetch] [--lineinfo] [--launches 20]

``--lineinfo`` builds the kernels with line tables (into a cache directory of their own),
so that a profiler's source page names resolve.cu's lines.
"""

from __future__ import annotations

import argparse
import tempfile

import cupy as cp
import numpy as np

from sparsekv.bench.kernels import EventTimer, resolve_sequence
from sparsekv.csrc import build
from sparsekv.daemon.kernels import get_cache
from sparsekv.daemon.residency.cuda import CudaResidency
from sparsekv.proto import Layout


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--region-rows", type=int, default=2560)
    ap.add_argument("--prefetch", action="store_true", help="keep prefetch marks (as a prefetch rank does)")
    ap.add_argument("--lineinfo", action="store_true")
    ap.add_argument("--launches", type=int, default=20)
    o = ap.parse_args()
    if o.lineinfo:
        build.OPTIONS = build.OPTIONS + ("-lineinfo",)
        kc = get_cache(tempfile.mkdtemp(prefix="skv-lineinfo-"))
    else:
        kc = get_cache()  # kernel_cache_dir, as the daemon reads it
    k = 2048
    lay = Layout(num_layers=1, row_bytes=16, top_k=k, region_stride=o.region_rows, max_reqs=1,
                 host_rows=65536, max_batch=1).validate()
    s = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    with s:
        seq = [cp.asarray(x) for x in resolve_sequence(rng, steps=20, batch=1, top_k=k)]
        rows = cp.zeros(1, dtype=cp.int32)
    res = CudaResidency(lay, kernels=kc, stream=s, prefetch=o.prefetch)
    ro = res.new_output(1)
    for x in seq:
        res.resolve_async(0, rows, x, ro, stream=s)
    s.synchronize()
    timer = EventTimer(cp, s)

    def go(i):
        res.launch_resolve(ro.desc, rows, seq[i], ro.slots, ro.misses, ro.plan_rows, ro.plan_slots, ro.counters, 0,
                           ro.err, ro.workspace, 1, s)

    t, tmin = timer.graph_us(go, len(seq))
    print(f"resolve batch 1, region {o.region_rows}, prefetch {o.prefetch}, table x{res.hash_scale}, "
          f"lru_smem {res.lru_smem}, owner_smem {res.owner_smem}: {t:.2f} us (min {tmin:.2f}; graph)", flush=True)
    for i in range(o.launches):
        go(i % len(seq))
    s.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
