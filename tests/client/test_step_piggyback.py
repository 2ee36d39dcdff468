"""A STEP rides on its step's first TOPK (one message); alone only when no TOPK follows."""

import contextlib
import time

import numpy as np
import pytest

import helpers
from sparsekv.client import BadRequest, Client, NotAttached, SparseKVError
from sparsekv.proto import ErrorCode, MsgType

LAYOUT = helpers.layout(num_layers=1, row_bytes=32, top_k=4, region_stride=8, max_reqs=2, host_rows=64)
IDS = np.array([[0, 1, 2, 3]], np.int32)


def test_step_rides_on_topk_and_its_error_comes_back_there(module_daemon):
    with Client(module_daemon.run_dir, timeout_s=10) as c:
        c.attach(LAYOUT, engine="p")
        before = c.stats()["requests"]
        c.step(0, [0], reset=[True])
        r = c.topk(0, 0, IDS)
        assert int(r.misses[0]) == 4
        assert c.stats()["requests"] - before == 2  # the TOPK (with its STEP) and this STATS
        c.step(1, [0])
        assert int(c.topk(1, 0, IDS).misses[0]) == 0  # the state carried over
        c.step(2, [7])  # a bad state row: the TOPK carrying it fails with its code
        with pytest.raises(BadRequest, match="BAD_STATE_ROW"):
            c.topk(2, 0, IDS)


def test_reset_on_a_topk_that_begins_no_step_is_refused(module_daemon):
    with Client(module_daemon.run_dir, timeout_s=10) as c:
        c.attach(LAYOUT, engine="p")
        c.step(0, [0])
        c.flush()  # alone
        assert MsgType.STEP in c.timings
        with pytest.raises(BadRequest, match="reset and invalidate"):
            c._call(MsgType.TOPK, {"step": 0, "group": 0}, {"topk": IDS, "reset": np.array([True])})


def test_a_topk_refused_by_its_resolve_runs_neither_its_step(module_daemon):
    # The client cannot tell which half was refused: neither ran, and step() goes again.
    with Client(module_daemon.run_dir, timeout_s=10) as c:
        c.attach(LAYOUT, engine="p")
        c.step(0, [0], reset=[True])
        assert int(c.topk(0, 0, IDS).misses[0]) == 4
        c.step(1, [0], reset=[True])  # would empty the region, but its TOPK names a row twice
        with pytest.raises(BadRequest, match="DUPLICATE_IDS"):
            c.topk(1, 0, np.array([[0, 0, 1, 2]], np.int32))
        c.step(1, [0])
        assert int(c.topk(1, 0, IDS).misses[0]) == 0  # the reset did not run: the rows are still there


def test_a_detach_that_raises_an_earlier_steps_error_still_detaches_the_client(module_daemon):
    """Found by a review of the client: the DETACH ran, but the deferred error of a STEP
    sent alone was raised in place of its reply, and the client kept its slab mapped and
    its blocks handle alive while the daemon had detached the rank."""
    with Client(module_daemon.run_dir, timeout_s=10) as c:
        c.attach(LAYOUT, engine="p-detach", block_size=4)
        blocks = c.blocks
        c.step(0, [0, 5])  # a bad state row (max_reqs 2) ...
        c.step(1, [0])  # ... sent alone, not waited for
        with pytest.raises(BadRequest, match="BAD_STATE_ROW"):
            c.detach()
        assert c.attachment is None and c._blocks is None and c.stats()["attached"] == 0
        with pytest.raises(NotAttached):
            blocks.alloc(1)  # the handle ended here, not at the daemon
        c.attach(LAYOUT, engine="p-detach")  # and attaches again
        c.step(0, [0])
        assert int(c.topk(0, 0, IDS).misses[0]) == 4


def test_a_request_made_before_close_fails_at_once_after_connect(module_daemon):
    """Found by a review of the client: its wait blocked for timeout_s after a reconnect
    (the new connection never answers the old one's request), then said the daemon was gone."""
    c = Client(module_daemon.run_dir, timeout_s=30).connect()
    try:
        c.attach(LAYOUT, engine="p-stale")
        c.step(0, [0])
        p = c.submit_topk(0, 0, IDS)
        c.close()
        c.connect()
        t0 = time.monotonic()
        with pytest.raises(SparseKVError, match="earlier connection") as e:
            p.wait()
        assert e.value.code == ErrorCode.NOT_HELLO  # the client's misuse, not "the daemon hit a bug"
        assert time.monotonic() - t0 < 5
        c.attach(LAYOUT, engine="p-stale")  # the client works on
        c.step(0, [0])
        c.topk(0, 0, IDS)
    finally:
        c.close()


