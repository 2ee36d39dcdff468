"""A request after a STEP sent alone, on a cuda rank (fence events, device wait, both):
the STEP's refusal is raised by the next request, which is not run (a WRITE does not
write, an ALLOC holds no block), as on the cpu backend (test_step_piggyback.py).

Marked ``cuda``: skipped on CPU machines, failures under --require-cuda.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.client import BadRequest, Client
from sparsekv.proto import Layout

pytestmark = pytest.mark.cuda

LAY = Layout(num_layers=2, row_bytes=64, top_k=4, region_stride=8, max_reqs=2, host_rows=256,
             index_groups=((0, 1),)).validate()
ONE = np.array([[0, -1, -1, -1]], np.int32)


@pytest.mark.parametrize("fence, device_wait", [(False, True), (True, False), (True, True)])
def test_a_request_after_a_refused_step_sent_alone_is_not_run_on_a_cuda_rank(fence, device_wait):
    pytest.importorskip("torch")
    with PrivateDaemon(pool_bytes=LAY.pool_bytes + (8 << 20), backend="cuda",
                       extra_args=["--device-arena-size", "1GiB"]) as d, \
            Client(d.run_dir, device="cuda:0", device_wait=device_wait, timeout_s=20) as c:
        c.attach(LAY, fence=fence, block_size=4)
        row = c.blocks.rows(c.blocks.alloc(1))[:1]
        c.write(row, np.full((2, 1, 64), 1, np.uint8))
        c.step(0, [LAY.max_reqs])  # a bad state row: the STEP goes alone before the WRITE
        with pytest.raises(BadRequest, match="BAD_STATE_ROW"):
            c.write(row, np.full((2, 1, 64), 2, np.uint8))
        c.step(1, [LAY.max_reqs])
        with pytest.raises(BadRequest, match="BAD_STATE_ROW"):
            c.blocks.alloc(2)
        assert c.blocks.reserve(0)["private"] == 1  # the ALLOC did not run
        c.step(2, [0], reset=[True])
        r = c.topk(2, 0, np.where(ONE >= 0, int(row[0]), -1).astype(np.int32))
        slots, _ = r.host()
        got = c.attachment.slab[0, 0, int(slots[0, 0])].cpu().numpy()
        assert (got == 1).all()  # the refused WRITE did not run
        c.step(3, [0])  # a good STEP sent alone: the WRITE after it runs
        c.write(row, np.full((2, 1, 64), 3, np.uint8))
        r = c.topk(3, 0, np.where(ONE >= 0, int(row[0]), -1).astype(np.int32))
        slots, _ = r.host()
        assert (c.attachment.slab[1, 0, int(slots[0, 0])].cpu().numpy() == 3).all()
        c.flush()
