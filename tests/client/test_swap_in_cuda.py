"""HostSwapIn over a real cuda daemon with its inputs on the GPU: every row read through
the returned indices is the host row its position maps to (the byte pattern), with and
without fence events (with them the top-k goes from the GPU into the step block and the
host waits for nothing) and with and without device wait.

Marked ``cuda``: skipped on CPU machines, failures under --require-cuda.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparsekv.client import Client
from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.client.swap_in import HostSwapIn
from sparsekv.bench.verify import fill_pool, pattern
from sparsekv.proto import Layout
from sparsekv.proto.positions import host_rows

pytestmark = pytest.mark.cuda

BS, BLOCKS, REQS, K = 16, 12, 6, 32
LAYOUT = Layout(num_layers=4, row_bytes=64, top_k=K, region_stride=2 * K, max_reqs=REQS, host_rows=REQS * BLOCKS * BS,
                index_groups=((0, 1), (2,), (3,)), max_batch=2 * REQS).validate()


@pytest.mark.parametrize("fence, device_wait, pos_dtype, table_dtype",
                         [(False, False, "int64", "int32"), (True, False, "int64", "int32"),
                          (False, True, "int64", "int32"), (True, True, "int64", "int32"),
                          (True, True, "int32", "int64"), (True, False, "int16", "int32")])
def test_rows_through_gpu_inputs_are_the_mapped_host_rows(fence, device_wait, pos_dtype, table_dtype, monkeypatch):
    """Positions int64 or int32 with tables of int32 or int64 (one kernel each), int16 (the
    torch mapping); indices into an out tensor at one layer of each step."""
    torch = pytest.importorskip("torch")
    from sparsekv.client import cuda_attach

    copies = []
    real_copy = cuda_attach.CudaAttachment._copy_from_device
    monkeypatch.setattr(cuda_attach.CudaAttachment, "_copy_from_device",
                        lambda self, dst, t: copies.append(1) or real_copy(self, dst, t))
    rng = np.random.default_rng(3)
    dev = torch.device("cuda:0")
    # Each request's blocks: a shuffled slice of the pool, some null, the rest past the table.
    table = rng.permutation(REQS * BLOCKS).reshape(REQS, BLOCKS).astype(table_dtype)
    table[rng.random(table.shape) < 0.1] = -1
    with PrivateDaemon(pool_bytes=LAYOUT.pool_bytes + (8 << 20), backend="cuda",
                       extra_args=["--device-arena-size", "1GiB"]) as d, \
            Client(d.run_dir, device="cuda:0", device_wait=device_wait) as c:
        c.attach(LAYOUT, fence=fence)
        assert c.attachment.takes_device_topk is fence
        fill_pool(c, LAYOUT)
        h = HostSwapIn(c)
        table_t = torch.from_numpy(table).to(dev)
        checked = 0
        for step in range(12):
            live = rng.permutation(REQS)[: rng.integers(2, REQS + 1)].astype(np.int32)
            # Two tokens for some requests (speculative decoding), a padding token.
            reqs = np.concatenate([live, live[:2], [-1]]).astype(np.int32)
            pos = np.stack([rng.permutation(BLOCKS * BS + 8)[:K] - 4 for _ in reqs]).astype(pos_dtype)
            reqs_t, pos_t = torch.from_numpy(reqs).to(dev), torch.from_numpy(pos).to(dev)
            h.begin_step(torch.from_numpy(live).to(dev), reset=np.full(live.shape, step == 0))
            want_rows = host_rows(pos, table, BS, table_rows=reqs)
            for layer in range(LAYOUT.num_layers):
                out = torch.full(pos.shape, 7, dtype=torch.int32, device=dev) if layer == 2 else None
                idx = h.swap_in(reqs_t, table_t, pos_t, layer=layer, block_size=BS, attention_indices_out=out)
                assert idx.is_cuda and idx.dtype == torch.int32 and (out is None or idx is out)
                kv = h.kv(layer)
                got = kv[idx.clamp(min=0).long()].cpu().numpy()  # [tokens, K, row_bytes]
                i = idx.cpu().numpy()
                mapped = want_rows >= 0
                np.testing.assert_array_equal(i >= 0, mapped, err_msg=f"step {step} layer {layer}")
                np.testing.assert_array_equal(got[mapped], pattern(layer, want_rows[mapped], LAYOUT.row_bytes),
                                              err_msg=f"step {step} layer {layer}")
                checked += int(mapped.sum())
        h.check()
        counts = h.counts
        h.close()
    assert checked > 1000 and counts["misses"] > 0
    # With fences every leader's top-k went from the GPU (three leaders a step).
    assert len(copies) == (12 * 3 if fence else 0)
