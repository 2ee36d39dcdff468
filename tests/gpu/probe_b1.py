"""Where a batch-1 layer's swap-in goes: the in-process handle's kernels, one by one.

    python3 tests/gpu/probe_b1.py [--context 32768] [--layers 61] [--steps 12] [--region-rows N [--prefetch]] [--out DIR]

The serving bench's batch-1 shape (DeepSeek-V3.2 rows of 656 bytes, top-k 2048, one index
group a layer, 90 % step-to-step hits, layer overlap 0.85) without the model: a step is
``begin_step`` and every layer's ``swap_in``, captured in one CUDA graph; the "filled"
variants put a device copy and a matmul before each swap-in (other kernels' use of L2 and
shared memory, as the model's between two layers). Each replay is
timed by CUDA events; a few replays run under torch's profiler, whose kernel records
(inside the graph) give each kernel's time and the idle gaps between kernels. Prints one
table and writes ``probe-b1.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import numpy as np
import torch

from sparsekv.bench.decode_modes import capture_step
from sparsekv.bench.decode_workload import fill_pattern, generate
from sparsekv.embedded.inproc_cuda import InprocSwapIn
from sparsekv.proto import Layout

ROW_BYTES, TOP_K, BLOCK = 656, 2048, 64


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--gather-blocks", type=int, default=32)
    ap.add_argument("--filler-mb", type=int, default=256,
                    help="the 'filled' variants: per layer, before its swap-in, a device copy of this many MB "
                         "and a bf16 matmul (the model's work between two swap-ins: L2 and shared memory "
                         "taken by other kernels)")
    ap.add_argument("--region-rows", type=int, default=TOP_K,
                    help="hot-region rows a layer (>= top-k; the serving bench's offloaded modes use 2560)")
    ap.add_argument("--prefetch", action="store_true",
                    help="the handle with cross-layer prefetch (needs --region-rows above top-k): where a "
                         "prefetch's kernels and its fresh marks put time on a batch-1 layer's path")
    ap.add_argument("--filler-topk", action="store_true",
                    help="the filled variants: also torch.topk(2048) over 32K scores right before each swap-in "
                         "(what precedes it in the model)")
    ap.add_argument("--filler-kernels", type=int, default=0, metavar="N",
                    help="the filled variants: also N tiny kernels a layer (a graph of the model's node count)")
    ap.add_argument("--max-batch", type=int, default=1,
                    help="the layout's max_batch and max_reqs (a batch of 1 still; the serving bench's handles "
                         "are made for the largest batch of the run)")
    ap.add_argument("--spread", type=int, default=1,
                    help="a host pool N times the context, the request's blocks spread over it at random (the "
                         "serving bench's pool is 16 GiB: the GPU's reach into host memory)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    o = ap.parse_args()
    L, C = o.layers, o.context
    if o.region_rows < TOP_K or (o.prefetch and o.region_rows == TOP_K):
        ap.error(f"--region-rows must be >= {TOP_K}, and above it with --prefetch")
    lay = Layout(num_layers=L, row_bytes=ROW_BYTES, top_k=TOP_K, region_stride=o.region_rows, max_reqs=o.max_batch, host_rows=C * o.spread,
                 index_groups=tuple((i,) for i in range(L)), max_batch=o.max_batch, staging_rows=min(4096, C)).validate()
    steps = 3 + o.steps + 4
    wl = generate(1, 0.9, steps=steps, layers=L, context=C, top_k=TOP_K, block_size=BLOCK, layer_overlap=0.85)
    d = torch.device("cuda", 0)
    # A handle (residency and pool) per offloaded variant: each replays the sequence once,
    # in order (on one shared handle the second variant would replay the first's top-k and
    # hit every row).
    hs = {}
    try:
        for name in ("offload", "offload_filled"):
            hs[name] = InprocSwapIn(lay, device=0, gather_blocks=o.gather_blocks, prefetch=o.prefetch)
            fill_pattern(hs[name].pool)
        table = wl.block_table
        if o.spread > 1:  # the request's blocks at distinct random host blocks of the larger pool
            n = table.size
            table = np.random.default_rng(1).choice(n * o.spread, size=n, replace=False).astype(np.int32)
        table = torch.from_numpy(table.reshape(wl.block_table.shape)).to(d)
        req = torch.zeros(1, dtype=torch.int32, device=d)
        state, reset = req.clone(), torch.zeros(1, dtype=torch.bool, device=d)
        topk = torch.zeros((L, 1, TOP_K), dtype=torch.int32, device=d)
        idx = torch.zeros_like(topk)
        base = torch.from_numpy(wl.base.reshape(steps, -1)).to(d, torch.int64)
        perms = torch.from_numpy(wl.perms).to(d)
        resets = torch.from_numpy(wl.reset).to(d)
        hbm_base = torch.zeros((1, 1), dtype=torch.int32, device=d)

        def load(t):
            reset.copy_(resets[t])
            topk.view(L, -1).copy_(perms.index_select(1, base[t]))

        n_fill = max(1, o.filler_mb << 19)  # bf16 elements
        fa, fb = torch.empty(n_fill, dtype=torch.bfloat16, device=d), torch.empty(n_fill, dtype=torch.bfloat16, device=d)
        wa = torch.randn((1, 7168), dtype=torch.bfloat16, device=d)
        wb = torch.randn((7168, 4096), dtype=torch.bfloat16, device=d)
        wo = torch.empty((1, 4096), dtype=torch.bfloat16, device=d)

        scores = torch.randn((1, 32768), device=d)
        tiny = torch.zeros(256, device=d)

        def fill():
            fb.copy_(fa)
            torch.mm(wa, wb, out=wo)
            for _ in range(o.filler_kernels):
                tiny.add_(1.0)
            if o.filler_topk:
                torch.topk(scores, TOP_K, dim=-1, sorted=False)

        def offload(filled=False):
            h = hs["offload_filled" if filled else "offload"]
            h.begin_step(state, reset, None)
            for layer in range(L):
                if filled:
                    fill()
                h.swap_in(req, table, topk[layer], layer=layer, block_size=BLOCK, attention_indices_out=idx[layer])

        def hbm(filled=False):  # all on the GPU: the index mapping alone
            for layer in range(L):
                if filled:
                    fill()
                torch.add(topk[layer], hbm_base, out=idx[layer])

        load(0)
        runs = {}
        variants = (("offload", offload), ("hbm", hbm), ("offload_filled", lambda: offload(True)),
                    ("hbm_filled", lambda: hbm(True)))
        for name, fn in variants:
            run, kind, graph = capture_step(torch, fn, name)
            runs[name] = (run, kind, graph)
        times = defaultdict(list)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for t in range(1, 1 + 3 + o.steps):
            for name, (run, _, _) in runs.items():
                load(t)
                torch.cuda.synchronize()
                e0.record()
                run()
                e1.record()
                torch.cuda.synchronize()
                if t > 3:
                    times[name].append(e0.elapsed_time(e1) * 1e3)
        # The profiler over the last replays, per offloaded graph: each kernel's time, and the
        # idle gaps between consecutive kernels of one replay.
        from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

        prof_steps = list(range(1 + 3 + o.steps, steps))
        n = len(prof_steps) * L
        profiled = {}
        c0 = {name: h.counters() for name, h in hs.items()}
        for name in ("offload", "offload_filled"):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for t in prof_steps:
                    load(t)
                    torch.cuda.synchronize()
                    runs[name][0]()
                    torch.cuda.synchronize()
            kern = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                          key=lambda ev: ev.time_range.start)
            by = defaultdict(list)
            for ev in kern:
                by[ev.name].append(ev.time_range.end - ev.time_range.start)
            gaps = [b.time_range.start - a.time_range.end for a, b in zip(kern, kern[1:])]
            small_gaps = [g for g in gaps if g < 100]  # within a replay (us)
            rows = [{"kernel": k[:60], "count": len(ds), "per_layer": len(ds) / n, "mean_us": statistics.fmean(ds),
                     "us_per_layer": sum(ds) / n} for k, ds in sorted(by.items(), key=lambda kv: -sum(kv[1]))]
            profiled[name] = {"kernels": rows, "gap_us_per_layer": sum(small_gaps) / n if small_gaps else None,
                              "gap_mean_us": statistics.fmean(small_gaps) if small_gaps else None}
        out = {
            "context": C, "layers": L, "gather_blocks": o.gather_blocks, "region_rows": o.region_rows,
            "pool_gib": C * o.spread * L * ROW_BYTES / 2**30, "max_batch": o.max_batch,
            "filler_topk": o.filler_topk, "filler_kernels": o.filler_kernels,
            "prefetch": o.prefetch,
            "graph": {k: v[1] for k, v in runs.items()},
            "step_us": {k: statistics.median(v) for k, v in times.items()},
            "layer_us": {k: statistics.median(v) / L for k, v in times.items()},
            "profiled": profiled,
        }
        for name, h in hs.items():  # over the profiled replays: prof_steps x L layers each
            c1 = h.counters()
            out[f"{name}_misses_per_layer"] = (c1["misses"] - c0[name]["misses"]) / n
            if o.prefetch:
                out[f"{name}_prefetch_hits_per_layer"] = (c1["prefetch_hits"] - c0[name]["prefetch_hits"]) / n
        print(json.dumps(out, indent=1))
        for name, p in profiled.items():
            print(f"== {name}\n{'kernel':60s} {'/layer':>6s} {'mean us':>8s} {'us/layer':>8s}")
            for r in p["kernels"]:
                print(f"{r['kernel']:60s} {r['per_layer']:6.2f} {r['mean_us']:8.2f} {r['us_per_layer']:8.2f}")
            print(f"gaps between kernels: {p['gap_us_per_layer']} us a layer (mean gap {p['gap_mean_us']})")
        print("layer us: " + "  ".join(f"{k} {v:.2f}" for k, v in out["layer_us"].items()))
        os.makedirs(o.out, exist_ok=True)
        with open(os.path.join(o.out, "probe-b1.json"), "w") as f:
            json.dump(out, f, indent=1)
        for h in hs.values():
            h.check()
    finally:
        for h in hs.values():
            h.close()
    return 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"probe_b1: {time.time() - t0:.1f} s", file=sys.stderr)
    sys.exit(rc)
