"""A verifying client for tests/soak/test_chaos.py, run as its own process (so that the
test can SIGKILL it): ``python chaos_worker.py RUN_DIR ENGINE SEED EVENTS_PATH [DEVICE]``
(DEVICE: ``cpu``, or ``cuda:N`` against a cuda daemon: the slab is then GPU memory).

It owns engine ENGINE alone (one rank): it fills the pool with generation 0 of the
``--verify`` pattern, then loops: every few steps it rewrites a few random rows (some hot)
with the next generation through WRITE, and after each STEP + TOPK it checks every
delivered hot row against the pattern of that row's current generation. Writes and reads
come from this one process in program order, so once a WRITE's reply has arrived the row's
expected bytes are exactly its new generation: no tolerance window is needed.

When the daemon goes away (``DaemonUnavailable``) it notes the time, drops the client and
reconnects until a new daemon serves, then re-attaches and re-fills (generation 0). Any
other error is recorded as a failure. Events go to EVENTS_PATH as JSON lines (flushed
each time; a SIGKILL loses at most a progress line)."""

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import helpers  # noqa: E402
from sparsekv.client import Client  # noqa: E402

LAYOUT = helpers.layout(num_layers=2, row_bytes=32, top_k=8, region_stride=16, max_reqs=4, host_rows=256)
BATCH = 4


def main(run_dir: str, engine: str, seed: int, events_path: str, device: str = "cpu") -> None:
    out = open(events_path, "a", buffering=1)
    rng = np.random.default_rng(seed)

    def ev(kind: str, **kw):
        out.write(json.dumps({"ev": kind, "t": time.time(), "pid": os.getpid(), **kw}) + "\n")

    counts = {"checks": 0, "rows": 0, "bad": 0}
    run = {"step": 0, "gen": None}  # the step counter lives across reconnects
    helpers.stacks_on_sigusr2(events_path + ".stacks")
    ev("start")

    def open_client():
        return Client(run_dir, name=f"chaos-{engine}", device=device, timeout_s=10).connect()

    def start(client):
        att = client.attach(LAYOUT, engine=engine)
        run["gen"] = np.zeros(LAYOUT.host_rows, np.int64)
        helpers.fill(client, LAYOUT, run["gen"])
        return att

    def work(client, att):
        first = True
        last_topk = None
        state_rows = np.arange(BATCH, dtype=np.int32)
        # Progress every 200 steps or every second, with the longest request and check
        # of the interval: when the test times out waiting for this worker, its last
        # events say whether it was stuck in the daemon's calls or in its own checks.
        slow = {"req_s_max": 0.0, "check_s_max": 0.0}
        last_progress = time.monotonic()
        while True:
            run["step"] += 1
            step, gen = run["step"], run["gen"]
            if last_topk is not None and step % 5 == 0:
                hot = rng.choice(last_topk.ravel(), 2, replace=False)
                cold = rng.integers(0, LAYOUT.host_rows, 2)
                rows = np.unique(np.concatenate([hot, cold])).astype(np.int32)
                new_gen = gen.copy()
                new_gen[rows] += 1
                data = np.stack([helpers.gen_pattern(layer, rows, LAYOUT.row_bytes, new_gen)
                                 for layer in range(LAYOUT.num_layers)])
                client.write(rows, data)
                gen = run["gen"] = new_gen  # the reply has arrived: these bytes are the current ones
            reset = np.full(BATCH, first or rng.random() < 0.02)
            first = False
            client.step(step, state_rows, reset)
            topk = np.stack([rng.choice(LAYOUT.host_rows, LAYOUT.top_k, replace=False)
                             for _ in range(BATCH)]).astype(np.int32)
            for g, layers in enumerate(att.layout.groups):
                t0 = time.monotonic()
                slots, _ = client.topk(step, g, topk).host()
                t1 = time.monotonic()
                bad = helpers.bad_rows(att.slab, layers, state_rows, topk, slots, LAYOUT.host_rows, gen)
                slow["req_s_max"] = max(slow["req_s_max"], t1 - t0)
                slow["check_s_max"] = max(slow["check_s_max"], time.monotonic() - t1)
                counts["checks"] += 1
                counts["rows"] += topk.size * len(layers)
                if bad:
                    counts["bad"] += bad
                    ev("bad", step=step, group=g, bad=bad)
            last_topk = topk
            if step % 200 == 0 or time.monotonic() - last_progress > 1.0:
                ev("progress", checks=counts["checks"], rows=counts["rows"], bad=counts["bad"], step=step,
                   **{k: round(v, 4) for k, v in slow.items()})
                slow = dict.fromkeys(slow, 0.0)
                last_progress = time.monotonic()

    helpers.soak_worker_loop(open_client, start, work, ev, counts)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], *sys.argv[5:6])