def test_a_request_after_a_refused_step_sent_alone_raises_its_refusal_and_is_not_run(module_daemon):
    """Found by an integrator's review: a STEP sent alone (a WRITE or a block request came
    before its TOPK) was not waited for; the next request ran, then raised the STEP's
    refusal as its own: a WRITE that raised had written, an ALLOC that raised held blocks
    the caller never saw. Now that request waits for the STEP's reply first."""
    with Client(module_daemon.run_dir, timeout_s=10) as c:
        att = c.attach(LAYOUT, engine="p-alone")
        c.write([0], np.full((1, 1, 32), 1, np.uint8))
        c.step(0, [7])  # a bad state row (max_reqs 2)
        with pytest.raises(BadRequest, match="BAD_STATE_ROW"):
            c.write([0], np.full((1, 1, 32), 2, np.uint8))
        c.step(1, [0], reset=[True])
        r = c.topk(1, 0, np.array([[0, -1, -1, -1]], np.int32))
        assert (att.slab[0, 0, r.slots[0, 0]] == 1).all()  # the WRITE did not run
        # a good STEP sent alone: the WRITE after it runs, and the step's TOPK still works
        c.step(2, [0])
        c.write([1], np.full((1, 1, 32), 3, np.uint8))
        r = c.topk(2, 0, np.array([[1, -1, -1, -1]], np.int32))
        assert (att.slab[0, 0, r.slots[0, 0]] == 3).all()
    with Client(module_daemon.run_dir, timeout_s=10) as c:
        c.attach(LAYOUT, engine="p-alone-blocks", block_size=4)
        c.step(0, [7])
        with pytest.raises(BadRequest, match="BAD_STATE_ROW"):
            c.blocks.alloc(2)
        assert c.blocks.reserve(0)["private"] == 0  # the ALLOC did not run


@pytest.mark.parametrize("topk_kw", [{"step": 1}, {"step": 0, "state_rows": [0]}])
def test_a_request_after_a_topk_that_sent_a_refused_step_alone_is_not_run(module_daemon, topk_kw):
    """Found by a review of the fix above: a TOPK that does not carry the STEP (another
    step, or state rows of its own, as HostSwapIn sends) sent it alone, and the WRITE or
    ALLOC after the TOPK ran and raised the STEP's refusal."""
    with Client(module_daemon.run_dir, timeout_s=10) as c:
        att = c.attach(LAYOUT, engine="p-alone-topk", block_size=4)
        c.step(0, [7])  # a bad state row
        pending = c.submit_topk(group=0, topk=IDS, **topk_kw)  # not waited for
        with pytest.raises(BadRequest, match="BAD_STATE_ROW"):
            c.blocks.alloc(2)
        with contextlib.suppress(BadRequest):  # (its own answer: refused for another step, served for its rows)
            pending.wait()
        assert c.blocks.reserve(0)["private"] == 0  # the ALLOC did not run
        c.step(2, [0], reset=[True])
        assert int(c.topk(2, 0, IDS).misses[0]) == 4
        new = c.blocks.alloc(1)
        rows = c.blocks.rows(new)[:1]
        c.write(rows, np.full((1, 1, 32), 5, np.uint8))
        c.step(3, [7])
        pending = c.submit_topk(group=0, topk=IDS, **{**topk_kw, "step": topk_kw["step"] + 3})
        with pytest.raises(BadRequest, match="BAD_STATE_ROW"):
            c.write(rows, np.full((1, 1, 32), 6, np.uint8))
        with contextlib.suppress(BadRequest):
            pending.wait()
        c.step(5, [0])
        r = c.topk(5, 0, np.array([[int(rows[0]), -1, -1, -1]], np.int32))
        assert (att.slab[0, 0, r.slots[0, 0]] == 5).all()  # the second WRITE did not run
