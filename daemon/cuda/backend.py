"""The cuda backend: one worker per GPU, hot slabs in a per-GPU arena exported through
CUDA IPC, residency and gathers as kernels on the worker's copy stream.

The decode path of a rank (``CudaRankState.serve_topk``) checks the batch on the host,
copies it into pinned staging, and enqueues on the GPU's copy stream: [wait on the
client's fence event] -> H2D of the top-k -> resolve -> gather -> record the rank's IPC
event. It never reads anything back from the device; the reply names the ring entry whose
event the client's stream waits on and whose slots it reads.

Host-pool ranges are registered with ``cudaHostRegister`` (portable, mapped) per engine,
at attach, in chunks that never split a row; one registration serves every GPU.
"""

from __future__ import annotations

import logging
import mmap
import os

import numpy as np

from sparsekv.proto.layout import ROW_ALIGN_BYTES

from .cuda_ipc import ArenaFull, DeviceArena, EventRing, ImportedEvents
from .engine import EngineSpace, RankState
from .pinned import PinnedRegion
from .residency.base import ResidencyError, check_batch
from .residency.cuda import HITS, MISSES, OUT_OF_RANGE, CudaMover, CudaResidency, DeviceBuffers

log = logging.getLogger("sparsekv.cuda")


def mps_running() -> bool:
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipe, "control"))


class DeviceWorker:
    """One GPU: its copy stream, its arena, its compiled kernels."""

    def __init__(self, ordinal: int, arena_bytes: int, kernels):
        import cupy as cp  # noqa: PLC0415

        self.ordinal = ordinal
        self.bus_id = cp.cuda.runtime.deviceGetPCIBusId(ordinal).lower()
        with cp.cuda.Device(ordinal):
            free, _total = cp.cuda.runtime.memGetInfo()
            if arena_bytes > free:
                raise RuntimeError(
                    f"GPU {ordinal} ({self.bus_id}) has {free >> 20} MiB free, the device arena needs "
                    f"{arena_bytes >> 20} MiB; lower --device-arena-size"
                )
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.arena = DeviceArena(ordinal, arena_bytes)
            self.kernels = kernels
            kernels.warm()  # compile (or load) every module before the daemon says READY

    def close(self) -> None:
        self.stream.synchronize()
        self.arena.close()


