"""The in-process transport: same results and the same typed exceptions as the daemon
client, no daemon."""

import numpy as np
import pytest

import helpers
from sparsekv.client import BadRequest, NotAttached
from sparsekv.embedded.inproc import InprocClient
from sparsekv.proto import ErrorCode

LAYOUT = helpers.layout(num_layers=2, row_bytes=32, top_k=4, region_stride=8, max_reqs=2, host_rows=64,
                        staging_rows=4)


def test_inproc_gathers_written_rows_and_stages_blocks():
    with InprocClient() as c:
        att = c.attach(LAYOUT)
        helpers.fill(c, LAYOUT)
        c.step(0, [1, -1])
        r = c.topk(0, 1, [[3, 9, -1, 70], [1, 1, 1, 1]])
        assert r.misses.tolist() == [2, 0] and r.hits == 0 and r.out_of_range == 1
        assert helpers.bad_rows(att.slab, (1,), np.array([1, -1]), np.array([[3, 9, -1, 70], [1, 1, 1, 1]]),
                                r.slots, 64) == 0
        assert c.stage([8, 9, 10]) == 3 * 2 * 32
        assert np.array_equal(att.staging[0, :3], helpers.gen_pattern(0, [8, 9, 10], 32))


def test_inproc_raises_the_daemon_clients_typed_errors():
    with InprocClient() as c:
        with pytest.raises(NotAttached):
            c.step(0, [0])
        c.attach(LAYOUT)
        c.step(0, [0])
        with pytest.raises(BadRequest) as ei:
            c.topk(0, 0, [[4, 4, -1, -1]])
        assert ei.value.code == ErrorCode.DUPLICATE_IDS and "twice" in str(ei.value)
        with pytest.raises(BadRequest) as ei:
            c.step(1, [5])
        assert ei.value.code == ErrorCode.BAD_STATE_ROW


def test_inproc_refuses_other_backends():
    with pytest.raises(ValueError, match="backend 'cpu'"):
        InprocClient(backend="tpu")


def test_stage_of_rows_outside_the_pool_is_a_typed_error_as_through_the_daemon():
    import pytest

    from sparsekv.client import BadRequest
    from sparsekv.embedded.inproc import InprocClient
    from sparsekv.proto import Layout

    lay = Layout(num_layers=1, row_bytes=16, top_k=2, region_stride=2, max_reqs=1, host_rows=8, staging_rows=4)
    with InprocClient() as c:
        c.attach(lay)
        with pytest.raises(BadRequest, match=r"stage rows must lie in \[0, 8\)"):
            c.stage([8])
