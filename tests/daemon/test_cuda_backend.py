"""The cuda backend end to end: a real sparsekvd on the GPU, clients opening its slab
through CUDA IPC, every result compared with the cpu backend bit for bit.

All tests are marked ``cuda``: skipped on CPU machines, failures under --require-cuda.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import numpy as np
import pytest

from sparsekv.client import BadRequest, Client
from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.bench.replay import replay
from sparsekv.bench.synth import synth
from sparsekv.bench.verify import count_mismatches, fill_pool, pattern
from sparsekv.proto import MsgType
from sparsekv.proto.settings import TEST_DAEMON_LOG

pytestmark = pytest.mark.cuda

ARENA = ["--device-arena-size", "2GiB"]
# On the GPU machine the device run script points this at its output folder.
DAEMON_LOG = TEST_DAEMON_LOG.get() or None


def small_trace(**kw):
    base = dict(steps=60, batch=8, top_k=128, region_stride=256, max_reqs=12, host_rows=12 * 2048,
                num_layers=3, context=1500, lifetime=20, overlap=0.7, invalidate=0.2, share_prefix=0.3,
                out_of_range=0.01, seed=11)
    base.update(kw)
    return synth(**base)


@pytest.mark.parametrize("kw", [{}, {"top_k": 512, "region_stride": 1024, "batch": 4, "steps": 30},
                                {"top_k": 64, "region_stride": 192, "seed": 5, "pad": 0.4},
                                {"host_rows": 12 * 2048 + 5, "num_layers": 1, "seed": 8},  # not whole pages
                                {"slab": "engine"}])  # the hot rows in this process's tensor, guards around
def test_replay_zmq_cuda_equals_cpu_bit_for_bit(kw):
    kw = dict(kw)
    slab = kw.pop("slab", "daemon")
    trace = small_trace(**kw)
    cpu, cpu_res = replay(trace, transport="inproc", backend="cpu")
    gpu, gpu_res = replay(trace, transport="zmq", backend="cuda", verify=True, slab=slab)
    assert gpu["mismatched_rows"] == 0
    assert gpu["guard_bytes_changed"] == (0 if slab == "engine" else None)
    np.testing.assert_array_equal(gpu_res["slots"], cpu_res["slots"])
    np.testing.assert_array_equal(gpu_res["misses"], cpu_res["misses"])
    assert (gpu["hits"], gpu["misses"], gpu["out_of_range"]) == (cpu["hits"], cpu["misses"], cpu["out_of_range"])


def test_daemon_stats_are_counted_on_the_device():
    trace = small_trace()
    cpu, _ = replay(trace, transport="inproc", backend="cpu")
    lay = trace.layout()
    with PrivateDaemon(pool_bytes=lay.pool_bytes + (8 << 20), backend="cuda", extra_args=ARENA) as d:
        replay(trace, transport="zmq", backend="cuda", connect=d.run_dir)
        with Client(d.run_dir, device="cuda:0") as c:
            snap = c.stats()
    assert snap["backend"] == "cuda"
    assert (snap["hits"], snap["misses"], snap["out_of_range"]) == (cpu["hits"], cpu["misses"], cpu["out_of_range"])
    assert snap["rows_moved"] == cpu["misses"] * lay.num_layers
    assert snap["bytes_moved"] == cpu["misses"] * lay.num_layers * lay.row_bytes


def test_two_rank_processes_share_one_pool_on_one_gpu():
    _run_two_ranks(["cuda:0", "cuda:0"], fence=True, trace_kw={"steps": 40})


@pytest.fixture
def filled():
    """A private cuda daemon and one attached cuda:0 client whose pool holds the pattern."""
    lay = small_trace(steps=1).layout()
    with PrivateDaemon(pool_bytes=lay.pool_bytes + (8 << 20), backend="cuda", extra_args=ARENA,
                       log_path=DAEMON_LOG) as d, Client(d.run_dir, device="cuda:0") as c:
        att = c.attach(lay, engine="one")
        fill_pool(c, lay)
        yield lay, c, att


@pytest.mark.parametrize("at_start, chunk_gib", [("1", ""), ("0", ""), ("1", "0.002"), ("0", "0.002")])
def test_the_pool_is_page_locked_at_start_and_an_attach_serves_from_it(tmp_path, at_start, chunk_gib):
    """By default (SPARSEKV_PIN_POOL_AT_START=1) the daemon registers the whole pool while
    pre-faulting it (not inside an attach), and an engine's range is a view of it; with 0
    the attach registers the engine's range. Either way its rows are served exactly, also
    from many small registrations (SPARSEKV_PIN_CHUNK_GIB 0.002: 2 MiB chunks)."""
    lay = small_trace(steps=1).layout()
    assert lay.pool_bytes > 8 * (2 << 20)  # several chunks of 2 MiB
    log = tmp_path / "sparsekvd.log"
    env = dict(os.environ, SPARSEKV_PIN_POOL_AT_START=at_start, SPARSEKV_PIN_CHUNK_GIB=chunk_gib)
    with PrivateDaemon(pool_bytes=lay.pool_bytes + (8 << 20), backend="cuda", extra_args=ARENA,
                       log_path=str(log), env=env) as d, Client(d.run_dir, device="cuda:0") as c:
        att = c.attach(lay, engine="pinned-at-start")
        fill_pool(c, lay)
        ids = np.arange(lay.top_k, dtype=np.int32)[None, :]
        c.step(0, [0])
        slots, misses = c.topk(0, 0, ids).host()
        assert misses[0] == lay.top_k
        for layer in lay.groups[0]:
            got = att.slab[layer, 0, slots[0]].cpu().numpy()
            np.testing.assert_array_equal(got, pattern(layer, ids[0], lay.row_bytes))
    text = log.read_text()
    assert ("page-locked for the GPUs" in text) == (at_start == "1"), text[-2000:]


def test_write_reaches_the_pool_and_drops_hot_copies(filled):
    lay, c, att = filled
    ids = np.arange(lay.top_k, dtype=np.int32)[None, :]
    c.step(0, [0])
    s0, m0 = c.topk(0, 0, ids).host()
    assert m0[0] == lay.top_k
    new = np.stack([pattern(layer + 100, ids[0, :5], lay.row_bytes) for layer in range(lay.num_layers)])
    c.write(ids[0, :5], new)
    c.step(1, [0])
    s1, m1 = c.topk(1, 0, ids).host()
    assert m1[0] == 5  # exactly the rewritten rows miss
    for layer in range(lay.num_layers):
        got = att.slab[layer, 0, s1[0, :5]].cpu().numpy()
        np.testing.assert_array_equal(got, new[layer])


def test_a_tp_group_on_zmq_is_refused_before_anything_is_allocated_and_the_others_are_served(filled):
    lay, c, att = filled
    before = c.stats()
    with Client(c.run_dir, rank=1, device="cuda:0") as other:
        # (the pool has no room for a second engine: the refusal comes before any is sought)
        with pytest.raises(BadRequest, match="runs on the doorbell transport"):
            other.attach(lay, engine="tp", tp_size=2)
    after = c.stats()
    assert (after["engines"], after["pool_used_bytes"]) == (before["engines"], before["pool_used_bytes"])
    c.step(0, [0])
    assert c.topk(0, 0, np.arange(lay.top_k, dtype=np.int32)[None, :]).host()[1][0] == lay.top_k


def test_duplicate_ids_are_refused_and_state_kept(filled):
    """Found on the device: the row is refused, and the next request gets the typed error
    (the cpu backend raises at once; the GPU only knows after the fact)."""
    lay, c, att = filled
    ids = np.arange(lay.top_k, dtype=np.int32)[None, :]
    c.step(0, [1])
    c.topk(0, 0, ids).host()
    bad = ids.copy()
    bad[0, 3] = bad[0, 7]
    s, m = c.topk(0, 0, bad).host()  # waits for the GPU: its error record is out
    assert (s == -1).all() and m[0] == 0
    with pytest.raises(BadRequest, match="DUPLICATE_IDS") as e:
        c.topk(0, 0, ids)
    assert "batch row 0" in str(e.value)
    s, m = c.topk(0, 0, ids).host()
    assert m[0] == 0  # all hits: the refused row changed nothing
    assert count_mismatches(att.slab, (0, 1, 2), np.array([1]), ids, s, lay.host_rows) == 0
    snap = c.stats()
    assert snap["device_errors"]["duplicate_ids"] == 1
    assert snap["errors_by_code"]["DUPLICATE_IDS"] == 1 and snap["async_errors"] == 1


def test_two_engines_with_different_layouts_share_one_gpu():
    """Two engines whose resolve needs different shared memory on one GPU: the later,
    smaller one attached, the first one's decode still equals the cpu backend."""
    big = small_trace(top_k=2048, region_stride=8192, batch=2, max_reqs=2, host_rows=2 * 16384, steps=6,
                      num_layers=1, context=12000, lifetime=6)
    little = small_trace(top_k=2048, region_stride=4096, batch=2, max_reqs=2, host_rows=2 * 16384, steps=6,
                         num_layers=1, context=12000, lifetime=6, seed=3)
    _, want = replay(big, transport="inproc", backend="cpu")
    pool = big.layout().pool_bytes + little.layout().pool_bytes + (16 << 20)
    with PrivateDaemon(pool_bytes=pool, backend="cuda", extra_args=ARENA, log_path=DAEMON_LOG) as d, \
            Client(d.run_dir, device="cuda:0") as other:
        first = Client(d.run_dir, device="cuda:0").connect()
        try:
            first.attach(big.layout(), engine="big")
            other.attach(little.layout(), engine="little")
            for t in range(big.steps):
                first.step(t, big.state_rows[t], big.reset[t], big.invalidate[t])
                s, m = first.topk(t, 0, big.topk[t]).host()
                np.testing.assert_array_equal(s, want["slots"][t])
                np.testing.assert_array_equal(m, want["misses"][t])
        finally:
            first.detach()
            first.close()


