"""End to end: a real sparsekvd process (cpu backend) and two client processes attached to
one engine as two TP ranks. Every byte check runs inside the rank process, on its own
mapping of its hot slab (tests/helpers.py ``_rank_server``)."""

import numpy as np
import pytest

import helpers
from helpers import RankError
from sparsekv.bench.private_daemon import PrivateDaemon

# Two index groups of two layers (leader + follower), a staging buffer of one 8-row block.
LAYOUT = helpers.layout(num_layers=4, row_bytes=64, top_k=8, region_stride=16, max_reqs=4, host_rows=256,
                        index_groups=((0, 1), (2, 3)), staging_rows=8)
WIRE = LAYOUT.to_wire()


def batches(steps: int, seed: int = 0):
    """Top-k rows for a batch of 3 requests (state rows 0, 2, 3) with step-to-step overlap."""
    rng = np.random.default_rng(seed)
    prev = [rng.choice(np.arange(64 * r, 64 * r + 64), 8, replace=False) for r in range(3)]
    out = []
    for _ in range(steps):
        rows = []
        for r in range(3):
            keep = rng.choice(prev[r], 5, replace=False)
            new = rng.choice(np.setdiff1d(np.arange(64 * r, 64 * r + 64), keep), 3, replace=False)
            prev[r] = rng.permutation(np.concatenate([keep, new]))
            rows.append(prev[r])
        out.append(np.array(rows, np.int32))
    return out


STATE_ROWS = np.array([0, 2, 3], np.int32)


def start_ranks(spawn_rank, run_dir, engine="tp", fill=True):
    ranks = [spawn_rank(run_dir, r) for r in range(2)]  # both start (import) in parallel
    for r in ranks:
        r.call("connect")
        assert r.call("attach", layout=WIRE, engine=engine)["slab_shape"] == [4, 4, 16, 64]
    if fill:
        ranks[0].call("fill")  # rank 0 writes every host row; rank 1 reads them
    return ranks


def step_both(ranks, t, topk, reset=None):
    """One decode step on both ranks (identical top-k, as TP ranks send); returns each
    rank's results per group. Fails on any byte mismatch in any rank."""
    out = []
    for r in ranks:
        r.call("step", step=t, state_rows=STATE_ROWS, reset=reset)
        res = [r.call("topk", step=t, group=g, topk=topk) for g in range(2)]
        for g, x in enumerate(res):
            assert x["bad"] == 0, f"rank {ranks.index(r)} group {g} step {t}: {x['bad']} rows with wrong bytes"
        out.append(res)
    return out


def test_two_rank_processes_read_correct_bytes_and_rewritten_rows_miss_with_new_bytes(daemon, spawn_rank):
    ranks = start_ranks(spawn_rank, daemon.run_dir)
    total_hits = total_misses = 0
    steps = batches(6)
    for t, topk in enumerate(steps):
        res = step_both(ranks, t, topk, reset=np.full(3, t == 0))
        for g in range(2):  # same history, same slots in both ranks
            np.testing.assert_array_equal(res[0][g]["slots"], res[1][g]["slots"])
        total_hits += sum(x["hits"] for rr in res for x in rr)
        total_misses += sum(int(x["misses"].sum()) for rr in res for x in rr)
    assert res[0][0]["hits"] > 0  # overlap gives hits after the first step
    # Rank 0 rewrites two rows that are hot in both ranks (and both groups), in state rows 0 and 3.
    last = steps[-1]
    rewritten = [int(last[0, 1]), int(last[2, 4])]
    w = ranks[0].call("write", rows=rewritten)
    assert w["invalidated"] == 2 * 2 * 2  # 2 rows x 2 groups x 2 ranks
    ranks[1].call("gen", rows=rewritten)
    res = step_both(ranks, len(steps), last)  # same top-k again: only the rewritten rows miss
    for rr in res:
        for x in rr:
            assert x["misses"].tolist() == [1, 0, 1]
            assert x["hits"] == 3 * 8 - 2
    total_hits += sum(x["hits"] for rr in res for x in rr)
    total_misses += sum(int(x["misses"].sum()) for rr in res for x in rr)
    stats = helpers.stats_json(daemon.run_dir)
    assert (stats["hits"], stats["misses"]) == (total_hits, total_misses)
    assert stats["rows_moved"] == 2 * total_misses and stats["bytes_moved"] == 2 * total_misses * 64
    assert stats["hot_invalidated"] == 8 and stats["errors"] == 0
    assert stats["rows_written"] == 256 * 4 + 2 * 4


def test_prefill_staging_copies_whole_blocks_in_the_rank_process(daemon, spawn_rank):
    r0, r1 = start_ranks(spawn_rank, daemon.run_dir)
    block = np.arange(24, 32, dtype=np.int32)
    out = r1.call("stage", rows=block)
    assert out["staged_ok"] and out["bytes"] == 8 * 4 * 64
    # a later block of two layers only: the other layers keep the first block
    out = r1.call("stage", rows=np.arange(40, 48, dtype=np.int32), layers=[1, 3])
    assert out["staged_ok"] and out["bytes"] == 8 * 2 * 64
    first = helpers.gen_pattern(0, block, 64)
    assert np.array_equal(out["staging"][0], first)
    # rank 0's staging buffer is its own
    assert not r0.call("stage", rows=np.arange(0, 0, dtype=np.int32))["staging"].any()
    with pytest.raises(RankError) as ei:
        r1.call("stage", rows=np.arange(9, dtype=np.int32))
    assert ei.value.code == "TOO_LARGE" and "staging buffer of 8" in ei.value.msg


