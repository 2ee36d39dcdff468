"""``sparsekv bench transport`` and ``cuda_transport``: a decode step through a daemon
against the same step in this process.

* ``transport``: a cpu daemon over zmq against the in-process engine.
* ``cuda_transport``: a cuda daemon over zmq against the same device step run in this
  process, beside a bare ZMTP + CUDA IPC event round trip; as installed, or with the
  daemon's loop thread on a warm CPU (deploy/README.md "Warm CPUs").
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import tempfile
import time

import socket

import numpy as np

from sparsekv.client.client import Client
from sparsekv.client.wire import Wire
from sparsekv.daemon.cuda.backend import DeviceWorker
from sparsekv.daemon.cuda.rank import CudaRankState
from sparsekv.daemon.engine import EngineSpace
from sparsekv.daemon.kernels import get_cache
from sparsekv.daemon.zmtp import READY as DAEMON_READY
from sparsekv.daemon.pinned import PinnedRegion
from sparsekv.daemon.pool import HostPool
from sparsekv.embedded.inproc import InprocClient
from sparsekv.proto import MsgType
from sparsekv.proto import zmtp
from sparsekv.proto.cpus import keep_off
from sparsekv.proto.cuda_ipc import EventRing, ImportedEvents
from sparsekv.proto.settings import BENCH_DAEMON_LOG

from .private_daemon import PrivateDaemon
from .synth import synth


def bench_transport(steps=100, batch=8, top_k=256) -> dict:
    tr = synth(steps=steps, batch=batch, top_k=top_k, region_stride=2 * top_k, max_reqs=2 * batch,
               host_rows=2 * batch * 4096, num_layers=2, context=2048, seed=3)
    lay = tr.layout()

    def run(client) -> np.ndarray:
        client.attach(lay, engine="bench")
        lat = np.zeros(tr.steps)
        for t in range(tr.steps):
            t0 = time.perf_counter()
            client.step(t, tr.state_rows[t], tr.reset[t], tr.invalidate[t])
            client.topk(t, 0, tr.topk[t])
            lat[t] = time.perf_counter() - t0
        client.detach()
        return lat * 1e6

    with InprocClient() as c:
        base = run(c)
    with PrivateDaemon(pool_bytes=lay.pool_bytes + (8 << 20), backend="cpu") as d, Client(d.run_dir, name="bench") as c:
        over = run(c)
    p50b, p50z = float(np.median(base)), float(np.median(over))
    return {"bench": "transport", "steps": steps, "batch": batch, "top_k": top_k,
            "inproc_p50_us": round(p50b, 1), "zmq_p50_us": round(p50z, 1),
            "zmq_p99_us": round(float(np.percentile(over, 99)), 1),
            "zmq_overhead_us": round(p50z - p50b, 1), "ratio_vs_inproc": round(p50z / p50b, 3)}


def _bare_server(path: str, ready, handles, busy_poll_us: int = 1000, io_cpus=()) -> None:
    """A bare ZMTP + CUDA IPC event echo (the floor of any cross-process hand-off): the
    daemon's end of a client's connection with nothing behind it, each request ("go", one
    frame) answered at once after recording an interprocess event on a stream. Polls like
    sparsekvd: busy for ``busy_poll_us`` after a request, then sleeps; with ``io_cpus``,
    its thread there (like the daemon's loop) and the rest off them."""
    import select  # noqa: PLC0415

    import cupy as cp  # noqa: PLC0415

    keep_off(io_cpus)  # the threads CUDA starts with its context: off the loop's CPUs
    ring = EventRing(0, 1)
    stream = cp.cuda.Stream(non_blocking=True)
    if io_cpus:
        os.sched_setaffinity(0, io_cpus)  # then this thread (the loop) there
    lsock = socket.socket(socket.AF_UNIX)
    lsock.bind(path)
    lsock.listen(1)
    handles.put(ring.handles)
    ready.set()
    conn, _ = lsock.accept()
    conn.sendall(zmtp.GREETING)
    got = b""
    while len(got) < zmtp.GREETING_LEN + 2 or len(got) < zmtp.GREETING_LEN + 2 + got[zmtp.GREETING_LEN + 1]:
        got += conn.recv(4096)  # the client's greeting, then its READY (a short command frame)
    conn.sendall(DAEMON_READY)
    conn.setblocking(False)
    go = zmtp.frame_header(2) + b"go"  # the one request; anything else ("stop") ends it
    last = time.perf_counter_ns()
    while True:
        try:
            msg = conn.recv(64)
        except BlockingIOError:
            if time.perf_counter_ns() - last > busy_poll_us * 1000:
                select.select([conn], [], [], 1.0)
            continue
        if msg != go:
            conn.sendall(zmtp.frame_header(3) + b"bye")
            break
        ring.record(0, stream)
        conn.sendall(zmtp.frame_header(2) + b"ok")
        last = time.perf_counter_ns()
    conn.close()
    lsock.close()


class _BareRoundTrip:
    """The client side of :func:`_bare_server`: the client's own connection
    (:class:`~sparsekv.client.wire.Wire`), send, spin for the reply like a cuda Client,
    make a stream wait on the event, synchronise it."""

    def __init__(self, stack, spin_us: int = 500, server_io_cpus=()):
        import cupy as cp  # noqa: PLC0415

        ctx = multiprocessing.get_context("spawn")
        path = os.path.join(stack.enter_context(tempfile.TemporaryDirectory()), "bare.sock")
        ready, handles = ctx.Event(), ctx.Queue()
        self.proc = ctx.Process(target=_bare_server, args=(path, ready, handles, 1000, tuple(server_io_cpus)),
                                daemon=True)
        self.proc.start()
        if not ready.wait(60):
            raise RuntimeError("bare ZMTP server did not start")
        self.events = ImportedEvents(handles.get(timeout=10), 0)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.wire = Wire.connect(path, timeout_s=10)
        self.spin_ns = spin_us * 1000
        stack.callback(self.close)

    def once(self) -> float:
        t0 = time.perf_counter_ns()
        self.wire.send([b"go"])
        end = t0 + self.spin_ns
        while not self.wire.ready() and time.perf_counter_ns() < end:
            pass
        while not self.wire.wait(1000):
            pass
        self.wire.recv()
        self.events.wait(0, self.stream.ptr)
        self.stream.synchronize()
        return (time.perf_counter_ns() - t0) * 1e-9

    def close(self) -> None:
        self.wire.send([b"stop"])
        self.wire.wait(10000)
        self.wire.close()
        self.proc.join(10)
        self.events.close()


def bench_cuda_transport(steps=200, batch=16, top_k=2048, region_stride=4096, num_layers=1, seed=5,
                         device_wait: bool = False, warm_io: bool = False) -> dict:
    """A decode step through a cuda daemon over zmq (STEP + TOPK, wait for the event,
    slots to the host) against the same device step run in this process on the same GPU
    (no socket): the difference is the cross-process hand-off (run it under MPS), beside a
    bare ZeroMQ + IPC event round trip timed step by step in the same window. The header
    timestamps split the zmq step into client, socket and daemon time. ``device_wait``:
    the same steps through a second rank with ``Client(device_wait=True)``
    (``zmq_device_wait_*`` keys). ``warm_io``: the daemon's loop thread on a warm CPU (the
    last this process may use; deploy/README.md "Warm CPUs"), the bare server's on the one
    before (warm too: each busy-polls a millisecond after its request, and the steps
    alternate between them), every other thread off both (the client has no thread of its
    own: its caller's thread does the I/O)."""
    import cupy as cp  # noqa: PLC0415

    tr = synth(steps=steps, batch=batch, top_k=top_k, region_stride=region_stride, max_reqs=2 * batch,
               host_rows=2 * batch * 16384, num_layers=num_layers, context=12000, lifetime=steps,
               arrive=1.0, pad=0.0, invalidate=0.0, out_of_range=0.0, share_prefix=0.0, overlap=0.8, seed=seed)
    lay = tr.layout()
    # Both paths in one window, step by step, so that drift of the machine does not land
    # in the difference. In process: a rank of the daemon's own kind, driven directly.
    daemon_args, daemon_io, bare_io = ["--device-arena-size", "4GiB"], (), ()
    if warm_io:
        allowed = sorted(os.sched_getaffinity(0))
        if len(allowed) < 3:
            raise ValueError(f"warm_io needs 3 CPUs or more (the daemon's loop, the bare server, the rest), this "
                             f"process may use {len(allowed)}")
        daemon_io, bare_io = (allowed[-1],), (allowed[-2],)
        daemon_args += ["--io-cpus", str(allowed[-1]), "--warm-cpus", f"{allowed[-2]},{allowed[-1]}"]
    with contextlib.ExitStack() as stack:
        if warm_io:
            stack.callback(os.sched_setaffinity, 0, os.sched_getaffinity(0))
            keep_off(daemon_io + bare_io)
        pool = stack.enter_context(HostPool(lay.pool_bytes + (2 << 20)))
        pinned = PinnedRegion(pool.address, lay.pool_bytes, lay.row_bytes)
        stack.callback(pinned.close)
        worker = DeviceWorker(0, 2 << 30, get_cache())
        stack.callback(worker.close)
        space = EngineSpace("bench", lay, pool.view(0, (lay.num_layers, lay.host_rows, lay.row_bytes)), 0)
        rank = CudaRankState(0, worker, space, pinned, ring_depth=8, gather_blocks=32)
        stack.callback(rank.close)
        d = stack.enter_context(PrivateDaemon(pool_bytes=lay.pool_bytes + (8 << 20), backend="cuda",
                                              extra_args=daemon_args,
                                              log_path=BENCH_DAEMON_LOG.get() or None))
        c = stack.enter_context(Client(d.run_dir, name="bench", device="cuda:0", device_wait=False))
        c.attach(lay, engine="bench")
        cw = None
        if device_wait:
            cw = stack.enter_context(Client(d.run_dir, rank=1, name="bench-device-wait", device="cuda:0",
                                            device_wait=True))
            cw.attach(lay, engine="bench")
        bare_rt = _BareRoundTrip(stack, server_io_cpus=bare_io)
        bare, base, over, reply, dwait, daemon_host, sock_in, sock_out = np.zeros((8, steps))
        enqueue, to_enqueue = np.full(steps, np.nan), np.full(steps, np.nan)
        for t in range(steps):
            with cp.cuda.Device(0):
                t0 = time.perf_counter()
                rank.begin_step(t, tr.state_rows[t], tr.reset[t], tr.invalidate[t])
                f, _, _ = rank.serve_topk(t, 0, tr.topk[t])
                worker.stream.synchronize()
                rank.buffers.slots[f["entry"], :batch, :top_k].get()
                base[t] = time.perf_counter() - t0
            t0 = time.perf_counter()
            c.step(t, tr.state_rows[t], tr.reset[t], tr.invalidate[t])
            r = c.topk(t, 0, tr.topk[t])
            reply[t] = time.perf_counter() - t0  # the daemon has enqueued the work
            r.host()
            over[t] = time.perf_counter() - t0
            # The STEP rides on the TOPK (client.step): one request does both.
            k_ts, k_tr, k_tx, k_rx = c.timings[MsgType.TOPK]
            daemon_host[t] = k_tx - k_tr
            if c.enqueued_at is not None:  # the reply's "tl": the GPU work was enqueued
                enqueue[t] = c.enqueued_at - k_tr
                to_enqueue[t] = c.enqueued_at - k_ts
            sock_in[t] = k_tr - k_ts
            sock_out[t] = k_rx - k_tx
            if cw is not None:
                t0 = time.perf_counter()
                cw.step(t, tr.state_rows[t], tr.reset[t], tr.invalidate[t])
                cw.topk(t, 0, tr.topk[t]).host()  # host() synchronises the stream: the done word
                dwait[t] = time.perf_counter() - t0
            bare[t] = bare_rt.once()
        if cw is not None:
            cw.flush()  # every reply read: an error in any would be raised here
        daemon_stats = c.stats()
        daemon_us, warm_running = daemon_stats["topk_latency_us"], daemon_stats.get("warm_cpus_running", 0)
    warm = slice(10, None)  # the first steps fault in state and caches
    b, z = base[warm] * 1e6, over[warm] * 1e6

    def p50(a, scale=1.0):
        return round(float(np.median(a[warm])) * scale, 1)

    extra = {}
    if device_wait:
        # (The daemon's topk latency then counts both ranks' requests.)
        extra = {"zmq_device_wait_p50_us": p50(dwait, 1e6),
                 "zmq_device_wait_handoff_p50_us": round(float(np.median(dwait[warm]) * 1e6 - np.median(b)), 1)}
    if warm_io:
        extra.update(io_cpus=f"daemon {daemon_io[0]}, bare server {bare_io[0]}", warm_cpus_running=warm_running)
    return {**extra, "bench": "cuda_transport", "warm_io": warm_io, "steps": steps, "batch": batch, "top_k": top_k,
            "region_stride": region_stride, "layers": num_layers,
            "inproc_p50_us": round(float(np.median(b)), 1), "inproc_p99_us": round(float(np.percentile(b, 99)), 1),
            "zmq_p50_us": round(float(np.median(z)), 1), "zmq_p99_us": round(float(np.percentile(z, 99)), 1),
            "zmq_reply_p50_us": p50(reply, 1e6),
            "daemon_host_us_per_step": p50(daemon_host, 1e-3),
            # Of it, until the GPU work is enqueued (what a device-wait client waits for),
            # and from the client's send to that point.
            "daemon_enqueue_p50_us": _nanp50(enqueue[warm], 1e-3),
            "send_to_enqueue_p50_us": _nanp50(to_enqueue[warm], 1e-3),
            "topk_socket_in_p50_us": p50(sock_in, 1e-3), "topk_socket_out_p50_us": p50(sock_out, 1e-3),
            "daemon_topk_p50_us": round(daemon_us["p50"], 1),
            "zmq_handoff_p50_us": round(float(np.median(z) - np.median(b)), 1),
            # The floor in the same window: a bare ZMTP request/reply plus a CUDA IPC event wait.
            "bare_zmq_event_rtt_p50_us": p50(bare, 1e6),
            "handoff_vs_bare_rtt": round(float((np.median(z) - np.median(b)) / (np.median(bare[warm]) * 1e6)), 3),
            "ratio_vs_inproc": round(float(np.median(z) / np.median(b)), 3)}


def _nanp50(a, scale: float):
    """Median of the measured entries of ``a`` (NaN: not measured), or None."""
    a = a[~np.isnan(a)]
    return round(float(np.median(a)) * scale, 1) if a.size else None
