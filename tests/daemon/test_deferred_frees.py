"""The cuda backend's held frees (daemon/cuda/deferred.py): without a GPU, the rule alone.
A free runs at once while no doorbell stream may be parked, waits while one may, and the
waiting ones run, all of them, once none may be; the bytes waiting are counted per GPU.
The GPU side (a detach beside a parked doorbell rank returns) is in
tests/client/test_doorbell.py."""

from __future__ import annotations

import logging

from sparsekv.daemon.cuda.deferred import DeferredFrees, free_now


def test_a_free_runs_at_once_when_no_doorbell_stream_may_be_parked():
    ran = []
    d = DeferredFrees(lambda: False)
    d.free(0, "blocks", 4096, lambda: ran.append("blocks"))
    assert ran == ["blocks"] and d.held_count() == 0 and d.held_bytes() == 0


def test_frees_wait_while_a_stream_may_be_parked_and_all_run_once_none_may():
    parked = [True]
    ran = []
    d = DeferredFrees(lambda: parked[0])
    d.free_for(0)("host blocks", 4096, lambda: ran.append("a"))
    d.free_for(1)("engine slab", 1 << 20, lambda: ran.append("b"))
    d.free(None, "pool range", 8192, lambda: ran.append("c"))
    assert ran == []
    assert (d.held_count(0), d.held_bytes(0)) == (1, 4096)
    assert (d.held_count(1), d.held_bytes(1)) == (1, 1 << 20)
    assert (d.held_count(), d.held_bytes()) == (3, 4096 + (1 << 20) + 8192)
    d.flush()  # still parked: nothing runs
    assert ran == [] and d.held_count() == 3
    parked[0] = False
    d.flush()
    assert ran == ["a", "b", "c"] and d.held_count() == 0 and d.held_bytes() == 0
    d.flush()  # each ran once
    assert ran == ["a", "b", "c"]


def test_a_failing_free_is_logged_and_the_others_still_run(caplog):
    parked = [True]
    ran = []
    d = DeferredFrees(lambda: parked[0])

    def bad():
        raise RuntimeError("cudaHostUnregister: invalid argument")

    d.free(0, "first", 1, lambda: ran.append(1))
    d.free(0, "broken", 1, bad)
    d.free(0, "last", 1, lambda: ran.append(3))
    parked[0] = False
    with caplog.at_level(logging.ERROR, logger="sparsekv.cuda"):
        d.close()
    assert ran == [1, 3] and d.held_count() == 0
    assert any("broken" in r.getMessage() and "invalid argument" in r.getMessage() for r in caplog.records)


def test_free_now_runs_the_free():
    ran = []
    free_now("x", 1, lambda: ran.append(1))
    assert ran == [1]


def test_a_spare_is_closed_at_once_when_nothing_may_be_parked():
    closed = []
    d = DeferredFrees(lambda: False)
    d.keep_spare(("uid", 0, 4096), 0, 4096, "blocks", lambda: closed.append("blocks"))
    assert closed == ["blocks"] and d.reuse(("uid", 0, 4096)) is None


def test_spares_wait_for_their_key_count_as_held_and_are_closed_by_the_flush():
    parked = [True]
    closed = []
    d = DeferredFrees(lambda: parked[0])
    d.keep_spare((1000, 0, 4096), 0, 4096, "a", lambda: closed.append("a"))
    d.keep_spare((1000, 0, 4096), 0, 4096, "b", lambda: closed.append("b"))
    d.keep_spare((1001, 0, 4096), 0, 4096, "other uid", lambda: closed.append("other uid"))
    assert (d.held_count(0), d.held_bytes(0)) == (3, 3 * 4096)
    assert d.reuse((1000, 1, 4096)) is None  # another GPU
    assert d.reuse((1000, 0, 8192)) is None  # another size
    got = {d.reuse((1000, 0, 4096)), d.reuse((1000, 0, 4096))}
    assert got == {"a", "b"} and d.reuse((1000, 0, 4096)) is None
    assert d.held_count() == 1 and closed == []  # taken spares are the new rank's, not closed
    parked[0] = False
    d.flush()
    assert closed == ["other uid"] and d.held_count() == 0
