"""Where a mode's step time goes outside its graph's kernels: ``bench serve``'s configs run
as usual, but each timed step also says how long the host took to launch the graph and
how long the graph ran on the GPU once its launch was hidden behind a sleep kernel.

    python3 tests/gpu/probe_launch.py [bench serve options, e.g. --batches 1 --contexts 32k]

Steps alternate: even steps as ``bench serve`` times them (launch, then a synchronisation:
``wall``), odd steps behind a ~4 ms sleep on the step's stream (``hidden``: CUDA events
around the replay; ``launch``: the host's time in ``replay()``). Prints, per config and
mode, the medians; writes ``probe-launch.json`` under ``$OUT``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch

from sparsekv.bench import serve_run
from sparsekv.cli.main import main as cli_main

SLEEP_CYCLES = 8_000_000  # ~4 ms at ~2 GHz: longer than any graph launch seen
found: list[dict] = []


def timed(runs: list, st, warmup: int, steps: int, counts: list):
    n = len(runs)
    times = np.zeros((n, steps))
    wall = [[] for _ in range(n)]
    hidden = [[] for _ in range(n)]
    launch = [[] for _ in range(n)]
    before = [None] * n
    for t in range(warmup + steps):
        st.load(t)
        torch.cuda.synchronize()
        if t == warmup:
            before = [c() if c else None for c in counts]
        for j in range(n):
            i = (t + j) % n
            if t % 2 == 0:
                t0 = time.perf_counter()
                runs[i]()
                torch.cuda.synchronize()
                dt = (time.perf_counter() - t0) * 1e6
                if t >= warmup:
                    wall[i].append(dt)
            else:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(SLEEP_CYCLES)
                a.record()
                t0 = time.perf_counter()
                runs[i]()
                lt = (time.perf_counter() - t0) * 1e6
                b.record()
                torch.cuda.synchronize()
                dt = a.elapsed_time(b) * 1e3
                if t >= warmup:
                    hidden[i].append(dt)
                    launch[i].append(lt)
            if t >= warmup:
                times[i, t - warmup] = dt
    after = [c() if c else None for c in counts]
    deltas = [tuple(x - y for x, y in zip(aa, bb)) if aa and bb else None for aa, bb in zip(after, before)]
    rec = {"batch": st.batch, "modes": [
        {"wall_us": float(np.median(wall[i])), "hidden_us": float(np.median(hidden[i])),
         "launch_us": float(np.median(launch[i]))} for i in range(n)]}
    found.append(rec)
    print("probe_launch: " + json.dumps(rec), flush=True)
    return times, deltas


def main() -> int:
    serve_run.timed = timed
    rc = cli_main(["bench", "serve", *sys.argv[1:]])
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "probe-launch.json"), "w") as f:
        json.dump(found, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
