"""Timestamps in headers, against a real cpu daemon: every request carries the client's
send time ``ts``, every reply the daemon's receive and reply times ``tr`` / ``tx``, and
``Client.timings`` keeps, per request type, the last reply's four times in order
(one host clock, so ts <= tr <= tx <= received). They never reach a method's result."""

import time

import numpy as np

import helpers
from sparsekv.client import Client
from sparsekv.proto import MsgType

LAYOUT = helpers.layout(num_layers=2, row_bytes=32, top_k=4, region_stride=8, max_reqs=2, host_rows=64)


def test_step_and_topk_times_are_ordered_client_daemon_client(module_daemon):
    with Client(module_daemon.run_dir, rank=0, timeout_s=10) as c:
        c.attach(LAYOUT, engine="t")
        assert set(c.timings) == {MsgType.HELLO, MsgType.ATTACH}
        before = time.perf_counter_ns()
        c.step(0, [0, 1])
        r = c.topk(0, 0, np.array([[0, 1, 2, 3], [4, 5, 6, -1]], np.int32))
        after = time.perf_counter_ns()
        assert r.hits == 0  # the result is untouched by the timing fields
        # The STEP rode on the TOPK (one message): no STEP reply of its own.
        assert MsgType.STEP not in c.timings
        c.step(1, [0, 1])
        c.flush()  # a STEP with no TOPK after it goes alone
        for t in (MsgType.STEP, MsgType.TOPK):
            ts, tr, tx, recv = c.timings[t]
            assert all(isinstance(x, int) for x in (ts, tr, tx, recv))
            assert before <= ts <= tr <= tx <= recv <= time.perf_counter_ns(), (t.name, ts, tr, tx, recv)
        assert c.timings[MsgType.TOPK][3] <= c.timings[MsgType.STEP][0]  # the flushed STEP went after
        assert c.timings[MsgType.TOPK][3] <= after
        first = c.timings[MsgType.TOPK]
        c.topk(1, 1, np.array([[0, 1, 2, 3], [4, 5, 6, -1]], np.int32))
        assert c.timings[MsgType.TOPK][0] > first[0]  # the last reply of the type
        assert not c._sent  # every request's entry went with its reply


def test_timing_fields_are_not_part_of_a_reply_s_fields(module_daemon):
    with Client(module_daemon.run_dir, rank=0, timeout_s=10) as c:
        c.attach(LAYOUT, engine="t")
        out = c.write([1, 2], np.zeros((2, 2, 32), np.uint8))
        assert set(out) == {"bytes", "invalidated"}
        assert not {"tr", "tx", "ts"} & set(c.stats())
        assert {"ts", "tr", "tx"}.isdisjoint(c.info)
        assert MsgType.WRITE in c.timings and MsgType.STATS in c.timings