class CudaRankState(RankState):
    """A rank on one GPU. Same contract as the cpu rank; the work is enqueued, not waited."""

    def __init__(self, rank: int, worker: DeviceWorker, space: EngineSpace, pinned: PinnedRegion,
                 ring_depth: int, gather_blocks: int):
        import cupy as cp  # noqa: PLC0415
        import cupyx  # noqa: PLC0415

        lay = space.layout
        self.worker = worker
        self._cp = cp
        self.max_batch = lay.max_batch
        R, B, K = ring_depth, self.max_batch, lay.top_k
        arena = worker.arena
        # Arena layout of a rank: slab | staging | result slots [R, B, K] | misses [R, B].
        sizes = {"slab": lay.slab_bytes, "staging": lay.staging_bytes, "slots": R * B * K * 4, "misses": R * B * 4}
        self.offsets: dict[str, int] = {}
        try:
            for name, n in sizes.items():
                self.offsets[name] = arena.allocate(max(n, 1))
        except ArenaFull as e:
            self._release_offsets()
            raise ResidencyError("TOO_LARGE", str(e)) from None
        with cp.cuda.Device(worker.ordinal):
            slab = arena.view(self.offsets["slab"], lay.slab_shape)
            staging = arena.view(self.offsets["staging"], lay.staging_shape) if lay.staging_rows else None
            self.slots_ring = arena.view(self.offsets["slots"], (R, B, K), "int32")
            self.misses_ring = arena.view(self.offsets["misses"], (R, B), "int32")
            stream = worker.stream
            residency = CudaResidency(lay, kernels=worker.kernels, stream=stream)
            mover = CudaMover(lay, pinned, pool_offset=0, kernels=worker.kernels, stream=stream,
                              buffers=DeviceBuffers(None, slab, staging, self.offsets["staging"]),
                              blocks=gather_blocks)
            self.outs = [residency.new_output(B) for _ in range(R)]
            for k, out in enumerate(self.outs):
                out.slots = self.slots_ring[k]  # results land where the client reads them
                out.misses = self.misses_ring[k]
            with stream:
                self.slots_ring.fill(-1)
                self.misses_ring.fill(0)
            # Per-group counters (hits, misses, out of range, errors): rows moved is
            # misses x layers of the group, so they are kept apart.
            self.group_counters = cp.zeros((lay.num_groups, 4), dtype=cp.uint64)
            self.events = EventRing(worker.ordinal, R)
            self.d_topk = cp.empty((R, B * K), dtype=cp.int32)
            self.d_rows = cp.empty((R, B), dtype=cp.int32)
        self.h_topk = cupyx.empty_pinned((R, B * K), dtype=np.int32)
        self.h_rows = cupyx.empty_pinned((R, B), dtype=np.int32)
        self.fence_events: ImportedEvents | None = None
        super().__init__(rank=rank, device=f"cuda:{worker.ordinal}", residency=residency, mover=mover,
                         slab=slab, staging=staging)

    # -- decode path -------------------------------------------------------------------
    def begin_step(self, step: int, state_rows, reset=None, invalidate=None) -> None:
        cp = self._cp
        state_rows, reset, invalidate = self.check_step(state_rows, reset, invalidate)
        res = self.residency
        with cp.cuda.Device(self.worker.ordinal), self.worker.stream:
            if reset is not None and reset.any():
                res.reset_async(cp.asarray(state_rows[reset & (state_rows >= 0)]))
            if invalidate is not None and invalidate.size:
                for b in np.flatnonzero(state_rows >= 0):
                    rows = invalidate[b][invalidate[b] >= 0]
                    if rows.size:
                        res.invalidate_async(cp.asarray(rows), cp.asarray(state_rows[b : b + 1]))
        self.step = int(step)
        self.state_rows = state_rows

    def serve_topk(self, step, group, topk, state_rows=None, fence=None):
        from .engine import as_ids  # noqa: PLC0415

        cp = self._cp
        lay = self.residency.layout
        state_rows = self.batch_rows(step, state_rows)
        topk = as_ids("topk", topk, 2)
        state_rows, topk = check_batch(lay, group, state_rows, topk)
        batch, k = topk.shape
        if batch > self.max_batch:
            raise ResidencyError("TOO_LARGE", f"batch {batch} exceeds max_batch {self.max_batch} of the layout")
        if fence is not None and (self.fence_events is None or not 0 <= fence < len(self.fence_events.ptrs)):
            raise ResidencyError("BAD_ARGUMENT", f"fence {fence} names no event the client exported at attach")
        entry = self.events.take()
        # The entry's last use must be done before its pinned staging is overwritten
        # (ring_depth requests ago: normally long finished, so this rarely waits).
        self.events.events[entry].synchronize()
        n = batch * k
        self.h_topk[entry, :n] = topk.reshape(-1)
        self.h_rows[entry, :batch] = state_rows
        out = self.outs[entry]
        out.counters = self.group_counters[group]
        stream = self.worker.stream
        with cp.cuda.Device(self.worker.ordinal), stream:
            if fence is not None:
                # The client's reads of the slab (previous steps) finish before we overwrite.
                self.fence_events.wait(fence, stream.ptr)
            d_topk = self.d_topk[entry, :n].reshape(batch, k)
            d_rows = self.d_rows[entry, :batch]
            d_topk.set(self.h_topk[entry, :n].reshape(batch, k), stream=stream)
            d_rows.set(self.h_rows[entry, :batch], stream=stream)
            self.residency.resolve_async(group, d_rows, d_topk, out, stream)
            # Per-request plans, each sorted by host row. One sort of the whole batch moves
            # rows ~2x faster, but done with CuPy's argsort (commit f9154a0) it waited on the
            # stream and was slower end to end at decode sizes (docs/PERF.md).
            self.mover.gather_async(out, lay.groups[group], stream)
            self.events.record(entry, stream)
        return {"entry": entry, "batch": batch, "k": k}, None, {"topk_batches": 1}

    def write_staged(self, space, layers, rows, fence=None):
        """Staging buffer -> host pool on this GPU's copy stream (the write-mirror kernel),
        after the client's fence; other ranks' streams wait for it before their next
        work, and every rank drops its hot copies of ``rows`` in stream order. Returns
        when enqueued; slots dropped are not counted (that would need a readback)."""
        cp = self._cp
        if fence is not None and (self.fence_events is None or not 0 <= fence < len(self.fence_events.ptrs)):
            raise ResidencyError("BAD_ARGUMENT", f"fence {fence} names no event the client exported at attach")
        n = int(rows.shape[0])
        stream = self.worker.stream
        with cp.cuda.Device(self.worker.ordinal), stream:
            if fence is not None:
                self.fence_events.wait(fence, stream.ptr)
            if n:
                src = self.staging[cp.asarray(np.asarray(layers, np.int32))][:, :n]
                self.mover.write_async(layers, cp.asarray(rows), src, stream)
            written = cp.cuda.Event(disable_timing=True)
            written.record(stream)
        for other in space.ranks.values():
            with cp.cuda.Device(other.worker.ordinal):
                if other is not self:
                    # The pool rows change on this GPU's stream: no later gather of another
                    # rank (any GPU) may start before that copy is done.
                    other.worker.stream.wait_event(written)
                if n:
                    with other.worker.stream:
                        other.residency.invalidate_async(cp.asarray(rows))
        return n * len(layers) * space.layout.row_bytes, 0

    def drop_rewritten(self, rows):
        with self._cp.cuda.Device(self.worker.ordinal):
            return self.residency.invalidate_everywhere(rows)

    def stage(self, rows, layers=None):
        with self._cp.cuda.Device(self.worker.ordinal):
            return super().stage(rows, layers)

    def quiesce(self) -> None:
        self.worker.stream.synchronize()

    def counters(self) -> dict:
        """Device counters read back (stats only; synchronises the stream)."""
        self.worker.stream.synchronize()
        with self._cp.cuda.Device(self.worker.ordinal):
            c = self.group_counters.get()
        lay = self.residency.layout
        layers = np.array([len(g) for g in lay.groups], dtype=np.uint64)
        misses = c[:, MISSES]
        return {"hits": int(c[:, HITS].sum()), "misses": int(misses.sum()),
                "out_of_range": int(c[:, OUT_OF_RANGE].sum()),
                "rows_moved": int((misses * layers).sum()),
                "bytes_moved": int((misses * layers).sum()) * lay.row_bytes}

    def export(self) -> dict:
        lay = self.residency.layout
        return {"kind": "cuda_ipc", "device": self.worker.ordinal, "bus_id": self.worker.bus_id,
                "arena_handle": self.worker.arena.handle, "arena_bytes": self.worker.arena.nbytes,
                "slab_offset": self.offsets["slab"], "staging_offset": self.offsets["staging"],
                "slots_offset": self.offsets["slots"], "misses_offset": self.offsets["misses"],
                "ring_depth": len(self.events), "max_batch": self.max_batch, "top_k": lay.top_k,
                "events": self.events.handles}

    def _release_offsets(self) -> None:
        for off in self.offsets.values():
            self.worker.arena.release(off)
        self.offsets = {}

    def close(self) -> None:
        self.quiesce()
        if self.fence_events is not None:
            self.fence_events.close()
            self.fence_events = None
        self._release_offsets()


