"""How a step reaches a cuda rank's device step: fed by messages
(:class:`MessageTransport`, :class:`ZmqTransport` here) or driven by the engine's stream
(:class:`DeviceTransport`, ``doorbell.py``).
"""

from __future__ import annotations

import abc

import numpy as np

from sparsekv.proto.step_block import write_step, write_topk
from sparsekv.proto.stream_ops import write32

from ..residency.base import as_ids
from ..residency.base import ResidencyError
from .step import capture


class Transport(abc.ABC):
    """Moves a rank's steps onto its device step; owns whatever staging that takes."""

    @abc.abstractmethod
    def failure(self) -> str | None:
        """Why the rank's GPU work can no longer be served (the daemon then exits), or None."""

    @abc.abstractmethod
    def close(self) -> bool:
        """Wait for work in flight and free what the transport holds. False when that
        work did not drain: then nothing it may touch can be freed or reused."""


class MessageTransport(Transport):
    """Fed by messages: the daemon enqueues each STEP and TOPK it receives. ``fence``: a
    callable that makes a stream wait for the client's fence event, or None."""

    @abc.abstractmethod
    def step(self, step: int, state_rows: np.ndarray, reset, invalidate) -> None:
        """Enqueue a STEP (its resets and invalidations)."""

    @abc.abstractmethod
    def topk(self, step: int, group: int, state_rows: np.ndarray, topk: np.ndarray, fence=None) -> int:
        """Enqueue a TOPK; return the result ring entry whose event the client waits on."""

    @abc.abstractmethod
    def topk_block(self, entry: int, begin: bool, fence=None, done: int | None = None) -> int:
        """Enqueue a TOPK (with ``begin``: and its STEP) the client wrote into its pinned
        block ``entry``; ``done``: the value its done word takes once the result is in
        place (a device-wait client's stream waits on it). Returns ``entry``."""

    @abc.abstractmethod
    def release_entry(self, entry: int, done: int, fence=None) -> None:
        """A device-wait TOPK on ``entry`` failed: set its done word to ``done`` anyway."""

    @abc.abstractmethod
    def prefetch(self) -> None:
        """Enqueue the prefetch of the last TOPK's rows into the next group's regions
        (``DeviceStep.enqueue_prefetch``), after its result's event: off the client's wait."""


class DeviceTransport(Transport):
    """Driven by the device: the engine's stream writes the step blocks and rings the
    rank's words; no message carries a step (``doorbell.py``)."""


