"""The cuda backend: one worker per GPU (its copy stream, its arena, its kernels) and the
ranks it serves (``rank.py``), hot slabs in the arena exported through CUDA IPC.

The daemon page-locks the whole host pool at start (``daemon/main.py``,
``pinned.PoolPinner``) and an engine's range is a view of it (``pool_region``); with
``SPARSEKV_PIN_POOL_AT_START=0`` each engine's range (its rows and its indexer keys plane)
is registered at its attach instead.
"""

from __future__ import annotations

import logging
import math
import mmap
import os

from sparsekv.proto.cuda_ipc import ImportedEvents, mps_running
from sparsekv.proto.layout import ROW_ALIGN_BYTES

from ..engine import Backend, EngineSpace
from ..kernels import get_cache
from ..memfd import remove_stale, run_dir_tag
from ..pinned import PinnedRegion, PinnedView
from ..residency.base import ResidencyError
from .arena import DeviceArena
from .buffers import HostBlocks
from .deferred import DeferredFrees
from .rank import CudaRankState
from .tp_doorbell import TpDoorbellGroup

log = logging.getLogger("sparsekv.cuda")


class DeviceWorker:
    """One GPU: its copy stream (the zmq ranks' resolves and gathers), its bulk stream
    (keys loads: a cached prefix's gigabyte never waits in front of a gather), its arena,
    its compiled kernels."""

    def __init__(self, ordinal: int, arena_bytes: int, kernels, row_bytes=(656,)):
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
            self.bulk_stream = cp.cuda.Stream(non_blocking=True)
            self.arena = DeviceArena(ordinal, arena_bytes)
            self.kernels = kernels
            kernels.warm(row_bytes)  # compile (or load) every module before the daemon says READY

    def close(self) -> None:
        self.stream.synchronize()
        self.bulk_stream.synchronize()
        self.arena.close()


