"""CUDA residency: the residency contract as kernels (``csrc/resolve.cu``), with the
interface and exact semantics of ``cpu.py``; ``owner`` / ``lru`` are CuPy int32 arrays
``[groups, max_reqs, region_stride]``.

* **device-resident** (the decode path): ``resolve_async``, ``invalidate_async`` and the
  ``launch_*`` methods take device arrays, write into fixed-shape buffers
  (:class:`ResolveOutput`), run on a given stream, never read back.
  They cannot raise on bad values: the kernels refuse the row (csrc/README.md) and count
  it in the error record ``out.err``, which the daemon turns into typed errors.
* **host convenience** (tests, ``replay --verify``): ``resolve``, ``prefetch``, ``reset``,
  ``invalidate``, ``invalidate_everywhere`` take and return NumPy, raise the cpu
  backend's :class:`ResidencyError` codes before any state changes, and synchronise.

With ``prefetch=True`` the residency also keeps the prefetch marks ``fresh`` (uint8, the
shape of ``owner``) and the counters ``pf_counters`` (uint64 [4]: prefetched, hits,
wasted, accumulated), which every kernel updates (csrc/prefetch.cu, csrc/resolve.cu);
without, the kernels get null pointers and do exactly the work they did before.
"""

from __future__ import annotations

import numpy as np

from sparsekv.daemon.kernels import DEFAULT_HASH_SCALE, RESOLVE_THREADS, get_cache, resolve_defines
from sparsekv.proto.layout import Layout

from ..base import Plan, Residency, ResidencyError, Resolved, check_batch
from .device import (
    HITS,
    OUT_OF_RANGE,
    PF_COUNTERS,
    PF_HITS,
    PF_PREFETCHED,
    PF_WASTED,
    SETUP_BLOCKS,
    STEP_BLOCKS,
    ResolveOutput,
    cp_module,
    device_i32,
    error_bits,
    fresh_marks,
    grid_blocks,
    make_desc,
    null_ptr,
    pow2,
    prefetch_workspace_bytes,
    resolve_workspace_bytes,
    rows_block,
    smem_limit,
)


