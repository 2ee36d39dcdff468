"""The decode step on one GPU, enqueued from device memory only.

:class:`DeviceStep` turns a rank's step blocks (``buffers.py``) into kernel launches: a
STEP is ``skv_begin_step``; a TOPK is ``skv_resolve`` into a ring entry and the per-row
plans, then their gather for every layer of the group; each is followed by
``enqueue_stats_out`` (counters and error record -> the pinned host mirror, no wait). With
prefetch, ``enqueue_prefetch`` follows a group's TOPK: its rows into the next group's
regions (``skv_prefetch``), then their gather into that group's layers.

Every size comes from the descriptor in the block, every launch has a fixed grid and
shared memory, and nothing reads back or waits: the sequence captures into a CUDA graph.
"""

from __future__ import annotations

import numpy as np

from ..kernels import copy_defines
from ..residency.cuda import CudaMover, CudaResidency

FETCH_BLOCKS = 16
MEMCPY_DEVICE_TO_HOST = 2


class DeviceStep:
    """The decode-path kernels of one rank, bound to its buffers.

    Args:
        residency: the rank's :class:`CudaResidency` (owner/lru on its GPU).
        mover: the rank's :class:`CudaMover` (pool and slab addresses).
        buffers: the rank's :class:`~sparsekv.daemon.cuda.buffers.RankBuffers`.
        kernels: the :class:`~sparsekv.daemon.kernels.KernelCache` (for ``skv_fetch``).
    """

    def __init__(self, residency: CudaResidency, mover: CudaMover, buffers, kernels):
        self.residency, self.mover, self.buffers = residency, mover, buffers
        self.layout = residency.layout
        self._fetch = kernels.function("copy.cu", "skv_fetch", copy_defines(self.layout.row_bytes))

    def enqueue_fetch(self, host_address: int, block, stream, step: bool) -> None:
        """``skv_fetch``: a pinned host step block (device address) -> ``block`` (device)."""
        b = self.buffers
        i32 = np.int32
        with stream:
            self._fetch((FETCH_BLOCKS,), (256,),
                        (np.uint64(host_address), block, i32(b.max_batch), i32(b.max_batch * self.layout.top_k),
                         i32(1 if step else 0)))

    def enqueue_resolve(self, block, slots, misses, stream, clear: int = 0) -> None:
        """``skv_resolve`` of a top-k block into ``slots`` / ``misses`` and the per-row
        plans. ``clear``: a doorbell word the resolve sets to 0 (device address), or 0."""
        bufs = self.buffers
        self.residency.launch_resolve(block.desc, block.rows, block.payload, slots, misses,
                                      bufs.plan_rows, bufs.plan_slots, bufs.counters, 4, bufs.err,
                                      bufs.workspace, bufs.max_batch, stream, clear=clear)

    def enqueue_gather(self, block, misses, stream, group_layers=None, ready: int = 0, arrivals: int = 0,
                       after_resolve: bool = False, mark_slots: bool = False) -> None:
        """The gather of the last :meth:`enqueue_resolve`, for the group's layers (or the
        ones ``group_layers`` names). ``ready`` / ``arrivals``: a word the gather's last
        block sets to 1 and its zeroed arrival counter (device addresses).
        ``after_resolve``: enqueued right after that resolve (no other operation between
        them on ``stream``): launched programmatically (``CudaMover.launch_gather``).
        ``mark_slots``: it sets the block's ``D_SLOTS`` word once the slots are written."""
        bufs = self.buffers
        self.mover.launch_gather(block.desc, bufs.plan_rows, bufs.plan_slots, misses, bufs.max_batch, stream,
                                 group_layers=group_layers, ready=ready, arrivals=arrivals,
                                 after_resolve=after_resolve, mark_slots=mark_slots)

    def enqueue_prefetch(self, block, stream, stats_out: bool = True) -> None:
        """The cross-layer prefetch after ``block``'s TOPK (group g < G - 1, its resolve
        and gathers enqueued before on ``stream``): ``skv_prefetch`` of the block's rows
        into group g + 1's regions (``group_offset`` 1: the block's own descriptor), its
        plan into the ``pf_*`` buffers (never the resolve's: the next resolve would
        overwrite it; its errors into ``pf_err``: the resolve reported them), then the
        gather of that plan into group g + 1's layers (the table ``pf_layers``, whose row
        g names them), then (``stats_out``) the counters out: a doorbell step leaves that
        to its last group's, which comes after every prefetch of the step. On the
        same stream as the next group's resolve, which then finds the rows as hits, and
        whose ready word comes after the rows' bytes."""
        bufs = self.buffers
        self.residency.launch_prefetch(block.desc, block.rows, block.payload, bufs.pf_rows, bufs.pf_slots,
                                       bufs.pf_counts, bufs.pf_err, bufs.max_batch, stream, group_offset=1)
        self.mover.launch_gather(block.desc, bufs.pf_rows, bufs.pf_slots, bufs.pf_counts, bufs.max_batch, stream,
                                 group_layers=bufs.pf_layers)
        if stats_out:
            self.enqueue_stats_out(stream)

    def enqueue_stats_out(self, stream) -> None:
        """Counters and error record (and, with prefetch, the prefetch counters) -> their
        pinned host mirrors, asynchronously."""
        import cupy as cp

        bufs = self.buffers
        cp.cuda.runtime.memcpyAsync(bufs.host_stats_address, bufs.stats.data.ptr, bufs.stats_bytes,
                                    MEMCPY_DEVICE_TO_HOST, stream.ptr)
        pf = self.residency.pf_counters
        if pf is not None:
            cp.cuda.runtime.memcpyAsync(bufs.host_pf_address, pf.data.ptr, pf.nbytes, MEMCPY_DEVICE_TO_HOST,
                                        stream.ptr)

    def enqueue_step_request(self, host_address: int | None, stream) -> None:
        """A STEP: [fetch its block from pinned memory] -> begin -> stats out."""
        if host_address is not None:
            self.enqueue_fetch(host_address, self.buffers.step.block, stream, step=True)
        b = self.buffers
        self.residency.launch_begin_step(b.step.desc, b.step.rows, b.step.aux, b.step.payload, b.err, b.max_batch,
                                         stream)
        self.enqueue_stats_out(stream)

    def enqueue_topk_request(self, entry: int, host_address: int | None, stream) -> None:
        """A TOPK into ring entry ``entry``: [fetch] -> resolve -> gather -> stats out."""
        if host_address is not None:
            self.enqueue_fetch(host_address, self.buffers.topk.block, stream, step=False)
        b = self.buffers
        self.enqueue_resolve(b.topk, b.slots[entry], b.misses[entry], stream)
        self.enqueue_gather(b.topk, b.misses[entry], stream, after_resolve=True)
        self.enqueue_stats_out(stream)


THREAD_LOCAL = 1  # cudaStreamCaptureModeThreadLocal (the CUDA runtime's value)


def capture(fn, device: int):
    """Run ``fn(stream)`` under stream capture on a fresh stream; return the graph, uploaded.
    Thread-local mode: a synchronising or unsafe call of this thread inside fails the
    capture, while the daemon's other threads go on (in global mode a doorbell rank's
    stocking thread, launching and querying its own stream, failed another rank's capture
    at its attach: seen on the H200)."""
    import cupy as cp

    with cp.cuda.Device(device):
        stream = cp.cuda.Stream(non_blocking=True)
        stream.begin_capture(getattr(cp.cuda.runtime, "streamCaptureModeThreadLocal", THREAD_LOCAL))
        try:
            fn(stream)
        finally:
            graph = stream.end_capture()
        graph.upload(stream)
        stream.synchronize()
    return graph
