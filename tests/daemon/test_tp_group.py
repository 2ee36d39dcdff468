"""A TP group (ATTACH tp_size, daemon/tp.py) through a real daemon: the ranks of an engine
that send the same steps and top-k batches get one resolve between them: every rank's
slots are those a single rank of its own would get (the contract, through a reference
engine fed the same requests), every rank's slab holds the pool's rows at them whatever
order the ranks come in (one rank far ahead, interleaved, the other first), hits are
counted once; a rank whose request differs is refused and stays where it was; a rank
too far ahead is refused naming the one it waits for; joining follows the group's rules."""

import contextlib

import numpy as np
import pytest

import helpers
from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.client import BadRequest, Client, LayoutMismatch, NotAttached, TpLag, TpMismatch
from sparsekv.proto import MsgType

GROUPS = ((0,), (1, 2), (3,))
HOST_ROWS = 96


def lay(**kw):
    base = dict(num_layers=4, top_k=4, region_stride=8, max_reqs=3, host_rows=HOST_ROWS, index_groups=GROUPS)
    return helpers.layout(**{**base, **kw})


def requests_of(seed: int, steps: int = 6):
    """A decode run as (kind, args) requests, the order every rank sends them: per step a
    STEP (state rows, some resets, some invalidations), then each group's top-k batch."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(steps):
        rows = np.array([0, 2, 1] if t % 2 else [2, 0, -1], np.int32)
        reset = rng.random(3) < 0.2
        inval = np.full((3, 2), -1, np.int32)
        inval[rng.integers(0, 3)] = rng.choice(HOST_ROWS, 2, replace=False)
        out.append(("step", t, rows, reset, inval))
        for g in range(len(GROUPS)):
            topk = np.stack([rng.choice(HOST_ROWS, 4, replace=False) for _ in range(3)]).astype(np.int32)
            topk[rng.random((3, 4)) < 0.1] = -1
            out.append(("topk", t, g, topk, rows))
    return out


@contextlib.contextmanager
def two_ranks(tmp_path, layout, *args, engine: str = "tp", fill: bool = True, pool: int = 16 << 20):
    """A private cpu daemon (``args``: its options) and ranks 0 and 1 of a TP group of 2
    attached to ``engine`` (the pool filled through rank 0 unless ``fill`` is False)."""
    with PrivateDaemon(pool_bytes=pool, backend="cpu", extra_args=list(args), log_path=str(tmp_path / "d.log")) as d:
        with Client(d.run_dir, rank=0) as c0, Client(d.run_dir, rank=1) as c1:
            for c in (c0, c1):
                c.attach(layout, engine=engine, tp_size=2)
            if fill:
                helpers.fill(c0, layout)
            yield d, c0, c1


def send(c, req):
    """Send one request; a top-k's result, or None for a STEP."""
    if req[0] == "step":
        _, t, rows, reset, inval = req
        c.step(t, rows, reset=reset, invalidate=inval)
        return None
    _, t, g, topk, _ = req
    return c.topk(t, g, topk)


def check_rows(att, req, res) -> int:
    _, _, g, topk, rows = req
    return helpers.bad_rows(att.slab, GROUPS[g], rows, topk, res.slots, HOST_ROWS)


def run_group(run_dir, reqs, order, prefetch=False):
    """Rank 0 and 1 of a TP group send ``reqs``; ``order`` lists which rank sends its next
    request, in turn. Returns each rank's results in request order and the wrong rows seen
    (checked at each reply, on the replying rank's slab)."""
    with Client(run_dir, rank=0, name="r0") as c0, Client(run_dir, rank=1, name="r1") as c1:
        ranks = [c0, c1]
        atts = [c.attach(lay(), engine="tp", tp_size=2, prefetch=prefetch) for c in ranks]
        helpers.fill(c0, lay())
        got, pos, bad = [[], []], [0, 0], 0
        for r in order:
            req = reqs[pos[r]]
            res = send(ranks[r], req)
            pos[r] += 1
            if res is not None:
                got[r].append((np.array(res.slots), np.array(res.misses)))
                bad += check_rows(atts[r], req, res)
        stats = c0.stats()
    return got, bad, stats


