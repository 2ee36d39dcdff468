"""``sparsekv demo``: the main job on embedded defaults.

Starts a private daemon (cuda if a GPU is present, else cpu), connects two tensor-parallel
ranks as separate processes to one engine (on cpu as a TP group: one resolve for both,
DESIGN §5.6), runs a synthetic decode, checks every row the ranks read, and prints a
summary table.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import time

import numpy as np

from sparsekv.bench.private_daemon import PrivateDaemon, die_with_parent
from sparsekv.bench.synth import synth, trace_bytes
from sparsekv.bench.trace import check_room
from sparsekv.bench.verify import count_mismatches, fill_pool
from sparsekv.client.client import Client
from sparsekv.daemon.backends import cuda_unavailable
from .progress import Progress

DEFAULTS = dict(steps=300, batch=8, top_k=256, region_stride=512, max_reqs=16, host_rows=65536,
                row_bytes=656, num_layers=4, overlap=0.8, context=2048, lifetime=64, seed=7)
GROUPS = ((0, 1), (2, 3))  # two index groups of two layers (leader + follower)
RESULT_POLL_S = 5.0  # how often the demo looks for a rank that ended without its result
SYNC_EVERY = 16  # steps between the ranks' meetings (3 requests a step: far below tp_max_lag)


def _rank_main(parent: int, run_dir: str, rank: int, device: str, params: dict, barrier, results,
               show_progress: bool) -> None:
    die_with_parent(parent)  # a demo killed by SIGKILL takes its ranks along
    try:
        _rank_body(run_dir, rank, device, params, barrier, results, show_progress)
    except BaseException as e:  # tell the parent, and free the other rank from the barrier
        barrier.abort()
        results.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})
        raise


def _result(results, procs) -> dict:
    """The next rank's result, however long the demo runs; RuntimeError once a rank ended
    without one (killed: no error of its own to send)."""
    while True:
        try:
            return results.get(timeout=RESULT_POLL_S)
        except queue.Empty:
            gone = [p.exitcode for p in procs if not p.is_alive() and p.exitcode != 0]
            if gone:
                raise RuntimeError(f"a demo rank ended with exit code {gone[0]} before its result") from None


def _rank_body(run_dir, rank, device, params, barrier, results, show_progress) -> None:
    trace = synth(**{k: params[k] for k in DEFAULTS})
    layout = trace.layout()
    layout = dataclasses.replace(layout, index_groups=GROUPS)
    lat = np.zeros(trace.steps)
    bad = 0
    with Client(run_dir, rank=rank, device=device, name=f"demo-rank{rank}") as c:
        att = c.attach(layout, engine="demo", tp_size=2 if device == "cpu" else 1)
        if rank == 0:
            fill_pool(c, layout)  # the "prefill": every host row gets known bytes
        barrier.wait(timeout=300)
        bar = Progress("decode", trace.steps) if show_progress else None
        for t in range(trace.steps):
            t0 = time.perf_counter()
            c.step(t, trace.state_rows[t], trace.reset[t], trace.invalidate[t])
            # Both groups go out before waiting: the daemon works while the client sends.
            pend = [c.submit_topk(t, g, trace.topk[t]) for g in range(len(GROUPS))]
            res = [p.wait().host() for p in pend]  # cuda: waits for the gathers
            lat[t] = time.perf_counter() - t0
            for g, (slots, _misses) in enumerate(res):
                bad += count_mismatches(att.slab, GROUPS[g], trace.state_rows[t], trace.topk[t], slots, layout.host_rows)
            if bar:
                bar.update(t + 1)
            if t % SYNC_EVERY == SYNC_EVERY - 1:
                # A TP engine's collectives keep its ranks together; these two processes share
                # nothing else, and a TP group refuses a rank tp_max_lag requests ahead.
                barrier.wait(timeout=300)
        if bar:
            bar.close()
        barrier.wait(timeout=300)
        stats = c.stats() if rank == 0 else None
    results.put({"rank": rank, "lat": lat, "mismatched": bad, "stats": stats, "bytes_per_row": layout.row_bytes})


def run_demo(backend: str = "auto", steps: int | None = None, progress: bool = True) -> dict:
    params = dict(DEFAULTS)
    if steps is not None:
        params["steps"] = steps
    # Each rank synthesizes the trace (its top-k and step arrays): checked here, before the
    # daemon and the ranks start, as each rank's synth would check its own.
    check_room(2 * trace_bytes(params["steps"], params["batch"], params["top_k"]),
               f"the demo's two ranks' traces of {params['steps']} steps take")
    pool_bytes = params["num_layers"] * params["host_rows"] * params["row_bytes"] + (16 << 20)
    reason = cuda_unavailable() if backend != "cpu" else None
    if backend == "auto":
        backend = "cpu" if reason else "cuda"
    elif reason:
        raise RuntimeError(f"--backend cuda: {reason}")
    devices = ["cpu", "cpu"]
    if backend == "cuda":
        import cupy as cp  # noqa: PLC0415

        n = cp.cuda.runtime.getDeviceCount()
        devices = [f"cuda:{r % n}" for r in range(2)]  # two GPUs when there are two
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    t0 = time.perf_counter()
    extra = ["--device-arena-size", "1GiB"] if backend == "cuda" else []
    with PrivateDaemon(pool_bytes=pool_bytes, backend=backend, extra_args=extra) as d:
        # daemon=True: ranks still running when the demo stops (an error, SIGTERM) are
        # terminated at its exit instead of joined.
        procs = [ctx.Process(target=_rank_main, daemon=True, args=(
            os.getpid(), d.run_dir, r, devices[r], params, barrier, results, progress and r == 0)) for r in range(2)]
        for p in procs:
            p.start()
        try:
            out = [_result(results, procs) for _ in procs]
            errors = [r["error"] for r in out if "error" in r]
            if errors:
                raise RuntimeError(f"a demo rank failed: {errors[0]}")
            for p in procs:
                p.join(timeout=60)
            failed = [p.exitcode for p in procs if p.exitcode != 0]
            if failed:
                raise RuntimeError(f"a demo rank failed with exit code {failed[0]}")
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=10)
    wall = time.perf_counter() - t0
    out.sort(key=lambda r: r["rank"])
    stats = out[0]["stats"]
    lat = np.concatenate([r["lat"] for r in out]) * 1e6
    return {
        "backend": stats["backend"],
        "devices": ",".join(devices),
        "ranks": len(out),
        "steps": params["steps"],
        "batch": params["batch"],
        "top_k": params["top_k"],
        "layers": params["num_layers"],
        "hit_rate": stats["hit_rate"],
        "hits": stats["hits"],
        "misses": stats["misses"],
        "rows_moved": stats["rows_moved"],
        "topk_batches": stats["topk_batches"],
        "tp_followed": stats["tp_followed"],
        "bytes_moved": stats["bytes_moved"],
        "step_p50_us": float(np.percentile(lat, 50)),
        "step_p99_us": float(np.percentile(lat, 99)),
        "mismatched_rows": int(sum(r["mismatched"] for r in out)),
        "wall_s": wall,
    }


def format_table(s: dict) -> str:
    rows = [
        ("backend", s["backend"]),
        ("ranks (processes)", f"{s['ranks']} on {s['devices']}"),
        ("steps x batch x top_k", f"{s['steps']} x {s['batch']} x {s['top_k']}"),
        ("layers (2 index groups)", s["layers"]),
        ("hit rate", f"{s['hit_rate'] * 100:.2f} %"),
        ("top-k batches", f"{s['topk_batches']} ({s['tp_followed']} served by a peer's resolve)"),
        ("hits / misses", f"{s['hits']} / {s['misses']}"),
        ("rows moved", s["rows_moved"]),
        ("bytes moved", f"{s['bytes_moved'] / 2**20:.1f} MiB"),
        ("step latency p50", f"{s['step_p50_us']:.0f} us"),
        ("step latency p99", f"{s['step_p99_us']:.0f} us"),
        ("rows checked wrong", s["mismatched_rows"]),
        ("wall time", f"{s['wall_s']:.1f} s"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows) + "\n"
