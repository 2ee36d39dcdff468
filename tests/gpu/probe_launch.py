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

from sparsekv.bench import serve_modes, serve_run
from sparsekv.cli.main import main as cli_main

SLEEP_CYCLES = 8_000_000  # ~4 ms at ~2 GHz: longer than any graph launch seen
found: list[dict] = []


def timed(runs: list, st, warmup: int, steps: int, counts: list):
    """``serve_modes.timed``, even steps by wall time, odd ones with the launch hidden."""
    kinds = {k: [[] for _ in runs] for k in ("wall_us", "hidden_us", "launch_us")}

    def replay(run, side: int, t: int) -> float:
        if t % 2 == 0:
            dt = serve_modes.wall_us(run, side, t)
            if t >= warmup:
                kinds["wall_us"][side].append(dt)
            return dt
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        a.record()
        t0 = time.perf_counter()
        run()
        launch = (time.perf_counter() - t0) * 1e6
        b.record()
        torch.cuda.synchronize()
        dt = a.elapsed_time(b) * 1e3
        if t >= warmup:
            kinds["hidden_us"][side].append(dt)
            kinds["launch_us"][side].append(launch)
        return dt

    out = serve_modes.timed(runs, st, warmup, steps, counts, replay=replay)
    rec = {"batch": st.batch, "modes": [{k: float(np.median(v[i])) for k, v in kinds.items()}
                                        for i in range(len(runs))]}
    found.append(rec)
    print("probe_launch: " + json.dumps(rec), flush=True)
    return out


def main() -> int:
    serve_run.timed = timed
    rc = cli_main(["bench", "serve", *sys.argv[1:]])
    with open(os.path.join(os.environ.get("OUT", "."), "probe-launch.json"), "w") as f:
        json.dump(found, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