def _rank_on(run_dir, rank, device, fence, trace_kw, barrier, out):
    """One TP rank in its own process: attach, (rank 0) fill the pool, decode, check every
    row it reads from its slab on the GPU."""
    try:
        trace = small_trace(**trace_kw)
        lay = trace.layout()
        bad = 0
        slots = np.zeros(trace.topk.shape, np.int32)
        with Client(run_dir, rank=rank, device=device) as c:
            att = c.attach(lay, engine="tp", fence=fence)
            if rank == 0:
                fill_pool(c, lay)
            barrier.wait(timeout=120)
            for t in range(trace.steps):
                c.step(t, trace.state_rows[t], trace.reset[t], trace.invalidate[t])
                s, _ = c.topk(t, 0, trace.topk[t]).host()
                slots[t] = s
                bad += count_mismatches(att.slab, lay.groups[0], trace.state_rows[t], trace.topk[t], s, lay.host_rows)
            barrier.wait(timeout=120)
            stats = c.stats() if rank == 0 else None
        out.put((rank, bad, slots, stats))
    except BaseException:  # report instead of leaving the other rank at the barrier
        barrier.abort()
        out.put((rank, -1, traceback.format_exc(), None))


def _run_two_ranks(devices, fence, trace_kw):
    trace = small_trace(**trace_kw)
    _, want = replay(trace, transport="inproc", backend="cpu")
    lay = trace.layout()
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    with PrivateDaemon(pool_bytes=lay.pool_bytes + (8 << 20), backend="cuda", extra_args=ARENA,
                       log_path=DAEMON_LOG) as d:
        procs = [ctx.Process(target=_rank_on, args=(d.run_dir, r, devices[r], fence, trace_kw, barrier, out))
                 for r in range(2)]
        for p in procs:
            p.start()
        results = sorted((out.get(timeout=300) for _ in procs), key=lambda r: r[0])
        for p in procs:
            p.join(60)
    for rank, bad, slots, _ in results:
        assert bad != -1, f"rank {rank} failed:\n{slots}"
        assert bad == 0, f"rank {rank} read {bad} wrong rows"
        np.testing.assert_array_equal(slots, want["slots"])
    return results


