"""The write path for rows a rank produced itself: staging buffer -> host pool, hot copies
dropped in every rank. Same results in process and through a real daemon."""

import numpy as np
import pytest

from sparsekv.client import BadRequest, Client
from sparsekv.embedded.inproc import InprocClient
from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.bench.verify import fill_pool, pattern
from sparsekv.proto import ErrorCode, Layout

LAY = Layout(num_layers=3, row_bytes=32, top_k=4, region_stride=8, max_reqs=2, host_rows=64,
             index_groups=((0, 1), (2,)), staging_rows=8)


def check(c):
    att = c.attach(LAY)
    fill_pool(c, LAY)
    ids = [[1, 2, 3, 4]]
    c.step(0, [0])
    first = [c.topk(0, g, ids) for g in (0, 1)]
    assert all(int(r.misses[0]) == 4 for r in first)
    new = {layer: pattern(layer + 50, np.array([2, 3]), LAY.row_bytes) for layer in (1, 2)}
    for layer in (1, 2):
        att.staging[layer, :2] = new[layer]
    out = c.write_staged([2, 3], layers=[1, 2])
    assert out["bytes"] == 2 * 2 * LAY.row_bytes
    assert out["invalidated"] == 4  # rows 2 and 3, hot in both groups' regions
    c.step(1, [0])
    r0, r1 = c.topk(1, 0, ids), c.topk(1, 1, ids)
    assert int(r0.misses[0]) == 2 and int(r1.misses[0]) == 2  # exactly the rewritten rows
    # layer 0 was not written: the old bytes; layers 1 and 2: the staged ones
    np.testing.assert_array_equal(att.slab[0, 0, r0.slots[0, 1:3]], pattern(0, np.array([2, 3]), LAY.row_bytes))
    np.testing.assert_array_equal(att.slab[1, 0, r0.slots[0, 1:3]], new[1])
    np.testing.assert_array_equal(att.slab[2, 0, r1.slots[0, 1:3]], new[2])
    with pytest.raises(BadRequest, match="exceed the staging buffer"):
        c.write_staged(list(range(9)))
    with pytest.raises(BadRequest, match="write rows must lie"):
        c.write_staged([64])
    att.staging[1, :3] = 99
    with pytest.raises(BadRequest, match="names host row 2 more than once"):
        c.write_staged([2, 4, 2], layers=[1])  # which copy lands would be nobody's choice
    with pytest.raises(BadRequest, match="names host row 4 more than once"):
        c.write([4, 4], np.zeros((3, 2, LAY.row_bytes), np.uint8))
    c.step(2, [0])
    r = c.topk(2, 0, [[2, 4, 5, 6]])
    np.testing.assert_array_equal(att.slab[1, 0, r.slots[0, 0]], new[1][0])  # nothing of them written
    np.testing.assert_array_equal(att.slab[1, 0, r.slots[0, 1]], pattern(1, np.array([4]), LAY.row_bytes)[0])


def test_write_staged_in_process():
    with InprocClient() as c:
        check(c)


def test_write_staged_through_the_daemon():
    with PrivateDaemon(pool_bytes=32 << 20) as d, Client(d.run_dir) as c:
        check(c)
        # the daemon kept serving after the refused writes
        assert c.stats()["errors_by_code"] == {"TOO_LARGE": 1, "BAD_ARGUMENT": 3}


def test_flush_raises_the_error_of_a_step_nobody_waited_for():
    """STEP is sent without waiting; flush() surfaces its error when no request follows."""
    with PrivateDaemon(pool_bytes=32 << 20) as d, Client(d.run_dir) as c:
        c.attach(LAY)
        c.step(0, [LAY.max_reqs])  # state row out of range
        with pytest.raises(BadRequest, match="BAD_STATE_ROW"):
            c.flush()
        c.step(1, [0])
        c.flush()  # nothing pending, nothing raised
        assert int(c.topk(1, 0, [[1, 2, 3, 4]]).misses[0]) == 4


def test_an_oversized_staged_write_is_too_large_before_its_rows_are_sorted(monkeypatch):
    """Found by a review: a rows array no staging buffer holds (a full frame of them) was
    sorted for repeats first, on the daemon's loop, and refused BAD_ARGUMENT."""
    from sparsekv.daemon import engine as engine_mod

    sorted_sizes = []
    real = engine_mod.repeated
    monkeypatch.setattr(engine_mod, "repeated", lambda ids: (sorted_sizes.append(ids.size), real(ids))[1])
    rows = (np.arange(100_000) % 64).astype(np.int32)  # repeats, and more than staging_rows
    with InprocClient() as c:
        c.attach(LAY)
        with pytest.raises(BadRequest, match="exceed the staging buffer") as ei:
            c.write_staged(rows)
    assert ei.value.code == ErrorCode.TOO_LARGE and max(sorted_sizes, default=0) <= LAY.staging_rows
    with PrivateDaemon(pool_bytes=32 << 20) as d, Client(d.run_dir) as c:
        c.attach(LAY)
        with pytest.raises(BadRequest, match="exceed the staging buffer"):
            c.write_staged(rows)
