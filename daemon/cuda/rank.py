"""One rank on one GPU: the orchestration of its buffers, device step and transport.

:class:`CudaRankState` keeps the cpu rank's contract (``engine.RankState``), but its work
is enqueued, never waited on: bad values come back through the error record
(:meth:`CudaRankState.take_error`), counters from their pinned mirror.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from sparsekv.proto import LIMITS
from sparsekv.proto.cuda_ipc import EventRing, ImportedBuffer
from sparsekv.proto.device_errors import ErrorRecord

from ..engine import RankState
from ..residency.base import ResidencyError, as_ids, check_batch_shape
from ..residency.cuda import (
    HITS,
    MISSES,
    OUT_OF_RANGE,
    PF_HITS,
    PF_PREFETCHED,
    PF_WASTED,
    CudaMover,
    CudaResidency,
    DeviceBuffers,
    rows_block,
)
from .buffers import HostBlocks, RankBuffers
from .deferred import FreeFn, free_now
from .doorbell import DoorbellTransport
from .step import DeviceStep
from .transport import DeviceTransport, MessageTransport, ZmqTransport

log = logging.getLogger("sparsekv.cuda")

class CudaRankState(RankState):
    """A rank on one GPU. Same contract as the cpu rank; the work is enqueued, not waited.

    Args:
        rank: the client's TP rank.
        worker: the GPU's :class:`~sparsekv.daemon.cuda.backend.DeviceWorker`.
        space: the engine (layout, pool range, ranks).
        pinned: the engine's registered pool range.
        ring_depth: result ring entries.
        gather_blocks: the most blocks a gather uses (SMs are shared with attention).
        graphs: replay a CUDA graph per request (True) or launch kernel by kernel.
        blocks_path: the memfd name of the rank's pinned step blocks (None: anonymous).
        transport: ``"zmq"`` (steps arrive as messages) or ``"doorbell"`` (``doorbell.py``).
        engine_slab: an engine-owned slab (``engine.EngineSlabImport``): imported through
            CUDA IPC (closed with the rank), gathered into by its geometry.
        slab_owner: ``(ptr, nbytes) -> client id or None``: which other rank's engine slab
            overlaps these bytes of the imported one (an IPC handle opened again in this
            process maps to the same address, so one allocation given twice is seen).
        tp: a rank of a TP group (doorbell): its transport starts nothing; the group's
            leader stream serves it (``tp_doorbell.py``, once every rank has joined).
        prefetch: after each group's top-k, prefetch its rows into the next group's
            regions on the rank's stream (``DeviceStep.enqueue_prefetch``; zmq: once the
            result's event is recorded, by the rule of ``RankState.prefetch_next``;
            doorbell: in the step graph, after each group but the last).
        free: how its CUDA IPC imports (and pinned host blocks, without ``host_blocks``)
            are freed (``deferred.py``: those frees wait for every stream of the process, a
            parked doorbell stream too).
        host_blocks: ``(make, spare)``: where its pinned host blocks come from
            (``RankBuffers``'s ``make_host``) and go at close (None: new ones, then ``free``).
    """

    def __init__(self, rank: int, worker, space, pinned, ring_depth: int, gather_blocks: int,
                 graphs: bool = True, blocks_path: str | None = None, transport: str = "zmq",
                 engine_slab=None, prefetch: bool = False, free: FreeFn = free_now, host_blocks=None,
                 tp: bool = False, slab_owner=None):
        import cupy as cp

        lay = space.layout
        self._free = free
        make_host, self._spare_host = host_blocks if host_blocks is not None else (HostBlocks, None)
        self.space_name = space.name
        # One of a TP group (export: the leader's stream waits on its bells). Not `tp`: that is
        # RankState's field (the group, once joined), which its __init__ below sets to None.
        self.tp_member = tp
        self.worker, self._cp = worker, cp
        self.fence_events = None
        self.pinned = pinned
        self._keys_targets: dict[bytes, ImportedBuffer] = {}  # BLOCK_LOAD_KEYS buffers, by IPC handle
        self._keys_event: EventRing | None = None  # recorded after each load's copies
        self.engine_slab = None  # the imported engine-owned slab (ImportedBuffer)
        if engine_slab is not None:
            handle, offset = engine_slab.ipc
            try:
                self.engine_slab = ImportedBuffer(handle, offset, engine_slab.geometry.buffer_bytes, worker.ordinal)
            except (ValueError, RuntimeError) as e:  # a handle of another GPU, a short allocation, garbage
                raise ResidencyError("BAD_ARGUMENT", f"cannot import the engine's slab: {e}") from None
            if self.engine_slab.ptr % 16:
                self._close_slab()
                raise ResidencyError("BAD_ARGUMENT", "the engine's slab must start on a 16-byte boundary")
            other = None if slab_owner is None else slab_owner(self.engine_slab.ptr, self.engine_slab.nbytes)
            if other is not None:  # both ranks' rows would be gathered into the same bytes
                self._close_slab()
                raise ResidencyError("BAD_ARGUMENT", f"this engine slab's memory overlaps the slab of client {other}: "
                                     "each rank needs a slab of its own (memory no other rank's slab uses)")
        with cp.cuda.Device(worker.ordinal):
            stream = worker.stream
            try:
                residency = CudaResidency(lay, kernels=worker.kernels, stream=stream, prefetch=prefetch)
            except ValueError as e:  # (prefetch) a workspace beyond shared memory, max_batch > 65535
                self._close_slab()
                if not prefetch:
                    raise
                raise ResidencyError("BAD_LAYOUT", f"prefetch on the cuda backend: {e}; attach without it") from None
            ws = residency.workspace_bytes if residency.workspace_global else 0
            if transport not in ("zmq", "doorbell"):
                raise ResidencyError("BAD_ARGUMENT", f"unknown transport {transport!r}; use zmq or doorbell")
            try:
                self.buffers = bufs = RankBuffers(worker.arena, lay, ring_depth, ws, blocks_path,
                                                  doorbell=transport == "doorbell", own_slab=engine_slab is None,
                                                  prefetch=prefetch, make_host=make_host)
            except BaseException:
                self._close_slab()
                raise
            try:
                mover = CudaMover(lay, pinned, pool_offset=0, kernels=worker.kernels, stream=stream,
                                  buffers=DeviceBuffers(None, bufs.slab, bufs.staging, bufs.offsets["staging"]),
                                  blocks=gather_blocks,
                                  engine_slab=None if engine_slab is None
                                  else (self.engine_slab.ptr, engine_slab.geometry))
                self.dstep = DeviceStep(residency, mover, bufs, worker.kernels)
                self.events = EventRing(worker.ordinal, ring_depth)
                self.transport: MessageTransport | DeviceTransport = (
                    DoorbellTransport(self.dstep, worker, start=not tp) if transport == "doorbell"
                    else ZmqTransport(self.dstep, worker, self.events, graphs=graphs))
            except Exception:
                bufs.close(free, self._spare_host)
                self._close_slab()
                raise
        self.tp_device = None  # its TP group's device side (tp_doorbell.py), once added to it
        self._write_uploads: list = []  # events after the last staged write's uploads
        self._write_done = None  # event after the last staged write's kernel
        self._errors = ErrorRecord(bufs.host_err)  # counts already turned into replies
        super().__init__(rank=rank, device=f"cuda:{worker.ordinal}", residency=residency, mover=mover,
                         slab=bufs.slab, staging=bufs.staging, prefetch=prefetch)

    def _fed(self) -> MessageTransport:
        """The transport a STEP or TOPK message is enqueued on."""
        if self.device_driven:
            raise ResidencyError("BAD_ARGUMENT", "this rank attached with the doorbell transport: its steps come "
                                 "from its engine's stream (client/doorbell.py), not as STEP/TOPK messages")
        return self.transport

    def begin_step(self, step: int, state_rows, reset=None, invalidate=None, then=None) -> None:
        # A STEP's arrays are on the host here: checked as the cpu rank checks them (a bad
        # state row refuses the whole STEP in its reply, before anything is enqueued, so a
        # request after it is not run); so are the shapes of the TOPK it rides on (``then``:
        # all or nothing), the invalidated rows' values too. The top-k's values are the
        # kernels', and so are those of a step block an engine's kernel wrote.
        state_rows, reset, invalidate = self.check_step(state_rows, reset, invalidate)
        if then is not None:
            check_batch_shape(self.residency.layout, then[0], state_rows, as_ids("topk", then[1], 2))
        transport = self._fed()
        with self._cp.cuda.Device(self.worker.ordinal):
            transport.step(int(step), state_rows, reset, invalidate)
        self.step = int(step)
        self.state_rows = state_rows

    def serve_topk(self, step, group, topk, state_rows=None, fence=None):
        state_rows = self.batch_rows(step, state_rows)
        topk = as_ids("topk", topk, 2)
        wait = self._fence_wait(fence)
        transport = self._fed()
        with self._cp.cuda.Device(self.worker.ordinal):
            entry = transport.topk(int(step), int(group), state_rows, topk, wait)
        self._note_prefetch(step, group)
        batch, k = topk.shape
        # "tl": when the GPU work was enqueued (perf_counter_ns, like the envelope's tr, tx).
        return {"entry": entry, "batch": batch, "k": k, "tl": time.perf_counter_ns()}, None, {"topk_batches": 1}

    def serve_topk_block(self, step: int, group: int, entry: int, begin: bool, fence=None, done: int | None = None):
        """A TOPK (with ``begin``: and its STEP) the client wrote into its pinned block
        ``entry`` (``MessageTransport.topk_block``)."""
        transport = self._fed()
        with self._cp.cuda.Device(self.worker.ordinal):
            transport.topk_block(int(entry), bool(begin), self._fence_wait(fence), done)
        tl = time.perf_counter_ns()  # the GPU work (and the done word) is enqueued
        if begin:
            # The step's state rows are in the client's block, not here: a later TOPK of
            # this step sent as arrays must carry its own (batch_rows says so).
            self.step = int(step)
            self.state_rows = None
        self._note_prefetch(step, group)  # (the step and group the header names)
        return {"entry": int(entry), "tl": tl}, None, {"topk_batches": 1}

    def _note_prefetch(self, step: int, group: int) -> None:
        """After a TOPK was enqueued: leave the next group's prefetch pending by the cpu
        rank's rule (its rows are in the device block ``topk``, which nothing else
        touches before :meth:`run_prefetch`)."""
        if self.prefetch_next(int(step), int(group)):
            self.pending_prefetch = (int(group) + 1, None, None)

    def run_prefetch(self) -> dict:
        """Enqueue the pending prefetch (``ZmqTransport.prefetch``); no wait, no deltas."""
        self.pending_prefetch = None
        with self._cp.cuda.Device(self.worker.ordinal):
            self._fed().prefetch()
        return {}

    def prefetch_outcomes(self) -> dict:
        """None as deltas: a cuda rank's prefetch counters are in :meth:`counters` (from
        their pinned mirror, like its hits and misses; a doorbell rank sends no request
        that could carry deltas)."""
        return {}

    def release_topk_block(self, entry: int, done: int, fence: int | None = None) -> None:
        """A device-wait TOPK on ``entry`` failed: ``ZmqTransport.release_entry``, after the
        client's ``fence`` when it names one of its events."""
        if self.device_driven or not 0 <= int(entry) < self.buffers.ring_depth:
            return
        try:
            wait = self._fence_wait(fence)
        except ResidencyError:
            wait = None  # (the request's own error, reported in its reply)
        with self._cp.cuda.Device(self.worker.ordinal):
            self.transport.release_entry(int(entry), int(done), wait)

    def check_fence(self, fence) -> None:
        self._fence_wait(fence)

    def _fence_wait(self, fence):
        if fence is None:
            return None
        fence_events = self.fence_events
        if fence_events is None or not 0 <= fence < len(fence_events.ptrs):
            raise ResidencyError("BAD_ARGUMENT", f"fence {fence} names no event the client exported at attach")

        def wait(stream):
            # The client's reads of the slab (earlier steps) finish before we overwrite.
            fence_events.wait(fence, stream.ptr)
        return wait

    def load_keys(self, space, ids: np.ndarray, dst: dict, fence=None) -> dict:
        """BLOCK_LOAD_KEYS on this GPU: the indexer keys of blocks ``ids`` (checked: the
        caller's to read, ``dst["bytes"]`` enough) copied from the engine's page-locked keys
        plane into its exported buffer ``dst`` (block ``i`` of ``ids`` at ``dst["offset"] + i
        * block_bytes``), one ``cudaMemcpyAsync`` a run of consecutive blocks (cut where a
        registered chunk ends), on the GPU's bulk stream after the client's ``fence``; then
        the rank's keys event is recorded. Every offset and size is checked before anything
        is enqueued; nothing is waited for. Returns the reply's ``event`` (its IPC handle)."""
        cp = self._cp
        wait = self._fence_wait(fence)
        if dst["bus_id"].lower() != self.worker.bus_id:
            raise ResidencyError("BAD_ARGUMENT", f"dst is memory of GPU {dst['bus_id']}; this rank's GPU is "
                                 f"{self.worker.bus_id}")
        target = self._keys_target(dst["ipc_handle"])
        off, nbytes = dst["offset"], dst["bytes"]
        if off + nbytes > target.alloc_bytes:
            raise ResidencyError("BAD_ARGUMENT", f"dst [{off}, {off + nbytes}) passes the end of its allocation "
                                 f"({target.alloc_bytes} bytes)")
        copies = space.keys_copies(ids, self.pinned, target.ptr + off)
        stream = self.worker.bulk_stream
        with cp.cuda.Device(self.worker.ordinal):
            if self._keys_event is None:
                self._keys_event = EventRing(self.worker.ordinal, 1)
            if wait is not None:
                wait(stream)  # the engine's stream reached the load: nothing reads dst's old bytes
            for to, src, k in copies:
                cp.cuda.runtime.memcpyAsync(to, src, k, 1, stream.ptr)  # 1: host to device
            self._keys_event.record(0, stream)
        return {"event": self._keys_event.handles[0]}

    def _keys_target(self, handle: bytes) -> ImportedBuffer:
        """The engine's allocation of IPC ``handle``, imported once for this rank."""
        target = self._keys_targets.get(handle)
        if target is not None:
            return target
        if len(self._keys_targets) >= LIMITS.max_keys_targets:
            raise ResidencyError("BAD_ARGUMENT", f"this rank has loaded keys into {LIMITS.max_keys_targets} "
                                 "allocations already (each stays imported while it is attached): load into "
                                 "buffers you keep")
        try:
            target = ImportedBuffer(handle, 0, 1, self.worker.ordinal)
        except (ValueError, RuntimeError) as e:  # garbage, another GPU's, an exited exporter's, this process's own
            raise ResidencyError("BAD_ARGUMENT", f"cannot import the keys load's dst: {e}") from None
        arena = self.worker.arena
        if target.ptr < arena.ptr + arena.nbytes and arena.ptr < target.ptr + target.alloc_bytes:
            self._free("imported keys buffer", target.alloc_bytes, target.close)
            raise ResidencyError("BAD_ARGUMENT", "dst is the daemon's own arena: load into the engine's memory")
        self._keys_targets[handle] = target
        return target

    def take_error(self) -> ResidencyError | None:
        """The first error the kernels recorded since the last call, as the cpu backend's
        typed error (read from the pinned mirror of the error record: no wait). Every kind
        counted meanwhile is marked reported; the others are logged. A doorbell rank's
        errors are its engine's to read (its handle's ``check()``), never a request's."""
        if self.device_driven:
            return None
        found = self._errors.take()
        for code, msg in found[1:]:
            log.warning("rank %d: also %s: %s", self.rank, code, msg)
        return ResidencyError(*found[0]) if found else None

    def error_counts(self) -> dict[str, int]:
        """Rows refused or mended on this rank by kind (from the pinned mirror)."""
        return self._errors.counts()

    def write_staged(self, space, layers, rows, fence=None):
        """Staging buffer -> host pool on this GPU's stream (the write-mirror kernel), after
        the client's fence. Every other rank's stream then waits for it, and every rank
        drops its hot copies of ``rows`` in stream order. Returns when enqueued; slots
        dropped are not counted (that would need a readback)."""
        cp = self._cp
        wait = self._fence_wait(fence)  # checks the fence before anything is written
        bufs = self.buffers
        n = int(rows.shape[0])
        stream = self.worker.stream
        # The pinned write blocks are reused: the previous write's uploads must be done.
        # Each upload is enqueued before anything that waits on a client (fences, other
        # streams), so this waits at most for work already queued ahead of it.
        for ev in self._write_uploads:
            ev.synchronize()
        self._write_uploads = []
        bufs.host_write_rows[0] = n
        bufs.host_write_rows[1 : 1 + n] = rows
        bufs.host_drop_rows[:] = rows_block(rows, space.layout.staging_rows)
        bufs.host_layers[: len(layers)] = layers
        others = [o for o in space.ranks.values() if o.worker.stream is not stream and not o.device_driven]
        with cp.cuda.Device(self.worker.ordinal), stream:
            _upload(bufs.write_rows, bufs.host_write_rows, stream)
            _upload(bufs.layers, bufs.host_layers, stream)
            up = cp.cuda.Event(disable_timing=True)
            up.record(stream)
            self._write_uploads.append(up)
            if wait is not None:
                wait(stream)
        # Gathers already queued on other GPUs' streams read the pool rows being
        # rewritten: the write starts after them.
        for other in others:
            with cp.cuda.Device(other.worker.ordinal):
                queued = cp.cuda.Event(disable_timing=True)
                queued.record(other.worker.stream)
            with cp.cuda.Device(self.worker.ordinal):
                stream.wait_event(queued)
        with cp.cuda.Device(self.worker.ordinal), stream:
            self.mover.launch_write_staged(bufs.layers, len(layers), bufs.write_rows, stream)
            written = cp.cuda.Event(disable_timing=True)
            written.record(stream)
            self._write_done = written
        for other in space.ranks.values():
            if other.device_driven:
                continue  # its engine passes rewritten rows to begin_step (doorbell.py)
            with cp.cuda.Device(other.worker.ordinal):
                s = other.worker.stream
                _upload(other.buffers.drop_rows, bufs.host_drop_rows, s)
                up = cp.cuda.Event(disable_timing=True)
                up.record(s)
                self._write_uploads.append(up)
                if s is not stream:
                    # The pool rows change on this GPU's stream: no later gather of another
                    # rank (any GPU) may start before that copy is done.
                    s.wait_event(written)
                other.residency.invalidate_async(other.buffers.drop_rows, space.layout.staging_rows, stream=s)
        return n * len(layers) * space.layout.row_bytes, 0

    def drop_rewritten(self, rows):
        if self.device_driven:  # its engine passes rewritten rows to begin_step (doorbell.py)
            return 0
        with self._cp.cuda.Device(self.worker.ordinal):
            return self.residency.invalidate_everywhere(rows)

    def stage(self, rows, layers=None):
        with self._cp.cuda.Device(self.worker.ordinal):
            return super().stage(rows, layers)

    def quiesce(self) -> None:
        self.worker.stream.synchronize()

    def quiesce_keys(self) -> None:
        if self._keys_event is not None:  # this rank has loaded keys: one may still read them
            self.worker.bulk_stream.synchronize()

    def counters(self) -> dict:
        """Counters (the prefetch's too) from the pinned mirrors the device step copies out
        after each request: no synchronisation (a scrape never stalls the copy stream; it may lag by the
        requests still in flight)."""
        c = self.buffers.host_counters
        lay = self.residency.layout
        layers = np.array([len(g) for g in lay.groups], dtype=np.uint64)
        misses = c[:, MISSES]
        moved = int((misses * layers).sum())
        pf = self.buffers.host_pf  # zero without prefetch
        return {"hits": int(c[:, HITS].sum()), "misses": int(misses.sum()),
                "out_of_range": int(c[:, OUT_OF_RANGE].sum()),
                "rows_moved": moved, "bytes_moved": moved * lay.row_bytes,
                "prefetched": int(pf[PF_PREFETCHED]), "prefetch_hits": int(pf[PF_HITS]),
                "prefetch_wasted": int(pf[PF_WASTED])}

    def export(self) -> dict:
        out = self.buffers.export(self.worker.ordinal, self.worker.bus_id, self.events.handles)
        if "doorbell" in out:  # begin_step checks its invalidate width on the engine's side
            out["doorbell"]["inv_cap"] = self.residency.inv_cap
            # Only this GPU's stream waits on the rank's group bells unless it is one of a
            # TP group (the leader's stream waits on every member's, from its own GPU).
            out["doorbell"]["bells_local"] = not self.tp_member
        return out

    @property
    def device_driven(self) -> bool:
        """True when the engine's stream drives this rank (doorbell transport)."""
        return isinstance(self.transport, DeviceTransport)

    def failure(self) -> str | None:
        """Why this rank's GPU work can no longer be served (its transport), or None."""
        return self.transport.failure()

    def close(self) -> bool:
        """Wait for this rank's work, then free its graphs, events, host blocks and ranges.
        Returns False (and frees nothing) if the rank's stream did not drain: it may still
        touch every one of them."""
        if self.tp_device is not None and not self.tp_device.remove(self.rank):
            return False  # the group's stream, which reads this rank's memory, did not drain
        if not self.transport.close():
            return False
        # Its last staged write (a doorbell rank's too) runs on the GPU's shared stream and
        # its uploads read this rank's host blocks on every rank's stream: done before the
        # blocks become a spare, its ranges another rank's and its pool range another
        # engine's. (Those streams never wait on a doorbell stream.)
        if self._write_done is not None:
            self._write_done.synchronize()
        for ev in self._write_uploads:
            ev.synchronize()
        self._write_uploads, self._write_done = [], None
        if self.fence_events is not None:
            events, self.fence_events = self.fence_events, None
            self._free("imported fence events", 0, events.close)
        self.buffers.close(self._free, self._spare_host)
        self._close_slab()  # the stream is drained: nothing writes it any more
        if self._keys_targets or self._keys_event is not None:
            self.worker.bulk_stream.synchronize()  # its loads' copies write them
            for target in self._keys_targets.values():
                self._free("imported keys buffer", target.alloc_bytes, target.close)
            self._keys_targets = {}
            self._keys_event = None
        return True

    def _close_slab(self) -> None:
        """Close the import of the engine's slab (through ``free``)."""
        slab, self.engine_slab = self.engine_slab, None
        if slab is not None:
            self._free("imported engine slab", slab.nbytes, slab.close)


def _upload(dst, src: np.ndarray, stream) -> None:
    """Host (pinned) -> device copy of ``src``'s bytes on ``stream``, asynchronous."""
    import cupy as cp

    cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.ctypes.data, src.nbytes, 1, stream.ptr)
