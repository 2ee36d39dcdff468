"""The device-driven decode step of a cuda rank, in process: the daemon's whole decode
path captured as a CUDA graph in global mode (any sync or readback fails the capture),
errors found on the device, two layouts sharing one GPU's kernels, staged writes read in
place, stats without a sync.

All tests are marked ``cuda``: skipped on CPU machines, failures under --require-cuda.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

import prefetch_program
from sparsekv.bench.replay import replay
from sparsekv.bench.synth import synth
from sparsekv.bench.verify import count_mismatches, pattern
from sparsekv.daemon.engine import EngineSpace
from sparsekv.daemon.residency.base import ResidencyError
from sparsekv.daemon.residency.cpu import CpuResidency
from sparsekv.proto.layout import Layout

pytestmark = pytest.mark.cuda


def small_trace(**kw):
    base = dict(steps=30, batch=8, top_k=128, region_stride=256, max_reqs=12, host_rows=12 * 2048,
                num_layers=3, context=1500, lifetime=12, overlap=0.7, invalidate=0.2, share_prefix=0.3,
                out_of_range=0.01, seed=21)
    base.update(kw)
    return synth(**base)


class Rig:
    """A cuda rank in this process: worker, pinned pool holding the verify pattern, rank."""

    def __init__(self, layout: Layout, graphs: bool = False, arena_bytes: int = 256 << 20, prefetch: bool = False):
        import cupy as cp

        from sparsekv.daemon.cuda.backend import DeviceWorker
        from sparsekv.daemon.cuda.rank import CudaRankState
        from sparsekv.daemon.kernels import get_cache
        from sparsekv.daemon.pinned import PinnedRegion
        from sparsekv.daemon.pool import HostPool

        self.cp = cp
        self.layout = lay = layout
        self.pool = HostPool(lay.pool_bytes + (2 << 20))
        view = self.pool.view(0, (lay.num_layers, lay.host_rows, lay.row_bytes))
        for layer in range(lay.num_layers):
            view[layer] = pattern(layer, np.arange(lay.host_rows), lay.row_bytes)
        self.worker = DeviceWorker(0, arena_bytes, get_cache())
        self.pinned = PinnedRegion(self.pool.address, -(-lay.pool_bytes // 4096) * 4096, lay.row_bytes)
        self.space = EngineSpace("rig", lay, view, 0)
        self.rank = CudaRankState(0, self.worker, self.space, self.pinned, ring_depth=4, gather_blocks=8,
                                  graphs=graphs, prefetch=prefetch)
        self.space.ranks[1] = self.rank

    def close(self):
        self.rank.close()
        self.pinned.close()
        self.worker.close()
        self.pool.close()

    def slots(self, entry, batch, k):
        self.worker.stream.synchronize()
        return self.rank.buffers.slots[entry, :batch, :k].get(), self.rank.buffers.misses[entry, :batch].get()

    def wrong_rows(self, state_rows, topk, slots) -> int:
        """Rows whose hot copy differs from the pattern of its host row (every layer)."""
        slab = self.rank.buffers.slab.get()
        lay, bad = self.layout, 0
        for b in np.flatnonzero(state_rows >= 0):
            ok = (topk[b] >= 0) & (topk[b] < lay.host_rows)
            for layer in range(lay.num_layers):
                got = slab[layer, state_rows[b], slots[b][ok]]
                bad += int((got != pattern(layer, topk[b][ok], lay.row_bytes)).any(axis=1).sum())
        return bad


@pytest.fixture
def rig():
    made = []

    def make(layout, **kw):
        r = Rig(layout, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def test_whole_decode_path_captures_in_global_mode_and_replays_like_the_cpu(rig):
    """For every step of a trace: the daemon's STEP + TOPK handling (host block writes,
    fetch, begin step, resolve, gather, stats out, event record) runs with the rank's
    stream under global capture. A sync, readback or host-sized launch would fail the
    capture; replayed, the graph gives the cpu backend's slots and the pattern's bytes."""
    import cupy as cp

    tr = small_trace()
    lay = tr.layout()
    _, want = replay(tr, transport="inproc", backend="cpu")
    r = rig(lay, graphs=False)
    home = r.worker.stream
    # The ready signal is a CUDA IPC event, which cannot be recorded under capture
    # (cudaErrorStreamCaptureUnsupported): the transport's record is held back and made
    # after the replay, where the zmq transport makes it after its graph launch.
    held = []
    r.rank.events.record = lambda k, stream: held.append(k)
    for t in range(tr.steps):
        # Each step's graph is replayed and finished before the next capture, so no ring
        # entry is in use: the ring's back-pressure wait (the transport's, for a client
        # that runs ring_depth requests ahead) is not on this path.
        r.rank.transport._step_used[:] = [False] * len(r.rank.transport._step_used)
        r.rank.transport._topk_used[:] = [False] * len(r.rank.transport._topk_used)
        cap = cp.cuda.Stream(non_blocking=True)
        r.worker.stream = cap  # the transport enqueues on the worker's stream
        cap.begin_capture(cp.cuda.runtime.streamCaptureModeGlobal)
        try:
            r.rank.begin_step(t, tr.state_rows[t], tr.reset[t], tr.invalidate[t])
            fields, _, _ = r.rank.serve_topk(t, 0, tr.topk[t])
        finally:
            graph = cap.end_capture()
            r.worker.stream = home
        graph.launch(home)
        assert held == [fields["entry"]]
        r.rank.events.events[held.pop()].record(home)
        slots, misses = r.slots(fields["entry"], fields["batch"], fields["k"])
        np.testing.assert_array_equal(slots, want["slots"][t], err_msg=f"step {t}")
        np.testing.assert_array_equal(misses, want["misses"][t], err_msg=f"step {t}")
        assert r.wrong_rows(tr.state_rows[t], tr.topk[t], slots) == 0, f"step {t}"
    assert r.rank.take_error() is None


def test_graph_replay_transport_matches_cpu_and_counts_on_device(rig):
    tr = small_trace(steps=25, seed=4)
    lay = tr.layout()
    cpu_sum, want = replay(tr, transport="inproc", backend="cpu")
    r = rig(lay, graphs=True)
    for t in range(tr.steps):
        r.rank.begin_step(t, tr.state_rows[t], tr.reset[t], tr.invalidate[t])
        f, _, _ = r.rank.serve_topk(t, 0, tr.topk[t])
        slots, misses = r.slots(f["entry"], f["batch"], f["k"])
        np.testing.assert_array_equal(slots, want["slots"][t])
        np.testing.assert_array_equal(misses, want["misses"][t])
    c = r.rank.counters()
    assert (c["hits"], c["misses"], c["out_of_range"]) == (cpu_sum["hits"], cpu_sum["misses"], cpu_sum["out_of_range"])


def _one_row_layout(**kw):
    base = dict(num_layers=2, row_bytes=32, top_k=8, region_stride=16, max_reqs=4, host_rows=200, max_batch=6)
    base.update(kw)
    return Layout(**base).validate()


def test_device_errors_refuse_the_row_keep_the_state_and_come_back_typed(rig):
    import cupy as cp

    lay = _one_row_layout()
    r = rig(lay)
    cpu = CpuResidency(lay)
    ids = np.arange(8, dtype=np.int32)[None, :]
    r.rank.begin_step(0, np.array([1], np.int32))
    f, _, _ = r.rank.serve_topk(0, 0, ids)
    cpu.resolve(0, np.array([1], np.int32), ids)
    r.worker.stream.synchronize()
    assert r.rank.take_error() is None
    owner0, lru0 = r.rank.residency.state()

    # A duplicate id: that row is refused (slots -1, no misses, no state change).
    dup = ids.copy()
    dup[0, 3] = dup[0, 6]
    f, _, _ = r.rank.serve_topk(0, 0, dup)
    slots, misses = r.slots(f["entry"], 1, 8)
    assert (slots == -1).all() and misses[0] == 0
    owner1, lru1 = r.rank.residency.state()
    np.testing.assert_array_equal(owner1, owner0)
    np.testing.assert_array_equal(lru1, lru0)
    e = r.rank.take_error()
    assert e is not None and e.code == "DUPLICATE_IDS" and "batch row 0" in str(e)
    assert r.rank.take_error() is None  # reported once

    # Three tokens of one state row where region_stride / top_k = 2 fit: the third is refused.
    sr = np.array([2, 2, 2], np.int32)
    three = np.stack([np.arange(8) + 20 * i for i in range(3)]).astype(np.int32)
    r.rank.begin_step(1, sr)
    f, _, _ = r.rank.serve_topk(1, 0, three)
    slots, misses = r.slots(f["entry"], 3, 8)
    want = cpu.resolve(0, sr[:2], three[:2])
    np.testing.assert_array_equal(slots[:2], want.slots)
    assert (slots[2] == -1).all() and misses[2] == 0
    e = r.rank.take_error()
    assert e is not None and e.code == "BAD_ARGUMENT" and "batch row 2" in str(e)

    # A state row out of range in a STEP message: refused on the host, nothing enqueued.
    with pytest.raises(ResidencyError, match="state row 9 out of range") as refused:
        r.rank.begin_step(2, np.array([9], np.int32), reset=np.array([True]))
    assert refused.value.code == "BAD_STATE_ROW"
    r.worker.stream.synchronize()
    assert r.rank.take_error() is None
    # The kernel's own check (a step block the client wrote): skipped, reported.
    with cp.cuda.Device(r.worker.ordinal):
        r.rank.transport.step(2, np.array([9], np.int32), np.array([True]), None)
    r.worker.stream.synchronize()
    e = r.rank.take_error()
    assert e is not None and e.code == "BAD_STATE_ROW"
    assert r.rank.error_counts()["duplicate_ids"] == 1
    assert isinstance(e, ResidencyError)
    del cp


def test_two_layouts_on_one_gpu_keep_their_shared_memory(rig):
    """The resolve kernel is shared by every engine on a GPU; a later, smaller layout must
    not lower the first one's shared-memory opt-in (its next resolve would fail)."""
    from sparsekv.daemon.kernels import get_cache
    from sparsekv.daemon.residency.cuda import CudaResidency

    big = Layout(num_layers=1, row_bytes=16, top_k=2048, region_stride=8192, max_reqs=2, host_rows=1 << 16)
    small = dataclasses.replace(big, region_stride=4096)
    kc = get_cache()
    first = CudaResidency(big, kernels=kc)
    assert not first.workspace_global and first.resolve_smem > 60 << 10
    second = CudaResidency(small, kernels=kc)
    assert second.resolve_smem < first.resolve_smem
    ids = np.arange(2048, dtype=np.int32)[None, :]
    got = first.resolve(0, np.array([0], np.int32), ids)  # failed before: launch out of resources
    assert int(got.misses[0]) == 2048
    assert int(second.resolve(0, np.array([1], np.int32), ids).misses[0]) == 2048


