"""A decode program for the cuda prefetch tests (tests/daemon/test_cuda_prefetch_daemon.py,
test_cuda_step.py) and what the cpu backend serves for it: three index groups, each
group's top-k mostly the previous group's rows of the step."""

from __future__ import annotations

import numpy as np

from sparsekv.embedded.inproc import InprocClient
from sparsekv.proto import Layout

GROUPS = ((0,), (1, 2), (3,))
PF_KEYS = ("prefetched", "prefetch_hits", "prefetch_wasted")


def layout() -> Layout:
    return Layout(num_layers=4, row_bytes=656, top_k=32, region_stride=64, max_reqs=6, host_rows=4096,
                  index_groups=GROUPS, max_batch=8).validate()


def program(lay: Layout, n: int, seed: int):
    """Per step: state rows (five requests and a padding row; request 4 restarts at step
    n // 2), resets, and each group's top-k: most of the previous group's rows of the step,
    the rest new, every request's rows from its own window of host rows."""
    rng = np.random.default_rng(seed)
    span = lay.host_rows // lay.max_reqs
    out = []
    for t in range(n):
        state = np.array([0, 1, 2, 3, 4, -1], np.int32)
        reset = np.zeros(6, bool)
        reset[:5] = t == 0
        reset[4] |= t == n // 2
        per_group, prev = [], None
        for _ in GROUPS:
            rows = np.empty((6, lay.top_k), np.int32)
            for b in range(5):
                fresh = rng.permutation(300)[: lay.top_k] + b * span
                if prev is not None:
                    keep = prev[b][rng.random(lay.top_k) < 0.8]
                    fresh = np.concatenate([keep, np.setdiff1d(fresh, keep)])[: lay.top_k]
                rows[b] = fresh
            rows[5] = rng.integers(-3, 50, lay.top_k)  # junk on the padding row
            per_group.append(rows)
            prev = rows
        out.append((state, reset, per_group))
    return out


def reference(lay: Layout, plan):
    """The cpu backend in process: per step, per group (slots, misses); the counters."""
    want = []
    with InprocClient(backend="cpu") as c:
        c.attach(lay, engine="ref", prefetch=True)
        for t, (state, reset, per_group) in enumerate(plan):
            c.step(t, state, reset)
            want.append([tuple(np.asarray(x) for x in c.topk(t, g, rows).host()) for g, rows in enumerate(per_group)])
        r = c._state.residency
        counters = {"prefetched": r.prefetched, "prefetch_hits": r.prefetch_hits, "prefetch_wasted": r.prefetch_wasted}
    assert counters["prefetch_hits"] > 0
    return want, counters
