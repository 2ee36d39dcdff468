"""The doorbell transport: a rank whose steps the engine's own stream drives.

The engine's stream writes the step blocks straight into this rank's ``db_*`` sections of
the arena (CUDA IPC) and rings words there with stream memory operations
(``proto/stream_ops.py``); the daemon's stream, stocked ahead with one CUDA graph per
step, waits on those words, runs the same device step as the zmq transport, and sets a
ready word per layer (``_enqueue_step``: one step graph, captured once at attach); with
prefetch, each group but the last then prefetches its rows into the next group's regions.
No host code of either process sits between a top-k and its rows.

A stocking thread keeps ``depth`` step graphs launched ahead on the rank's own stream
(never the GPU worker's shared stream: it spends its life waiting on this engine's
bells). Closing stops the thread, then rings every bell from the host until the stocked
graphs have run out (they resolve the last step's blocks again: harmless), so the stream
drains and the rank's memory can be given back.

Writes (``WRITE``, ``WRITE_STAGED``) are not ordered against a doorbell rank's stream,
and do not drop its hot copies (its residency belongs to its stream): its engine passes
rewritten rows to the next ``begin_step`` as ``invalidate``, and rewrites only rows no
step in flight reads (new KV rows).

While the stream waits on a bell, other work of this process on the GPU may wait behind
it: readbacks run on the residency's stream, never the legacy one (see also ``close``).
"""

from __future__ import annotations

import logging
import threading
import time

from sparsekv.proto.stream_ops import graph_launch, wait32, write32

from .step import capture
from .transport import DeviceTransport

log = logging.getLogger("sparsekv.cuda")

DEPTH = 2  # step graphs launched ahead (a launch must never block: see _stock)
DRAIN_TIMEOUT_S = 10.0