def run_alone(run_dir, reqs, prefetch=False):
    with Client(run_dir, name="ref") as c:
        att = c.attach(lay(), engine="ref", prefetch=prefetch)
        helpers.fill(c, lay())
        got, bad = [], 0
        for req in reqs:
            res = send(c, req)
            if res is not None:
                got.append((np.array(res.slots), np.array(res.misses)))
                bad += check_rows(att, req, res)
        stats = c.stats()
    return got, bad, stats


def orders(n: int):
    """Ways two ranks interleave ``n`` requests each: in turn, rank 1 first, one rank all
    the way ahead, random."""
    rng = np.random.default_rng(3)
    rand = [0] * n + [1] * n
    rng.shuffle(rand)
    return {"in turn": [0, 1] * n, "rank 1 first": [1, 0] * n, "rank 0 ahead": [0] * n + [1] * n,
            "random": rand}


@pytest.mark.parametrize("prefetch", [False, True])
def test_every_rank_gets_the_slots_of_one_resolve_and_the_pools_rows_in_any_order(daemon, prefetch):
    reqs = requests_of(1)
    want, bad, alone = run_alone(daemon.run_dir, reqs, prefetch)
    assert bad == 0
    for name, order in orders(len(reqs)).items():
        got, bad, stats = run_group(daemon.run_dir, reqs, order, prefetch)
        assert bad == 0, name
        for r in (0, 1):
            assert len(got[r]) == len(want)
            for (s, m), (ws, wm) in zip(got[r], want):
                np.testing.assert_array_equal(s, ws, err_msg=f"{name}, rank {r}")
                np.testing.assert_array_equal(m, wm, err_msg=f"{name}, rank {r}")
    # The daemon's counters over every run: each group batch resolved once, followed once.
    s = stats
    batches = sum(1 for q in reqs if q[0] == "topk")
    runs = len(orders(len(reqs)))
    assert s["tp_followed"] == runs * batches
    assert s["topk_batches"] == (2 * runs + 1) * batches
    assert s["hits"] + s["misses"] + s["out_of_range"] == (runs + 1) * (alone["hits"] + alone["misses"]
                                                                         + alone["out_of_range"])
    if prefetch:
        assert s["prefetched"] == (runs + 1) * alone["prefetched"]


def test_a_rank_whose_topk_differs_is_refused_and_stays_where_it_was(daemon):
    reqs = requests_of(2, steps=2)
    with Client(daemon.run_dir, rank=0) as c0, Client(daemon.run_dir, rank=1) as c1:
        a0, a1 = (c.attach(lay(), engine="tp", tp_size=2) for c in (c0, c1))
        helpers.fill(c0, lay())
        for req in reqs[:2]:  # step 0 and its group 0 batch
            send(c0, req)
        send(c1, reqs[0])
        wrong = list(reqs[1])
        wrong[3] = np.where(wrong[3] >= 0, (wrong[3] + 1) % HOST_ROWS, -1).astype(np.int32)  # ids still distinct
        with pytest.raises(TpMismatch, match="rank 1 .* step 0, group 0: top-k row 0 differs"):
            send(c1, tuple(wrong))  # its STEP rode on it: neither ran
        send(c1, reqs[0])
        with pytest.raises(TpMismatch, match="it sent the TOPK of step 0, group 1"):
            send(c1, reqs[2])
        send(c1, reqs[0])
        res = send(c1, reqs[1])  # the right one is served, with rank 0's slots
        assert helpers.bad_rows(a1.slab, GROUPS[0], reqs[1][4], reqs[1][3], res.slots, HOST_ROWS) == 0
        send(c0, reqs[2])
        c1.step(0, reqs[0][2])  # a STEP where its peers sent group 1's batch (it rides on the TOPK)
        with pytest.raises(TpMismatch, match="it sent the STEP of step 0"):
            send(c1, reqs[2])
        res = send(c1, reqs[2])
        assert helpers.bad_rows(a1.slab, GROUPS[1], reqs[2][4], reqs[2][3], res.slots, HOST_ROWS) == 0
        assert c0.stats()["errors"] == 3