def test_staged_write_reads_staging_in_place(rig):
    """WRITE_STAGED allocates nothing on the device: the mirror reads the staging buffer."""
    import cupy as cp

    lay = _one_row_layout(staging_rows=16)
    r = rig(lay)
    rows = np.array([5, 9, 100, 7], np.int32)
    new = np.stack([pattern(layer + 50, rows, lay.row_bytes) for layer in range(lay.num_layers)])
    r.rank.buffers.staging[:, :4] = cp.asarray(new)
    r.worker.stream.synchronize()
    pool = cp.get_default_memory_pool()
    before = pool.total_bytes()
    r.rank.write_staged(r.space, (0, 1), rows)
    r.worker.stream.synchronize()
    assert pool.total_bytes() == before
    for layer in range(lay.num_layers):
        np.testing.assert_array_equal(r.space.pool[layer, rows], new[layer])


def test_stats_scrape_does_not_wait_for_the_stream(rig):
    import cupy as cp

    lay = _one_row_layout()
    r = rig(lay)
    spin = cp.RawKernel(r"""
    extern "C" __global__ void spin(long long cycles) {
        long long t0 = clock64();
        while (clock64() - t0 < cycles) {}
    }""", "spin")
    rate = cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrClockRate, 0) * 1000  # Hz
    with r.worker.stream:
        spin((1,), (1,), (np.int64(rate * 0.5),))  # half a second of GPU time
    t0 = time.perf_counter()
    r.rank.counters()
    took = time.perf_counter() - t0
    busy = not r.worker.stream.done
    r.worker.stream.synchronize()
    assert busy and took < 0.1, (busy, took)


