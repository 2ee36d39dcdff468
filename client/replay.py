"""``sparsekv replay``: drive the whole stack with a recorded trace (DESIGN §6)."""

from __future__ import annotations

import contextlib
import json
import time

import numpy as np

from .client import Client
from .errors import BadRequest
from .inproc import InprocClient
from .private_daemon import PrivateDaemon
from .trace import Trace
from .verify import count_mismatches, fill_pool


def replay(trace: Trace, *, transport: str = "inproc", backend: str = "cpu", verify: bool = False,
           connect: str | None = None, engine: str = "replay", daemon_log: str | None = None) -> tuple[dict, dict]:
    """Run ``trace``; return (summary, result arrays ``slots`` and ``misses``)."""
    layout = trace.layout()
    if transport == "doorbell":
        raise ValueError("the doorbell transport needs the cuda backend's device rings, which are not built yet; "
                         "use --transport zmq or inproc")
    if transport not in ("inproc", "zmq"):
        raise ValueError(f"unknown transport {transport!r}; use inproc or zmq")
    with contextlib.ExitStack() as stack:
        if transport == "inproc":
            client = stack.enter_context(InprocClient(backend=backend))
        else:
            run_dir = connect
            if run_dir is None:
                pool_bytes = layout.pool_bytes + (8 << 20)
                run_dir = stack.enter_context(PrivateDaemon(pool_bytes=pool_bytes, backend=backend, log_path=daemon_log)).run_dir
            device = "cuda:0" if backend == "cuda" else "cpu"
            client = stack.enter_context(Client(run_dir, name="replay", device=device))
        att = client.attach(layout, engine=engine)
        if verify:
            fill_pool(client, layout)
        slots = np.full(trace.topk.shape, -1, np.int32)
        misses = np.zeros(trace.topk.shape[:2], np.int32)
        lat = np.zeros(trace.steps)
        hits = out_of_range = mismatched = 0
        layers = layout.groups[0]
        t_start = time.perf_counter()
        for t in range(trace.steps):
            t0 = time.perf_counter()
            try:
                client.step(t, trace.state_rows[t], trace.reset[t], trace.invalidate[t])
                r = client.topk(t, 0, trace.topk[t])
            except BadRequest as e:  # the trace breaks the contract: say where
                raise BadRequest(f"step {t}: {e.args[0]}", e.code) from None
            slots[t], misses[t] = r.host()  # cuda: waits for the gather (the step's end)
            lat[t] = time.perf_counter() - t0
            if r.hits is None:  # cuda: counted on the GPU; derive them from the result
                live = trace.state_rows[t] >= 0
                ids = trace.topk[t][live]
                hits += int(((ids >= 0) & (ids < layout.host_rows)).sum()) - int(misses[t].sum())
                out_of_range += int(((ids < -1) | (ids >= layout.host_rows)).sum())
            else:
                hits += r.hits
                out_of_range += r.out_of_range
            if verify:
                mismatched += count_mismatches(att.slab, layers, trace.state_rows[t], trace.topk[t], slots[t], layout.host_rows)
        elapsed = time.perf_counter() - t_start
        client.detach()
    summary = {
        "transport": transport,
        "backend": backend,
        "steps": trace.steps,
        "batch": trace.batch,
        "top_k": trace.top_k,
        "hits": int(hits),
        "misses": int(misses.sum()),
        "hit_rate": round(hits / max(1, hits + int(misses.sum())), 6),
        "out_of_range": int(out_of_range),
        "rows_moved": int(misses.sum()) * layout.num_layers,
        "bytes_moved": int(misses.sum()) * layout.num_layers * layout.row_bytes,
        "verified": verify,
        "mismatched_rows": int(mismatched) if verify else None,
        "elapsed_s": round(elapsed, 4),
        "step_p50_us": round(float(np.percentile(lat, 50)) * 1e6, 1) if trace.steps else 0.0,
        "step_p99_us": round(float(np.percentile(lat, 99)) * 1e6, 1) if trace.steps else 0.0,
    }
    return summary, {"slots": slots, "misses": misses}


def save_result(path: str, result: dict) -> None:
    np.savez_compressed(path, slots=result["slots"], misses=result["misses"])


def summary_line(summary: dict) -> str:
    return json.dumps(summary, sort_keys=False)