class CudaResidency(Residency):
    """Residency state on one GPU with the resolve/reset/invalidate kernels.

    Args:
        layout: the attached layout.
        kernels: a :class:`sparsekv.daemon.kernels.KernelCache` (default: the process one).
        stream: the CuPy stream of the host-convenience calls and the default of the
            async ones (default: a new non-blocking stream).
        threads: threads per resolve block (a multiple of 32).
        workspace: ``"auto"`` (shared memory when it fits, else global scratch),
            ``"shared"`` or ``"global"``.
        hash_scale: the hash table's entries per power-of-two column, 2 or 4; ``None``
            (the default): 4 when that workspace fits in shared memory, else 2.
        lru_smem, owner_smem: the new lru row built in the workspace, then copied out
            whole; the owner row read into it with the lru row (csrc/resolve.cu
            SKV_LRU_SMEM, SKV_OWNER_SMEM; a region row of workspace each). ``None`` (the
            default): each where the workspace (with the table above) still fits.
        prefetch: keep the prefetch marks and counters, and build ``skv_prefetch``
            (a layout whose prefetch workspace exceeds shared memory is refused).
    """

    def __init__(self, layout: Layout, *, kernels=None, stream=None, threads: int = RESOLVE_THREADS,
                 workspace: str = "auto", hash_scale: int | None = None, lru_smem: bool | None = None, owner_smem: bool | None = None,
                 prefetch: bool = False):
        cp = cp_module()
        self.layout = layout.validate()
        kernels = kernels if kernels is not None else get_cache()
        self.stream = stream if stream is not None else cp.cuda.Stream(non_blocking=True)
        g, r, s = layout.num_groups, layout.max_reqs, layout.region_stride
        with self.stream:
            self.owner = cp.full((g, r, s), -1, dtype=cp.int32)
            self.lru = cp.empty((g, r, s), dtype=cp.int32)
            self.lru[...] = cp.arange(s, dtype=cp.int32)
            self.fresh = fresh_marks((g, r, s), cp) if prefetch else None
            self.pf_counters = cp.zeros(PF_COUNTERS, dtype=cp.uint64) if prefetch else None
        self.threads = int(threads)
        # Options not given: the smallest, then each that still fits in shared memory.
        # Built for a shared-memory workspace unless it must be global (rebuilt if not).
        if workspace not in ("auto", "shared", "global"):
            raise ValueError(f"workspace must be auto, shared or global, got {workspace!r}")
        opts = {"hash_scale": DEFAULT_HASH_SCALE if hash_scale is None else int(hash_scale),
                "lru_smem": bool(lru_smem), "owner_smem": bool(owner_smem)}

        def build(**o):
            d = resolve_defines(threads, **o)
            return d, kernels.function("resolve.cu", "skv_resolve", d)

        ws_smem = workspace != "global"
        defines, self._resolve = build(**opts, ws_smem=ws_smem)
        limit = smem_limit(self._resolve)  # no option changes the static shared memory
        if workspace != "global" and hash_scale is None and resolve_workspace_bytes(
                layout.top_k, s, **dict(opts, hash_scale=4)) <= limit:
            opts["hash_scale"] = 4
            defines, self._resolve = build(**opts, ws_smem=ws_smem)
        grown = False
        for name, given in (("owner_smem", owner_smem), ("lru_smem", lru_smem)):
            trial = dict(opts, **{name: True})
            if (workspace != "global" and given is None and not opts[name]
                    and resolve_workspace_bytes(layout.top_k, s, **trial) <= limit):
                opts, grown = trial, True
        if grown:
            defines, self._resolve = build(**opts, ws_smem=ws_smem)
        self.hash_scale, self.lru_smem, self.owner_smem = opts["hash_scale"], opts["lru_smem"], opts["owner_smem"]
        self.workspace_bytes = resolve_workspace_bytes(layout.top_k, s, **opts)
        if workspace == "shared" and self.workspace_bytes > limit:
            raise ValueError(f"resolve workspace {self.workspace_bytes} B exceeds shared memory {limit} B")
        self.workspace_global = workspace == "global" or (workspace == "auto" and self.workspace_bytes > limit)
        if self.workspace_global and ws_smem:
            defines, self._resolve = build(**opts)
        self._reset = kernels.function("resolve.cu", "skv_reset", defines)
        self._invalidate = kernels.function("resolve.cu", "skv_invalidate", defines)
        self.resolve_smem = 0 if self.workspace_global else self.workspace_bytes
        # Raised, never lowered, on the function every engine on this GPU shares.
        self._resolve = kernels.function("resolve.cu", "skv_resolve", defines, smem_bytes=self.resolve_smem)
        # skv_begin_step holds one sorted invalidate row (at most top_k ids) in shared memory.
        self.inv_cap = layout.top_k
        self.step_smem = pow2(self.inv_cap) * 4
        if self.step_smem > limit:
            self.inv_cap = limit // 8  # a power of two that fits; STEP refuses wider rows
            self.step_smem = pow2(self.inv_cap) * 4
        self._begin_step = kernels.function("resolve.cu", "skv_begin_step", defines, smem_bytes=self.step_smem)
        self._prefetch = None
        if prefetch:
            pf_defines = resolve_defines(threads)
            self.prefetch_smem = prefetch_workspace_bytes(layout.top_k, s)
            pf_limit = smem_limit(kernels.function("prefetch.cu", "skv_prefetch", pf_defines))
            if self.prefetch_smem > pf_limit:
                raise ValueError(f"prefetch workspace {self.prefetch_smem} B (top_k {layout.top_k}, region_stride "
                                 f"{s}) exceeds shared memory {pf_limit} B")
            if layout.max_batch > 0xFFFF:
                raise ValueError(f"prefetch takes at most 65535 batch rows, max_batch is {layout.max_batch}")
            self._prefetch = kernels.function("prefetch.cu", "skv_prefetch", pf_defines, smem_bytes=self.prefetch_smem)
        self._host_out: ResolveOutput | None = None
        self.last_errors = 0  # error bits of the last host-convenience resolve

    def new_output(self, max_batch: int | None = None) -> ResolveOutput:
        """A :class:`ResolveOutput` for batches of up to ``max_batch`` rows (default: the
        layout's ``max_batch``)."""
        ws = self.workspace_bytes if self.workspace_global else 0
        return ResolveOutput(self.layout, self.layout.max_batch if max_batch is None else max_batch, ws, self.stream)

    def resolve_async(self, group: int, state_rows, topk, out: ResolveOutput, stream=None) -> None:
        """Resolve ``topk`` (int32 [B, k], device) for ``state_rows`` (int32 [B], device)
        into ``out`` on ``stream``: writes ``out.desc`` from the shapes, then
        :meth:`launch_resolve`. Checks shapes only (bad values: the module docstring).
        ``state_rows``' memory must hold ``out.max_batch`` entries (a view of the first B
        will do): every block reads its row's entry before it knows the batch."""
        lay = self.layout
        stream = stream if stream is not None else self.stream
        if not 0 <= group < lay.num_groups:
            raise ResidencyError("BAD_ARGUMENT", f"group {group} out of range [0, {lay.num_groups})")
        with stream:  # a contiguity copy, if any, is ordered on the stream too
            state_rows = device_i32(state_rows, "state_rows", 1)
            topk = device_i32(topk, "topk", 2)
        batch, k = topk.shape
        if state_rows.shape[0] != batch:
            raise ResidencyError("BAD_ARGUMENT", f"state_rows {state_rows.shape} and topk {topk.shape} disagree")
        if k > out.top_k:
            raise ResidencyError("BAD_ARGUMENT", f"topk has {k} columns, the output holds {out.top_k}")
        if batch > out.max_batch:
            raise ResidencyError("TOO_LARGE", f"batch {batch} exceeds the output's max_batch {out.max_batch}")
        if self.workspace_global and out.workspace is None:
            raise ResidencyError("BAD_ARGUMENT", "this residency needs an output with a global workspace (new_output)")
        out.batch, out.k, out.group = batch, k, group
        if batch == 0:
            return
        out.desc.set(make_desc(batch, k, group), stream=stream)
        self.launch_resolve(out.desc, state_rows, topk, out.slots, out.misses, out.plan_rows, out.plan_slots,
                            out.counters, 0, out.err, out.workspace, out.max_batch, stream)

    def launch_resolve(self, desc, state_rows, topk, slots, misses, plan_rows, plan_slots, counters,
                       counters_per_group: int, err, workspace, max_batch: int, stream, clear: int = 0) -> None:
        """Enqueue ``skv_resolve`` on ``stream`` (its arguments: csrc/resolve.cu). Device
        arrays only; batch, columns and group come from ``desc``; grid and shared memory
        are fixed by the layout. ``clear``: a device address, or 0."""
        lay = self.layout
        i32 = np.int32
        if self.workspace_global:
            ws = workspace
            ws_stride = np.int64(self.workspace_bytes)
        else:
            ws, ws_stride = null_ptr(), np.int64(0)
        with stream:
            self._resolve(
                (int(max_batch),), (self.threads,),
                (desc, self.owner, self.lru, i32(lay.num_groups), i32(lay.max_reqs), i32(lay.region_stride),
                 i32(lay.host_rows), i32(lay.top_k), i32(max_batch), state_rows, topk, i32(lay.top_k),
                 slots, misses, plan_rows, plan_slots, counters, i32(counters_per_group), err, ws, ws_stride,
                 np.uint64(clear), *self._marks()),
                shared_mem=self.resolve_smem,
            )

    def launch_begin_step(self, desc, state_rows, reset, invalidate, err, max_batch: int, stream) -> None:
        """Enqueue ``skv_begin_step`` on ``stream``: the step's resets and invalidations
        (device arrays: ``state_rows`` and ``reset`` int32 [max_batch], ``invalidate``
        int32 [batch, desc INV_N] flat), sized by ``desc``, on a fixed grid."""
        lay = self.layout
        i32 = np.int32
        with stream:
            self._begin_step(
                (STEP_BLOCKS,), (256,),
                (desc, self.owner, self.lru, i32(lay.num_groups), i32(lay.max_reqs), i32(lay.region_stride),
                 i32(max_batch), state_rows, reset, invalidate, i32(self.inv_cap), err, *self._marks()),
                shared_mem=self.step_smem,
            )

    def invalidate_async(self, rows, rows_cap: int, state_rows=None, counter=None, stream=None) -> None:
        """Enqueue ``skv_invalidate`` (csrc/resolve.cu): ``rows`` device int32 ``[1 + cap]``
        (:func:`rows_block`), ``state_rows`` int32 [m] or None, ``counter`` uint64 [1] or
        None (a slot counted once only when ``state_rows`` is None or has no repeats)."""
        lay = self.layout
        stream = stream if stream is not None else self.stream
        i32 = np.int32
        with stream:
            if state_rows is None:
                regions, sr, n_state = lay.num_groups * lay.max_reqs, null_ptr(), 0
            else:
                sr = device_i32(state_rows, "state_rows", 1)
                n_state = sr.shape[0]
                regions = lay.num_groups * n_state
                if n_state == 0:
                    return
            total = regions * lay.region_stride
            self._invalidate(
                (grid_blocks(total, 256, SETUP_BLOCKS),), (256,),
                (self.owner, i32(lay.num_groups), i32(lay.max_reqs), i32(lay.region_stride), sr,
                 i32(n_state), rows, i32(rows_cap), counter if counter is not None else null_ptr(), *self._marks()),
            )

    def reset(self, state_rows: np.ndarray) -> None:
        cp = cp_module()
        rows = np.asarray(state_rows, dtype=np.int64)
        rows = rows[rows >= 0]
        if rows.size and rows.max() >= self.layout.max_reqs:
            raise ResidencyError("BAD_STATE_ROW", f"state row {int(rows.max())} >= max_reqs")
        if not rows.size:
            return
        lay, i32 = self.layout, np.int32
        total = rows.size * lay.num_groups * lay.region_stride
        with self.stream:
            self._reset((grid_blocks(total, 256, SETUP_BLOCKS),), (256,),
                        (self.owner, self.lru, i32(lay.num_groups), i32(lay.max_reqs), i32(lay.region_stride),
                         cp.asarray(rows.astype(np.int32)), i32(rows.size), *self._marks()))
        self.stream.synchronize()

    def invalidate(self, state_row: int, rows: np.ndarray) -> None:
        cp = cp_module()
        if not 0 <= state_row < self.layout.max_reqs:
            raise ResidencyError("BAD_STATE_ROW", f"state row {state_row} out of range")
        block = rows_block(rows)
        if not block[0]:
            return
        with self.stream:
            self.invalidate_async(cp.asarray(block), int(block[0]), cp.asarray(np.array([state_row], np.int32)))
        self.stream.synchronize()

    def invalidate_everywhere(self, rows: np.ndarray) -> int:
        cp = cp_module()
        block = rows_block(rows)
        if not block[0]:
            return 0
        with self.stream:
            counter = cp.zeros(1, dtype=cp.uint64)
            self.invalidate_async(cp.asarray(block), int(block[0]), None, counter)
        with self.stream:  # a readback on the legacy stream would wait behind parked doorbell streams
            return int(counter.get()[0])

    def _marks(self) -> tuple:
        """The last two arguments of every residency kernel: the prefetch marks and
        counters, or null pointers (prefetch off)."""
        if self.fresh is None:
            return null_ptr(), null_ptr()
        return self.fresh, self.pf_counters

    def launch_prefetch(self, desc, state_rows, topk, plan_rows, plan_slots, counts, err, max_batch: int,
                        stream, group_offset: int = 0) -> None:
        """Enqueue ``skv_prefetch`` (csrc/prefetch.cu) on ``stream``: ``topk`` (int32
        [batch, k], another group's) into the regions of group ``desc`` group +
        ``group_offset`` (1: ``desc`` is the source group's top-k block), the plan into
        ``plan_rows`` / ``plan_slots`` [max_batch, top_k] and ``counts`` [max_batch] (the
        format ``skv_gather`` reads). Device arrays only; no read-back."""
        if self._prefetch is None:
            raise ResidencyError("BAD_ARGUMENT", "this residency was made without prefetch")
        lay = self.layout
        i32 = np.int32
        with stream:
            self._prefetch(
                (int(max_batch),), (self.threads,),
                (desc, np.int32(group_offset), self.owner, self.lru, self.fresh, i32(lay.num_groups), i32(lay.max_reqs),
                 i32(lay.region_stride), i32(lay.host_rows), i32(lay.top_k), i32(max_batch), state_rows, topk,
                 i32(lay.top_k), plan_rows, plan_slots, counts, self.pf_counters, err),
                shared_mem=self.prefetch_smem,
            )

    def prefetch(self, group: int, state_rows: np.ndarray, topk: np.ndarray) -> Plan:
        if self._prefetch is None:
            return super().prefetch(group, state_rows, topk)
        cp = cp_module()
        state_rows, topk = check_batch(self.layout, group, state_rows, topk)
        batch, k = topk.shape
        if batch == 0:
            return Plan(rows=np.empty(0, np.int32), slots=np.empty(0, np.int32))
        out = self._host_output(batch)
        with self.stream:
            out.desc.set(make_desc(batch, k, group), stream=self.stream)
            self.launch_prefetch(out.desc, cp.asarray(_padded(state_rows, out.max_batch)),
                                 cp.asarray(np.ascontiguousarray(topk)), out.plan_rows, out.plan_slots, out.misses,
                                 out.err, out.max_batch, self.stream)
        self.stream.synchronize()
        with self.stream:
            counts = out.misses[:batch].get()
            prow = out.plan_rows[:batch].get()
            pslot = out.plan_slots[:batch].get()
            self.last_errors = error_bits(out.err.get())
        # Entries a later token of the request dropped (slot -1) left out; sorted by host
        # row, then slot, as the NumPy engine's plan.
        take = (np.arange(out.top_k)[None, :] < counts[:, None]) & (pslot >= 0)
        rows, flat = prow[take], pslot[take]
        by_row = np.lexsort((flat, rows))
        return Plan(rows=rows[by_row].astype(np.int32), slots=flat[by_row].astype(np.int32))

    def _pf_counter(self, i: int) -> int:
        if self.pf_counters is None:
            return 0
        self.stream.synchronize()
        with self.stream:
            return int(self.pf_counters[i].get())

    @property
    def prefetched(self) -> int:
        return self._pf_counter(PF_PREFETCHED)

    @property
    def prefetch_hits(self) -> int:
        return self._pf_counter(PF_HITS)

    @property
    def prefetch_wasted(self) -> int:
        return self._pf_counter(PF_WASTED)

    def resolve(self, group: int, state_rows: np.ndarray, topk: np.ndarray) -> Resolved:
        cp = cp_module()
        lay = self.layout
        state_rows, topk = check_batch(lay, group, state_rows, topk)
        batch, k = topk.shape
        if batch == 0:
            empty = np.empty(0, np.int32)
            return Resolved(slots=np.full((0, k), -1, np.int32), misses=empty.copy(), hits=0,
                            out_of_range=0, plan=Plan(rows=empty.copy(), slots=empty.copy()))
        out = self._host_output(batch)
        with self.stream:
            out.zero_counters()
            self.resolve_async(group, cp.asarray(_padded(state_rows, out.max_batch))[:batch],
                               cp.asarray(np.ascontiguousarray(topk)), out)
        self.stream.synchronize()
        # Read back with our stream current (CuPy's slice copies too), never the legacy one.
        with self.stream:
            slots = out.slots[:batch, :k].get()
            misses = out.misses[:batch].get()
            counters = out.counters.get()
            prow = out.plan_rows[:batch].get()
            pslot = out.plan_slots[:batch].get()
            self.last_errors = error_bits(out.err.get())
        # Per-row plans (each sorted by host row) in batch order, then one stable sort:
        # the same order as the NumPy engine (ties between batch rows in batch order).
        take = np.arange(out.top_k)[None, :] < misses[:, None]
        rows, flat = prow[take], pslot[take]
        by_row = np.argsort(rows, kind="stable")
        return Resolved(
            slots=np.ascontiguousarray(slots),
            misses=misses,
            hits=int(counters[HITS]),
            out_of_range=int(counters[OUT_OF_RANGE]),
            plan=Plan(rows=rows[by_row].astype(np.int32), slots=flat[by_row].astype(np.int32)),
        )

    def _host_output(self, batch: int) -> ResolveOutput:
        if self._host_out is None or self._host_out.max_batch < batch:
            self._host_out = self.new_output(max(batch, 2 * (self._host_out.max_batch if self._host_out else 0)))
        return self._host_out

    def state(self) -> tuple[np.ndarray, np.ndarray]:
        """``(owner, lru)`` copied to the host (synchronises the stream)."""
        self.stream.synchronize()
        with self.stream:
            return self.owner.get(), self.lru.get()

    def load_state(self, owner: np.ndarray, lru: np.ndarray) -> None:
        """Overwrite the device state with host arrays of shape ``[groups, max_reqs, stride]``."""
        cp = cp_module()
        shape = self.owner.shape
        owner = np.asarray(owner, dtype=np.int32)
        lru = np.asarray(lru, dtype=np.int32)
        if owner.shape != shape or lru.shape != shape:
            raise ResidencyError("BAD_ARGUMENT", f"state must be {shape}, got {owner.shape} and {lru.shape}")
        with self.stream:
            self.owner[...] = cp.asarray(owner)
            self.lru[...] = cp.asarray(lru)
        self.stream.synchronize()


def _padded(state_rows: np.ndarray, n: int) -> np.ndarray:
    """``state_rows`` followed by -1 up to ``n`` entries (the kernels read the first entry
    of each of their ``max_batch`` blocks' rows before they know the batch)."""
    out = np.full(max(n, state_rows.shape[0]), -1, np.int32)
    out[:state_rows.shape[0]] = state_rows
    return out