def test_a_bad_descriptor_in_a_client_block_does_nothing_and_leaves_no_stale_result(rig):
    """The client writes its blocks itself: a descriptor out of range (k > top_k) after a
    good TOPK on the same ring entry resolves nothing, gathers nothing, leaves the entry
    with slots -1 and 0 misses (not the earlier result), and comes back as BAD_ARGUMENT."""
    from sparsekv.proto.step_block import write_step, write_topk

    lay = _one_row_layout(num_layers=2, index_groups=((0,), (1,)))
    r = rig(lay, graphs=True)
    bufs = r.rank.buffers
    sr = np.array([1], np.int32)
    ids = np.arange(8, dtype=np.int32)[None, :]
    write_step(bufs.client_step[0][0], 1, 0, sr, None, None)
    write_topk(bufs.client_topk[0][0], 1, 0, 0, sr, ids)
    r.rank.serve_topk_block(0, 0, 0, True)
    slots, misses = r.slots(0, 1, 8)
    assert misses[0] == 8
    owner0, _ = r.rank.residency.state()
    slab0 = bufs.slab.get()
    write_topk(bufs.client_topk[0][0], 2, 0, 1, sr, ids)
    bufs.client_topk[0][0].desc[3] = lay.top_k + 1  # K out of range
    r.rank.serve_topk_block(0, 1, 0, False)
    slots, misses = r.slots(0, 1, 8)
    assert (slots == -1).all() and misses[0] == 0
    owner1, _ = r.rank.residency.state()
    np.testing.assert_array_equal(owner1, owner0)
    np.testing.assert_array_equal(bufs.slab.get(), slab0)
    e = r.rank.take_error()
    assert e is not None and e.code == "BAD_ARGUMENT" and "descriptor" in str(e)
    # The step's state rows came in the block: a TOPK sent as arrays must bring its own.
    with pytest.raises(ResidencyError, match="client-written block"):
        r.rank.serve_topk(0, 1, ids)


