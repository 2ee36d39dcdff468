"""How long one client's heavy request stalls another client's top-k (cpu backend).

    .venv/bin/python tests/soak/stall.py [--pool-gib 7] [--engine-gib 5] [--slab-gib 2] [--rounds 3] [--blocks-gib 5]

A private cpu sparsekvd. Client A (its own process) attaches a small engine, fills it and
sends small TOPK requests in a loop (one every ~1 ms: a decode step), recording each one's
send time and latency. Client B (this process) meanwhile runs the heaviest legal requests,
one case at a time, ``--rounds`` times each:

- ``attach``: ATTACH of a large engine (a pool range of ``--engine-gib`` and a rank of
  ``--slab-gib``: hot slab, staging and residency state), then its DETACH (``detach``);
- ``write``: a WRITE of one data frame of ``LIMITS.max_frame_bytes``;
- ``stage`` / ``write_staged``: STAGE of the whole staging buffer, WRITE_STAGED of it;
- ``gone_blocks`` (with ``--blocks-gib``): a second client of an engine with a block store
  of that size takes every block private, then detaches (as a client that exits does): the
  window runs until the first client's next block request, which waits for their zeros;
- ``narrow_topk`` / ``small_write`` (with ``--cheap``): small requests of much host work:
  a TOPK of 4,096 rows of one id in regions of 32,768 slots (134M slots sorted), and a
  one-row WRITE to an engine of 64 layers x 4,096 regions x 512 slots (134M slots of
  residency state scanned for the row's hot copies).

For each case it prints A's largest latency among the top-k requests in flight during B's
request (the stall), next to A's own p50 and max while B is idle. One JSON line per case,
then a summary line. Not a pass/fail test: figures for docs/RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import helpers  # noqa: E402
from sparsekv.client import Client  # noqa: E402
from sparsekv.bench.private_daemon import PrivateDaemon  # noqa: E402
from sparsekv.proto import LIMITS, Layout, MsgType  # noqa: E402

GiB = 1 << 30
SMALL = helpers.layout(num_layers=2, row_bytes=256, top_k=64, region_stride=128, max_reqs=4, host_rows=4096)
PACE_S = 0.001  # client A's pause between top-k requests


def client_a(run_dir: str, stop, ready, out) -> None:
    """Client A: small top-k requests until ``stop``; sends [(t_sent, latency, in the
    daemon)] in seconds (the daemon's part: its reply's ``tx - tr``)."""
    rng = np.random.default_rng(0)
    with Client(run_dir, name="stall-a", timeout_s=120) as c:
        c.attach(SMALL, engine="a")
        helpers.fill(c, SMALL)
        rows = np.arange(4, dtype=np.int32)
        c.step(0, rows, np.ones(4, bool))
        ready.set()
        samples = []
        while not stop.is_set():
            topk = np.stack([rng.choice(SMALL.host_rows, SMALL.top_k, replace=False) for _ in range(4)]).astype(np.int32)
            t0 = time.perf_counter()
            c.topk(0, 0, topk, rows)
            _, tr, tx, _ = c.timings[MsgType.TOPK]  # perf_counter_ns, one clock for the host
            samples.append((t0, time.perf_counter() - t0, (tx - tr) * 1e-9))
            time.sleep(PACE_S)
    out.send(samples)


def big_layout(engine_bytes: int, rank_bytes: int) -> Layout:
    """A layout whose pool range is about ``engine_bytes`` and whose rank (hot slab +
    staging, residency state small) about ``rank_bytes``: 4 KiB rows, 8 layers."""
    row, layers, stride, reqs = 4096, 8, 4096, 8
    slab = layers * reqs * stride * row  # 1 GiB per 8 requests
    reqs = max(1, int(reqs * rank_bytes * 0.75 / slab))
    staging = max(1, int(rank_bytes * 0.25 / (layers * row)))
    host_rows = engine_bytes // (layers * row)
    return Layout(num_layers=layers, row_bytes=row, top_k=64, region_stride=stride, max_reqs=reqs,
                  host_rows=host_rows, staging_rows=staging).validate()


def gone_blocks(b: Client, store_bytes: int, run_dir: str, timed) -> None:
    """The ``gone_blocks`` case: ``b`` and a second client attach an engine whose block
    store holds ``store_bytes``; the second takes every block and detaches; ``b``'s next
    block request waits for their zeros (the window); then ``b`` detaches (the engine goes)."""
    lay = big_layout(store_bytes, 64 << 20)
    lay = Layout(num_layers=lay.num_layers, row_bytes=lay.row_bytes, top_k=64, region_stride=128, max_reqs=2,
                 host_rows=lay.host_rows // 64 * 64).validate()
    b.attach(lay, engine="blocks", block_size=64)
    with Client(run_dir, name="stall-b2", timeout_s=300) as b2:
        b2.attach(lay, engine="blocks", block_size=64)
        b2.blocks.alloc(lay.host_rows // 64)
        timed("gone_blocks", lambda: (b2.detach(), b.blocks.reserve(0)))
    b.detach()


# The --cheap cases' layouts: small requests that cost much host work (module docstring).
NARROW = Layout(num_layers=1, row_bytes=16, top_k=1, region_stride=32768, max_reqs=1, max_batch=4096, host_rows=64,
                index_groups=((0,),))
WIDE_STATE = Layout(num_layers=64, row_bytes=1, top_k=4, region_stride=512, max_reqs=4096, host_rows=64,
                    index_groups=tuple((i,) for i in range(64)))


def cheap_cases(run_dir: str, round_: int, timed) -> None:
    with Client(run_dir, name="stall-c", timeout_s=300) as c:
        c.attach(NARROW, engine="narrow")
        c.step(round_, np.zeros(NARROW.max_batch, np.int32))
        ids = (np.arange(NARROW.max_batch, dtype=np.int32) % NARROW.host_rows).reshape(-1, 1)
        timed("narrow_topk", lambda: c.topk(round_, 0, ids))
        c.detach()
        c.attach(WIDE_STATE, engine="state")
        row = np.ones((WIDE_STATE.num_layers, 1, WIDE_STATE.row_bytes), np.uint8)
        timed("small_write", lambda: c.write(np.array([round_ % WIDE_STATE.host_rows], np.int32), row))
        c.detach()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pool-gib", type=float, default=7.0, help="the daemon's pool")
    p.add_argument("--engine-gib", type=float, default=5.0, help="pool range of the large engine")
    p.add_argument("--slab-gib", type=float, default=2.0, help="memory of the large engine's rank")
    p.add_argument("--rounds", type=int, default=3, help="repetitions of each case")
    p.add_argument("--blocks-gib", type=float, default=0.0, help="the block store of the gone_blocks case (0: no case)")
    p.add_argument("--cheap", action="store_true", help="also the narrow_topk and small_write cases")
    p.add_argument("--log", default=None, help="the daemon's log file (default: discarded)")
    a = p.parse_args(argv)
    big = big_layout(int(a.engine_gib * GiB), int(a.slab_gib * GiB))
    ctx = mp.get_context("spawn")
    windows: dict[str, list[tuple[float, float]]] = {}
    with PrivateDaemon(pool_bytes=int(a.pool_gib * GiB), backend="cpu", log_path=a.log, start_timeout_s=300,
                       extra_args=["--max-slab-bytes", f"{int(max(a.slab_gib * 1.5, 2 if a.cheap else 0) * GiB)}B"]) as d:
        stop, ready = ctx.Event(), ctx.Event()
        recv, send = ctx.Pipe(duplex=False)
        pa = ctx.Process(target=client_a, args=(d.run_dir, stop, ready, send), daemon=True)
        pa.start()
        if not ready.wait(60):
            raise SystemExit("client A did not start")
        with Client(d.run_dir, name="stall-b", timeout_s=300) as b:
            # The largest legal WRITE: one data frame of max_frame_bytes, rows of the large engine.
            write_rows = LIMITS.max_frame_bytes // (big.num_layers * big.row_bytes)
            rng = np.random.default_rng(1)
            data = rng.integers(0, 255, (big.num_layers, write_rows, big.row_bytes), dtype=np.uint8)

            def timed(name, fn):
                time.sleep(0.3)  # A idles a while between cases: its baseline
                t0 = time.perf_counter()
                fn()
                windows.setdefault(name, []).append((t0, time.perf_counter()))

            for _ in range(a.rounds):
                timed("attach", lambda: b.attach(big, engine="big"))
                timed("write", lambda: b.write(np.arange(write_rows, dtype=np.int32), data))
                timed("stage", lambda: b.stage(np.arange(big.staging_rows, dtype=np.int32)))
                timed("write_staged", lambda: b.write_staged(np.arange(big.staging_rows, dtype=np.int32)))
                timed("detach", b.detach)
                if a.blocks_gib:
                    gone_blocks(b, int(a.blocks_gib * GiB), d.run_dir, timed)
            for r in range(a.rounds if a.cheap else 0):
                cheap_cases(d.run_dir, r, timed)
            time.sleep(0.3)
        stop.set()
        samples = np.array(recv.recv())
        pa.join(30)
    t_sent, lat, in_daemon = samples[:, 0], samples[:, 1], samples[:, 2]
    busy = np.zeros(len(lat), bool)
    rows = []
    for name, spans in windows.items():
        worst, worst_daemon, n, dur = 0.0, 0.0, 0, []
        for t0, t1 in spans:
            # every top-k in flight at some point of B's request
            sel = (t_sent < t1) & (t_sent + lat > t0)
            busy |= sel
            n += int(sel.sum())
            if sel.any():
                i = np.flatnonzero(sel)[np.argmax(lat[sel])]
                if lat[i] > worst:
                    worst, worst_daemon = float(lat[i]), float(in_daemon[i])
            dur.append(t1 - t0)
        # a_stall_ms_max: A's slowest top-k in flight during B's request; of it, in the
        # daemon (from its receipt to its reply: waiting for the loop included)
        rows.append({"case": name, "b_request_ms_max": round(max(dur) * 1e3, 1),
                     "a_topk_in_flight": n, "a_stall_ms_max": round(worst * 1e3, 2),
                     "of_it_in_daemon_ms": round(worst_daemon * 1e3, 2)})
    idle = lat[~busy]
    base = {"a_idle_p50_ms": round(float(np.median(idle)) * 1e3, 3),
            "a_idle_p99_ms": round(float(np.percentile(idle, 99)) * 1e3, 3),
            "a_idle_max_ms": round(float(idle.max()) * 1e3, 2), "a_topk": len(lat)}
    for r in rows:
        print(json.dumps({**r, **base}))
    print(json.dumps({"summary": {r["case"]: r["a_stall_ms_max"] for r in rows}, **base,
                      "pool_gib": a.pool_gib, "engine_pool_bytes": big.pool_bytes,
                      "rank_bytes": big.slab_bytes + big.staging_bytes, "write_bytes": int(data.nbytes),
                      "rounds": a.rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
