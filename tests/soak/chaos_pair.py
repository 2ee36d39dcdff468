"""Two ranks of one engine for tests/soak/test_chaos.py, each its own process (so that the
test can SIGKILL either): ``python chaos_pair.py ROLE RUN_DIR STATE_PATH SEED EVENTS_PATH
[DEVICE]`` (as chaos_worker.py).

ROLE ``writer`` rewrites random rows of engine ``pair`` through WRITE, without pause;
ROLE ``reader`` runs STEP + TOPK on the same engine at the same time and checks every
delivered hot row. Their shared truth is STATE_PATH (a memory-mapped int64 array, which
outlives both processes): per host row the generation whose WRITE was *started* and the
one whose WRITE reply has *arrived*, and the pid of the daemon the pool was last filled
for. The writer bumps ``started`` before it sends a WRITE and ``done`` once its reply has
arrived. The reader copies ``done`` before it sends its STEP and ``started`` after its
TOPK reply; every delivered row must then hold a generation between the two (a WRITE
that finished before the step began must be seen: its hot copies in every rank of the
engine were invalidated; one still in flight may or may not be). That check is exact
whatever the interleaving, and survives either process being killed mid-request.

After a daemon restart the engine (and its pool range) is new: the writer re-fills every
row with its ``done`` generation and records the new daemon's pid; the reader checks
nothing until then. The test SIGKILLs the reader at random but never the writer, so the
engine (and its rows) outlives every reader kill. Events as chaos_worker.py (start, attached, lost, progress, bad,
error), as JSON lines to EVENTS_PATH.
"""

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
ENGINE = "pair"
H = LAYOUT.host_rows


def state(path: str) -> np.memmap:
    """started[H], done[H], filled_pid: created zeroed by the test."""
    return np.memmap(path, np.int64, mode="r+", shape=(2 * H + 1,))


def writer(c: Client, st: np.memmap, rng, ev, counts) -> None:
    started, done = st[:H], st[H : 2 * H]
    if st[2 * H] != c.info["daemon_pid"]:
        # A new daemon (a new engine, its rows zero): every row at its done generation.
        rows = np.arange(H, dtype=np.int32)
        c.write(rows, np.stack([helpers.gen_pattern(layer, rows, LAYOUT.row_bytes, done)
                                for layer in range(LAYOUT.num_layers)]))
        st[2 * H] = c.info["daemon_pid"]
        st.flush()
    while True:
        rows = np.unique(rng.integers(0, H, 4)).astype(np.int32)
        new = np.maximum(started[rows], done[rows]) + 1
        gen = done.copy()
        gen[rows] = new
        started[rows] = new  # before the WRITE is sent
        c.write(rows, np.stack([helpers.gen_pattern(layer, rows, LAYOUT.row_bytes, gen)
                                for layer in range(LAYOUT.num_layers)]))
        done[rows] = new  # its reply has arrived
        counts["writes"] += 1
        time.sleep(0.001)  # a race, not a CPU hog: the reader steps about as often
        if counts["writes"] % 500 == 0:
            ev("progress", checks=0, rows=0, bad=0, writes=counts["writes"])


def reader(c: Client, att, st: np.memmap, rng, ev, counts) -> None:
    started, done = st[:H], st[H : 2 * H]
    while st[2 * H] != c.info["daemon_pid"]:  # the writer has not re-filled the pool yet
        c.stats()  # raises DaemonUnavailable if the daemon goes meanwhile
        time.sleep(0.01)
    state_rows = np.arange(BATCH, dtype=np.int32)
    first = True
    while True:
        counts["step"] += 1
        lo = done.copy()
        c.step(counts["step"], state_rows, np.full(BATCH, first or rng.random() < 0.02))
        first = False
        topk = np.stack([rng.choice(H, LAYOUT.top_k, replace=False) for _ in range(BATCH)]).astype(np.int32)
        for g, layers in enumerate(att.layout.groups):
            slots, _ = c.topk(counts["step"], g, topk).host()  # (cuda: waits for the rows)
            hi = started.copy()
            bad = helpers.bad_rows_between(att.slab, layers, state_rows, topk, slots, H, lo, hi)
            counts["checks"] += 1
            counts["rows"] += topk.size * len(layers)
            if bad:
                counts["bad"] += bad
                ev("bad", step=counts["step"], group=g, bad=bad)
        if counts["step"] % 200 == 0:
            ev("progress", checks=counts["checks"], rows=counts["rows"], bad=counts["bad"], step=counts["step"])


def main(role: str, run_dir: str, state_path: str, seed: int, events_path: str, device: str = "cpu") -> None:
    out = open(events_path, "a", buffering=1)
    rng = np.random.default_rng(seed)
    st = state(state_path)

    def ev(kind: str, **kw):
        out.write(json.dumps({"ev": kind, "t": time.time(), "pid": os.getpid(), "role": role, **kw}) + "\n")

    counts = {"checks": 0, "rows": 0, "bad": 0, "step": 0, "writes": 0}
    helpers.stacks_on_sigusr2(events_path + ".stacks")
    ev("start")

    def open_client():
        return Client(run_dir, name=f"chaos-{role}", rank=int(role == "reader"), device=device,
                      timeout_s=10).connect()

    def work(c, att):
        if role == "writer":
            writer(c, st, rng, ev, counts)
        else:
            reader(c, att, st, rng, ev, counts)

    helpers.soak_worker_loop(open_client, lambda c: c.attach(LAYOUT, engine=ENGINE), work, ev, counts)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], *sys.argv[6:7])
