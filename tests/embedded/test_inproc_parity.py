"""Where the in-process client behaved otherwise than the daemon's (found by an adversarial
review): a layout past max_slab_bytes taken (allocated, gigabytes), a refused top-k that
left its step applied, a slab still there after detach, calls after close. Each side by
side with the daemon client on the same calls."""

import contextlib

import numpy as np
import psutil
import pytest

import helpers
from sparsekv.client import BadRequest, Client, NotAttached, SparseKVError
from sparsekv.embedded.inproc import InprocClient
from sparsekv.proto import ErrorCode, Layout

LAYOUT = helpers.layout(num_layers=2, row_bytes=32, top_k=4, region_stride=8, max_reqs=2, host_rows=64)


@contextlib.contextmanager
def both():
    """An in-process client and a daemon client (of a daemon served from this process), each
    attached to LAYOUT, the pool written."""
    with helpers.serving_daemon() as d:
        with InprocClient() as x, Client(d.run_dir, timeout_s=10) as c:
            for cl in (x, c):
                cl.attach(LAYOUT, engine=f"parity-{id(cl)}")
                helpers.fill(cl, LAYOUT)
            yield x, c


def hot_then_reset(cl) -> None:
    """Rows 1-4 made hot for request 0 at step 0, then step 1 (held) resetting request 0."""
    cl.step(0, [0])
    cl.topk(0, 0, [[1, 2, 3, 4]])
    cl.step(1, [0], reset=[True])


def test_a_layout_past_max_slab_bytes_is_refused_before_anything_is_allocated():
    """20 GiB of slab and state: TOO_LARGE at once, as the daemon's attach (it took 15 s and
    4 GiB of RSS before); the setting can be lowered as the daemon's."""
    big = Layout(num_layers=64, row_bytes=32, top_k=2048, region_stride=32768, max_reqs=256, host_rows=4096).validate()
    rss = psutil.Process().memory_info().rss
    with InprocClient() as x:
        with pytest.raises(BadRequest, match="max_slab_bytes") as ei:
            x.attach(big)
        assert ei.value.code == ErrorCode.TOO_LARGE
    assert psutil.Process().memory_info().rss - rss < 256 << 20
    with InprocClient(max_slab_bytes=1024) as x:
        with pytest.raises(BadRequest, match="max_slab_bytes") as ei:
            x.attach(LAYOUT)
        assert ei.value.code == ErrorCode.TOO_LARGE
        with pytest.raises(NotAttached):  # nothing was attached
            x.step(0, [0])
    with pytest.raises(ValueError, match="max_slab_bytes"):
        InprocClient(max_slab_bytes=0)


def test_a_refused_top_k_runs_neither_half_of_its_step():
    """Step 1 resets request 0 and its top-k is refused (a row named twice): on both paths
    the reset did not happen, a retry of the top-k without its step is refused, and a later
    step serves request 0's rows as hits."""
    got = []
    with both() as clients:
        for cl in clients:
            hot_then_reset(cl)
            with pytest.raises(BadRequest) as ei:
                cl.topk(1, 0, [[5, 5, 6, 7]])
            assert ei.value.code == ErrorCode.DUPLICATE_IDS
            with pytest.raises(BadRequest, match="the last STEP was 0"):
                cl.topk(1, 0, [[1, 2, 3, 4]])
            cl.step(2, [0])
            r = cl.topk(2, 0, [[1, 2, 3, 4]])
            got.append((r.slots.tolist(), r.misses.tolist()))
    assert got[0] == got[1] and got[0][1] == [0]  # no reset: every row still hot


def test_a_step_held_runs_before_any_other_request():
    """A write after a step runs the step first (as the client sends it alone): the step's
    reset is applied, counted once, on both paths."""
    got = []
    with both() as clients:
        for cl in clients:
            hot_then_reset(cl)
            cl.write(np.array([9], np.int32), np.zeros((2, 1, 32), np.uint8))
            got.append(cl.topk(1, 0, [[1, 2, 3, 4]]).misses.tolist())
        assert clients[0].stats()["steps"] == 2
    assert got == [[4], [4]]


def test_after_detach_the_slab_is_gone_and_after_close_every_call_raises():
    x = InprocClient()
    att = x.attach(LAYOUT)
    x.detach()
    assert att.slab is None and att.staging is None
    x.close()
    for call in (lambda: x.attach(LAYOUT), x.stats, lambda: x.step(0, [0]), lambda: x.topk(0, 0, [[1, 2, 3, 4]])):
        with pytest.raises(SparseKVError) as ei:
            call()
        assert ei.value.code == ErrorCode.NOT_HELLO
    x.connect()
    x.attach(LAYOUT)
    x.step(0, [0])
    assert x.topk(0, 0, [[1, 2, 3, 4]]).misses.tolist() == [4]
    x.close()


def test_flush_and_detach_run_a_step_held():
    """As the daemon client's: flush() runs the step held, detach() too (each counted)."""
    with InprocClient() as x:
        x.attach(LAYOUT)
        x.step(0, [0])
        x.flush()
        assert x._pending_step is None
        x.step(1, [0])
        x.detach()
        assert x.stats()["steps"] == 2
