"""``sparsekv bench prefix``: the block store's costs as an engine sees them, through a
private daemon (cpu backend; on a GPU host it measures that host's CPU, which is what the
lookup runs on).

* ``prefix_lookup_us_128k``: lookup + pin of a cached 128K-token prefix (2,048 blocks of
  64) through zmq, p50 and p99 (the release that follows each is timed apart);
* ``restart_s``: a new engine process, from its start to the cached prefix pinned
  (import, connect, attach to the kept engine, hashes, lookup): what a restarted engine
  waits before it serves the prefix without prefilling it.

The comparison with recomputing the prefix (its prefill on the GPU) is not measured here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np

from sparsekv.client import Client
from sparsekv.proto import Layout

from .private_daemon import PrivateDaemon

# A new engine: attach to the kept engine, hash the prompt, look it up; prints the hits
# and the seconds since the parent's clock reading in argv.
_RESTART = r"""
import json, sys, time
import numpy as np
from sparsekv.client import Client
from sparsekv.proto import Layout
run_dir, lay, block_size, n_tokens, t0 = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
with Client(run_dir, name="bench-restart") as c:
    c.attach(Layout.from_wire(lay), engine="bench-prefix", block_size=block_size)
    hit = c.blocks.lookup(c.blocks.hashes(np.arange(n_tokens)))
    print(json.dumps({"hit": int(hit.size), "s": time.time() - t0}), flush=True)
"""


def bench_prefix(blocks: int = 2048, block_size: int = 64, reps: int = 200, restarts: int = 3) -> dict:
    lay = Layout(num_layers=1, row_bytes=64, top_k=64, region_stride=128, max_reqs=1,
                 host_rows=2 * blocks * block_size)
    n_tokens = blocks * block_size
    lookup_us, release_us, restart_s = [], [], []
    with PrivateDaemon(pool_bytes=lay.pool_bytes + (8 << 20), backend="cpu") as d:
        with Client(d.run_dir, name="bench") as c:
            c.attach(lay, engine="bench-prefix", block_size=block_size)
            keys = c.blocks.hashes(np.arange(n_tokens))
            got = c.blocks.alloc(blocks)
            c.blocks.commit(got, keys)
            c.blocks.release(got)
            for _ in range(reps):
                t0 = time.perf_counter()
                got = c.blocks.lookup(keys)
                t1 = time.perf_counter()
                c.blocks.release(got)
                t2 = time.perf_counter()
                assert got.size == blocks, f"the cached prefix has {got.size} of {blocks} blocks"
                lookup_us.append((t1 - t0) * 1e6)
                release_us.append((t2 - t1) * 1e6)
            # c closes here: the engine is kept for its cached blocks, as after a crash
        for _ in range(restarts):
            out = subprocess.run([sys.executable, "-c", _RESTART, d.run_dir, json.dumps(lay.to_wire()),
                                  str(block_size), str(n_tokens), repr(time.time())],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout)
            assert r["hit"] == blocks, r
            restart_s.append(r["s"])
    return {"bench": "prefix", "blocks": blocks, "block_size": block_size, "reps": reps,
            "prefix_lookup_us_p50": round(float(np.median(lookup_us)), 1),
            "prefix_lookup_us_p99": round(float(np.percentile(lookup_us, 99)), 1),
            "release_us_p50": round(float(np.median(release_us)), 1),
            "restart_s_median": round(float(np.median(restart_s)), 3)}
