"""The engine's handle with no daemon: the daemon's kernels inline on the caller's stream.

:class:`InprocSwapIn` has the API of the doorbell handle (``client/doorbell.py``) and runs
the daemon's kernels, in the same order, where the doorbell hands off: ``skv_begin_step``
after the step block is written, ``skv_resolve`` after a group's top-k block, then
the gather of every layer of the group right after (the resolve's plan buffer is one for
all groups: a follower layer swapped in after the next group's leader must not read the
next group's plan; as the doorbell step graph, which gathers a group's layers before it
waits for the next bell), and with ``prefetch`` then ``DeviceStep.enqueue_prefetch`` into
the next group on a stream of its own, forked from the caller's there and joined back
before the next group's resolve or the next step's begin (beside the caller's work, as
the daemon's runs). It owns a pinned host pool (``pool``, NumPy ``[L,
host_rows, row_bytes]``, for the caller to fill), made and page-locked as the daemon's
(``daemon/pool.py``, its ``pool_backing`` and ``pin_chunk_gib``), and a device arena. For
baselines (``sparsekv bench decode``) and for sparsekv as a library in one process.
"""

from __future__ import annotations

import numpy as np

from sparsekv.client.cuda_stream import external_stream
from sparsekv.client.doorbell import DeviceSwapIn
from sparsekv.daemon.config import load as daemon_settings
from sparsekv.daemon.cuda.arena import DeviceArena
from sparsekv.daemon.cuda.buffers import RankBuffers
from sparsekv.daemon.cuda.step import DeviceStep
from sparsekv.daemon.kernels import get_cache
from sparsekv.daemon.pinned import PinnedRegion
from sparsekv.daemon.pool import HostPool
from sparsekv.daemon.residency.cuda import (
    HITS,
    MISSES,
    OUT_OF_RANGE,
    PF_COUNTERS,
    PF_HITS,
    PF_PREFETCHED,
    PF_WASTED,
    CudaMover,
    CudaResidency,
    DeviceBuffers,
)
from sparsekv.proto import Layout

GATHER_BLOCKS = 32  # the daemon's default gather_blocks (config.py)
HUGE_PAGE = 2 << 20  # the pool is a whole number of 2 MiB pages


