"""Random interleavings of a TP group's ranks (2 or 3, through a real daemon) against one
rank of its own (the in-process engine) fed each request when the group makes its entry
(the first rank to send it), and each write when it happens: every rank's slots and
misses are the reference's, every slab byte a reply names holds the row (of a generation
between the entry's making and the reply: a rank behind gathers a rewritten row's new
bytes), the daemon's counters are the reference's once (tp_followed the batches answered
from a peer's resolve). Steps sent alone or riding on a TOPK, TOPKs with their own state
rows, several batches of a group in a step, writes from any rank at any point, requests
that differ from the peers' (refused, nothing changed), a rank that leaves mid-run,
prefetch on and off."""

import numpy as np
import pytest

import helpers
from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.client import Client, TpLag, TpMismatch
from sparsekv.embedded.inproc import InprocClient

GROUPS = ((0,), (1, 2), (3,))
HOST_ROWS = 40  # few rows: hits, evictions and rewrites of rows in use
COUNTERS = ("hits", "misses", "out_of_range", "tp_followed", "topk_batches", "prefetched", "prefetch_hits",
            "prefetch_wasted", "hot_invalidated")


def lay():
    return helpers.layout(num_layers=4, top_k=4, region_stride=12, max_reqs=3, host_rows=HOST_ROWS,
                          index_groups=GROUPS)


def sequence(rng, steps: int) -> list:
    """The requests every rank sends: per step a STEP (padding, a request's several tokens,
    resets, invalidations), then top-k batches of the groups in any order, a group maybe
    twice, some with their own state rows."""
    out = []
    for t in range(steps):
        rows = rng.integers(-1, 3, rng.integers(1, 4)).astype(np.int32)
        inval = np.full((rows.size, 2), -1, np.int32)
        inval[rng.random(inval.shape) < 0.2] = rng.integers(0, HOST_ROWS)
        out.append(("step", t, rows, rng.random(rows.size) < 0.15, inval))
        for g in rng.integers(0, len(GROUPS), rng.integers(1, 5)):
            own = rows if rng.random() < 0.7 else rng.integers(-1, 3, rng.integers(1, 4)).astype(np.int32)
            topk = np.stack([rng.choice(HOST_ROWS, 4, replace=False) for _ in own]).astype(np.int32)
            topk[rng.random(topk.shape) < 0.1] = -1
            out.append(("topk", t, int(g), topk, None if own is rows else own, own))
    return out


def pool_rows(rows, gen):
    return np.stack([helpers.gen_pattern(layer, rows, lay().row_bytes, gen) for layer in range(lay().num_layers)])


