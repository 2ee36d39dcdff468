"""``sparsekv bench tp``: what a TP group (ATTACH ``tp_size``, DESIGN §5.6) saves the
daemon on the cpu backend: the same synthetic decode (one index group, batch 16, top-k
2048, 90 % of each row kept step to step, 656-byte rows) sent by ``ranks`` rank clients
of one engine, each resolving its own batches, then as one TP group, in one run, each
through a private daemon. The figures are the daemon's time per request (each reply's
``tx - tr``), medians after a warm-up:

* ``tp_group_daemon_us_per_step_vs_separate``: the daemon's time for a step of every
  rank, group over separate (one resolve and ``ranks`` gathers, against ``ranks`` of
  each);
* ``tp_maker_topk_us`` / ``tp_follower_topk_us``: a TOPK that resolves (and gathers),
  one that only gathers the group's plan; ``separate_topk_us``: a rank of its own.
"""

from __future__ import annotations

import numpy as np

from sparsekv.client import Client
from sparsekv.proto import MsgType

from .private_daemon import PrivateDaemon
from .synth import synth

WARMUP = 20


def _daemon_us(trace, ranks: int, tp: bool) -> list[list[float]]:
    """Each rank's daemon time (us) per TOPK after the warm-up, the ranks sending each step in turn."""
    lay = trace.layout()
    with PrivateDaemon(pool_bytes=lay.pool_bytes + (64 << 20), backend="cpu") as d:
        clients = [Client(d.run_dir, rank=r, name=f"bench-tp{r}").connect() for r in range(ranks)]
        try:
            for c in clients:
                c.attach(lay, engine="bench-tp", tp_size=ranks if tp else 1)
            out = [[] for _ in range(ranks)]
            for t in range(trace.steps):
                for r, c in enumerate(clients):
                    c.step(t, trace.state_rows[t], trace.reset[t], trace.invalidate[t])
                    c.topk(t, 0, trace.host_topk(t))
                    sent, got, replied, _ = c.timings[MsgType.TOPK]
                    if t >= WARMUP:
                        out[r].append((replied - got) / 1e3)
            return out
        finally:
            for c in clients:
                c.close()


def bench_tp(ranks: int = 2, steps: int = 120, batch: int = 16, top_k: int = 2048, seed: int = 3) -> dict:
    if ranks < 2 or steps <= WARMUP:
        raise ValueError(f"bench tp needs 2 ranks or more and more than {WARMUP} steps")
    trace = synth(steps=steps, batch=batch, top_k=top_k, region_stride=2 * top_k, max_reqs=batch,
                  host_rows=batch * 16384, row_bytes=656, num_layers=1, overlap=0.9, context=16384,
                  lifetime=64, seed=seed)
    separate = _daemon_us(trace, ranks, tp=False)
    group = _daemon_us(trace, ranks, tp=True)
    sep_step = float(np.median(np.sum(separate, axis=0)))
    group_step = float(np.median(np.sum(group, axis=0)))
    # Rank 0 sends first each step: it makes every entry; the others follow.
    return {"bench": "tp", "ranks": ranks, "steps": steps, "batch": batch, "top_k": top_k,
            "separate_topk_us": round(float(np.median(separate)), 1),
            "tp_maker_topk_us": round(float(np.median(group[0])), 1),
            "tp_follower_topk_us": round(float(np.median(group[1:])), 1),
            "separate_daemon_us_per_step": round(sep_step, 1),
            "tp_group_daemon_us_per_step": round(group_step, 1),
            "tp_group_daemon_us_per_step_vs_separate": round(group_step / sep_step, 3)}