def test_two_ranks_on_two_gpus_share_one_host_pool():
    import cupy as cp

    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    results = _run_two_ranks(["cuda:0", "cuda:1"], fence=False, trace_kw={"steps": 30})
    assert results[0][3]["devices"] == ["cuda:0", "cuda:1"]


def test_rows_written_from_the_staging_buffer_reach_every_gpu(tmp_path):
    """The write mirror on the device: a rank writes rows from its staging buffer (GPU
    memory) into the host pool; the next resolve misses exactly those rows and gathers
    the new bytes, in this rank and in a second rank (on the second GPU when there is one)."""
    import dataclasses

    import cupy as cp
    import torch

    lay = dataclasses.replace(small_trace(steps=1).layout(), staging_rows=16)
    second = "cuda:1" if cp.cuda.runtime.getDeviceCount() > 1 else "cuda:0"
    with PrivateDaemon(pool_bytes=lay.pool_bytes + (8 << 20), backend="cuda", extra_args=ARENA,
                       log_path=DAEMON_LOG) as d, Client(d.run_dir, device="cuda:0") as a, \
            Client(d.run_dir, rank=1, device=second) as b:
        att_a = a.attach(lay, engine="ws", fence=True)
        att_b = b.attach(lay, engine="ws")
        fill_pool(a, lay)
        ids = np.arange(lay.top_k, dtype=np.int32)[None, :]
        for c in (a, b):
            c.step(0, [0])
            assert c.topk(0, 0, ids).host()[1][0] == lay.top_k
        rows = ids[0, 3:9]
        new = np.stack([pattern(layer + 200, rows, lay.row_bytes) for layer in range(lay.num_layers)])
        att_a.staging[:, : rows.size] = torch.from_numpy(new).to(att_a.staging.device)
        a.write_staged(rows)
        for c, att in ((a, att_a), (b, att_b)):
            c.step(1, [0])
            s, m = c.topk(1, 0, ids).host()
            assert m[0] == rows.size, "exactly the written rows miss"
            for layer in range(lay.num_layers):
                np.testing.assert_array_equal(att.slab[layer, 0, s[0, 3:9]].cpu().numpy(), new[layer])