def run(run_dir: str, seed: int, prefetch: bool, max_lag: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 4))
    seq = sequence(rng, steps=6)
    weight = rng.random(n) + 0.05  # one rank often far ahead of another
    ranks = [Client(run_dir, rank=r, name=f"tp{r}").connect() for r in range(n)]
    ref = InprocClient()
    try:
        atts = [c.attach(lay(), engine=f"tp{seed}", tp_size=n, prefetch=prefetch) for c in ranks]
        ref.attach(lay(), prefetch=prefetch)
        gen = np.zeros(HOST_ROWS, np.int64)
        everything = np.arange(HOST_ROWS, dtype=np.int32)
        ranks[0].write(everything, pool_rows(everything, gen))
        ref.write(everything, pool_rows(everything, gen))
        before = ranks[0].stats()
        pos = [0] * n  # each rank's next request
        deferred = [None] * n  # a rank's STEP not sent yet (it rides on the rank's next request)
        made = 0  # entries the group made: the reference has been fed requests [0, made)
        want, made_gen = {}, {}  # per top-k request: the reference's result, the generations then
        live, followed, answered, ref_hits, ref_dropped = set(range(n)), 0, 0, [0, 0, 0], 0

        def sent(k: int) -> None:
            """Request ``k`` reaches the group: the first to send it makes the entry."""
            nonlocal made
            if k < made:
                return
            assert k == made
            made += 1
            req = seq[k]
            if req[0] == "step":
                ref.step(req[1], req[2], reset=req[3], invalidate=req[4])
                return
            res = ref.topk(req[1], req[2], req[3], state_rows=req[4])
            want[k], made_gen[k] = res, gen.copy()
            ref_hits[0] += res.hits
            ref_hits[1] += int(np.asarray(res.misses).sum())
            ref_hits[2] += res.out_of_range

        def send_deferred(r: int) -> None:
            if deferred[r] is not None:
                sent(deferred[r])
                deferred[r] = None

        def lag_refuses(r: int, entries: int) -> bool:
            """Whether ``entries`` new entries from rank ``r`` are TP_LAG: a peer would be more
            than ``max_lag`` behind (a rank's STEP not sent yet has not reached the group)."""
            return entries > 0 and any(made - pos[x] + (deferred[x] is not None) + entries > max_lag
                                       for x in live if x != r)

        def lone_step(r: int) -> bool:
            """Send rank ``r``'s STEP not sent yet alone; False if it was refused (TP_LAG: it
            did not run, the rank sends it again)."""
            k = deferred[r]
            if lag_refuses(r, int(k == made)):
                with pytest.raises(TpLag, match=f"rank {r} is"):
                    ranks[r].flush()
                pos[r], deferred[r] = k, None
                return False
            send_deferred(r)
            ranks[r].flush()
            return True

        while live:
            alive = sorted(live)
            r = int(rng.choice(alive, p=weight[alive] / weight[alive].sum()))
            c, roll = ranks[r], rng.random()
            if roll < 0.08 and deferred[r] is None:  # a write of a few rows, from this rank, wherever it is
                rows = rng.choice(HOST_ROWS, rng.integers(1, 4), replace=False).astype(np.int32)
                gen[rows] += 1
                c.write(rows, pool_rows(rows, gen))
                ref_dropped += ref.write(rows, pool_rows(rows, gen))["invalidated"]
                continue
            if roll < 0.1 and len(live) > 1 and deferred[r] is None:  # this rank leaves mid-run
                c.detach()
                live.discard(r)
                continue
            if pos[r] == len(seq):
                c.flush()
                live.discard(r)
                continue
            k, req = pos[r], seq[pos[r]]
            if req[0] == "step":
                if roll < 0.2 and k < made:  # a STEP that differs from the peers': refused, nothing ran
                    c.step(req[1], req[2], reset=~req[3], invalidate=req[4])
                    with pytest.raises(TpMismatch, match="resets or invalidations differ"):
                        c.flush()
                    continue
                c.step(req[1], req[2], reset=req[3], invalidate=req[4])
                deferred[r] = k
                pos[r] += 1
                if rng.random() < 0.4:
                    lone_step(r)
                continue
            riding = deferred[r] is not None and req[4] is None  # else the STEP goes alone first
            if deferred[r] is not None and not riding and not lone_step(r):
                continue
            if roll < 0.2 and k < made:  # a batch that differs from the peers': refused, nothing ran
                wrong = req[3].copy()
                wrong[0, 0] = -2
                with pytest.raises(TpMismatch, match="top-k row 0 differs"):
                    c.topk(req[1], req[2], wrong, state_rows=req[4])
                if riding:  # (its STEP did not run either: the rank sends it again)
                    pos[r], deferred[r] = k - 1, None
                continue
            if lag_refuses(r, 2 if riding and k - 1 == made else int(k == made)):
                with pytest.raises(TpLag, match=f"rank {r} is"):
                    c.topk(req[1], req[2], req[3], state_rows=req[4])
                if riding:
                    pos[r], deferred[r] = k - 1, None
                continue
            send_deferred(r)
            following = k < made
            sent(k)
            res = c.topk(req[1], req[2], req[3], state_rows=req[4])
            pos[r] += 1
            answered += 1
            followed += following
            w = want[k]
            np.testing.assert_array_equal(res.slots, w.slots, err_msg=f"seed {seed}, rank {r}, request {k}")
            np.testing.assert_array_equal(res.misses, w.misses, err_msg=f"seed {seed}, rank {r}, request {k}")
            assert helpers.bad_rows_between(atts[r].slab, GROUPS[req[2]], req[5], req[3], res.slots, HOST_ROWS,
                                            made_gen[k], gen) == 0, f"seed {seed}, rank {r}, request {k}"
        after = ranks[0].stats()
        rr = ref._state.residency
        expect = dict(zip(COUNTERS, (*ref_hits, followed, answered, rr.prefetched, rr.prefetch_hits,
                                     rr.prefetch_wasted, ref_dropped)))
        assert {k: after[k] - before[k] for k in COUNTERS} == expect, f"seed {seed}"
    finally:
        for c in ranks:
            c.close()


@pytest.mark.parametrize("prefetch", [False, True])
def test_random_interleavings_of_a_tp_group_equal_one_rank_of_its_own(daemon, prefetch):
    for seed in range(helpers.examples(6, 300)):
        run(daemon.run_dir, seed, prefetch, max_lag=256)


def test_random_interleavings_refused_for_lag_equal_one_rank_of_its_own(tmp_path):
    # A rank that would run more than tp_max_lag requests ahead is refused and sends again
    # (a TOPK carrying its STEP: both); the group still equals one rank.
    with PrivateDaemon(pool_bytes=16 << 20, backend="cpu", extra_args=["--tp-max-lag", "3"],
                       log_path=str(tmp_path / "d.log")) as d:
        for seed in range(helpers.examples(6, 300)):
            run(d.run_dir, seed, prefetch=bool(seed % 2), max_lag=3)