def test_detach_then_reattach_gets_a_fresh_region_and_correct_bytes(daemon, spawn_rank):
    r0, r1 = start_ranks(spawn_rank, daemon.run_dir)
    steps = batches(4, seed=1)
    step_both([r0, r1], 0, steps[0], reset=np.ones(3, bool))
    assert len(helpers.shm_slabs(daemon.run_dir)) == 2
    r1.call("detach")
    # The daemon closes the slab's descriptor at once; its mapping (which holds one of
    # its own) goes with the last view, possibly just after the reply.
    helpers.wait_for(lambda: len(helpers.shm_slabs(daemon.run_dir)) == 1, timeout_s=5,
                     what="rank 1's slab unmapped")
    assert helpers.stats_json(daemon.run_dir)["attached"] == 1
    step_both([r0], 1, steps[1])  # rank 0 keeps the engine (and its pool rows) alive
    r1.call("attach", layout=WIRE, engine="tp")
    res = step_both([r0, r1], 2, steps[2])
    assert [int(x["misses"].sum()) for x in res[1]] == [24, 24]  # rank 1 starts cold
    assert all(int(x["misses"].sum()) < 24 for x in res[0])  # rank 0 is warm
    step_both([r0, r1], 3, steps[3])
    assert len(helpers.shm_slabs(daemon.run_dir)) == 2


def test_second_rank_with_another_layout_gets_layout_mismatch(daemon, spawn_rank):
    r0 = spawn_rank(daemon.run_dir, 0)
    r1 = spawn_rank(daemon.run_dir, 1)
    for r in (r0, r1):
        r.call("connect")
    r0.call("attach", layout=WIRE, engine="tp")
    other = dict(WIRE, region_stride=24)
    with pytest.raises(RankError) as ei:
        r1.call("attach", layout=other, engine="tp")
    assert ei.value.type == "LayoutMismatch" and ei.value.code == "LAYOUT_MISMATCH"
    assert "region_stride" in ei.value.msg
    r0.call("fill")
    step_both([r0], 0, batches(1)[0])  # the first rank is unaffected


def test_layout_that_does_not_fit_the_pool_gets_pool_full(daemon, spawn_rank):
    r = spawn_rank(daemon.run_dir, 0)
    r.call("connect")
    big = dict(WIRE, host_rows=1 << 20)  # 4 layers x 1 Mi rows x 64 B = 256 MiB > 64 MiB pool
    with pytest.raises(RankError) as ei:
        r.call("attach", layout=big, engine="big")
    assert ei.value.type == "PoolFull" and ei.value.code == "POOL_FULL"
    assert "--pool-size" in ei.value.msg
    assert helpers.stats_json(daemon.run_dir)["pool_used_bytes"] == 0
    r.call("attach", layout=WIRE, engine="big")  # a layout that fits still attaches


def test_dead_client_process_is_reaped_and_its_engine_freed(daemon, spawn_rank):
    survivor, victim = start_ranks(spawn_rank, daemon.run_dir, fill=True)
    other = spawn_rank(daemon.run_dir, 0, name="victim2")
    other.call("connect")
    other.call("attach", layout=WIRE, engine="alone")
    s = helpers.stats_json(daemon.run_dir)
    assert (s["clients"], s["engines"]) == (3, 2)
    used_two_engines = s["pool_used_bytes"]
    assert len(helpers.shm_slabs(daemon.run_dir)) == 3
    victim.kill()
    other.kill()
    # Reaping ends in steps (the session, then the rank's memory off the loop, then the
    # engine): wait for the whole of it, so a loaded machine sees the end state too.
    s = helpers.wait_for(lambda: (x := helpers.stats_json(daemon.run_dir))["clients"] == 1 and x["engines"] == 1
                         and len(helpers.shm_slabs(daemon.run_dir)) == 1 and x, timeout_s=10,
                         what="the daemon to reap the dead clients and free the engine they alone used")
    assert s["attached"] == 1
    assert s["pool_used_bytes"] < used_two_engines  # the engine "alone" had no other rank
    assert str(other.pid) not in helpers.stats_query(daemon.run_dir, "clients")
    step_both([survivor], 0, batches(1)[0])  # the shared engine lives on with its bytes


def test_stopping_the_daemon_leaves_no_shared_memory_behind(spawn_rank):
    with PrivateDaemon(pool_bytes=64 << 20, backend="cpu") as d:
        ranks = start_ranks(spawn_rank, d.run_dir, fill=False)
        slabs = helpers.shm_slabs(d.run_dir)
        assert len(slabs) == 2
        run_dir = d.run_dir
    # stopped with both ranks still attached (and mapping their slabs)
    assert helpers.shm_slabs(run_dir) == []
    assert all(r.proc.is_alive() for r in ranks)