def test_a_rank_too_far_ahead_is_refused_naming_the_slow_one(tmp_path):
    reqs = requests_of(3, steps=3)
    with two_ranks(tmp_path, lay(), "--tp-max-lag", "3") as (d, c0, c1):
        for req in reqs[:3]:
            send(c0, req)
        with pytest.raises(TpLag, match="rank 0 is 3 requests ahead of rank 1 .* at most 3"):
            send(c0, reqs[3])
        e = helpers.stats_json(d.run_dir)["per_engine"]["tp"]  # what an operator sees of it
        assert (e["tp_size"], e["tp_lag"]) == (2, 3)
        for req in reqs[:2]:  # rank 1 moves (its STEP rides on its TOPK): rank 0 may go on
            send(c1, req)
        send(c0, reqs[3])
        send(c0, reqs[4])
        c1.detach()  # a rank that leaves stops counting
        for req in reqs[4:]:
            send(c0, req)


def test_joining_a_tp_group(daemon):
    run = daemon.run_dir
    with Client(run, rank=2) as c:
        with pytest.raises(BadRequest, match=r"rank 2 is not a rank of a TP group of 2"):
            c.attach(lay(), engine="tp", tp_size=2)
    with Client(run, rank=0) as c0, Client(run, rank=0) as dup, Client(run, rank=1) as c1, \
            Client(run, rank=1) as plain:
        c0.attach(lay(), engine="tp", tp_size=2)
        with pytest.raises(BadRequest, match="rank 0 of this TP group is attached already"):
            dup.attach(lay(), engine="tp", tp_size=2)
        with pytest.raises(LayoutMismatch, match="a TP group of 2 ranks, this rank asked for tp_size 1"):
            plain.attach(lay(), engine="tp")
        with pytest.raises(LayoutMismatch, match="the same prefetch"):
            c1.attach(lay(), engine="tp", tp_size=2, prefetch=True)
        with pytest.raises(LayoutMismatch, match="a TP group of 2 ranks, this rank asked for tp_size 4"):
            c1.attach(lay(), engine="tp", tp_size=4)
        c1.attach(lay(), engine="tp", tp_size=2)
        c0.step(0, np.array([0], np.int32))
        c0.topk(0, 0, np.array([[1, 2, 3, 4]], np.int32))
        c1.detach()
        with pytest.raises(BadRequest, match="has served 2 requests: its ranks join before the first step"):
            c1.attach(lay(), engine="tp", tp_size=2)
        c0.detach()  # the group goes with its last rank; the next ranks form a new one
        c1.attach(lay(), engine="tp", tp_size=2)
        c1.step(0, np.array([0], np.int32))
        assert c1.topk(0, 0, np.array([[1, 2, 3, 4]], np.int32)).misses[0] == 4  # a fresh residency
    with Client(run, rank=0) as a, Client(run, rank=1) as b:
        a.attach(lay(), engine="solo")
        with pytest.raises(LayoutMismatch, match="ranks without a TP group, this rank asked for tp_size 2"):
            b.attach(lay(), engine="solo", tp_size=2)
        for bad in (0, 65, "2", True):
            with pytest.raises(BadRequest, match="tp_size must be an integer in"):
                b._call(MsgType.ATTACH, {"engine": "x", "layout": lay().to_wire(), "tp_size": bad})