class DoorbellTransport(DeviceTransport):
    """Args:
        dstep: the rank's :class:`~sparsekv.daemon.cuda.step.DeviceStep` (its buffers have
            the ``db_*`` sections).
        worker: the GPU's worker (``ordinal``).
        depth: step graphs kept launched ahead.
    """

    def __init__(self, dstep, worker, depth: int = DEPTH, start: bool = True):
        import cupy as cp

        self.dstep, self.worker = dstep, worker
        self.buffers = b = dstep.buffers
        if not b.doorbell:
            raise ValueError("rank buffers were made without the doorbell sections")
        self.layout = dstep.layout
        self.depth = int(depth)
        ctl = b.db_ctl.data.ptr
        G, L = self.layout.num_groups, self.layout.num_layers
        self._bell_step = ctl
        self._bells = [ctl + 4 * (1 + g) for g in range(G)]
        self._ready = [ctl + 4 * (1 + G + layer) for layer in range(L)]
        with cp.cuda.Device(worker.ordinal):
            self.stream = cp.cuda.Stream(non_blocking=True)
            # The gathers' arrival counters, one per layer: zeroed here, back at 0 after
            # each gather; they live as long as the stream may run. Zeroed on this stream,
            # ahead of the step graphs it runs: no wait (a device-wide one would also wait
            # for another doorbell rank's stream, which waits on its engine's bells).
            with self.stream:
                self._arrivals = cp.zeros(L, dtype=cp.uint32)
        self.graph = None
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.bells_extra: list[int] = []  # other ranks' words this stream waits on (a TP group's leader)
        if start:
            self.start(self._enqueue_step)

    def start(self, enqueue_step) -> None:
        """Capture ``enqueue_step(stream)`` as this rank's step graph and keep it stocked
        (a TP group's leader: the group's step; ``tp_doorbell.py``)."""
        self.graph = capture(enqueue_step, self.worker.ordinal)
        self._thread = threading.Thread(target=self._stock, name=f"sparsekv-doorbell-{self.worker.ordinal}",
                                        daemon=True)
        self._thread.start()

    @property
    def bell_addresses(self) -> list[int]:
        """Its step bell and its group bells (device addresses), the order they are rung."""
        return [self._bell_step, *self._bells]

    @property
    def ready_addresses(self) -> list[int]:
        return list(self._ready)

    @property
    def stop_address(self) -> int:
        """The rank's stop word: once set, the engine's ``skv_db_indices`` answers -1 and its
        handle releases its stream (a TP group stopped under it)."""
        return self.buffers.db_ctl.data.ptr + 4 * (1 + self.layout.num_groups + self.layout.num_layers)

    @property
    def arrivals(self):
        return self._arrivals

    def _wait_bell(self, stream, address: int, cleared_by_kernel: bool = False) -> None:
        """Wait until the word at ``address`` is 1 and set it to 0 again; with
        ``cleared_by_kernel`` the next kernel clears it (skv_resolve's ``clear``)."""
        wait32(stream.ptr, address, 1)
        if not cleared_by_kernel:
            write32(stream.ptr, address, 0)

    def _enqueue_step(self, stream) -> None:
        b, d = self.buffers, self.dstep
        self._wait_bell(stream, self._bell_step)
        d.residency.launch_begin_step(b.db_step.desc, b.db_step.rows, b.db_step.aux, b.db_step.payload, b.err,
                                      b.max_batch, stream)
        for g, layers in enumerate(self.layout.groups):
            t = b.db_topk[g]
            self._wait_bell(stream, self._bells[g], cleared_by_kernel=True)
            d.enqueue_resolve(t, b.db_slots[g], b.db_misses[g], stream, clear=self._bells[g])
            last = g == self.layout.num_groups - 1
            if last:
                # Before the last ready word: once the engine's stream has passed a step,
                # the step's counters and errors are in the pinned mirror (check()).
                d.enqueue_stats_out(stream)
            for i, layer in enumerate(layers):
                # The first one marks the block's slots written (D_SLOTS): the engine's
                # polling skv_db_indices makes its indices while the rows still come.
                d.enqueue_gather(t, b.db_misses[g], stream, group_layers=b.db_layers[layer],
                                 ready=self._ready[layer], arrivals=self._arrivals.data.ptr + 4 * layer,
                                 after_resolve=i == 0 and not last, mark_slots=i == 0)
            if b.prefetch and g + 1 < self.layout.num_groups:
                # After group g's ready words (its layers do not wait for it), before group
                # g + 1's bell: its resolve finds the rows as hits, its ready words come after
                # their bytes. The groups run in order within the step, so group g + 1 has had
                # no batch of this step yet (DESIGN §4's rule holds by construction).
                # Its counters go out with the last group's (after every prefetch of the step).
                d.enqueue_prefetch(t, stream, stats_out=False)

    def _stock(self) -> None:
        import cupy as cp

        graph = self.graph
        if getattr(graph, "graphExec", 0) == 0 and hasattr(graph, "_ensure_instantiate"):
            graph._ensure_instantiate()
        exec_ptr = graph.graphExec
        try:
            with cp.cuda.Device(self.worker.ordinal):
                inflight: list = []
                while not self._stop.is_set():
                    while inflight and inflight[0].done:
                        inflight.pop(0)
                    if len(inflight) >= self.depth:
                        time.sleep(0.0002)
                        continue
                    graph_launch(exec_ptr, self.stream.ptr)  # the GIL is free while it runs
                    ev = cp.cuda.Event(block=False, disable_timing=True)
                    ev.record(self.stream)
                    inflight.append(ev)
        except BaseException as e:  # noqa: BLE001 - the daemon exits (failure())
            self._error = e
            log.critical("doorbell stocking thread of GPU %d failed: %r", self.worker.ordinal, e)

    def failure(self) -> str | None:
        """Why this rank's stream can no longer serve its engine (a stocking thread that died
        leaves the engine's stream waiting on a ready word for ever: the daemon exits), or None."""
        if self._error is not None:
            return f"the doorbell stream of GPU {self.worker.ordinal} stopped: {self._error!r}"
        return None

    def close(self) -> bool:
        """Stop stocking; ring the bells until the stocked steps have drained. False if the
        stream did not drain: it may still touch the rank's memory and the engine's pinned
        pool, so nothing of it may be freed or reused (the daemon exits)."""
        import cupy as cp

        self._stop.set()
        if self._thread is None:  # never started (a TP follower: the leader's stream serves it)
            self._arrivals = None
            return True
        self._thread.join()
        G = self.layout.num_groups
        bells = [self.buffers.db_ctl.data.ptr + 4 * i for i in range(1 + G)] + self.bells_extra
        with cp.cuda.Device(self.worker.ordinal):
            done = cp.cuda.Event(block=False, disable_timing=True)
            done.record(self.stream)
            side = cp.cuda.Stream(non_blocking=True)
            rung = cp.cuda.Event(block=False, disable_timing=True)
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            while not done.done:
                if time.monotonic() > deadline:
                    log.error("doorbell stream of GPU %d did not drain in %.0f s; its memory stays allocated",
                              self.worker.ordinal, DRAIN_TIMEOUT_S)
                    return False
                # Stream memory operations, never a kernel: a CuPy kernel's first launch
                # loads a module, which waits for the context's streams, this parked one too.
                for address in bells:
                    write32(side.ptr, address, 1)
                rung.record(side)
                while not rung.done and time.monotonic() < deadline:  # never an unbounded synchronize
                    time.sleep(0.0002)
                time.sleep(0.0002)
        self.graph = None
        self._arrivals = None
        return True
