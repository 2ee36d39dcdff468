"""Where the daemon's host time goes on the cuda decode path: the server's handlers called
in process (no sockets), timed per request type, then under cProfile. Run on the GPU
machine:
    python3 tests/gpu/profile_daemon.py [steps]
"""

import cProfile
import os
import pstats
import sys
import time

import numpy as np

from sparsekv.bench.trace import synth
from sparsekv.daemon.config import Config
from sparsekv.daemon.cuda.backend import CudaBackend
from sparsekv.daemon.pool import HostPool
from sparsekv.daemon.server import Daemon
from sparsekv.proto import MsgType, decode, encode

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
tr = synth(steps=steps, batch=16, top_k=2048, region_stride=4096, max_reqs=32, host_rows=32 * 16384,
           num_layers=1, context=12000, lifetime=steps, arrive=1.0, pad=0.0, invalidate=0.0,
           out_of_range=0.0, share_prefix=0.0, overlap=0.8, seed=5)
lay = tr.layout()
cfg = Config(backend="cuda", run_dir="/tmp/skv-prof", device_arena_size=2 << 30, devices="0")
pool = HostPool(lay.pool_bytes + (8 << 20))
backend = CudaBackend(cfg, pool)
d = Daemon(cfg.run_dir, backend, pool)
frames = {}


def call(t, fields=None, arrays=None):
    h, _ = decode(d.handle(b"prof", encode(t, 1, fields, arrays)))
    assert h["ok"], h
    return h


call(MsgType.HELLO, {"pid": os.getpid(), "rank": 0, "device": "cuda:0", "name": "prof"})
call(MsgType.ATTACH, {"engine": "p", "layout": lay.to_wire()})
stream = backend.workers[0].stream
msgs = [(encode(MsgType.STEP, 2 * t, {"step": t}, {"state_rows": tr.state_rows[t], "reset": tr.reset[t],
                                                    "invalidate": tr.invalidate[t]}),
         encode(MsgType.TOPK, 2 * t + 1, {"step": t, "group": 0}, {"topk": tr.topk[t]})) for t in range(steps)]


def run(lo, hi, times=None):
    for t in range(lo, hi):
        for i, m in enumerate(msgs[t]):
            t0 = time.perf_counter_ns()
            d.handle(b"prof", m)
            if times is not None:
                times[i].append(time.perf_counter_ns() - t0)
        stream.synchronize()  # like a client that waits for each step's rows


run(0, 10)
times = ([], [])
run(10, steps // 2, times)
print(f"daemon host time per request (handle(), frames in hand): STEP p50 {np.median(times[0]) / 1e3:.1f} us, "
      f"TOPK p50 {np.median(times[1]) / 1e3:.1f} us, sum {(np.median(times[0]) + np.median(times[1])) / 1e3:.1f} us")
prof = cProfile.Profile()
prof.enable()
run(steps // 2, steps)
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(12)

# The block path: the client has written its step blocks (here: this script, into the
# rank's client blocks); the TOPK message names the entry and begins the step.
from sparsekv.proto.step_block import write_step, write_topk  # noqa: E402

rank = next(iter(backend._ranks.values()))
R = len(rank.buffers.client_topk)
blocks = []
for t in range(steps):
    e = t % R
    blocks.append((e, encode(MsgType.TOPK, 10_000 + t, {"step": t, "group": 0, "block": e, "begin": True})))
times = []
for t in range(steps):
    e, m = blocks[t]
    write_step(rank.buffers.client_step[e][0], t, t, tr.state_rows[t], tr.reset[t], None)
    write_topk(rank.buffers.client_topk[e][0], t, t, 0, tr.state_rows[t], tr.topk[t])
    t0 = time.perf_counter_ns()
    h, _ = decode(d.handle(b"prof", m))
    times.append(time.perf_counter_ns() - t0)
    assert h["ok"], h
    stream.synchronize()
print(f"block TOPK (begins its step), handle() p50 {np.median(times[10:]) / 1e3:.1f} us")
prof = cProfile.Profile()
prof.enable()
for t in range(steps):
    e, m = blocks[t]
    d.handle(b"prof", m)
    stream.synchronize()
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(12)
print("device counters", backend.device_counters())