def test_the_bytes_kept_for_a_slow_rank_are_bounded_per_uid(tmp_path):
    big = helpers.layout(num_layers=1, row_bytes=16, top_k=2048, region_stride=2048, max_reqs=16, host_rows=4096)
    rng = np.random.default_rng(0)
    topk = [np.stack([rng.permutation(4096)[:2048] for _ in range(16)]).astype(np.int32) for _ in range(2)]
    rows = np.arange(16, dtype=np.int32)
    with PrivateDaemon(pool_bytes=16 << 20, backend="cpu", extra_args=["--tp-max-lag-bytes", "1MiB"],
                       log_path=str(tmp_path / "d.log")) as d:
        with Client(d.run_dir, rank=0) as c0, Client(d.run_dir, rank=1) as c1:
            for c in (c0, c1):
                c.attach(big, engine="tp", tp_size=2)
            c0.topk(0, 0, topk[0], state_rows=rows)  # ~0.66 MB kept for rank 1
            with pytest.raises(TpLag, match=r"keep (\d+) bytes for ranks behind \(\1 of them this group's\) and this "
                               r"request's entry would add \d+, past tp_max_lag_bytes \(1048576\)"):
                c0.topk(0, 0, topk[1], state_rows=rows)
            # Another TP engine of the uid, its ranks in step: refused by the one budget,
            # which the message names (it had blamed the engine's own peer as "behind").
            with Client(d.run_dir, rank=0) as o0, Client(d.run_dir, rank=1) as o1:
                for c in (o0, o1):
                    c.attach(big, engine="tp2", tp_size=2)
                with pytest.raises(TpLag, match=r"keep \d+ bytes for ranks behind \(0 of them this group's\).* one "
                                   r"budget for all of that uid's TP engines") as ei:
                    o0.topk(0, 0, topk[0], state_rows=rows)
                assert "rank 1" not in str(ei.value)
                c1.topk(0, 0, topk[0], state_rows=rows)  # rank 1 reaches it: the bytes go
                for c in (o0, o1):
                    c.topk(0, 0, topk[0], state_rows=rows)
            c0.topk(0, 0, topk[1], state_rows=rows)


def test_a_refused_topk_that_carries_its_step_runs_neither(tmp_path):
    # A client cannot tell which half of a TOPK carrying its STEP was refused: neither runs,
    # and the rank sends both again (a STEP run twice would put the group out of step for good).
    reqs = requests_of(4, steps=3)
    with PrivateDaemon(pool_bytes=16 << 20, backend="cpu", extra_args=["--tp-max-lag", "5"],
                       log_path=str(tmp_path / "d.log")) as d:
        with Client(d.run_dir, rank=0) as c0, Client(d.run_dir, rank=1) as c1:
            atts = [c.attach(lay(), engine="tp", tp_size=2) for c in (c0, c1)]
            helpers.fill(c0, lay())
            for req in reqs[:4]:  # step 0 and its three batches
                send(c0, req)
            send(c0, reqs[4])  # step 1 rides on its group 0 batch: the batch would be the sixth kept
            with pytest.raises(TpLag, match=r"rank 0 is 4 requests ahead of rank 1 of its TP group \(this TOPK and "
                               r"the STEP it carries would add 2\)"):
                send(c0, reqs[5])
            assert helpers.stats_json(d.run_dir)["per_engine"]["tp"]["tp_lag"] == 4
            send(c1, reqs[0])  # rank 1's batch differs from rank 0's: neither its STEP nor it runs
            wrong = list(reqs[1])
            wrong[3] = np.where(wrong[3] >= 0, (wrong[3] + 1) % HOST_ROWS, -1).astype(np.int32)
            with pytest.raises(TpMismatch, match="top-k row 0 differs"):
                send(c1, tuple(wrong))
            assert helpers.stats_json(d.run_dir)["per_engine"]["tp"]["tp_lag"] == 4
            got = {0: [], 1: []}
            for r, part in ((1, reqs[:4]), (0, reqs[4:8]), (1, reqs[4:]), (0, reqs[8:])):  # refused STEPs sent again
                for req in part:
                    res = send((c0, c1)[r], req)
                    if res is not None:
                        assert check_rows(atts[r], req, res) == 0
                        got[r].append(np.array(res.slots))
            for a, b in zip(got[0], got[1][3:]):
                np.testing.assert_array_equal(a, b)


