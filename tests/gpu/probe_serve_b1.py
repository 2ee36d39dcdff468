"""A batch-1 swap-in inside the serving bench's model step: each kernel's time and the idle
time around the swap-in's kernels, from torch's profiler over replays of the step's graph.

    python3 tests/gpu/probe_serve_b1.py [--context 32768] [--steps 3] [--out DIR]

``bench serve``'s DeepSeek-V3.2 step at batch 1 (random weights, 61 layers), all on the GPU
and in process (``InprocSwapIn``, regions of 2560 rows), each captured as one CUDA graph:
``tests/gpu/probe_b1.py`` times the swap-in's kernels in a graph of their own; this puts
the same kernels among the model's, where the step's swap-in part is ~15 us a layer
longer. Per mode: every kernel's time a layer (the kernels of the swap-in by name), the
idle time before each (from the previous kernel's end) summed a layer, and the step.
Writes ``probe-serve-b1.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

from sparsekv.bench.decode_modes import capture_step
from sparsekv.bench.decode_workload import fill_pattern, generate
from sparsekv.bench.serve_model import PRESETS, BatchState, Model, Ops
from sparsekv.bench.serve_modes import HbmRows, Static, SwappedRows, block_table, offload_layout, row_tile
from sparsekv.embedded.inproc_cuda import InprocSwapIn


def replays(st, run, first: int, n: int) -> list[float]:
    """Steps ``first .. first + n - 1`` replayed through ``run``, each timed (us) between
    two synchronisations."""
    out = []
    for t in range(first, first + n):
        st.load(t)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=3, help="profiled replays a mode (after 3 untimed)")
    ap.add_argument("--region-rows", type=int, default=2560)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    o = ap.parse_args()
    sh, C, d = PRESETS["v32"], o.context, torch.device("cuda", 0)
    model = Model.build(sh, Ops(d, torch.bfloat16, fast=True), 0)
    host_rows = 2 * C
    wl = generate(1, 0.9, steps=4 + 4 * o.steps, layers=sh.layers, context=C, top_k=sh.top_k, block_size=64,
                  layer_overlap=0.85)
    st = Static(model, 1, block_table(1, C, 64, host_rows), wl, d)
    state = BatchState(sh, 1, C, d)
    tile = row_tile(model)
    h = InprocSwapIn(offload_layout(sh, 1, host_rows, o.region_rows), device=0)
    try:
        fill_pattern(h.pool, tile=tile)
        mirror = torch.empty((sh.layers, 1, sh.row_bytes), dtype=torch.uint8, pin_memory=True)
        sides = {"gpu": HbmRows.filled(tile, st, sh.layers, 64), "inproc": SwappedRows(h, st, 64, mirror)}
        out: dict = {"context": C, "region_rows": o.region_rows, "modes": {}}
        for mode, src in sides.items():
            st.load(0)
            run, kind, _ = capture_step(torch, lambda src=src: model.step(st.x, state, src), mode)
            for t in range(1, 4):
                st.load(t)
                run()
            torch.cuda.synchronize()
            plain_us = replays(st, run, 4, o.steps)  # without the profiler (it changes how a graph runs)
            from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                steps_us = replays(st, run, 4 + o.steps, o.steps)  # the steps after the plain replays'
            kern = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                          key=lambda ev: ev.time_range.start)
            per = o.steps * sh.layers
            busy, idle_before = defaultdict(float), defaultdict(float)
            for prev, ev in zip(kern, kern[1:]):
                gap = ev.time_range.start - prev.time_range.end
                if 0 <= gap < 100:  # within a replay
                    idle_before[ev.name[:60]] += gap
            for ev in kern:
                busy[ev.name[:60]] += ev.time_range.end - ev.time_range.start
            rows = sorted(({"kernel": k, "us_per_layer": v / per, "idle_before_us_per_layer": idle_before[k] / per}
                           for k, v in busy.items()), key=lambda r: -r["us_per_layer"])
            out["modes"][mode] = {"run": kind, "step_us": statistics.median(steps_us),
                                  "step_us_unprofiled": statistics.median(plain_us), "kernels": rows,
                                  "idle_us_per_layer": sum(idle_before.values()) / per}
            print(f"== {mode} ({kind}): step {statistics.median(steps_us):.0f} us profiled, "
                  f"{statistics.median(plain_us):.0f} us not, idle "
                  f"{out['modes'][mode]['idle_us_per_layer']:.1f} us a layer")
            print(f"{'kernel':60s} {'us/layer':>8s} {'idle before':>11s}")
            for r in rows[:25]:
                print(f"{r['kernel']:60s} {r['us_per_layer']:8.2f} {r['idle_before_us_per_layer']:11.2f}")
        # Both graphs again, replayed in turn step by step (as bench serve times its modes).
        graphs = {}
        for mode, src in sides.items():
            st.load(0)
            graphs[mode] = capture_step(torch, lambda src=src: model.step(st.x, state, src), mode)[0]
        turns: dict = {m: [] for m in graphs}
        first = 4 + 2 * o.steps  # the steps after the profiled ones: the residency goes on in order
        for t in range(first, first + 2 * o.steps):
            for j in range(len(graphs)):
                mode = list(graphs)[(t + j) % len(graphs)]
                st.load(t)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                graphs[mode]()
                torch.cuda.synchronize()
                if t >= first + 2:
                    turns[mode].append((time.perf_counter() - t0) * 1e6)
        out["in_turn_step_us"] = {m: statistics.median(v) for m, v in turns.items()}
        print("in turn: " + "  ".join(f"{m} {v:.0f} us" for m, v in out["in_turn_step_us"].items()))
        os.makedirs(o.out, exist_ok=True)
        with open(os.path.join(o.out, "probe-serve-b1.json"), "w") as f:
            json.dump(out, f, indent=1)
        h.check()
    finally:
        torch.cuda.synchronize()
        h.close()
    return 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"probe_serve_b1: {time.time() - t0:.1f} s", file=sys.stderr)
    sys.exit(rc)
