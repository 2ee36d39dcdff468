"""Engine-owned slabs on the cuda backend: device memory one rank's slab at a time (the
cpu backend's twin: tests/client/test_engine_slab.py)."""

import pytest

from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.client import BadRequest, Client
from sparsekv.proto import ErrorCode, Layout
from sparsekv.proto.settings import TEST_DAEMON_LOG

BLOCK = 16
LAY = Layout(num_layers=3, row_bytes=656, top_k=64, region_stride=128, max_reqs=8, host_rows=8 * 1024,
             index_groups=((0, 1), (2,)), max_batch=8).validate()


@pytest.fixture
def cuda_daemon():
    # Room for two engines' pool ranges: the overlap is refused, not the pool.
    with PrivateDaemon(pool_bytes=3 * LAY.pool_bytes + (8 << 20), backend="cuda",
                       extra_args=["--device-arena-size", "2GiB"],
                       log_path=TEST_DAEMON_LOG.get() or None) as d:
        yield d


@pytest.mark.cuda
def test_one_tensors_memory_serves_one_ranks_slab_at_a_time(cuda_daemon):
    """The cuda twin of the cpu backend's memfd check: an engine slab whose bytes overlap
    another attached rank's (the same tensor given twice, or a view overlapping it, of one
    engine or another) is refused, since both ranks' rows would be gathered into the same
    bytes; disjoint parts of one allocation each serve a rank; a detached rank's bytes
    serve the next."""
    import torch

    from sparsekv.client.engine_slab import EngineSlab
    from sparsekv.proto.slab import SlabGeometry

    lay = LAY
    hot_blocks = lay.max_reqs * lay.region_stride // BLOCK
    layer_span = hot_blocks * BLOCK * lay.row_bytes
    nbytes = lay.num_layers * layer_span
    big = torch.zeros(3 * nbytes, dtype=torch.uint8, device="cuda")
    geo = SlabGeometry.paged(lay, [layer * layer_span for layer in range(lay.num_layers)], first_block=0,
                             block_size=BLOCK, block_stride=BLOCK * lay.row_bytes, buffer_bytes=nbytes)

    def slab(start):
        return EngineSlab.from_tensor(big[start: start + nbytes]).with_geometry(geo)

    clients = [Client(cuda_daemon.run_dir, rank=r, name=f"slab-{r}", device="cuda:0").connect() for r in range(3)]
    try:
        clients[0].attach(lay, engine="one-tensor", slab=slab(0))
        for c, engine, start in ((clients[1], "one-tensor", 0), (clients[1], "another", nbytes // 2)):
            with pytest.raises(BadRequest, match="overlaps the slab of client") as ei:
                c.attach(lay, engine=engine, slab=slab(start))
            assert ei.value.code == ErrorCode.BAD_ARGUMENT and c.attachment is None
        clients[1].attach(lay, engine="one-tensor", slab=slab(nbytes))  # the next bytes: its own
        clients[0].detach()
        clients[2].attach(lay, engine="another", slab=slab(0))
    finally:
        for c in clients:
            c.close()