def test_a_topk_refused_by_its_resolve_runs_neither_its_step(daemon):
    reqs = requests_of(5, steps=1)
    with Client(daemon.run_dir, rank=0) as c0, Client(daemon.run_dir, rank=1) as c1:
        atts = [c.attach(lay(), engine="tp", tp_size=2) for c in (c0, c1)]
        helpers.fill(c0, lay())
        send(c0, reqs[0])
        dup = reqs[1][3].copy()
        dup[0, 1] = dup[0, 0] = 7
        with pytest.raises(BadRequest, match="names the same host row twice"):
            c0.topk(0, 0, dup)
        for c, a in ((c0, atts[0]), (c1, atts[1])):  # each sends the STEP with the right batch
            for req in reqs[:2]:
                res = send(c, req)
            assert check_rows(a, reqs[1], res) == 0
        assert helpers.stats_json(daemon.run_dir)["per_engine"]["tp"]["tp_lag"] == 0


def test_the_entries_kept_for_a_rank_go_when_it_dies_and_the_group_with_its_last_rank():
    reqs = requests_of(6, steps=2)
    with helpers.serving_daemon(16 << 20, reap_interval_s=0.1) as d, Client(d.run_dir, rank=0) as c0:
        slow = helpers.RankProc(d.run_dir, 1)
        try:
            slow.call("connect")
            c0.attach(lay(), engine="tp", tp_size=2)
            slow.call("attach", layout=lay().to_wire(), engine="tp", tp_size=2)
            helpers.fill(c0, lay())
            for req in reqs:
                send(c0, req)
            group = d.engines.space("tp").tp
            assert group.lag() == len(reqs) and d.engines.tp_ledger.held
            slow.kill()
            helpers.wait_for(lambda: group.lag() == 0, what="the dead rank reaped")
            assert not d.engines.tp_ledger.held and not group.entries
        finally:
            slow.close()
        c0.detach()
        assert "tp" not in d.engines and not d.engines.tp_ledger.held


def test_a_lone_step_taken_before_its_refused_topk_is_not_taken_again(tmp_path):
    """``topk(..., state_rows=)`` sends the step's STEP alone first. Rank 0's STEP 1 takes
    the group's last place and its TOPK is refused (TpLag); the rank sends the step again
    as the client's docs say: the group, holding that STEP, takes nothing new, and both
    ranks go on in step. Seen (an adversarial review): the STEP was kept twice and the
    peer, sending the same requests, was refused TP_MISMATCH for good."""
    rows = np.array([0, 1, 2], np.int32)
    rng = np.random.default_rng(0)
    tk = [np.stack([rng.choice(HOST_ROWS, 4, replace=False) for _ in range(3)]).astype(np.int32) for _ in range(3)]
    with two_ranks(tmp_path, lay(), "--tp-max-lag", "3") as (d, c0, c1):
        c0.step(0, rows)
        c0.topk(0, 0, tk[0], state_rows=rows)
        c0.step(1, rows)
        with pytest.raises(TpLag):
            c0.topk(1, 0, tk[1], state_rows=rows)  # its STEP was taken, this TOPK refused
        c1.step(0, rows)
        c1.topk(0, 0, tk[0], state_rows=rows)
        c0.step(1, rows)  # sent again: the group has it already
        a = c0.topk(1, 0, tk[1], state_rows=rows)
        c1.step(1, rows)
        b = c1.topk(1, 0, tk[1], state_rows=rows)  # seen: TpMismatch (it sent the TOPK at the second STEP 1)
        np.testing.assert_array_equal(a.slots, b.slots)
        for c in (c0, c1):
            c.step(2, rows)
            c.topk(2, 0, tk[2], state_rows=rows)
        assert helpers.stats_json(d.run_dir)["per_engine"]["tp"]["tp_lag"] == 0


