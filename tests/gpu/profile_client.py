"""Where a cuda rank's time goes on the zmq path, client side: one STEP + TOPK per step
against a private cuda daemon, then the same loop under cProfile. GPU machine, MPS on:
    python3 tests/gpu/profile_client.py [steps]
"""

import cProfile
import pstats
import sys
import time

import numpy as np

from sparsekv.client import Client
from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.bench.trace import synth
from sparsekv.proto import MsgType

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
tr = synth(steps=steps, batch=16, top_k=2048, region_stride=4096, max_reqs=32, host_rows=32 * 16384,
           num_layers=1, context=12000, lifetime=steps, arrive=1.0, pad=0.0, invalidate=0.0,
           out_of_range=0.0, share_prefix=0.0, overlap=0.8, seed=5)
lay = tr.layout()
with PrivateDaemon(pool_bytes=lay.pool_bytes + (8 << 20), backend="cuda",
                   extra_args=["--device-arena-size", "4GiB"]) as d, Client(d.run_dir, device="cuda:0") as c:
    c.attach(lay, engine="p")
    seg = {k: [] for k in ("submit", "to_ts", "in", "daemon", "out", "after_rx", "host")}

    def run(lo, hi, record):
        for t in range(lo, hi):
            t0 = time.perf_counter_ns()
            c.step(t, tr.state_rows[t], tr.reset[t], tr.invalidate[t])
            p = c.submit_topk(t, 0, tr.topk[t])
            t1 = time.perf_counter_ns()
            r = p.wait()
            t2 = time.perf_counter_ns()
            r.host()
            t3 = time.perf_counter_ns()
            if record:
                ts, trr, tx, rx = c.timings[MsgType.TOPK]
                seg["submit"].append(t1 - t0)
                seg["to_ts"].append(ts - t0)
                seg["in"].append(trr - ts)
                seg["daemon"].append(tx - trr)
                seg["out"].append(rx - tx)
                seg["after_rx"].append(t2 - rx)
                seg["host"].append(t3 - t2)

    run(0, 20, False)
    run(20, steps // 2, True)
    print("client-side segments, p50 us: " + ", ".join(f"{k} {np.median(v) / 1e3:.1f}" for k, v in seg.items()))
    prof = cProfile.Profile()
    prof.enable()
    run(steps // 2, steps, False)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
