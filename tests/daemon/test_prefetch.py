"""Prefetch (DESIGN §4) through a daemon: after each index group's top-k, the rows are
fetched ahead into the next group's regions once the reply is out; the next group's
resolve finds them as hits, every row served is the pool's, and the counters say so. The
slot rules themselves are the contract tests' (tests/daemon/residency)."""

import os
import socket

import numpy as np

import helpers
from zmtp_peer import hello, raw_peer, read_reply, send_message
from sparsekv.client import Client
from sparsekv.daemon.cuda.buffers import prefetch_layers
from sparsekv.daemon.stats import render_table
from sparsekv.embedded.inproc import InprocClient
from sparsekv.proto import ErrorCode, MsgType, encode

GROUPS = ((0,), (1, 2), (3,))


def lay():
    return helpers.layout(num_layers=4, top_k=4, region_stride=8, max_reqs=2, host_rows=64, index_groups=GROUPS)


def drive(c, att, steps):
    """Run ``steps`` (per step: [group] -> topk [2, 4]); return the misses per (step,
    group) and the wrong rows served (0 when every hot row is the pool's)."""
    misses, bad = [], 0
    for t, per_group in enumerate(steps):
        c.step(t, [0, 1])
        for g, topk in enumerate(per_group):
            res = c.topk(t, g, topk)
            misses.append(int(res.misses.sum()))
            bad += helpers.bad_rows(att.slab, GROUPS[g], [0, 1], topk, res.slots, 64)
    return misses, bad