class CudaBackend:
    name = "cuda"

    def __init__(self, cfg, pool):
        import cupy as cp  # noqa: PLC0415

        from .kernels import get_cache  # noqa: PLC0415

        count = cp.cuda.runtime.getDeviceCount()
        ordinals = list(range(count)) if cfg.devices == "all" else [int(x) for x in cfg.devices.split(",")]
        bad = [o for o in ordinals if not 0 <= o < count]
        if bad:
            raise RuntimeError(f"--devices names GPU(s) {bad}, but {count} are visible")
        if not mps_running():
            log.warning("NVIDIA MPS is not running: every cross-process GPU hand-off will cost ~300 us "
                        "instead of ~26 us (start nvidia-cuda-mps-control -d; see deploy/)")
        self.pool = pool
        self.cfg = cfg
        kernels = get_cache(cfg.kernel_cache_dir or None)
        self.workers: list[DeviceWorker] = []
        try:
            for o in ordinals:
                self.workers.append(DeviceWorker(o, cfg.device_arena_size, kernels))
        except Exception:
            self.close()
            raise
        self.devices = [f"cuda:{w.ordinal}" for w in self.workers]
        self._ranks: dict[int, CudaRankState] = {}
        self._pinned: dict[str, PinnedRegion] = {}
        self._retired: dict[str, int] = {}

    def describe(self) -> dict:
        return {"backend": self.name, "devices": self.devices,
                "bus_ids": [w.bus_id for w in self.workers], "mps": mps_running()}

    def worker_for(self, device: str) -> DeviceWorker:
        d = device.lower()
        for w in self.workers:
            if d in (w.bus_id, f"cuda:{w.ordinal}"):
                return w
        raise ResidencyError("BAD_ARGUMENT", f"device {device!r} is not served here; this daemon serves "
                             f"{', '.join(f'cuda:{w.ordinal} ({w.bus_id})' for w in self.workers)}")

    def new_rank(self, space: EngineSpace, client_id: int, rank: int, device: str, fence_events=None):
        if space.layout.row_bytes % ROW_ALIGN_BYTES:
            raise ResidencyError("BAD_LAYOUT", f"row_bytes {space.layout.row_bytes} must be a multiple of "
                                 f"{ROW_ALIGN_BYTES} on the cuda backend (rows move with 16-byte loads)")
        worker = self.worker_for(device)
        pinned = self._pinned.get(space.name)
        if pinned is None:
            lay = space.layout
            # Whole pages: cudaHostRegister wants them, and the engine's pool range is
            # reserved in 2 MiB units, so the rounded span stays inside it.
            nbytes = -(-lay.pool_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
            pinned = PinnedRegion(self.pool.address + space.pool_offset, nbytes, lay.row_bytes)
            self._pinned[space.name] = pinned
        try:
            state = CudaRankState(rank, worker, space, pinned, self.cfg.ring_depth, self.cfg.gather_blocks)
            if fence_events:
                state.fence_events = ImportedEvents(list(fence_events), worker.ordinal)
        except Exception:
            if not space.ranks:
                self._unpin(space.name)
            raise
        self._ranks[client_id] = state
        return state, state.export()

    def release_rank(self, client_id: int) -> None:
        state = self._ranks.pop(client_id, None)
        if state is None:
            return
        for k, v in state.counters().items():
            self._retired[k] = self._retired.get(k, 0) + v
        state.close()

    def release_engine(self, space: EngineSpace) -> None:
        self._unpin(space.name)

    def _unpin(self, name: str) -> None:
        pinned = self._pinned.pop(name, None)
        if pinned is not None:
            pinned.close()

    def device_counters(self) -> dict:
        total = dict(self._retired)
        for st in self._ranks.values():
            for k, v in st.counters().items():
                total[k] = total.get(k, 0) + v
        return total

    def close(self) -> None:
        for cid in list(self._ranks):
            self.release_rank(cid)
        for name in list(self._pinned):
            self._unpin(name)
        for w in self.workers:
            w.close()
        self.workers = []