@pytest.mark.parametrize("who", ["leader", "follower"])
def test_a_taken_step_sent_again_under_its_retried_topk_is_not_taken_again(tmp_path, who):
    """As above, but the retry's STEP rides on its TOPK (``step()`` then ``topk()`` without
    state rows, after the lone STEP went with ``flush()``). The leader's TOPK is refused
    TpLag; the follower's, whose STEP matched its peer's, TP_MISMATCH (a wrong top-k): the
    retry with the right one goes through and the peers go on in step. Seen (an
    adversarial review): the riding STEP was taken again, a second STEP 1 for the leader
    (its peer refused for good), a STEP where the follower's TOPK was due (it refused for
    good)."""
    rows = np.array([0, 1, 2], np.int32)
    rng = np.random.default_rng(0)
    tk = [np.stack([rng.choice(HOST_ROWS, 4, replace=False) for _ in range(3)]).astype(np.int32) for _ in range(3)]
    lag = ("--tp-max-lag", "3") if who == "leader" else ()
    with two_ranks(tmp_path, lay(), *lag) as (d, c0, c1):
        first, second = (c0, c1) if who == "leader" else (c1, c0)
        if who == "follower":
            for t in range(2):
                c0.step(t, rows)
                c0.topk(t, 0, tk[t])
        first.step(0, rows)
        first.topk(0, 0, tk[0])
        first.step(1, rows)
        first.flush()  # the lone STEP 1, taken
        with pytest.raises(TpLag if who == "leader" else TpMismatch):
            first.topk(1, 0, tk[1] if who == "leader" else (tk[1] + 1) % HOST_ROWS)
        if who == "leader":
            second.step(0, rows)
            second.topk(0, 0, tk[0])
        first.step(1, rows)  # sent again: rides on the TOPK below
        a = first.topk(1, 0, tk[1])
        if who == "leader":
            second.step(1, rows)
            b = second.topk(1, 0, tk[1])
            np.testing.assert_array_equal(a.slots, b.slots)
        for c in (c0, c1):
            c.step(2, rows)
            c.topk(2, 0, tk[2])
        assert helpers.stats_json(d.run_dir)["per_engine"]["tp"]["tp_lag"] == 0


@pytest.mark.parametrize("max_lag", [4, 3])
def test_a_handle_ahead_of_its_peer_goes_on_in_step_after_tplag(tmp_path, max_lag):
    """Two HostSwapIn ranks; rank 0 runs ahead until TpLag. At tp_max_lag 4 its step's
    first top-k is refused (its STEP taken): the same swap_in again, once rank 1 caught
    up, goes through. At 3 its STEP is refused (raised by that swap_in, which ends the
    step): begin_step again sends that step with the same number. Either way both go on
    in step. Seen (an adversarial review): the refused STEP's number was used up, the
    handle sent step 2 where its peer sent step 1, and the group was jammed for good."""
    from sparsekv.client.swap_in import HostSwapIn

    two = helpers.layout(num_layers=2, row_bytes=16, top_k=4, region_stride=8, max_reqs=3, host_rows=64,
                         index_groups=((0,), (1,)), max_batch=8)
    table, reqs = np.arange(16).reshape(2, 8) % 16, np.array([0, 1])

    def pos(t):
        return np.array([[t % 30, (t + 3) % 30, (t + 7) % 30, (t + 11) % 30]] * 2)

    with two_ranks(tmp_path, two, "--tp-max-lag", str(max_lag)) as (d, c0, c1):
        h = [HostSwapIn(c0), HostSwapIn(c1)]

        def step(r, t, layers=(0, 1), begin=True):
            if begin:
                h[r].begin_step([0, 1])
            return [h[r].swap_in(reqs, table, pos(t), layer=layer, block_size=4) for layer in layers]

        step(0, 0)
        h[0].begin_step([0, 1])
        with pytest.raises(TpLag):
            h[0].swap_in(reqs, table, pos(1), layer=0, block_size=4)
        step(1, 0)
        if max_lag == 4:
            a = step(0, 1, begin=False)
        else:
            with pytest.raises(BadRequest, match="its step's first swap_in, failed"):
                h[0].swap_in(reqs, table, pos(1), layer=0, block_size=4)  # the step ended with its STEP
            a = step(0, 1)
        b = step(1, 1)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
        for r in (0, 1):
            step(r, 2)
        assert helpers.stats_json(d.run_dir)["per_engine"]["tp"]["tp_lag"] == 0