def steps_of(seed: int, n: int = 4):
    """Each step's top-k, every group's the same rows but one (the next group's guess is
    mostly right), new rows each step."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        base = np.stack([rng.choice(64, 4, replace=False) for _ in range(2)]).astype(np.int32)
        groups = []
        for _ in GROUPS:
            t = base.copy()
            t[:, -1] = rng.choice(np.setdiff1d(np.arange(64), base), 2)
            groups.append(t)
        out.append(groups)
    return out


def test_the_next_groups_rows_arrive_ahead_and_are_the_pools(daemon):
    steps = steps_of(1)
    with Client(daemon.run_dir, name="pf") as c:
        att = c.attach(lay(), engine="pf", prefetch=True)
        helpers.fill(c, lay())
        misses, bad = drive(c, att, steps)
        s = c.stats()
    assert bad == 0
    # group 0 misses what it did not hold; groups 1 and 2 miss only their one row of each
    # request that group 0 did not pick (3 of 4 were fetched ahead)
    assert misses[1] == 2 and misses[2] == 2
    assert s["prefetched"] > 0 and s["prefetch_hits"] >= 12  # steps x 2 groups x 2 requests x 3 rows at least
    assert s["prefetch_hits"] + s["prefetch_wasted"] <= s["prefetched"]
    with Client(daemon.run_dir, name="plain") as c:  # the same steps without prefetch miss more
        att = c.attach(lay(), engine="plain")
        helpers.fill(c, lay())
        plain, bad = drive(c, att, steps)
    assert bad == 0 and sum(plain) > sum(misses)


def test_the_daemon_and_the_in_process_engine_prefetch_alike(daemon):
    steps = steps_of(2, 6)
    with Client(daemon.run_dir, name="pf") as c:
        att = c.attach(lay(), engine="pf", prefetch=True)
        helpers.fill(c, lay())
        got = drive(c, att, steps)
    with InprocClient() as c:
        att = c.attach(lay(), prefetch=True)
        helpers.fill(c, lay())
        want = drive(c, att, steps)
    misses, bad = got
    assert (misses, bad) == want and bad == 0


def test_prefetch_must_be_a_boolean(tmp_path):
    with helpers.inproc_daemon(tmp_path) as d:
        helpers.request(d, b"a", MsgType.HELLO, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": ""})
        h, _ = helpers.request(d, b"a", MsgType.ATTACH, {"engine": "e", "layout": lay().to_wire(), "prefetch": 1})
    assert not h["ok"] and h["code"] == ErrorCode.BAD_ARGUMENT and "prefetch must be true or false" in h["msg"]


def test_the_stats_table_shows_prefetch_once_it_ran(daemon):
    with Client(daemon.run_dir, name="pf") as c:
        assert "prefetched" not in render_table(c.stats())
        att = c.attach(lay(), engine="pf", prefetch=True)
        helpers.fill(c, lay())
        drive(c, att, steps_of(3, 2))
        s = c.stats()
    line = next(x for x in render_table(s).splitlines() if x.startswith("prefetched"))
    assert f"{s['prefetched']} rows: {s['prefetch_hits']} hit, {s['prefetch_wasted']} lost unused" in line



def test_a_later_tokens_prefetch_into_a_slot_an_earlier_token_just_took_copies_its_own_row(daemon):
    """Two tokens of one request: the first's prefetch takes both slots outside the latest
    resolve's, the second's retakes slot 0 for row 1. Slot 0 must hold row 1's bytes (a
    plan sorted by host row once copied row 2 over it), and row 2 counts as prefetched
    and wasted."""
    lay2 = helpers.layout(num_layers=2, top_k=2, region_stride=4, max_reqs=1, host_rows=8, max_batch=2,
                          index_groups=((0,), (1,)))
    with Client(daemon.run_dir, name="pf") as c:
        att = c.attach(lay2, engine="tokens", prefetch=True)
        helpers.fill(c, lay2)
        c.step(0, [0, 0])
        c.topk(0, 0, np.array([[2, 0], [1, -1]], np.int32))
        nxt = np.array([[1, -1], [0, -1]], np.int32)
        res = c.topk(0, 1, nxt)
        bad = helpers.bad_rows(att.slab, (1,), [0, 0], nxt, res.slots, 8)
        s = c.stats()
    assert res.misses.tolist() == [0, 0] and res.slots[:, 0].tolist() == [0, 1]
    assert bad == 0
    assert (s["prefetched"], s["prefetch_hits"], s["prefetch_wasted"]) == (3, 2, 1)


def test_no_prefetch_into_a_group_the_step_already_resolved():
    """Index groups need not follow layer order: here layer 0 is group 1's, so an engine
    running its layers in order sends group 1 first (two tokens of one request filling its
    4 slots), then group 0. A prefetch into group 1 then could keep only the second
    token's slots (the latest resolve's) and would overwrite the first token's, which the
    engine was told about this step. It does not run; the next step's group 0 prefetches
    again."""
    lay2 = helpers.layout(num_layers=2, top_k=2, region_stride=4, max_reqs=1, host_rows=64, max_batch=2,
                          index_groups=((1,), (0,)))
    with InprocClient() as c:
        att = c.attach(lay2, prefetch=True)
        helpers.fill(c, lay2)
        c.step(0, [0, 0])
        named = np.array([[1, 2], [3, 4]], np.int32)
        res = c.topk(0, 1, named)  # layer 0
        c.topk(0, 0, np.array([[10, 11], [12, 13]], np.int32))  # layer 1
        assert helpers.bad_rows(att.slab, (0,), [0, 0], named, res.slots, 64) == 0
        c.step(1, [0])
        c.topk(1, 0, np.array([[20, 21]], np.int32))
        assert c.topk(1, 1, np.array([[20, 21]], np.int32)).misses.tolist() == [0]


def test_no_prefetch_runs_for_a_rank_whose_connection_failed_on_the_reply():
    """A client sends its TOPK and stops reading: the reply's send fails (EPIPE), the
    connection and its rank go at once, and the prefetch the TOPK left must go with them
    (it copied rows into the slab of a rank already released and counted them)."""
    lay2 = helpers.layout(num_layers=2, top_k=4, region_stride=8, max_reqs=2, host_rows=64, index_groups=((0,), (1,)))
    with helpers.serving_daemon() as d:
        s = raw_peer(os.path.join(d.run_dir, "control.sock"))
        assert hello(s)["ok"]
        send_message(s, *encode(MsgType.ATTACH, 2, {"engine": "gone", "layout": lay2.to_wire(), "prefetch": True}))
        assert read_reply(s)["ok"]
        send_message(s, *encode(MsgType.STEP, 3, {"step": 0}, {"state_rows": np.array([0], np.int32)}))
        assert read_reply(s)["ok"]
        s.shutdown(socket.SHUT_RD)  # the daemon's next send fails (EPIPE): it drops the connection
        send_message(s, *encode(MsgType.TOPK, 4, {"step": 0, "group": 0}, {"topk": np.array([[1, 2, 3, 4]], np.int32)}))
        helpers.wait_for(lambda: d.stats.c["topk_batches"] == 1 and not d.sessions, what="the TOPK and the drop")
        s.close()
        assert d.stats.c["prefetched"] == 0 and d.stats.c["bytes_moved"] == 4 * lay2.row_bytes


def test_prefetched_rows_a_write_or_a_reset_drops_count_as_wasted_at_once(daemon):
    """The counters say what happened when it happened: a WRITE of prefetched rows, or a
    STEP resetting their request, wastes them before the next TOPK (the stats read then
    showed nothing; a rank that detached next never reported them)."""
    with Client(daemon.run_dir, name="pf") as c:
        c.attach(lay(), engine="waste", prefetch=True)
        helpers.fill(c, lay())
        c.step(0, [0, 1])
        c.topk(0, 0, np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int32))  # 8 rows fetched into group 1
        before = c.stats()
        c.write(np.array([1, 2], np.int32), np.zeros((4, 2, lay().row_bytes), np.uint8))
        after_write = c.stats()
        c.step(1, [0, 1], reset=np.array([False, True]))
        after_reset = c.stats()
    assert before["prefetched"] == 8 and before["prefetch_wasted"] == 0
    assert after_write["prefetch_wasted"] == 2  # rows 1 and 2 in group 1's region of request 0
    assert after_reset["prefetch_wasted"] == 6  # and request 1's four


def test_attach_hands_prefetch_to_the_backend_that_makes_the_rank_whatever_its_name(tmp_path, monkeypatch):
    """The backend builds a prefetching rank (the cuda one: its residency with the marks,
    its buffers with the prefetch plan), so it gets ``prefetch`` with the rank's other
    arguments; an ATTACH without it passes nothing new."""
    with helpers.inproc_daemon(tmp_path) as d:
        backend = d.engine_requests.backend
        monkeypatch.setattr(backend, "name", "cuda")  # no backend is refused by its name
        seen, new_rank = [], backend.new_rank

        def recording(*a, **kw):
            seen.append(kw)
            return new_rank(*a, **kw)

        monkeypatch.setattr(backend, "new_rank", recording)
        for ident, engine, extra in ((b"a", "e", {"prefetch": True}), (b"b", "f", {})):
            helpers.request(d, ident, MsgType.HELLO, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": ""})
            h, _ = helpers.request(d, ident, MsgType.ATTACH, {"engine": engine, "layout": lay().to_wire(), **extra})
            assert h["ok"], h
        assert seen == [{"prefetch": True}, {}]
        assert [st.prefetch for name in ("e", "f") for st in d.engines.space(name).ranks.values()] == [True, False]


def test_the_cuda_prefetch_gathers_into_the_next_groups_layers():
    """The prefetch's gather takes its row of the group table from group g's own top-k
    block: row g of ``prefetch_layers`` names group g + 1's layers, the last row none."""
    table = prefetch_layers(lay())  # groups (0,), (1, 2), (3,)
    assert table.tolist() == [[2, 1, 2], [1, 3, -1], [0, -1, -1]]