@pytest.mark.parametrize("graphs", [False, True])
def test_prefetch_after_each_topk_gives_the_cpu_backends_slots_counters_and_rows(rig, graphs):
    """The rank as the server drives it: each TOPK, then the prefetch it left pending
    (``run_prefetch``: launched kernel by kernel or as the transport's prefetch graph);
    none after the last group's. Slots, misses and the prefetch counters are the cpu
    backend's; every row in the slab is its host row's."""
    lay = prefetch_program.layout()
    plan = prefetch_program.program(lay, 10, seed=3)
    want, counters = prefetch_program.reference(lay, plan)
    r = rig(lay, graphs=graphs, prefetch=True)
    for t, (state, reset, per_group) in enumerate(plan):
        r.rank.begin_step(t, state, reset)
        for g, rows in enumerate(per_group):
            fields, _, _ = r.rank.serve_topk(t, g, rows)
            assert (r.rank.pending_prefetch is not None) == (g + 1 < lay.num_groups)
            if r.rank.pending_prefetch is not None:
                r.rank.run_prefetch()
            slots, misses = r.slots(fields["entry"], len(state), lay.top_k)
            np.testing.assert_array_equal(slots, want[t][g][0], err_msg=f"step {t} group {g}")
            np.testing.assert_array_equal(misses, want[t][g][1], err_msg=f"step {t} group {g}")
            slab = r.rank.buffers.slab.get()
            assert count_mismatches(slab, lay.groups[g], state, rows, slots, lay.host_rows) == 0
    assert r.rank.take_error() is None
    c = r.rank.counters()
    assert {k: c[k] for k in prefetch_program.PF_KEYS} == counters


def test_a_state_row_refused_with_prefetch_on_is_reported_once(rig):
    """The prefetch after a TOPK refuses the rows its resolve refused; they are reported
    once (its own error record), so no later request fails for them again."""
    lay = prefetch_program.layout()
    r = rig(lay, prefetch=True)
    bad = np.array([lay.max_reqs + 3], np.int32)
    r.rank.serve_topk(0, 0, np.arange(lay.top_k, dtype=np.int32)[None], state_rows=bad)
    assert r.rank.pending_prefetch is not None
    r.rank.run_prefetch()
    r.worker.stream.synchronize()
    err = r.rank.take_error()
    assert err is not None and err.code == "BAD_STATE_ROW"
    assert r.rank.take_error() is None and r.rank.error_counts()["bad_state_row"] == 1