class ZmqTransport(MessageTransport):
    """Steps that arrived as ZeroMQ messages, replayed as one CUDA graph each; the host
    checks shapes only (the kernels check values). Per ring entry ``e``, a pinned STEP
    block and a pinned TOPK block, each with a graph captured at attach; the entry's event
    (TOPK: the client's IPC event) guards the block's reuse ``ring_depth`` requests later.

    Args:
        dstep: the rank's :class:`~sparsekv.daemon.cuda.step.DeviceStep`.
        worker: the GPU's worker (its ``stream`` runs the graphs; ``ordinal``).
        events: the rank's :class:`~sparsekv.proto.cuda_ipc.EventRing` (TOPK results).
        graphs: replay captured graphs (True) or launch kernel by kernel (False).
    """

    def __init__(self, dstep, worker, events, graphs: bool = True):
        import cupy as cp

        self.dstep, self.worker, self.events = dstep, worker, events
        self.buffers = b = dstep.buffers
        self.layout = dstep.layout
        self.max_batch, self.top_k = b.max_batch, self.layout.top_k
        self.inv_cap = dstep.residency.inv_cap
        self._seq = 0
        self._step_next = 0
        with cp.cuda.Device(worker.ordinal):
            self._step_done = [cp.cuda.Event(block=False, disable_timing=True) for _ in range(b.ring_depth)]
        self._step_used = [False] * b.ring_depth
        self._topk_used = [False] * b.ring_depth
        self._done_set = [None] * b.ring_depth  # per entry: the last done value enqueued
        self.graphs = bool(graphs)
        self._step_graphs, self._topk_graphs = [], []
        self._cboth_graphs, self._ctopk_graphs = [], []
        if self.graphs:
            for e in range(b.ring_depth):
                self._step_graphs.append(capture(
                    lambda s, e=e: dstep.enqueue_step_request(b.host_step[e][1], s), worker.ordinal))
                self._topk_graphs.append(capture(
                    lambda s, e=e: dstep.enqueue_topk_request(e, b.host_topk[e][1], s), worker.ordinal))
                self._cboth_graphs.append(capture(  # a STEP riding on its first TOPK: one launch
                    lambda s, e=e: (dstep.enqueue_step_request(b.client_step[e][1], s),
                                    dstep.enqueue_topk_request(e, b.client_topk[e][1], s)), worker.ordinal))
                self._ctopk_graphs.append(capture(
                    lambda s, e=e: dstep.enqueue_topk_request(e, b.client_topk[e][1], s), worker.ordinal))
        # Every TOPK's block is fetched into the one device block ``topk``: one graph.
        self._prefetch_graph = (capture(lambda s: dstep.enqueue_prefetch(b.topk, s), worker.ordinal)
                                if self.graphs and b.prefetch else None)

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) & 0x7FFFFFFF
        return self._seq

    def step(self, step: int, state_rows: np.ndarray, reset, invalidate) -> None:
        B = self.max_batch
        batch = state_rows.shape[0]
        if batch > B:
            raise ResidencyError("TOO_LARGE", f"batch {batch} exceeds max_batch {B} of the layout")
        if reset is not None and np.shape(reset) != (batch,):
            raise ResidencyError("BAD_ARGUMENT", f"reset must be [batch]=({batch},), got {np.shape(reset)}")
        n = 0
        if invalidate is not None:
            invalidate = as_ids("invalidate", invalidate, 2)
            if invalidate.shape[0] != batch:
                raise ResidencyError("BAD_ARGUMENT",
                                     f"invalidate must be [batch, n] with batch {batch}, got {invalidate.shape}")
            n = invalidate.shape[1]
            if n > self.inv_cap:
                raise ResidencyError("TOO_LARGE", f"invalidate has {n} columns; at most {self.inv_cap} per step")
        e = self._step_next
        self._step_next = (e + 1) % len(self._step_done)
        if self._step_used[e] and not self._step_done[e].done:
            self._step_done[e].synchronize()  # back pressure: ring_depth steps ago, rarely waits
        blk, addr = self.buffers.host_step[e]
        write_step(blk, self._next_seq(), step, state_rows, reset, invalidate if n else None)
        stream = self.worker.stream
        if self.graphs:
            self._step_graphs[e].launch(stream)
        else:
            self.dstep.enqueue_step_request(addr, stream)
        self._step_done[e].record(stream)
        self._step_used[e] = True

    def topk(self, step: int, group: int, state_rows: np.ndarray, topk: np.ndarray, fence=None) -> int:
        batch, k = topk.shape
        if batch != state_rows.shape[0]:
            raise ResidencyError("BAD_ARGUMENT",
                                 f"state_rows must be [batch] and topk [batch, top_k]; got {state_rows.shape} and {topk.shape}")
        if k > self.top_k:
            raise ResidencyError("BAD_ARGUMENT", f"topk has {k} columns, layout top_k is {self.top_k}")
        if batch > self.max_batch:
            raise ResidencyError("TOO_LARGE", f"batch {batch} exceeds max_batch {self.max_batch} of the layout")
        if not 0 <= group < self.layout.num_groups:
            raise ResidencyError("BAD_ARGUMENT", f"group {group} out of range [0, {self.layout.num_groups})")
        e = self.events.take()
        if self._topk_used[e] and not self.events.events[e].done:
            # Back pressure: the entry's last use (ring_depth requests ago) must be done
            # before its pinned block is overwritten; normally long finished.
            self.events.events[e].synchronize()
        blk, addr = self.buffers.host_topk[e]
        write_topk(blk, self._next_seq(), step, group, state_rows, topk)
        stream = self.worker.stream
        if fence is not None:
            fence(stream)
        if self.graphs:
            self._topk_graphs[e].launch(stream)
        else:
            self.dstep.enqueue_topk_request(e, addr, stream)
        self.events.record(e, stream)
        self._topk_used[e] = True
        return e

    def topk_block(self, entry: int, begin: bool, fence=None, done: int | None = None) -> int:
        """The kernels check the descriptor; the client made sure the entry's previous use
        is done (its event) before writing it."""
        if not 0 <= entry < len(self._topk_used):
            raise ResidencyError("BAD_ARGUMENT", f"block {entry} outside the ring of {len(self._topk_used)}")
        stream = self.worker.stream
        b = self.buffers
        if fence is not None:
            fence(stream)
        if self.graphs:
            (self._cboth_graphs if begin else self._ctopk_graphs)[entry].launch(stream)
        else:
            if begin:
                self.dstep.enqueue_step_request(b.client_step[entry][1], stream)
            self.dstep.enqueue_topk_request(entry, b.client_topk[entry][1], stream)
        if done is not None:
            write32(stream.ptr, self.done_address(entry), done)
            self._done_set[entry] = done
        self.events.record(entry, stream)
        self._topk_used[entry] = True
        return entry

    def prefetch(self) -> None:
        stream = self.worker.stream
        if self._prefetch_graph is not None:
            self._prefetch_graph.launch(stream)
        else:
            self.dstep.enqueue_prefetch(self.buffers.topk, stream)

    def done_address(self, entry: int) -> int:
        return self.buffers.done.data.ptr + 4 * int(entry)

    def release_entry(self, entry: int, done: int, fence=None) -> None:
        """Unless the TOPK got as far as setting its done word, its entry's result becomes
        empty (slots -1, 0 misses; after ``fence(stream)``) and its done word ``done``, in
        stream order: the client's stream goes on and reads no stale row."""
        import cupy as cp

        if self._done_set[entry] == done:
            return
        b = self.buffers
        stream = self.worker.stream
        if fence is not None:
            fence(stream)
        slots, misses = b.slots[entry], b.misses[entry]
        cp.cuda.runtime.memsetAsync(slots.data.ptr, 0xFF, slots.nbytes, stream.ptr)
        cp.cuda.runtime.memsetAsync(misses.data.ptr, 0, misses.nbytes, stream.ptr)
        write32(stream.ptr, self.done_address(entry), done)
        self._done_set[entry] = done

    def failure(self) -> str | None:
        return None  # a failed request says so in its reply

    def close(self) -> bool:
        self.worker.stream.synchronize()
        self._step_graphs, self._topk_graphs = [], []
        self._cboth_graphs, self._ctopk_graphs = [], []
        self._prefetch_graph = None
        return True
