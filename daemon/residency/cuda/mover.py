"""CUDA mover: rows between the pinned host pool and one GPU with the copy kernels
(``csrc/copy.cu``), with the interface and results of ``cpu.py``'s mover. The
device-resident entry points (``gather_async``, ``launch_*``) take device arrays, run on a
given stream and never read back; ``gather`` and ``stage`` take NumPy and synchronise.
A TP group's ranks may share one plan striped (``launch_gather`` with a stripe, then
``launch_push`` of that stripe into each peer's slab; the rule: ``base.stripe_bounds``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsekv.daemon.kernels import COPY_THREADS, DEFAULT_SMEM_BYTES, copy_defines, get_cache
from sparsekv.proto.layout import Layout

from ..base import Mover, Plan, ResidencyError, check_stripe
from .device import ResolveOutput, cp_module, grid_blocks, null_ptr, smem_limit
from . import launch_ex

DEFAULT_COPY_BLOCKS = 32  # bounded: attention shares the SMs and the PCIe link


@dataclass
class DeviceBuffers:
    """The hot slab and the staging buffer of one rank: one ``cudaMalloc`` (``memory``;
    exportable as one CUDA IPC handle), each a view at a 256-byte-aligned offset."""

    memory: object  # cupy.cuda.memory.Memory
    slab: object  # cupy uint8 [num_layers, max_reqs, region_stride, row_bytes], offset 0
    staging: object | None  # cupy uint8 [num_layers, staging_rows, row_bytes] or None
    staging_offset: int


@dataclass(frozen=True)
class SlabTarget:
    """A slab ``launch_push`` writes, prepared on the pushing GPU (:meth:`CudaMover.slab_target`):
    its device address and ``skv_push``'s destination geometry arguments (per-layer byte
    offsets on the pushing GPU or null, block rows, block stride)."""

    address: int
    geo: tuple


def allocate_device_buffers(layout: Layout) -> DeviceBuffers:
    cp = cp_module()
    lay = layout.validate()
    staging_offset = (lay.slab_bytes + 255) & ~255
    total = staging_offset + lay.staging_bytes
    mem = cp.cuda.memory.Memory(total)  # plain cudaMalloc, outside CuPy's pool
    slab = cp.ndarray(
        (lay.num_layers, lay.max_reqs, lay.region_stride, lay.row_bytes), dtype=cp.uint8,
        memptr=cp.cuda.memory.MemoryPointer(mem, 0),
    )
    staging = None
    if lay.staging_rows:
        staging = cp.ndarray(
            (lay.num_layers, lay.staging_rows, lay.row_bytes), dtype=cp.uint8,
            memptr=cp.cuda.memory.MemoryPointer(mem, staging_offset),
        )
    return DeviceBuffers(mem, slab, staging, staging_offset)


class CudaMover(Mover):
    """Moves rows between the pinned host pool ``[L, host_rows, row_bytes]`` and one GPU.

    Args:
        layout: the attached layout.
        pool: the :class:`sparsekv.daemon.pinned.PinnedRegion` (or ``PinnedView``) holding
            the pool.
        pool_offset: byte offset of this engine's pool inside ``pool`` (16-aligned).
        buffers: slab and staging (default: :func:`allocate_device_buffers`).
        kernels, stream: as for :class:`CudaResidency`.
        blocks: most blocks a copy kernel uses (SMs are shared with attention).
        threads: threads per copy block.
        engine_slab: ``(device address, SlabGeometry)`` of an engine-owned slab, which
            gathers write instead of ``buffers.slab``.
    """

    def __init__(self, layout: Layout, pool, *, pool_offset: int = 0, buffers: DeviceBuffers | None = None,
                 kernels=None, stream=None, blocks: int = DEFAULT_COPY_BLOCKS, threads: int = COPY_THREADS,
                 engine_slab=None):
        cp = cp_module()
        self.layout = lay = layout.validate()
        kernels = kernels if kernels is not None else get_cache()
        self.stream = stream if stream is not None else cp.cuda.Stream(non_blocking=True)
        self.pool_address = int(pool.device_address(pool_offset, lay.pool_bytes))
        if self.pool_address % 16:
            raise ValueError(f"pool device address {self.pool_address:#x} must be 16-byte aligned")
        self.buffers = buffers if buffers is not None else allocate_device_buffers(lay)
        self.staging = self.buffers.staging
        # An engine's slab: (per-layer byte offsets on the device, block rows, stride).
        self._geo = (null_ptr(), np.int64(1), np.int64(0))
        self.engine_owned = engine_slab is not None
        if engine_slab is not None:
            address, geo = engine_slab
            if int(address) % 16:
                raise ValueError(f"engine slab address {int(address):#x} must be 16-byte aligned")
            self.slab = np.uint64(int(address))
            with self.stream:
                self._slab_offsets = cp.asarray(np.asarray(geo.layer_offsets, dtype=np.int64))
            self.stream.synchronize()
            self._geo = (self._slab_offsets, np.int64(geo.block_rows), np.int64(geo.block_stride))
        else:
            self.slab = self.buffers.slab
            want = (lay.num_layers, lay.max_reqs, lay.region_stride, lay.row_bytes)
            if tuple(self.slab.shape) != want or self.slab.dtype != cp.uint8 or not self.slab.flags.c_contiguous:
                raise ValueError(f"slab must be a contiguous uint8 array {want}")
        if blocks <= 0:
            raise ValueError(f"blocks must be positive, got {blocks}")
        self.blocks = int(blocks)
        self.threads = int(threads)
        defines = copy_defines(lay.row_bytes, threads)
        self._copy = kernels.function("copy.cu", "skv_copy_rows", defines)
        self._gather = kernels.function("copy.cu", "skv_gather", defines)
        self._push = kernels.function("copy.cu", "skv_push", defines)
        # Each group's layers on the device, [groups, 1 + most layers of a group]: count, layers.
        width = 1 + max(len(g) for g in lay.groups)
        table = np.full((lay.num_groups, width), -1, np.int32)
        for gi, g in enumerate(lay.groups):
            table[gi, 0] = len(g)
            table[gi, 1 : 1 + len(g)] = g
        with self.stream:
            self.group_layers = cp.asarray(table)
        self.stream.synchronize()
        self._layers: dict[tuple[int, ...], object] = {}

    def _layers_dev(self, layers) -> tuple[object, int]:
        cp = cp_module()
        key = tuple(int(x) for x in layers)
        arr = self._layers.get(key)
        if arr is None:
            bad = [x for x in key if not 0 <= x < self.layout.num_layers]
            if bad:
                raise ResidencyError("BAD_ARGUMENT", f"layers {bad} outside [0, {self.layout.num_layers})")
            with self.stream:
                arr = cp.asarray(np.array(key, dtype=np.int32))
            self.stream.synchronize()  # once per distinct tuple: the upload is done for good
            self._layers[key] = arr
        return arr, len(key)

    def _launch(self, stream, blocks, src, src_layer_rows, src_rows, src_layers, dst, dst_layer_rows,
                dst_rows, dst_layers, layers, mode, src_idx, dst_idx, counts, nb, ld, count_dev=None,
                layers_dev=None, dst_geo=None) -> None:
        """One ``skv_copy_rows``; ``dst_geo``: ``self._geo`` when writing the slab."""
        if nb == 0 or ld == 0:
            return
        if layers_dev is None:
            layers_dev, n_layers = self._layers_dev(layers)
        else:  # already on the device: (array, count)
            layers_dev, n_layers = layers_dev
        if n_layers == 0:
            return
        i32, i64 = np.int32, np.int64
        smem = (nb + 1) * 8 if counts is not None else 0
        if smem > DEFAULT_SMEM_BYTES:
            raise ResidencyError("TOO_LARGE", f"batch {nb} too large for one gather launch")
        with (stream if stream is not None else self.stream):
            self._copy(
                (int(blocks),), (self.threads,),
                (src, i64(src_layer_rows), i64(src_rows), i32(src_layers),
                 dst, i64(dst_layer_rows), i64(dst_rows), i32(dst_layers),
                 layers_dev, i32(n_layers), i32(mode),
                 src_idx if src_idx is not None else null_ptr(), dst_idx if dst_idx is not None else null_ptr(),
                 counts if counts is not None else null_ptr(), i32(nb), i32(ld),
                 count_dev if count_dev is not None else null_ptr(),
                 *(dst_geo if dst_geo is not None else (null_ptr(), np.int64(1), np.int64(0)))),
                shared_mem=smem,
            )

    def _pool(self) -> np.uint64:
        return np.uint64(self.pool_address)

    def _blocks_for(self, rows: int, layers: int) -> int:
        vecs = rows * layers * (self.layout.row_bytes // 16)
        return grid_blocks(vecs, self.threads, self.blocks)

    def gather_async(self, out: ResolveOutput, layers, stream=None, blocks: int | None = None) -> None:
        """Copy the plan of the last resolve into ``out`` for each of ``layers`` (the index
        group's layers), pool -> slab, on ``stream``. Order after the resolve on one stream."""
        lay = self.layout
        slots = lay.max_reqs * lay.region_stride
        self._launch(stream, blocks or self.blocks, self._pool(), lay.host_rows, lay.host_rows, lay.num_layers,
                     self.slab, slots, slots, lay.num_layers, layers, 3, out.plan_rows, out.plan_slots,
                     out.misses, out.batch, out.top_k, dst_geo=self._geo)

    def launch_gather(self, desc, plan_rows, plan_slots, misses, max_batch: int, stream,
                      group_layers=None, ready: int = 0, arrivals: int = 0, stripe: int = 0, stripes: int = 1,
                      expect: int = 0, after_resolve: bool = False, mark_slots: bool = False) -> None:
        """Enqueue ``skv_gather``: the plan of the last :meth:`CudaResidency.launch_resolve`
        (per-row counts ``misses``), pool -> slab, for every layer of the descriptor's
        group. Device arrays only; fixed grid and shared memory. ``group_layers``: an int32
        ``[groups, stride]`` table (count, then layers) in place of the layout's.
        ``stripe`` of ``stripes``: only that stripe of each row's entries
        (``base.stripe_bounds``; 0 of 1: all). ``ready`` / ``arrivals``: device addresses
        of a word set to 1 once every row is written, and of its zeroed arrival counter
        (0: no signal); ``expect``: the block arrivals that complete it (0: this grid's;
        a striped slab: ``stripes * blocks``, the gather's and the peers' pushes').
        ``after_resolve``: the kernel before it on ``stream`` is the resolve whose plan it
        copies; it is then launched programmatically (``launch_ex.py``: its blocks start
        while the resolve runs and wait in the kernel for its end, which saves the launch
        between them). ``mark_slots``: the kernel sets ``desc``'s ``D_SLOTS`` word to 1 once
        the resolve's slots are written, before it copies (a doorbell TOPK block's first
        gather: the engine's ``skv_db_indices`` makes its indices then)."""
        check_stripe(stripe, stripes)
        self._check_signal(ready, arrivals, expect)
        lay = self.layout
        i32, i64 = np.int32, np.int64
        slots = lay.max_reqs * lay.region_stride
        table = self.group_layers if group_layers is None else group_layers
        args = (desc, self._pool(), i64(lay.host_rows), i32(lay.num_layers), self.slab, i64(slots),
                table, i32(table.shape[1]), i32(lay.num_groups),
                plan_rows, plan_slots, misses, i32(max_batch), i32(lay.top_k), *self._geo,
                i32(stripe), i32(stripes), np.uint64(ready), np.uint64(arrivals), np.uint32(expect),
                i32(1 if mark_slots else 0))
        if after_resolve:
            launch_ex.launch(self._gather, self.blocks, self.threads, args, stream, self.group_layers.device.id)
            return
        with stream:
            self._gather((self.blocks,), (self.threads,), args)

    def _check_signal(self, ready: int, arrivals: int, expect: int) -> None:
        """A ready word completed by more than one block arrival needs its counter."""
        if not 0 <= int(expect) < 2**32:
            raise ResidencyError("BAD_ARGUMENT", f"expect {expect!r} must be in [0, 2^32)")
        if ready and not arrivals and (int(expect) or self.blocks) > 1:
            raise ResidencyError("BAD_ARGUMENT", "a ready word completed by several blocks needs an arrival counter")

    def slab_target(self, slab, geometry=None) -> SlabTarget:
        """A destination of :meth:`launch_push`: another rank's slab, reachable from this
        GPU (peer access or an IPC mapping; or a second slab of this GPU). ``slab``: a
        contiguous uint8 device array of the daemon's slab shape, or (with ``geometry``,
        a :class:`~sparsekv.proto.slab.SlabGeometry`) the device address of an engine-owned
        slab. Uploads the geometry's offsets to this GPU and waits: call it once a peer,
        before capture."""
        cp = cp_module()
        lay = self.layout
        if geometry is None:
            want = (lay.num_layers, lay.max_reqs, lay.region_stride, lay.row_bytes)
            if tuple(getattr(slab, "shape", ())) != want or slab.dtype != cp.uint8 or not slab.flags.c_contiguous:
                raise ResidencyError("BAD_ARGUMENT", f"a push target slab must be a contiguous uint8 array {want}")
            return SlabTarget(int(slab.data.ptr), (null_ptr(), np.int64(1), np.int64(0)))
        if int(slab) % 16:
            raise ResidencyError("BAD_ARGUMENT", f"engine slab address {int(slab):#x} must be 16-byte aligned")
        geometry.check(lay)
        with self.stream:
            offsets = cp.asarray(np.asarray(geometry.layer_offsets, dtype=np.int64))
        self.stream.synchronize()
        return SlabTarget(int(slab), (offsets, np.int64(geometry.block_rows), np.int64(geometry.block_stride)))

    def launch_push(self, desc, plan_rows, plan_slots, misses, max_batch: int, stream, dst: SlabTarget, *,
                    stripe: int, stripes: int, group_layers=None, ready: int = 0, arrivals: int = 0,
                    expect: int = 0) -> None:
        """Enqueue ``skv_push``: the entries of stripe ``stripe`` of ``stripes`` of the same
        plan as :meth:`launch_gather` (enqueue that gather first, on ``stream`` or ordered
        before it), this rank's slab -> ``dst`` (:meth:`slab_target`) at the same flat
        slots, for every layer of the descriptor's group; entries whose host row is
        outside the pool are skipped, as the gather skipped them. Needs this mover's slab
        in the daemon's layout (not an engine-owned one). Device arrays only; fixed grid
        (this mover's ``blocks``), no host sync. ``ready`` / ``arrivals``: device
        addresses (readable from this GPU) of ``dst``'s ready word and its zeroed arrival
        counter, set once ``expect`` blocks arrived (0: this grid's; with N ranks, ``N *
        blocks``: the local gather's and every peer's push into ``dst``)."""
        check_stripe(stripe, stripes)
        self._check_signal(ready, arrivals, expect)
        if not isinstance(dst, SlabTarget):
            raise ResidencyError("BAD_ARGUMENT", f"push destination must be a SlabTarget, got {type(dst).__name__}")
        if self.engine_owned:
            raise ResidencyError("BAD_ARGUMENT", "a push reads the daemon's slab; this mover writes an engine's")
        lay = self.layout
        i32, i64 = np.int32, np.int64
        slots = lay.max_reqs * lay.region_stride
        table = self.group_layers if group_layers is None else group_layers
        with stream:
            self._push(
                (self.blocks,), (self.threads,),
                (desc, i64(lay.host_rows), i32(lay.num_layers), self.slab, np.uint64(dst.address), i64(slots),
                 table, i32(table.shape[1]), i32(lay.num_groups),
                 plan_rows, plan_slots, misses, i32(max_batch), i32(lay.top_k), *dst.geo,
                 i32(stripe), i32(stripes), np.uint64(ready), np.uint64(arrivals), np.uint32(expect)),
            )

    def launch_write_staged(self, layers, n_layers: int, rows, stream) -> None:
        """Write mirror in place: staging row i of each of the ``n_layers`` ``layers``
        (device int32) -> host row ``rows[1 + i]`` for i < ``rows[0]`` (device int32
        ``[1 + staging_rows]``, the count read on the device). Fixed grid; rows outside
        [0, host_rows) are skipped."""
        lay = self.layout
        if self.staging is None:
            raise ResidencyError("BAD_ARGUMENT", "layout has no staging buffer (staging_rows = 0)")
        self._launch(stream, self.blocks, self.staging, lay.staging_rows, lay.staging_rows, lay.num_layers,
                     self._pool(), lay.host_rows, lay.host_rows, lay.num_layers, None, 3, None,
                     rows[1:], None, 1, lay.staging_rows, count_dev=rows, layers_dev=(layers, int(n_layers)))

    def gather(self, plan: Plan, layers: tuple[int, ...]) -> int:
        cp = cp_module()
        n = len(plan)
        if not n:
            return 0
        lay = self.layout
        slots = lay.max_reqs * lay.region_stride
        with self.stream:
            rows = cp.asarray(np.ascontiguousarray(plan.rows, dtype=np.int32))
            flat = cp.asarray(np.ascontiguousarray(plan.slots, dtype=np.int32))
            self._launch(None, self._blocks_for(n, len(layers)), self._pool(), lay.host_rows, lay.host_rows,
                         lay.num_layers, self.slab, slots, slots, lay.num_layers, layers, 3, rows, flat, None, 1, n,
                         dst_geo=self._geo)
        self.stream.synchronize()
        return n * len(layers) * lay.row_bytes

    def stage(self, rows: np.ndarray, layers: tuple[int, ...]) -> int:
        cp = cp_module()
        lay = self.layout
        if self.staging is None:
            raise ResidencyError("BAD_ARGUMENT", "layout has no staging buffer (staging_rows = 0)")
        rows = np.asarray(rows, dtype=np.int32).reshape(-1)
        n = int(rows.shape[0])
        if n > lay.staging_rows:
            raise ResidencyError("TOO_LARGE", f"{n} rows do not fit the staging buffer of {lay.staging_rows}")
        if n and (rows.min() < 0 or rows.max() >= lay.host_rows):
            raise ResidencyError("BAD_ARGUMENT", f"stage rows must lie in [0, {lay.host_rows})")
        if n:
            with self.stream:
                self._launch(None, self._blocks_for(n, len(layers)), self._pool(), lay.host_rows, lay.host_rows,
                             lay.num_layers, self.staging, lay.staging_rows, lay.staging_rows, lay.num_layers,
                             layers, 3, cp.asarray(rows), None, None, 1, n)
            self.stream.synchronize()
        return n * len(layers) * lay.row_bytes