@pytest.mark.parametrize("device_wait", [False, True], ids=["reply", "device-wait"])
def test_every_group_of_a_step_from_client_written_blocks_equals_cpu(device_wait):
    """A cuda client writes each TOPK into its pinned step block (the STEP rides on the
    first); later groups of the step reuse the step's state rows. Same as the cpu backend,
    whether the stream waits for the result after the reply or on the entry's done word."""
    from sparsekv.client.client import Ready
    from sparsekv.embedded.inproc import InprocClient

    trace = small_trace(steps=12)
    lay = trace.layout()
    with PrivateDaemon(pool_bytes=lay.pool_bytes + (8 << 20), backend="cuda", extra_args=ARENA,
                       log_path=DAEMON_LOG) as d, Client(d.run_dir, device="cuda:0", device_wait=device_wait) as c, \
            InprocClient(backend="cpu") as ref:
        att = c.attach(lay, engine="groups")
        assert att.caps.step_blocks and att.caps.done_words
        ref.attach(lay, engine="groups")
        for t in range(trace.steps):
            for cl in (c, ref):
                cl.step(t, trace.state_rows[t], trace.reset[t], trace.invalidate[t])
            for g in range(lay.num_groups):
                p = c.submit_topk(t, g, trace.topk[t])
                assert isinstance(p, Ready) == device_wait
                s, m = p.wait().host()
                want = ref.topk(t, g, trace.topk[t])
                np.testing.assert_array_equal(s, want.slots, err_msg=f"step {t} group {g}")
                np.testing.assert_array_equal(m, want.misses, err_msg=f"step {t} group {g}")
        c.flush()  # every reply read: no error in any
        # The replies say when the daemon had enqueued the GPU work ("tl"): after it got
        # the request, before it answered.
        ts, tr, tx, rx = c.timings[MsgType.TOPK]
        assert c.enqueued_at is not None and tr <= c.enqueued_at <= tx