def test_an_earlier_steps_refusal_raised_by_a_later_step_keeps_that_steps_number(tmp_path):
    """Found by a review of the fix above: a step ended by finish_step without a top-k
    keeps its STEP unsent; the next step sends it alone, and its refusal is raised by that
    step's first swap_in. That step's own STEP was taken: its number is not given back
    (the next begin_step had sent step 2 twice), and the error names the step refused."""
    from sparsekv.client.swap_in import HostSwapIn

    two = helpers.layout(num_layers=2, row_bytes=16, top_k=4, region_stride=8, max_reqs=3, host_rows=64,
                         index_groups=((0,), (1,)), max_batch=8)
    table, reqs, pos = np.arange(16).reshape(2, 8) % 16, np.array([0, 1]), np.array([[0, 3, 7, 11]] * 2)
    with two_ranks(tmp_path, two) as (d, c0, c1):
        for c in (c0, c1):
            sent, real = [], c._step_as
            c._step_as = lambda drv, step, *a, _sent=sent, _real=real, **kw: _sent.append(step) or _real(drv, step, *a,
                                                                                                          **kw)
            h = HostSwapIn(c)
            h.begin_step([0, 1])
            for layer in (0, 1):
                h.swap_in(reqs, table, pos, layer=layer, block_size=4)
            h.begin_step([0, 7])  # step 1: state row 7 past max_reqs 3 (refused by the daemon), no top-k
            h.finish_step()
            h.begin_step([0, 1])  # step 2: step 1's STEP goes alone first
            with pytest.raises(BadRequest, match="BAD_STATE_ROW") as ei:
                h.swap_in(reqs, table, pos, layer=0, block_size=4)
            assert (ei.value.earlier, ei.value.earlier_step) == ("STEP", 1)
            h.finish_step()
            h.begin_step([0, 1])
            for layer in (0, 1):
                h.swap_in(reqs, table, pos, layer=layer, block_size=4)
            assert sent == [0, 1, 2, 3]
        assert helpers.stats_json(d.run_dir)["per_engine"]["tp"]["tp_lag"] == 0


def test_the_topk_of_a_refused_lone_step_is_refused_too(tmp_path):
    """Rank 0's lone STEP 1 (large invalidations) is refused by the bytes the group may keep
    for a slow rank; its TOPK, smaller, would fit: it must be refused too (the step runs
    all or nothing), and once the peer caught up both go through. Seen (an adversarial
    review): the TOPK ran without its STEP (its resets and invalidations skipped) and the
    peer, sending STEP 1 then TOPK 1, was refused TP_MISMATCH for good."""
    big = helpers.layout(num_layers=1, row_bytes=16, top_k=1024, region_stride=1024, max_reqs=64, host_rows=4096)
    rng = np.random.default_rng(0)
    rows = np.arange(48, dtype=np.int32)
    tk0 = np.stack([rng.permutation(4096)[:1024] for _ in range(48)]).astype(np.int32)
    r1 = np.array([0], np.int32)
    tk1 = rng.permutation(4096)[:1024].astype(np.int32)[None]
    inval = np.full((1, 80000), -1, np.int32)
    with two_ranks(tmp_path, big, "--tp-max-lag-bytes", "1MiB", engine="A", fill=False, pool=64 << 20) as (d, c0, c1):
        c0.step(0, rows)
        c0.topk(0, 0, tk0)
        c0.step(1, r1, invalidate=inval)
        with pytest.raises(TpLag):
            c0.topk(1, 0, tk1, state_rows=r1)
        assert helpers.stats_json(d.run_dir)["per_engine"]["A"]["tp_lag"] == 2  # seen: 3 (the TOPK ran)
        c1.step(0, rows)
        c1.topk(0, 0, tk0)
        got = []
        for c in (c0, c1):
            c.step(1, r1, invalidate=inval)
            got.append(c.topk(1, 0, tk1, state_rows=r1).slots)
        np.testing.assert_array_equal(got[0], got[1])


