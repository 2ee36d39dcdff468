"""Soak runs (marked ``soak``: not in ``make test``; ``make soak`` runs them, with the
property tests at many more examples). Each repeats, for thousands of steps, a behaviour
that a short test of the default suite already checks, so that rare interleavings (a row
rewritten while hot in one group and cold in another, an eviction order many steps deep,
a ring or pipe reused many times) get their chance.

- the whole stack (private daemon, zmq transport, ``--verify``) against the reference
  model: tests/client/test_cli.py and test_replay_reference.py are the short ones;
- two TP-rank processes with rewrites of hot rows: tests/client/test_two_ranks.py is the
  short one.
"""

import numpy as np
import pytest

import helpers
from sparsekv.bench.replay import replay
from sparsekv.bench.synth import synth

pytestmark = pytest.mark.soak

STEPS = 20000 if helpers.LONG else 2000  # `pytest -m soak` alone: a shorter soak


@pytest.mark.parametrize("kw", [
    dict(batch=8, top_k=64, region_stride=128, max_reqs=12, overlap=0.8, invalidate=0.2, pad=0.1, seed=1),
    dict(batch=4, top_k=32, region_stride=96, max_reqs=6, overlap=0.3, invalidate=0.5, share_prefix=0.8, seed=2),
    dict(batch=6, top_k=16, region_stride=16, max_reqs=8, overlap=0.95, out_of_range=0.05, arrive=0.9, seed=3),
])
def test_long_zmq_replay_with_verify_equals_the_reference_model(kw):
    trace = synth(steps=STEPS, host_rows=8192, row_bytes=32, num_layers=2, context=600, lifetime=40, **kw)
    summary, result = replay(trace, transport="zmq", verify=True)
    want_slots, want_misses = helpers.reference_replay(trace)
    np.testing.assert_array_equal(result["slots"], want_slots)
    np.testing.assert_array_equal(result["misses"], want_misses)
    assert summary["steps"] == STEPS and summary["mismatched_rows"] == 0
    assert summary["hits"] > 0 and summary["misses"] > 0


def test_two_rank_processes_over_many_steps_with_rewrites_read_only_current_bytes(daemon, spawn_rank):
    """Two TP ranks of one engine, identical top-k, both index groups each step; every few
    steps rank 0 rewrites rows (some hot, some not). Both ranks check every hot byte
    against the rows' current generation, and their slots stay equal."""
    from test_two_ranks import STATE_ROWS, batches, start_ranks, step_both

    rng = np.random.default_rng(7)
    ranks = start_ranks(spawn_rank, daemon.run_dir)
    steps = STEPS // 5
    for t, topk in enumerate(batches(steps, seed=5)):
        if t and t % 7 == 0:
            hot = rng.choice(topk.ravel(), 2, replace=False)
            cold = rng.choice(np.setdiff1d(np.arange(192, 256), topk.ravel()), 2, replace=False)
            rows = np.unique(np.concatenate([hot, cold])).astype(np.int32)
            ranks[0].call("write", rows=rows)
            ranks[1].call("gen", rows=rows)
        res = step_both(ranks, t, topk, reset=np.full(len(STATE_ROWS), t % 200 == 0))
        for g in range(2):
            np.testing.assert_array_equal(res[0][g]["slots"], res[1][g]["slots"])
    s = ranks[0].call("stats")
    assert s["steps"] == 2 * steps and s["errors"] == 0 and s["hot_invalidated"] > 0 and s["hits"] > s["misses"]