def test_two_ranks_of_one_engine_one_with_prefetch_each_serve_the_pools_rows(daemon):
    """Each rank prefetches (or not) into its own slab; a write through one drops the
    prefetched copies of both; neither serves a wrong row."""
    steps = steps_of(4, 4)
    with Client(daemon.run_dir, name="r0") as a, Client(daemon.run_dir, name="r1") as b:
        att_a = a.attach(lay(), engine="tp", prefetch=True)
        att_b = b.attach(lay(), engine="tp")
        helpers.fill(a, lay())
        bad, gen = 0, np.zeros(64, np.int64)
        for t, per_group in enumerate(steps):
            if t == 2:  # rewrite rows both ranks hold (group 0 of step 1 prefetched them into rank 0's group 1)
                rows = steps[1][0][0]
                gen[rows] = 1
                b.write(rows, np.stack([helpers.gen_pattern(layer, rows, lay().row_bytes, gen) for layer in range(4)]))
            for c, att in ((a, att_a), (b, att_b)):
                c.step(t, [0, 1])
                for g, topk in enumerate(per_group):
                    res = c.topk(t, g, topk)
                    bad += helpers.bad_rows(att.slab, GROUPS[g], [0, 1], topk, res.slots, 64, gen)
        s = a.stats()
    assert bad == 0 and s["prefetched"] > 0
