"""A STEP rides on its step's first TOPK (one message); alone only when no TOPK follows."""

import numpy as np
import pytest

import helpers
from sparsekv.client import BadRequest, Client
from sparsekv.proto import MsgType

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
