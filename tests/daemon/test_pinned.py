"""PinnedRegion's chunking and lifetime on the CPU, with a fake at the CUDA boundary."""

import time

import numpy as np
import pytest

from sparsekv.daemon.pinned import PinError, PinnedRegion, PinnedView, PoolPinner, plan_chunks
from sparsekv.daemon.engine import EngineSpace
from sparsekv.daemon.pool import PREFAULT_CHUNK_BYTES, HostPool
from sparsekv.proto import Layout
from sparsekv.proto.blocks import KeysPlane

PAGE = 4096
GiB = 1 << 30


class FakeRuntime:
    """Records register/unregister calls; fails the n-th register when asked."""

    def __init__(self, fail_at: int | None = None):
        self.fail_at = fail_at
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def register(self, address, nbytes, flags):
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")
        assert flags == 0x03  # portable | mapped
        self.registered.append((address, nbytes))

    def unregister(self, address):
        self.unregistered.append(address)

    def device_pointer(self, address):
        return address  # UVA: same address


@pytest.mark.parametrize("row_bytes", [656, 16, 4096, 1000])
def test_chunks_cover_the_region_without_splitting_a_row(row_bytes):
    nbytes = 10 * GiB + 12345 * row_bytes
    chunks = plan_chunks(0x7F0000000000, nbytes, row_bytes, 3 * GiB, PAGE)
    assert chunks[0][0] == 0 and sum(n for _, n in chunks) == nbytes
    for (off, n), (nxt, _) in zip(chunks, chunks[1:]):
        assert off + n == nxt  # contiguous, no gap, no overlap
        assert nxt % row_bytes == 0 and nxt % PAGE == 0  # boundary between rows and pages
    assert all(n <= 3 * GiB for _, n in chunks)


def test_small_region_is_one_chunk_and_unaligned_large_region_is_refused():
    assert plan_chunks(123, 1000, 656, 64 * GiB, PAGE) == [(0, 1000)]
    with pytest.raises(ValueError, match="not page-aligned"):
        plan_chunks(123, 2 * GiB, 656, GiB, PAGE)
    with pytest.raises(ValueError, match="no chunk can hold whole rows"):
        plan_chunks(0, 2 * PAGE * 656, 656, PAGE, PAGE)


def test_close_unregisters_every_chunk_exactly_once():
    rt = FakeRuntime()
    base = 0x7F0000000000
    r = PinnedRegion(base, 5 * GiB, 656, 2 * GiB, runtime=rt, page_bytes=PAGE)
    assert len(rt.registered) == 3
    assert r.device_address(0) == base and r.device_base == base
    r.close()
    r.close()
    assert sorted(rt.unregistered) == sorted(a for a, _ in rt.registered)
    with pytest.raises(PinError, match="closed"):
        r.device_address(0)


def test_host_spans_cut_a_span_where_a_registered_chunk_ends():
    rt = FakeRuntime()
    base = 0x7F0000000000
    r = PinnedRegion(base, 5 * GiB, 656, 2 * GiB, runtime=rt, page_bytes=PAGE)
    cut = r.chunks[1].offset  # the first chunk's end
    assert r.host_spans(100, 1000) == [(base + 100, 1000)]  # inside one chunk: one span
    assert r.host_spans(cut - 10, 30) == [(base + cut - 10, 10), (base + cut, 20)]
    assert sum(n for _, n in r.host_spans(0, 5 * GiB)) == 5 * GiB and len(r.host_spans(0, 5 * GiB)) == 3
    with pytest.raises(ValueError, match="outside"):
        r.host_spans(5 * GiB - 10, 11)
    v = PinnedView(r, cut - PAGE, 2 * PAGE)  # a view's offsets are its own
    assert v.host_spans(PAGE - 1, 2) == [(base + cut - 1, 1), (base + cut, 1)]
    with pytest.raises(ValueError, match="outside the view"):
        v.host_spans(0, 2 * PAGE + 1)
    r.close()
    with pytest.raises(PinError, match="closed"):
        v.host_spans(0, 1)


def test_a_keys_load_is_one_copy_a_run_of_blocks_cut_where_a_pinned_chunk_ends():
    lay = Layout(num_layers=2, row_bytes=32, top_k=4, region_stride=8, max_reqs=4, host_rows=64,
                 index_groups=((0, 1),)).validate()
    space = EngineSpace("m", lay, np.zeros((2, 64, 32), np.uint8))
    space.keys_plane = plane = KeysPlane.of(lay, 4, 12)  # 16 blocks of 96 bytes from byte 4096
    base = 0x7F0000000000
    r = PinnedRegion(base, plane.end, 32, 1024, runtime=FakeRuntime(), page_bytes=16)  # chunks of 1 KiB
    bb, at = plane.block_bytes, base + plane.offset
    dst = 0x10000
    # Blocks 0-2 then 7 then 10-15: three runs; the third crosses the chunk boundary at 5120.
    ids = np.array([0, 1, 2, 7, 10, 11, 12, 13, 14, 15])
    cut = base + 5120
    assert space.keys_copies(ids, r, dst) == [
        (dst, at, 3 * bb), (dst + 3 * bb, at + 7 * bb, bb),
        (dst + 4 * bb, at + 10 * bb, cut - (at + 10 * bb)),
        (dst + 4 * bb + cut - (at + 10 * bb), cut, at + 16 * bb - cut)]
    assert space.keys_copies(ids[::-1][:2], r, dst) == [(dst, at + 15 * bb, bb), (dst + bb, at + 14 * bb, bb)]
    assert space.keys_copies(np.zeros(0, np.int64), r, dst) == []