def test_a_batch_whose_entry_alone_exceeds_tp_max_lag_bytes_is_too_large_not_tp_lag(tmp_path):
    """With every rank in step, a top-k batch whose entry would keep more than
    tp_max_lag_bytes for the other ranks can never be kept: TOO_LARGE, naming the cap.
    Seen (an adversarial review): TP_LAG on every rank at lag 0, blaming a peer, for good."""
    big = helpers.layout(num_layers=1, row_bytes=16, top_k=1024, region_stride=1024, max_reqs=64, host_rows=4096)
    rng = np.random.default_rng(0)
    rows = np.arange(64, dtype=np.int32)
    tk = np.stack([rng.permutation(4096)[:1024] for _ in range(64)]).astype(np.int32)
    with two_ranks(tmp_path, big, "--tp-max-lag-bytes", "1MiB", engine="A", fill=False, pool=64 << 20) as (d, c0, c1):
        with pytest.raises(BadRequest, match="TOO_LARGE.*more than tp_max_lag_bytes"):
            c0.topk(0, 0, tk, state_rows=rows)
        c0.topk(0, 0, tk[:8], state_rows=rows[:8])  # a smaller batch goes


def test_a_tp_rank_has_one_step_driver_while_it_lives(tmp_path):
    """Found by an integrator's walkthrough: raw step() calls and a HostSwapIn on one rank
    of a TP group (or two handles) number their steps each on their own, and the group
    held an entry its peers never matched. The second driver is refused (a raw top-k too,
    from a review of the first fix); a closed handle gives way, and the next handle numbers
    on from the last step; a detached client is told it is not attached; a rank of no TP
    group keeps both (nothing to match)."""
    from sparsekv.client.swap_in import HostSwapIn

    ids = np.array([[1, 2, 3, 4]], np.int32)
    with two_ranks(tmp_path, lay(), fill=False) as (d, c0, c1):
        h0, h1 = HostSwapIn(c0), HostSwapIn(c1)
        for h in (h0, h1):
            h.begin_step([0], reset=[True])
        with pytest.raises(BadRequest, match="steps are sent by a handle; a rank of a TP group has one step driver"):
            c0.step(1, [0])
        with pytest.raises(BadRequest, match="sent by a handle"):
            c0.topk(0, 0, ids, state_rows=[0])  # a raw top-k of the handle's step: an entry the peer never sends
        with pytest.raises(BadRequest, match="sent by a handle"):
            HostSwapIn(c0)
        for h in (h0, h1):
            h.finish_step()
        h0.close()
        h0 = HostSwapIn(c0)  # a handle replaced on one rank: it numbers on from step 0
        for h in (h0, h1):
            h.begin_step([0])
            h.finish_step()
        h0.close()
        c0.step(2, [0])  # the raw calls take over once the handle is closed
        with pytest.raises(BadRequest, match="steps are sent by its raw step\\(\\) and topk\\(\\) calls"):
            HostSwapIn(c0)
        c0.detach()
        with pytest.raises(NotAttached):
            c0.topk(2, 0, ids)  # not attached: told so, not "a second driver"
        with pytest.raises(BadRequest, match="bad-name|engine must be"):
            c0.attach(lay(), engine="bad name\n")  # refused: no TP attachment is left behind either
        with pytest.raises(NotAttached):
            c0.topk(0, 0, ids)
    with PrivateDaemon(pool_bytes=16 << 20, backend="cpu", log_path=str(tmp_path / "d2.log")) as d:
        with Client(d.run_dir) as c:
            c.attach(lay(), engine="alone")
            c.step(0, [0])
            HostSwapIn(c).close()  # no TP group: not refused
