"""On the GPU: ``model.generate`` through a cuda daemon gives transformers' eager outputs
(token ids identical, logits within LOGITS_TOL), both DSA models, batch 4 of mixed prompt
lengths, through the doorbell (the device handle on the model's stream) and the portable
handle (zmq)."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import HOST_ROWS, KINDS, check_same, generate, tiny  # noqa: E402

from sparsekv import hf  # noqa: E402
from sparsekv.bench.private_daemon import PrivateDaemon  # noqa: E402
from sparsekv.client import Client  # noqa: E402

ARENA = ["--device-arena-size", "1GiB"]


@pytest.mark.cuda
@pytest.mark.parametrize("transport", ["doorbell", "zmq"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_on_the_gpu_matches_eager(kind, transport):
    model = tiny(kind).to("cuda:0")
    ref = generate(model, device="cuda:0", do_sample=False)
    with PrivateDaemon(pool_bytes=64 << 20, backend="cuda", extra_args=ARENA) as d, \
            Client(d.run_dir, name="hf-cuda-test", device="cuda:0") as c:
        rt = hf.enable(model, c, max_batch=4, host_rows=HOST_ROWS, block_size=16, transport=transport)
        got = generate(model, device="cuda:0", do_sample=False)
        assert rt.free_rows == HOST_ROWS
        hf.disable(model)
    check_same(ref, got)