def test_failed_registration_rolls_back_the_chunks_already_registered():
    rt = FakeRuntime(fail_at=2)
    with pytest.raises(PinError, match="failed at chunk 3 of 3"):  # the third registration
        PinnedRegion(0x7F0000000000, 5 * GiB, 656, 2 * GiB, runtime=rt, page_bytes=PAGE)
    assert len(rt.registered) == 2
    assert sorted(rt.unregistered) == sorted(a for a, _ in rt.registered)


def test_a_deferred_region_registers_each_chunk_once_its_bytes_are_ready():
    """deferred=True: nothing is registered up front; register_through(n) registers the
    chunks that end within the first n bytes, in order; finish() the rest. Until then the
    region gives no device address."""
    rt = FakeRuntime()
    r = PinnedRegion(0x7F0000000000, 5 * GiB, 656, 2 * GiB, runtime=rt, page_bytes=PAGE, deferred=True)
    assert rt.registered == [] and r.registered_bytes == 0
    with pytest.raises(PinError, match="not registered yet"):
        r.device_address(0)
    r.register_through(1 * GiB)  # the first chunk is not all there yet
    assert rt.registered == []
    r.register_through(3 * GiB)
    assert len(rt.registered) == 1 and rt.registered[0][0] == 0x7F0000000000
    r.register_through(3 * GiB)  # nothing new
    assert len(rt.registered) == 1
    r.finish()
    assert len(rt.registered) == 3 and r.registered_bytes == 5 * GiB
    assert r.device_base == 0x7F0000000000
    r.close()
    assert sorted(rt.unregistered) == sorted(a for a, _ in rt.registered)


def test_a_deferred_region_that_fails_part_way_rolls_back_and_closes():
    rt = FakeRuntime(fail_at=1)
    r = PinnedRegion(0x7F0000000000, 5 * GiB, 656, 2 * GiB, runtime=rt, page_bytes=PAGE, deferred=True)
    r.register_through(2 * GiB)
    with pytest.raises(PinError, match="failed at chunk 2 of 3"):
        r.register_through(5 * GiB)
    assert rt.unregistered == [rt.registered[0][0]] and r.closed
    with pytest.raises(PinError, match="closed"):
        r.register_through(5 * GiB)


def test_the_pool_reports_its_faulted_prefix_in_order(tmp_path):
    """HostPool's on_faulted gets the faulted prefix, growing to the whole pool: a caller
    can page-lock it while the rest is still being faulted."""

    seen = []
    pool = HostPool(3 * PREFAULT_CHUNK_BYTES + 4096, threads=2, on_faulted=lambda a, n: seen.append((a, n)))
    try:
        done = [n for _, n in seen]
        assert {a for a, _ in seen} == {pool.address}
        assert done == sorted(done) and done[-1] == pool.size_bytes
        assert done[0] == PREFAULT_CHUNK_BYTES and len(done) == 4
    finally:
        pool.close()


def test_a_pool_pinner_while_faulting_registers_the_pool_as_it_is_faulted_and_views_share_it():

    rt = FakeRuntime()
    size = 5 * PREFAULT_CHUNK_BYTES
    pinner = PoolPinner(size, max_chunk_bytes=2 * PREFAULT_CHUNK_BYTES, runtime=rt, while_faulting=True)
    calls = []
    real = pinner.region

    def spy(address, faulted):
        calls.append((faulted, len(rt.registered)))
        pinner(address, faulted)

    pool = HostPool(size, threads=2, on_faulted=spy)
    try:
        assert real is None
        region = pinner.finish()
        assert [n for _, n in rt.registered] == [2 * PREFAULT_CHUNK_BYTES, 2 * PREFAULT_CHUNK_BYTES,
                                                 PREFAULT_CHUNK_BYTES]
        # The first chunk was registered when 2 of the 5 pre-fault chunks were done, before the rest.
        assert calls[2] == (3 * PREFAULT_CHUNK_BYTES, 1)
        v = PinnedView(region, 3 * 4096, 10 * 4096)
        assert v.device_address(0) == pool.address + 3 * 4096
        with pytest.raises(ValueError):
            v.device_address(9 * 4096, 2 * 4096)  # past the view
        v.close()
        assert not region.closed and v.closed
        with pytest.raises(PinError):
            v.device_address(0)
        region.close()
    finally:
        pool.close()


def test_time_in_the_register_calls_is_summed():
    """register_s: what the pool start reports as its page-locking time."""

    class SlowRuntime(FakeRuntime):
        def register(self, address, nbytes, flags):
            time.sleep(0.02)
            super().register(address, nbytes, flags)

    r = PinnedRegion(0x7F0000000000, 3 * GiB, 656, 1 * GiB, runtime=SlowRuntime(), page_bytes=PAGE)
    assert 0.02 * len(r.chunks) <= r.register_s < 1.0
    r.close()


def test_a_pool_pinner_after_the_fault_registers_in_finish_with_progress():
    """SPARSEKV_PIN_POOL_AT_START=after: nothing registered while the pool is faulted; finish()
    registers it chunk by chunk, saying how much is done after each."""

    rt = FakeRuntime()
    size = 5 * PREFAULT_CHUNK_BYTES
    pinner = PoolPinner(size, max_chunk_bytes=2 * PREFAULT_CHUNK_BYTES, runtime=rt, while_faulting=False)
    pool = HostPool(size, threads=2, on_faulted=pinner)
    try:
        assert rt.registered == [] and pinner.region is not None
        seen = []
        region = pinner.finish(seen.append)
        assert [n for _, n in rt.registered] == [2 * PREFAULT_CHUNK_BYTES, 2 * PREFAULT_CHUNK_BYTES,
                                                 PREFAULT_CHUNK_BYTES]
        assert seen == [0.4, 0.8, 1.0] and region.registered_bytes == size
        region.close()
    finally:
        pool.close()