class CudaBackend(Backend):
    name = "cuda"
    rank_memory_on_host = False  # the device arena holds them

    def __init__(self, cfg, pool, pool_region=None):
        import cupy as cp  # noqa: PLC0415

        count = cp.cuda.runtime.getDeviceCount()
        ordinals = list(range(count)) if cfg.devices == "all" else [int(x) for x in cfg.devices.split(",")]
        bad = [o for o in ordinals if not 0 <= o < count]
        if bad:
            raise RuntimeError(f"devices names GPU(s) {bad}, but {count} are visible")
        if not mps_running():
            log.warning("NVIDIA MPS is not running: every cross-process GPU hand-off will cost ~300 us "
                        "instead of ~26 us (start nvidia-cuda-mps-control -d; see deploy/)")
        self.pool = pool
        self.pool_region = pool_region  # None: each engine's range registered at attach
        self.cfg = cfg
        kernels = get_cache(cfg.kernel_cache_dir or None)
        self.workers: list[DeviceWorker] = []
        self._ranks: dict[int, CudaRankState] = {}  # before any worker: close() reads them
        self._pinned: dict[str, PinnedRegion] = {}
        self._retired: dict[str, int] = {}
        self._retired_errors: dict[str, int] = {}
        self._stuck: set[str] = set()  # engines whose pool a stream that did not drain may read
        # Frees that wait for every stream of the daemon: held while a doorbell rank is attached.
        # (A stream that did not drain at detach counts too: the daemon exits, freeing all.)
        self._deferred = DeferredFrees(lambda: bool(self._stuck)
                                       or any(st.device_driven for st in self._ranks.values()))
        try:
            for o in ordinals:
                self.workers.append(DeviceWorker(o, cfg.device_arena_size, kernels,
                                                 [int(x) for x in cfg.warm_row_bytes.split(",")]))
        except Exception:
            self.close()
            raise
        self.devices = [f"cuda:{w.ordinal}" for w in self.workers]
        # Each rank's pinned step blocks live in a memfd; files an older sparsekvd left go.
        self._blocks_name = f"sparsekv-{run_dir_tag(cfg.run_dir)}-blocks-"
        remove_stale(os.path.join(cfg.shm_dir, self._blocks_name))
        self._failure: str | None = None

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

    # The registry makes ranks on the loop's thread (their buffers, graphs and streams are
    # the loop's); only prepare_rank runs on a worker thread first.
    new_rank_on_loop = True

    def prepare_rank(self, space: EngineSpace, client_id: int, rank: int, device: str, fence_events=None,
                     transport: str = "zmq", engine_slab=None, prefetch: bool = False) -> DeviceWorker:
        """``new_rank``'s checks and its slow part, with its arguments; returns the rank's
        device worker. The slow part, when the pool was not page-locked at start:
        page-locking the engine's pool range (once per engine; ``release_engine`` undoes
        it). The registry runs this on a worker thread before ``new_rank`` (the CUDA
        runtime is thread-safe), so the loop never waits for it."""
        if space.layout.row_bytes % ROW_ALIGN_BYTES:
            raise ResidencyError("BAD_LAYOUT", f"row_bytes {space.layout.row_bytes} must be a multiple of "
                                 f"{ROW_ALIGN_BYTES} on the cuda backend (rows move with 16-byte loads)")
        worker = self.worker_for(device)
        if space.name not in self._pinned:
            lay = space.layout
            # Its rows and its indexer keys plane (BLOCK_LOAD_KEYS copies from it). Whole
            # pages: cudaHostRegister wants them, and the engine's pool range is reserved
            # in 2 MiB units, so the rounded span stays inside it.
            nbytes = -(-space.range_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
            if self.pool_region is not None:
                self._pinned[space.name] = PinnedView(self.pool_region, space.pool_offset, nbytes)
            else:
                # In the pool's chunks (pin_chunk_gib), each at least one whole row and
                # page (a chunk never splits either).
                chunk = max(self.cfg.pin_chunk_bytes, math.lcm(lay.row_bytes, mmap.PAGESIZE))
                self._pinned[space.name] = PinnedRegion(self.pool.address + space.pool_offset, nbytes, lay.row_bytes,
                                                        chunk)
        return worker

    def new_rank(self, space: EngineSpace, client_id: int, rank: int, device: str, fence_events=None,
                 transport: str = "zmq", engine_slab=None, prefetch: bool = False):
        # Checks again (cheap); pins only if nobody ran prepare_rank for this engine yet.
        worker = self.prepare_rank(space, client_id, rank, device, fence_events, transport, engine_slab)
        pinned = self._pinned[space.name]
        # On a failure the registry's abort unpins a new engine's range (release_engine).
        state = CudaRankState(rank, worker, space, pinned, self.cfg.ring_depth, self.cfg.gather_blocks,
                              graphs=self.cfg.cuda_graphs,
                              blocks_path=f"{self._blocks_name}{client_id}",  # a memfd name
                              transport=transport, engine_slab=engine_slab, prefetch=prefetch,
                              free=self._deferred.free_for(worker.ordinal),
                              host_blocks=self._host_blocks(space, worker.ordinal),
                              tp=space.tp is not None,
                              slab_owner=lambda ptr, n: self._slab_owner(worker.ordinal, ptr, n))
        try:
            if fence_events:
                state.fence_events = ImportedEvents(list(fence_events), worker.ordinal)
            if space.tp is not None:  # the group's device side; it starts once every rank is in
                if space.tp.device is None:
                    space.tp.device = TpDoorbellGroup(space.tp.size, worker.kernels)
                space.tp.device.add(rank, state)
        except Exception:
            state.close()
            raise
        self._ranks[client_id] = state
        return state, state.export()

    def _slab_owner(self, ordinal: int, ptr: int, nbytes: int) -> int | None:
        """The client whose rank's engine slab on GPU ``ordinal`` overlaps ``nbytes`` from
        ``ptr`` (addresses of this process: cuIpcOpenMemHandle returns the mapping already
        open for a handle it is given again), or None. Ranks are made on the loop: no race."""
        for cid, st in self._ranks.items():
            slab = st.engine_slab
            if (slab is not None and st.worker.ordinal == ordinal and ptr < slab.ptr + slab.nbytes
                    and slab.ptr < ptr + nbytes):
                return cid
        return None

    def _host_blocks(self, space: EngineSpace, device: int) -> tuple:
        """A rank's pinned host blocks: a spare its owner's detached rank left on this GPU
        (``deferred.py``), else new ones; at close kept as a spare while a doorbell rank is
        attached, else unregistered."""
        owner = (space.owner.uid if space.owner is not None else None, device)

        def make(nbytes: int, name: str | None) -> HostBlocks:
            host = self._deferred.reuse(owner + (HostBlocks.size_for(nbytes),))
            if host is None:
                return HostBlocks(nbytes, name)
            host.reset()
            return host

        def spare(host: HostBlocks) -> None:
            self._deferred.keep_spare(owner + (host.nbytes,), device, host.nbytes, host, host.close)
        return make, spare

    def share_fds(self, client_id: int) -> dict[str, int]:
        """Its pinned step blocks (``blocks_fd``; still owned by the rank)."""
        state = self._ranks.get(client_id)
        fd = None if state is None else state.buffers.host.fd
        return {} if fd is None else {"blocks": fd}

    def release_rank(self, client_id: int) -> None:
        state = self._ranks.pop(client_id, None)
        if state is None:
            return
        if not state.close():  # waits for the rank's work: the mirrors below are final
            # Its stream may still read the engine's pinned pool: never unpin it. The
            # daemon exits (failure()), which frees everything.
            self._stuck.add(state.space_name)
            self._failure = self._failure or (f"a doorbell stream of GPU {state.worker.ordinal} did not drain at "
                                              "detach: the GPU does not run it")
        self._retired = _summed(self._retired, [state.counters()])
        self._retired_errors = _summed(self._retired_errors, [state.error_counts()])
        self._deferred.flush()  # the last doorbell rank gone: what waited is freed now

    def release_engine(self, space: EngineSpace, give_back) -> None:
        self._unpin(space.name, give_back)
        self._deferred.flush()

    def failure(self) -> str | None:
        """A rank's stream that stopped or did not drain."""
        if self._failure:
            return self._failure
        for st in self._ranks.values():
            why = st.failure()
            if why:
                return why
        return None

    def _unpin(self, name: str, give_back=None) -> None:
        """Undo the page-locking of engine ``name``'s range, then ``give_back`` it: at once,
        or once the unregister has run (``deferred.py``): the pool must not place another
        engine on bytes still registered."""
        if name in self._stuck:  # a stream that did not drain may still read it (the daemon exits)
            if give_back is not None:
                give_back()
            return
        pinned = self._pinned.pop(name, None)
        if pinned is None or isinstance(pinned, PinnedView):  # a view of the pool pinned at start: no CUDA call
            if pinned is not None:
                pinned.close()
            if give_back is not None:
                give_back()
            return

        def free() -> None:
            try:
                pinned.close()
            finally:  # a failed unregister still gives the range back (a new pin there says why)
                if give_back is not None:
                    give_back()
        self._deferred.free(None, f"pinned pool range of engine {name!r}", pinned.nbytes, free)

    def device_counters(self) -> dict:
        """From each rank's pinned mirror (no synchronisation)."""
        return _summed(self._retired, (st.counters() for st in self._ranks.values()))

    def device_errors(self) -> dict:
        return _summed(self._retired_errors, (st.error_counts() for st in self._ranks.values()))

    def arenas(self) -> dict | None:
        """Each GPU's arena (one allocation for every rank's slab and rings)."""
        return {f"cuda:{w.ordinal}": {"bytes": int(w.arena.nbytes), "used_bytes": int(w.arena.used_bytes),
                                      "deferred_frees": self._deferred.held_count(w.ordinal),
                                      "deferred_free_bytes": self._deferred.held_bytes(w.ordinal)}
                for w in self.workers} or None

    def may_free_pinned(self) -> bool:
        """False once a doorbell stream did not drain: freeing device or page-locked memory
        would wait for it for ever (the process's exit frees both)."""
        return not self._stuck

    def close(self) -> None:
        for cid in list(self._ranks):
            self.release_rank(cid)
        for name in list(self._pinned):
            self._unpin(name)
        self._deferred.close()
        if self._stuck:  # cudaFree of the arenas would wait for the stream that did not drain
            log.error("a doorbell stream did not drain: the GPU arenas are left to the process's exit")
            self.workers = []
            return
        for w in self.workers:
            w.close()
        self.workers = []


def _summed(base: dict, parts) -> dict:
    """``base`` plus every dict of ``parts``, key by key (a new dict)."""
    total = dict(base)
    for part in parts:
        for k, v in part.items():
            total[k] = total.get(k, 0) + v
    return total