def test_a_failed_device_wait_topk_releases_the_stream_with_an_empty_result():
    """Device wait: a TOPK the daemon refuses (a fence the client never exported) still
    sets its done word, after emptying the entry's result (slots -1: nothing is read); the
    error comes from the next call, and the rank serves on."""
    trace = small_trace(steps=3)
    lay = trace.layout()
    with PrivateDaemon(pool_bytes=lay.pool_bytes + (8 << 20), backend="cuda", extra_args=ARENA,
                       log_path=DAEMON_LOG) as d, Client(d.run_dir, device="cuda:0", device_wait=True) as c:
        att = c.attach(lay, engine="dw-fail")
        fill_pool(c, lay)
        c.step(0, trace.state_rows[0], trace.reset[0], trace.invalidate[0])
        ring = att.handles["ring_depth"]
        for _ in range(ring):  # real results first: every entry's slots hold slots
            s, m = c.topk(0, 0, trace.topk[0]).host()
            assert (s >= 0).any()
        c.flush()
        att.next_fence = att.record_fence = lambda: 99
        for _ in range(ring):  # each entry once
            s, m = c.topk(0, 0, trace.topk[0]).host()
            with pytest.raises(BadRequest, match="fence 99"):
                c.flush()
            assert (s == -1).all() and (m == 0).all()
        del att.next_fence, att.record_fence
        c.step(1, trace.state_rows[1], trace.reset[1], trace.invalidate[1])
        c.topk(1, 0, trace.topk[1]).host()
        c.flush()


def test_a_killed_daemon_releases_a_device_wait_with_an_empty_result():
    """Device wait: the daemon stopped, a TOPK sent that it never reads, then SIGKILLed.
    The client's watcher empties the entry's result and sets its done word: the stream
    goes on (no hang), reads no row, and the next call raises DaemonUnavailable."""
    import signal
    import threading
    import time

    import torch

    from sparsekv.client import DaemonUnavailable

    trace = small_trace(steps=3)
    lay = trace.layout()
    d = PrivateDaemon(pool_bytes=lay.pool_bytes + (8 << 20), backend="cuda", extra_args=ARENA, log_path=DAEMON_LOG)
    with d:
        c = Client(d.run_dir, device="cuda:0", device_wait=True).connect()
        c.attach(lay, engine="dw-kill")
        fill_pool(c, lay)
        c.step(0, trace.state_rows[0], trace.reset[0], trace.invalidate[0])
        c.topk(0, 0, trace.topk[0]).host()
        c.flush()
        os.kill(d.proc.pid, signal.SIGSTOP)
        c.step(1, trace.state_rows[1], trace.reset[1], trace.invalidate[1])
        r = c.topk(1, 0, trace.topk[1])  # sent; nobody reads it
        time.sleep(0.2)
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait(10)
        done = threading.Event()
        t0 = time.monotonic()
        threading.Thread(target=lambda: (torch.cuda.synchronize(), done.set()), daemon=True).start()
        assert done.wait(20), "the stream still waits on the dead daemon's done word"
        print(f"stream released {(time.monotonic() - t0) * 1e3:.0f} ms after the kill")
        s, m = r.host()
        assert (s == -1).all() and (m == 0).all()
        with pytest.raises(DaemonUnavailable):
            c.step(2, trace.state_rows[2])
            c.topk(2, 0, trace.topk[2])
        c._sock = None
        c.close()