class InprocSwapIn(DeviceSwapIn):
    """Args:
        layout: the layout (as for ``Client.attach``).
        device: the GPU ordinal.
        gather_blocks: the most blocks a gather uses.
        backing: the pool's backing (``anon_thp`` or ``memfd``; None: the daemon's
            ``pool_backing`` setting, so that a baseline reads memory laid out as its).
        prefetch: prefetch each group's rows into the next group's regions, on a stream
            of the handle's own beside the caller's (forked after the group's last
            gather, joined before the next group's resolve): a step captured into a CUDA
            graph must then hold both ends, i.e. run from ``begin_step`` to its last
            layer in one capture.
    """

    def __init__(self, layout: Layout, device: int = 0, gather_blocks: int = GATHER_BLOCKS,
                 backing: str | None = None, prefetch: bool = False):
        import cupy as cp  # noqa: PLC0415
        import torch  # noqa: PLC0415

        lay = layout.validate()
        kernels = get_cache()
        nbytes = -(-lay.pool_bytes // HUGE_PAGE) * HUGE_PAGE
        settings = daemon_settings()  # a bad value named before minutes of pre-faulting
        chunk = settings.pin_chunk_bytes
        self._arena = self._pinned = self.buffers = None
        self._host = HostPool(nbytes, name="sparsekv-inproc-pool", backing=backing or settings.pool_backing)
        try:
            # Chunks as the daemon registers its pool (row_bytes 16 like its pinner: only
            # kernels read the pool, no DMA copy of rows that could cross a chunk).
            self._pinned = PinnedRegion(self._host.address, nbytes, 16, chunk)
            self.pool = self._host.array[: lay.pool_bytes].reshape(lay.num_layers, lay.host_rows, lay.row_bytes)
            with cp.cuda.Device(device):
                stream = cp.cuda.Stream(non_blocking=True)
                # The prefetch's own stream, and a fork and a join event per group.
                self._pf_stream = cp.cuda.Stream(non_blocking=True) if prefetch else None
                self._pf_events = [(cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True))
                                   for _ in range(lay.num_groups if prefetch else 0)]
                self._pf_pending: list = []  # join events the caller's stream has not waited for
                residency = CudaResidency(lay, kernels=kernels, stream=stream, prefetch=prefetch)
                ws = residency.workspace_bytes if residency.workspace_global else 0
                need = lay.slab_bytes + lay.staging_bytes + (64 << 20) + lay.max_batch * ws \
                    + 8 * lay.num_groups * lay.max_batch * lay.top_k * 4
                self._arena = DeviceArena(device, need)
                self.buffers = b = RankBuffers(self._arena, lay, 1, ws, None, doorbell=True, prefetch=prefetch)
                mover = CudaMover(lay, self._pinned, pool_offset=0, kernels=kernels, stream=stream,
                                  buffers=DeviceBuffers(None, b.slab, b.staging, b.offsets["staging"]),
                                  blocks=gather_blocks)
                self.dstep = DeviceStep(residency, mover, b, kernels)
            G = lay.num_groups
            self._err_host = np.zeros(b.err.shape[0], np.int32)
            self._bind(lay, device, torch.from_dlpack(b.slab), b.db_step.block.data.ptr,
                       [blk.block.data.ptr for blk in b.db_topk], [b.db_slots[g].data.ptr for g in range(G)],
                       self._err_host, misses=torch.from_dlpack(b.db_misses))
        except BaseException:
            if self.buffers is not None:
                self.buffers.close()
            self._free()  # no handle reaches the caller: nothing else would
            raise

    @property
    def pool_huge_bytes(self) -> int:
        """Bytes of the pool in transparent huge pages (0 for a memfd), as the daemon's
        ``pool_huge_bytes``."""
        return self._host.huge_bytes or 0

    def _ext(self, stream_ptr: int):
        import cupy as cp  # noqa: PLC0415

        return external_stream(cp, stream_ptr)

    def _begun(self, stream_ptr: int) -> None:
        b, d = self.buffers, self.dstep
        stream = self._ext(stream_ptr)
        self._join_prefetch(stream)
        d.residency.launch_begin_step(b.db_step.desc, b.db_step.rows, b.db_step.aux, b.db_step.payload, b.err,
                                      b.max_batch, stream)

    def _rang(self, group: int, stream_ptr: int) -> None:
        """The group's resolve, then the gather of all its layers (before any other group's
        resolve can reuse the plan buffer), then with prefetch the fork of its prefetch."""
        b, d = self.buffers, self.dstep
        stream = self._ext(stream_ptr)
        self._join_prefetch(stream)
        t = b.db_topk[group]
        d.enqueue_resolve(t, b.db_slots[group], b.db_misses[group], stream)
        d.enqueue_gather(t, b.db_misses[group], stream, after_resolve=True)
        if b.prefetch and group + 1 < self.layout.num_groups:
            fork, join = self._pf_events[group]
            fork.record(stream)
            self._pf_stream.wait_event(fork)
            d.enqueue_prefetch(t, self._pf_stream)
            join.record(self._pf_stream)
            self._pf_pending.append(join)

    def _ready(self, layer: int, group: int, stream_ptr: int) -> None:
        """Nothing: the group's resolve gathered every layer of it."""

    def _join_prefetch(self, stream) -> None:
        """The caller's stream waits for the prefetches forked from it: before a resolve or
        a step's begin (both change the regions a prefetch fills)."""
        for join in self._pf_pending:
            stream.wait_event(join)
        self._pf_pending.clear()

    def _device_read(self, *arrays) -> list:
        """``arrays`` (device) read to the host once the whole device is idle (the caller's
        streams, the prefetch's, any non-blocking one: a ``.get()`` alone waits for the
        current stream only)."""
        import cupy as cp  # noqa: PLC0415

        with cp.cuda.Device(self.device):
            cp.cuda.runtime.deviceSynchronize()
            return [a.get() if a is not None else None for a in arrays]

    def check(self) -> None:
        """As the doorbell handle's; waits for the device (reads its error record)."""
        self._err_host[:] = self._device_read(self.buffers.err)[0]
        super().check()

    def counters(self) -> dict:
        """hits, misses, out_of_range over every group, and the prefetch's counters
        (waits for the device)."""
        c, pf = self._device_read(self.buffers.counters, self.dstep.residency.pf_counters)
        pf = pf if pf is not None else np.zeros(PF_COUNTERS, np.uint64)
        return {"hits": int(c[:, HITS].sum()), "misses": int(c[:, MISSES].sum()),
                "out_of_range": int(c[:, OUT_OF_RANGE].sum()), "prefetched": int(pf[PF_PREFETCHED]),
                "prefetch_hits": int(pf[PF_HITS]), "prefetch_wasted": int(pf[PF_WASTED])}

    def close(self) -> None:
        import cupy as cp  # noqa: PLC0415

        super().close()
        if self._arena is None:
            return
        with cp.cuda.Device(self.device):
            cp.cuda.runtime.deviceSynchronize()
        self.buffers.close()
        self._free()

    def _free(self) -> None:
        """The device arena, then the pool's registration, then the pool (its mapping stays,
        with a warning, while a caller holds a view of it)."""
        try:
            if self._arena is not None:
                self._arena.close()
                self._arena = None
            if self._pinned is not None:
                self._pinned.close()
                self._pinned = None
        finally:
            self.pool = None
            self._host.close()
