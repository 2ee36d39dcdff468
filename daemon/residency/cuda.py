"""CUDA backend: the residency contract and the byte mover as kernels (``csrc/``).

Same interfaces and exact semantics as ``cpu.py``; the state lives on the device as CuPy
int32 arrays ``owner`` / ``lru`` of shape ``[groups, max_reqs, region_stride]``.

Two kinds of entry points:

* **device-resident** (the decode path): ``resolve_async``, ``gather_async``,
  ``reset_async``, ``invalidate_async``, ``stage_async``, ``write_async`` take device
  arrays, write into preallocated fixed-shape buffers (:class:`ResolveOutput`), run on a
  given CuPy stream and never read anything back to the host.
* **host convenience** (tests, ``replay --verify``, the CPU-backend-shaped interface):
  ``resolve``, ``reset``, ``invalidate``, ``invalidate_everywhere``, ``gather``, ``stage``,
  ``write`` take and return NumPy, validate on the host exactly like ``cpu.py`` (the same
  :class:`ResidencyError` codes, raised before any state changes) and synchronise.

Bad input: the host ``resolve`` raises before touching state, like the cpu backend. The
device path cannot raise; it stays memory-safe and deterministic: a top-k row naming a
host row twice, or a state row's row beyond ``region_stride / top_k`` tokens, is refused
(slots -1, no misses, no state change), a bad state row is padding, and the kernels count
each such event in the error record ``out.err`` (kind, batch row, step, group; see
``csrc/common.cuh``). The daemon turns those records into typed errors.

Every size the kernels use comes from a step descriptor in device memory (``make_desc``),
so a launch never depends on what the host knows about the step.

``cupy`` is imported lazily: importing this module needs no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsekv.proto.layout import Layout

from .base import Mover, Plan, Residency, ResidencyError, Resolved, check_batch

from sparsekv.daemon.kernels import (  # noqa: E402 - constants only; cupy stays lazy
    COPY_LOAD,
    COPY_THREADS,
    DEFAULT_HASH_SCALE,
    DEFAULT_SMEM_BYTES,
    MERGE_THREADS,
    RESOLVE_LOOKUPS,
    RESOLVE_THREADS,
    copy_defines,
    resolve_defines,
    tma_gather_smem,
)

DEFAULT_COPY_BLOCKS = 32  # bounded: attention shares the SMs and the PCIe link
# The order a decode step's gather reads the pool in: "request" (each batch row's plan in
# turn, each sorted by host row) or "batch" (every batch row's misses merged by host row on
# the device, skv_merge_plan). Measured on the H200 (docs/PERF.md, 2026-12-02 session 6):
# with each request's rows in its own blocks the merge buys nothing (request order 39.3
# GB/s, batch order 32.5-34.1 GB/s with the merge's 34.5 us included) and a decode step
# at batch 64 is 9 % slower with it; "batch" stays for pools where requests share blocks.
GATHER_ORDER_ENV = "SPARSEKV_GATHER_ORDER"
GATHER_ORDERS = ("request", "batch")
DEFAULT_GATHER_ORDER = "request"
MERGE_SMEM_CAP = 200 << 10  # the merge's lists in shared memory up to this much


def gather_order(value: str | None = None) -> str:
    """``value``, else ``$SPARSEKV_GATHER_ORDER``, else the default."""
    import os  # noqa: PLC0415

    order = value or os.environ.get(GATHER_ORDER_ENV) or DEFAULT_GATHER_ORDER
    if order not in GATHER_ORDERS:
        raise ValueError(f"gather order must be one of {', '.join(GATHER_ORDERS)}, got {order!r}")
    return order


SETUP_BLOCKS = 1024  # cap for the grid-stride reset/invalidate kernels
STEP_BLOCKS = 128  # fixed grid of skv_begin_step (blocks stride over batch rows x groups)

# The step descriptor (csrc/common.cuh, proto/step_block.py): int32[DESC_INTS].
from sparsekv.proto.step_block import D_BATCH, D_GROUP, D_INV_N, D_K, D_SEQ, D_STEP, DESC_INTS  # noqa: E402,F401
from sparsekv.proto.step_block import write_desc  # noqa: E402
# The error record (csrc/common.cuh): int32[ERR_INTS]; err[e] counts kind e, err[8 + e],
# err[16 + e], err[24 + e] hold the batch row, step and group of the latest.
ERR_INTS = 32
E_DUPLICATE_IDS, E_CORRUPT_STATE, E_BAD_STATE_ROW, E_TOO_MANY_TOKENS, E_BAD_STEP = range(5)
from sparsekv.proto.device_errors import ERROR_KINDS  # noqa: E402 - the record's kinds, shared with clients
# Bits of ResolveOutput.read_counters()["errors"]: 1 << kind.
ERR_DUPLICATE_IDS = 1 << E_DUPLICATE_IDS
ERR_CORRUPT_STATE = 1 << E_CORRUPT_STATE
ERR_BAD_STATE_ROW = 1 << E_BAD_STATE_ROW
ERR_TOO_MANY_TOKENS = 1 << E_TOO_MANY_TOKENS
ERR_BAD_STEP = 1 << E_BAD_STEP
# Indices into the per-group counters (u64 [3] used of 4).
HITS, MISSES, OUT_OF_RANGE = range(3)
COUNTERS_PER_GROUP = 4


def _cp():
    import cupy

    return cupy


def error_bits(err) -> int:
    """The bits (1 << kind) of the kinds an error record (host int32 [ERR_INTS]) counted."""
    return sum(1 << e for e in range(len(ERROR_KINDS)) if int(err[e]))


def make_desc(batch: int = 0, k: int = 0, group: int = 0, inv_n: int = 0, step: int = 0, seq: int = 0) -> np.ndarray:
    """A step descriptor (host int32 [DESC_INTS])."""
    d = np.zeros(DESC_INTS, np.int32)
    write_desc(d, seq=seq, step=step, batch=batch, k=k, group=group, inv_n=inv_n)
    return d


def rows_block(rows, cap: int | None = None) -> np.ndarray:
    """``[n, rows sorted ascending...]`` (int32; negative rows dropped), the input of
    ``skv_invalidate``, padded with -1 to ``1 + cap`` entries when ``cap`` is given."""
    rows = np.asarray(rows, dtype=np.int32).reshape(-1)
    rows = np.sort(rows[rows >= 0])
    n = 1 + (cap if cap is not None else rows.size)
    out = np.full(n, -1, np.int32)
    out[0] = rows.size
    out[1 : 1 + rows.size] = rows
    return out


def _pow2(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


def _a16(n: int) -> int:
    return (n + 15) & ~15


def resolve_workspace_bytes(k: int, region_stride: int, lookup: str = "sort", hash_scale: int = 2,
                            lru_smem: bool = False, owner_smem: bool = False) -> int:
    """Bytes of one resolve block's workspace for ``k`` columns (mirrors ``skv_ws``); the
    hash lookup adds its table (host rows and columns, ``hash_scale`` x pow2(k) entries
    each), ``lru_smem`` and ``owner_smem`` a region row each (csrc/resolve.cu
    SKV_LRU_SMEM, SKV_OWNER_SMEM)."""
    kp = _pow2(k)
    rows = 1 + int(bool(lru_smem)) + int(bool(owner_smem))
    base = _a16(kp * 8) + 2 * _a16(k * 4) + 2 * _a16((region_stride + 31) // 32 * 4) + rows * _a16(region_stride * 4)
    return base + (_a16(2 * hash_scale * kp * 4) if lookup == "hash" else 0)


RESOLVE_LOOKUP_ENV = "SPARSEKV_RESOLVE_LOOKUP"
DEFAULT_RESOLVE_LOOKUP = "hash"


def resolve_lookup(value: str | None = None) -> str:
    """``value``, else ``$SPARSEKV_RESOLVE_LOOKUP``, else the default, ``hash`` (on the H200,
    2026-12-02: 32.9 us against the sort's 51.2, batch 64, top-k 2048; docs/PERF.md)."""
    import os  # noqa: PLC0415

    lookup = value or os.environ.get(RESOLVE_LOOKUP_ENV) or DEFAULT_RESOLVE_LOOKUP
    if lookup not in RESOLVE_LOOKUPS:
        raise ValueError(f"resolve lookup must be one of {', '.join(RESOLVE_LOOKUPS)}, got {lookup!r}")
    return lookup


def _null():
    return np.uint64(0)


class ResolveOutput:
    """Device buffers of one resolve, fixed shapes ``[max_batch, top_k]``.

    After ``resolve_async(group, state_rows, topk, out)`` of a batch of ``B`` rows and
    ``k`` columns (on the stream, not yet on the host):

    * ``slots[b, c]``: slot within the region for column ``c`` of row ``b`` (-1 if none;
      columns ``k..top_k`` are -1);
    * ``misses[b]``: misses of row ``b``; padding rows 0;
    * ``plan_rows[b, :misses[b]]`` / ``plan_slots[b, :misses[b]]``: the compact plan of
      row ``b`` sorted by host row; a slot is flat ``state_row * region_stride + slot``;
      entries past ``misses[b]`` are stale;
    * ``counters`` (uint64 [4]): hits, misses, out-of-range ids, **accumulated** across
      resolves until :meth:`zero_counters`; ``err`` (int32 [ERR_INTS]) the error record;
      ``desc`` (int32 [DESC_INTS]) the descriptor of the last resolve.

    ``batch``, ``k`` and ``group`` (host ints) record the last resolve for ``gather_async``.
    """

    def __init__(self, layout: Layout, max_batch: int, workspace_bytes: int = 0, stream=None):
        cp = _cp()
        if max_batch <= 0:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        self.max_batch = int(max_batch)
        self.top_k = layout.top_k
        with _on(stream):
            self.slots = cp.full((max_batch, layout.top_k), -1, dtype=cp.int32)
            self.misses = cp.zeros(max_batch, dtype=cp.int32)
            self.plan_rows = cp.full((max_batch, layout.top_k), -1, dtype=cp.int32)
            self.plan_slots = cp.full((max_batch, layout.top_k), -1, dtype=cp.int32)
            self.counters = cp.zeros(4, dtype=cp.uint64)
            self.err = cp.zeros(ERR_INTS, dtype=cp.int32)
            self.desc = cp.zeros(DESC_INTS, dtype=cp.int32)
            # Global scratch for strides whose workspace does not fit in shared memory.
            self.workspace = cp.empty(max_batch * workspace_bytes, dtype=cp.uint8) if workspace_bytes else None
        self.workspace_bytes = int(workspace_bytes)
        self.batch = 0
        self.k = 0
        self.group = -1

    def zero_counters(self, stream=None) -> None:
        with _on(stream):
            self.counters.fill(0)
            self.err.fill(0)

    def read_counters(self, stream=None) -> dict:
        """Synchronise ``stream`` and return the counters and the error bits (tests)."""
        if stream is not None:
            stream.synchronize()
        c = self.counters.get()
        return {"hits": int(c[HITS]), "misses": int(c[MISSES]), "out_of_range": int(c[OUT_OF_RANGE]),
                "errors": error_bits(self.err.get())}


class _on:
    """``with _on(stream):`` makes ``stream`` current (no-op for None)."""

    def __init__(self, stream):
        self.stream = stream

    def __enter__(self):
        if self.stream is not None:
            self.stream.__enter__()
        return self.stream

    def __exit__(self, *exc):
        if self.stream is not None:
            self.stream.__exit__(*exc)


def _grid(total: int, threads: int, cap: int) -> int:
    return max(1, min(cap, -(-total // threads)))


def _device_i32(a, name: str, ndim: int):
    """A C-contiguous int32 device array. A device array of that kind passes through; any
    other integer array is converted (on the current stream; a host array is uploaded)."""
    cp = _cp()
    if a.ndim != ndim:
        raise ResidencyError("BAD_ARGUMENT", f"{name} must have {ndim} dimension(s), got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise ResidencyError("BAD_ARGUMENT", f"{name} must hold integers, got {a.dtype}")
    a = cp.asarray(a)
    if a.dtype != cp.int32:
        a = a.astype(cp.int32)
    return cp.ascontiguousarray(a)


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
        timing_defines: more constants for the kernels (``SKV_RESOLVE_STOP``: the
            kernel bench's phase timings; its results are wrong). Never in the daemon.
        lookup: how resolve finds a row's columns from the owners, ``sort`` or ``hash``
            (:func:`resolve_lookup`: else ``$SPARSEKV_RESOLVE_LOOKUP``, else ``hash``).
        hash_scale: the hash table's entries per power-of-two column, 2 or 4; ``None``
            (the default): 4 when that workspace fits in shared memory, else 2 (on the
            H200 the x4 table took batch 64 x top-k 2048 from 25.5 to 19.8 us: its probe
            runs are shorter; docs/PERF.md, session 8).
        lru_smem, owner_smem: the new lru row built in the workspace, then copied out
            whole; the owner row read into it with the lru row (csrc/resolve.cu
            SKV_LRU_SMEM, SKV_OWNER_SMEM). ``None`` (the default): each where the
            workspace (with the table chosen above) still fits in shared memory. Each
            costs a region row of it; on the H200 both took batch 64 x top-k 2048 from
            17.9 to 16.9 us (docs/PERF.md, session 14).
    """

    def __init__(self, layout: Layout, *, kernels=None, stream=None, threads: int = RESOLVE_THREADS,
                 workspace: str = "auto", timing_defines: dict | None = None, lookup: str | None = None,
                 hash_scale: int | None = None, lru_smem: bool | None = None, owner_smem: bool | None = None):
        cp = _cp()
        self.layout = layout.validate()
        if kernels is None:
            from sparsekv.daemon.kernels import get_cache

            kernels = get_cache()
        self.stream = stream if stream is not None else cp.cuda.Stream(non_blocking=True)
        g, r, s = layout.num_groups, layout.max_reqs, layout.region_stride
        with self.stream:
            self.owner = cp.full((g, r, s), -1, dtype=cp.int32)
            self.lru = cp.empty((g, r, s), dtype=cp.int32)
            self.lru[...] = cp.arange(s, dtype=cp.int32)
        self.lookup = resolve_lookup(lookup)
        self.threads = int(threads)
        # The workspace's options: those given, else the smallest, then (with workspace
        # auto or shared) the x4 table if the workspace still fits in shared memory.
        # Built for a shared-memory workspace unless it must be global (rebuilt if it
        # turns out not to fit).
        if workspace not in ("auto", "shared", "global"):
            raise ValueError(f"workspace must be auto, shared or global, got {workspace!r}")
        opts = {"hash_scale": DEFAULT_HASH_SCALE if hash_scale is None else int(hash_scale),
                "lru_smem": bool(lru_smem), "owner_smem": bool(owner_smem)}

        def build(**o):
            d = dict(resolve_defines(threads, self.lookup, **o), **(timing_defines or {}))
            return d, kernels.function("resolve.cu", "skv_resolve", d)

        ws_smem = workspace != "global"
        defines, self._resolve = build(**opts, ws_smem=ws_smem)
        limit = _smem_limit(self._resolve)  # no option changes the static shared memory
        if workspace != "global" and hash_scale is None and self.lookup == "hash" and resolve_workspace_bytes(
                layout.top_k, s, self.lookup, **dict(opts, hash_scale=4)) <= limit:
            opts["hash_scale"] = 4
            defines, self._resolve = build(**opts, ws_smem=ws_smem)
        # Then the owner row and the new lru row into the workspace, each one not given
        # while the workspace still fits.
        grown = False
        for name, given in (("owner_smem", owner_smem), ("lru_smem", lru_smem)):
            trial = dict(opts, **{name: True})
            if (workspace != "global" and given is None and not opts[name]
                    and resolve_workspace_bytes(layout.top_k, s, self.lookup, **trial) <= limit):
                opts, grown = trial, True
        if grown:
            defines, self._resolve = build(**opts, ws_smem=ws_smem)
        self.hash_scale, self.lru_smem, self.owner_smem = opts["hash_scale"], opts["lru_smem"], opts["owner_smem"]
        self.workspace_bytes = resolve_workspace_bytes(layout.top_k, s, self.lookup, **opts)
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
        self.step_smem = _pow2(self.inv_cap) * 4
        if self.step_smem > limit:
            self.inv_cap = limit // 8  # a power of two that fits; STEP refuses wider rows
            self.step_smem = _pow2(self.inv_cap) * 4
        self._begin_step = kernels.function("resolve.cu", "skv_begin_step", defines, smem_bytes=self.step_smem)
        self._host_out: ResolveOutput | None = None
        self.last_errors = 0  # error bits of the last host-convenience resolve

    # -- device-resident entry points ------------------------------------------------

    def new_output(self, max_batch: int | None = None) -> ResolveOutput:
        """A :class:`ResolveOutput` for batches of up to ``max_batch`` rows (default: the
        layout's ``max_batch``)."""
        if max_batch is None:
            max_batch = getattr(self.layout, "max_batch", 0) or self.layout.max_reqs
        ws = self.workspace_bytes if self.workspace_global else 0
        return ResolveOutput(self.layout, max_batch, ws, self.stream)

    def resolve_async(self, group: int, state_rows, topk, out: ResolveOutput, stream=None) -> None:
        """Resolve ``topk`` (int32 [B, k], device) for ``state_rows`` (int32 [B], device)
        into ``out`` on ``stream``: writes ``out.desc`` from the shapes (a small upload),
        then :meth:`launch_resolve`. Host-side checks look at shapes only (no readback):
        bad ids and state rows are handled on the device (see the module docstring)."""
        lay = self.layout
        stream = stream if stream is not None else self.stream
        if not 0 <= group < lay.num_groups:
            raise ResidencyError("BAD_ARGUMENT", f"group {group} out of range [0, {lay.num_groups})")
        with stream:  # a contiguity copy, if any, is ordered on the stream too
            state_rows = _device_i32(state_rows, "state_rows", 1)
            topk = _device_i32(topk, "topk", 2)
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
        """Enqueue ``skv_resolve`` on ``stream``. Device arrays only; the batch, columns and
        group come from ``desc``; the grid (``max_batch`` blocks) and shared memory are
        fixed by the layout. ``slots`` and the plan are ``[max_batch, top_k]``; counters
        are ``[groups, 4]`` with ``counters_per_group`` 4, or one ``[4]`` with 0.
        ``clear``: the device address of a u32 word the kernel sets to 0 first (a doorbell
        bell the stream has just waited on), or 0."""
        lay = self.layout
        i32 = np.int32
        if self.workspace_global:
            ws = workspace
            ws_stride = np.int64(self.workspace_bytes)
        else:
            ws, ws_stride = _null(), np.int64(0)
        with stream:
            self._resolve(
                (int(max_batch),), (self.threads,),
                (desc, self.owner, self.lru, i32(lay.num_groups), i32(lay.max_reqs), i32(lay.region_stride),
                 i32(lay.host_rows), i32(lay.top_k), i32(max_batch), state_rows, topk, i32(lay.top_k),
                 slots, misses, plan_rows, plan_slots, counters, i32(counters_per_group), err, ws, ws_stride,
                 np.uint64(clear)),
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
                 i32(max_batch), state_rows, reset, invalidate, i32(self.inv_cap), err),
                shared_mem=self.step_smem,
            )

    def reset_async(self, state_rows, stream=None) -> None:
        """Empty every group's region of each state row (int32 [n], device; -1 skipped)."""
        lay = self.layout
        i32 = np.int32
        with (stream if stream is not None else self.stream):
            state_rows = _device_i32(state_rows, "state_rows", 1)
            n = state_rows.shape[0]
            if n == 0:
                return
            total = n * lay.num_groups * lay.region_stride
            self._reset(
                (_grid(total, 256, SETUP_BLOCKS),), (256,),
                (self.owner, self.lru, i32(lay.num_groups), i32(lay.max_reqs), i32(lay.region_stride),
                 state_rows, i32(n)),
            )

    def invalidate_async(self, rows, rows_cap: int, state_rows=None, counter=None, stream=None) -> None:
        """Empty the slots owning one of the rows of ``rows`` (device int32 ``[1 + cap]``:
        ``[n, sorted rows...]``, see :func:`rows_block`): in every region, or only in
        ``state_rows`` (int32 [m], device). ``counter`` (uint64 [1], device) accumulates
        how many slots were emptied (counted once per slot only when ``state_rows`` is
        None or has no repeats). Fixed grid; the count is read on the device."""
        lay = self.layout
        stream = stream if stream is not None else self.stream
        i32 = np.int32
        with stream:
            if state_rows is None:
                regions, sr, n_state = lay.num_groups * lay.max_reqs, _null(), 0
            else:
                sr = _device_i32(state_rows, "state_rows", 1)
                n_state = sr.shape[0]
                regions = lay.num_groups * n_state
                if n_state == 0:
                    return
            total = regions * lay.region_stride
            self._invalidate(
                (_grid(total, 256, SETUP_BLOCKS),), (256,),
                (self.owner, i32(lay.num_groups), i32(lay.max_reqs), i32(lay.region_stride), sr,
                 i32(n_state), rows, i32(rows_cap), counter if counter is not None else _null()),
            )

    # -- host convenience (same checks and results as CpuResidency) ------------------

    def reset(self, state_rows: np.ndarray) -> None:
        cp = _cp()
        rows = np.asarray(state_rows, dtype=np.int64)
        rows = rows[rows >= 0]
        if rows.size and rows.max() >= self.layout.max_reqs:
            raise ResidencyError("BAD_STATE_ROW", f"state row {int(rows.max())} >= max_reqs")
        if not rows.size:
            return
        with self.stream:
            self.reset_async(cp.asarray(rows.astype(np.int32)))
        self.stream.synchronize()

    def invalidate(self, state_row: int, rows: np.ndarray) -> None:
        cp = _cp()
        if not 0 <= state_row < self.layout.max_reqs:
            raise ResidencyError("BAD_STATE_ROW", f"state row {state_row} out of range")
        block = rows_block(rows)
        if not block[0]:
            return
        with self.stream:
            self.invalidate_async(cp.asarray(block), int(block[0]), cp.asarray(np.array([state_row], np.int32)))
        self.stream.synchronize()

    def invalidate_everywhere(self, rows: np.ndarray) -> int:
        cp = _cp()
        block = rows_block(rows)
        if not block[0]:
            return 0
        with self.stream:
            counter = cp.zeros(1, dtype=cp.uint64)
            self.invalidate_async(cp.asarray(block), int(block[0]), None, counter)
        with self.stream:  # a readback on the legacy stream would wait behind parked doorbell streams
            return int(counter.get()[0])

    def resolve(self, group: int, state_rows: np.ndarray, topk: np.ndarray) -> Resolved:
        cp = _cp()
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
            self.resolve_async(group, cp.asarray(state_rows), cp.asarray(np.ascontiguousarray(topk)), out)
        self.stream.synchronize()
        # Read back on our stream (with it current, so that CuPy's contiguous copy of a
        # slice runs there too): never on the legacy stream, which can wait behind a
        # doorbell rank's parked stream.
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

    # -- state transfer (tests, checkpoints) -----------------------------------------

    def state(self) -> tuple[np.ndarray, np.ndarray]:
        """``(owner, lru)`` copied to the host (synchronises the stream)."""
        self.stream.synchronize()
        with self.stream:
            return self.owner.get(), self.lru.get()

    def load_state(self, owner: np.ndarray, lru: np.ndarray) -> None:
        """Overwrite the device state with host arrays of shape ``[groups, max_reqs, stride]``."""
        cp = _cp()
        shape = self.owner.shape
        owner = np.asarray(owner, dtype=np.int32)
        lru = np.asarray(lru, dtype=np.int32)
        if owner.shape != shape or lru.shape != shape:
            raise ResidencyError("BAD_ARGUMENT", f"state must be {shape}, got {owner.shape} and {lru.shape}")
        with self.stream:
            self.owner[...] = cp.asarray(owner)
            self.lru[...] = cp.asarray(lru)
        self.stream.synchronize()


def _smem_limit(kernel) -> int:
    """Dynamic shared memory a block of ``kernel`` may opt in to."""
    cp = _cp()
    rt = cp.cuda.runtime
    dev = cp.cuda.Device().id
    optin = rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)
    return int(optin) - int(kernel.shared_size_bytes)


@dataclass
class DeviceBuffers:
    """The hot slab and the staging buffer of one rank: one ``cudaMalloc`` (``memory``;
    exportable as one CUDA IPC handle), each a view at a 256-byte-aligned offset."""

    memory: object  # cupy.cuda.memory.Memory
    slab: object  # cupy uint8 [num_layers, max_reqs, region_stride, row_bytes], offset 0
    staging: object | None  # cupy uint8 [num_layers, staging_rows, row_bytes] or None
    staging_offset: int


def allocate_device_buffers(layout: Layout) -> DeviceBuffers:
    cp = _cp()
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
        pool: a :class:`sparsekv.daemon.pinned.PinnedRegion` holding the pool, or the
            device address (int) of any registered / pinned host buffer (tests).
        pool_offset: byte offset of this engine's pool inside ``pool`` (16-aligned).
        buffers: slab and staging (default: :func:`allocate_device_buffers`).
        kernels, stream: as for :class:`CudaResidency`.
        blocks: most blocks a copy kernel uses (SMs are shared with attention).
        threads: threads per copy block.
        load: how the copy kernel reads 16-byte vectors (see :func:`copy_defines`).
        engine_slab: ``(device address, SlabGeometry)`` of an engine-owned slab
            (``proto/slab.py``, checked): gathers write there, laid out by the geometry,
            instead of ``buffers.slab``.
        tma_stages: > 0: the decode gather (``skv_gather``) moves each row by two bulk
            asynchronous copies (sm_90's TMA) through that many one-row buffers a thread
            (csrc/copy.cu ``SKV_COPY_TMA``); 0: by 16-byte loads and stores.
    """

    def __init__(self, layout: Layout, pool, *, pool_offset: int = 0, buffers: DeviceBuffers | None = None,
                 kernels=None, stream=None, blocks: int = DEFAULT_COPY_BLOCKS, threads: int = COPY_THREADS,
                 load: int = COPY_LOAD, engine_slab=None, order: str | None = None, tma_stages: int = 0):
        cp = _cp()
        self.layout = lay = layout.validate()
        if kernels is None:
            from sparsekv.daemon.kernels import get_cache

            kernels = get_cache()
        self.stream = stream if stream is not None else cp.cuda.Stream(non_blocking=True)
        if hasattr(pool, "device_address"):
            self.pool_address = int(pool.device_address(pool_offset, lay.pool_bytes))
        else:
            self.pool_address = int(pool) + int(pool_offset)
        if self.pool_address % 16:
            raise ValueError(f"pool device address {self.pool_address:#x} must be 16-byte aligned")
        self.buffers = buffers if buffers is not None else allocate_device_buffers(lay)
        self.staging = self.buffers.staging
        # Where gathers write: the daemon's slab (no geometry), or an engine's buffer laid
        # out by its geometry (per-layer byte offsets on the device, block rows, stride).
        self._geo = (_null(), np.int64(1), np.int64(0))
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
        defines = copy_defines(lay.row_bytes, threads, load)
        self._copy = kernels.function("copy.cu", "skv_copy_rows", defines)
        # The gather's per-row prefix lives in shared memory: (max_batch + 1) x 8 bytes;
        # with TMA, the threads' row buffers too.
        self.tma_stages = int(tma_stages)
        gather_smem = (lay.max_batch + 1) * 8
        gather_defines = defines
        if self.tma_stages:
            gather_defines = copy_defines(lay.row_bytes, threads, load, self.tma_stages)
            gather_smem = tma_gather_smem(lay.row_bytes, threads, self.tma_stages, lay.max_batch)
        if gather_smem > DEFAULT_SMEM_BYTES:
            limit = _smem_limit(kernels.function("copy.cu", "skv_gather", gather_defines))  # its own static part
            if gather_smem > limit:
                raise ResidencyError("TOO_LARGE", f"max_batch {lay.max_batch} needs {gather_smem} B of shared "
                                     f"memory for one gather; this GPU allows {limit} B; lower max_batch"
                                     + (" or the TMA buffers" if self.tma_stages else ""))
        self.gather_smem = gather_smem
        self._gather = kernels.function("copy.cu", "skv_gather", gather_defines, smem_bytes=gather_smem)
        self.order = gather_order(order)
        if self.order == "batch":
            self._init_merge(kernels, defines)
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

    def _init_merge(self, kernels, defines) -> None:
        """The batch-wide plan: ``skv_merge_plan`` and its output (one list of up to
        max_batch x top_k entries and its count, on the device)."""
        cp = _cp()
        lay = self.layout
        head = (lay.max_batch + 1 + lay.top_k) * 4
        probe = kernels.function("copy.cu", "skv_merge_plan", defines)
        limit = min(_smem_limit(probe), MERGE_SMEM_CAP) // 16 * 16
        # The offsets and ranks always, every row's list too when it fits (16-byte units).
        self.merge_smem = min(limit, -(-(head + lay.max_batch * lay.top_k * 4) // 16) * 16)
        if head > self.merge_smem:
            raise ResidencyError("TOO_LARGE", f"max_batch {lay.max_batch} and top_k {lay.top_k} need {head} B of "
                                 f"shared memory for the batch-wide plan; this GPU allows {limit} B")
        self._merge = kernels.function("copy.cu", "skv_merge_plan", defines, smem_bytes=self.merge_smem)
        self._gather_merged = kernels.function("copy.cu", "skv_gather_merged", defines)
        n = lay.max_batch * lay.top_k
        with self.stream:
            self.merged_rows = cp.full(n, -1, dtype=cp.int32)
            self.merged_slots = cp.full(n, -1, dtype=cp.int32)
            self.merged_count = cp.zeros(1, dtype=cp.int32)
        self.stream.synchronize()

    def _layers_dev(self, layers) -> tuple[object, int]:
        cp = _cp()
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
        """One ``skv_copy_rows``; ``dst_geo``: the destination's (layer offsets, block
        rows, block stride) when it is an engine's slab (``self._geo``)."""
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
                 src_idx if src_idx is not None else _null(), dst_idx if dst_idx is not None else _null(),
                 counts if counts is not None else _null(), i32(nb), i32(ld),
                 count_dev if count_dev is not None else _null(),
                 *(dst_geo if dst_geo is not None else (_null(), np.int64(1), np.int64(0)))),
                shared_mem=smem,
            )

    def _pool(self) -> np.uint64:
        return np.uint64(self.pool_address)

    def _blocks_for(self, rows: int, layers: int) -> int:
        vecs = rows * layers * (self.layout.row_bytes // 16)
        return _grid(vecs, self.threads, self.blocks)

    # -- device-resident entry points ------------------------------------------------

    def gather_async(self, out: ResolveOutput, layers, stream=None, blocks: int | None = None) -> None:
        """Copy the plan of the last resolve into ``out`` for each of ``layers`` (the index
        group's layers), pool -> slab, on ``stream``. Order after the resolve on one stream."""
        lay = self.layout
        slots = lay.max_reqs * lay.region_stride
        self._launch(stream, blocks or self.blocks, self._pool(), lay.host_rows, lay.host_rows, lay.num_layers,
                     self.slab, slots, slots, lay.num_layers, layers, 3, out.plan_rows, out.plan_slots,
                     out.misses, out.batch, out.top_k, dst_geo=self._geo)

    def launch_gather(self, desc, plan_rows, plan_slots, misses, max_batch: int, stream,
                      group_layers=None, ready: int = 0, arrivals: int = 0) -> None:
        """Enqueue ``skv_gather``: the plan of the last :meth:`CudaResidency.launch_resolve`
        (per-row counts ``misses``), pool -> slab, for every layer of the descriptor's
        group. Device arrays only; fixed grid (``blocks``) and shared memory.
        ``group_layers``: another int32 ``[groups, stride]`` table (count, then layers) in
        place of the layout's, e.g. one naming a single layer of the group (doorbell: a
        ready word per layer). ``ready`` / ``arrivals``: device addresses of a word the
        kernel's last block sets to 1 once every row is written, and of its arrival
        counter (zeroed; 0: no signal)."""
        lay = self.layout
        i32, i64 = np.int32, np.int64
        slots = lay.max_reqs * lay.region_stride
        table = self.group_layers if group_layers is None else group_layers
        with stream:
            self._gather(
                (self.blocks,), (self.threads,),
                (desc, self._pool(), i64(lay.host_rows), i32(lay.num_layers), self.slab, i64(slots),
                 table, i32(table.shape[1]), i32(lay.num_groups),
                 plan_rows, plan_slots, misses, i32(max_batch), i32(lay.top_k), *self._geo,
                 np.uint64(ready), np.uint64(arrivals)),
                shared_mem=self.gather_smem if self.tma_stages else (int(max_batch) + 1) * 8,
            )

    def launch_merge_plan(self, desc, plan_rows, plan_slots, misses, max_batch: int, stream) -> None:
        """Enqueue ``skv_merge_plan``: the per-row plans of the last resolve merged into
        :attr:`merged_rows` / :attr:`merged_slots` in host-row order (stable in batch
        order), their count in :attr:`merged_count`. Fixed grid (``max_batch`` blocks)."""
        with stream:
            self._merge(
                (int(max_batch),), (MERGE_THREADS,),  # SKV_MERGE_THREADS (copy_defines)
                (desc, plan_rows, plan_slots, misses, np.int32(max_batch), np.int32(self.layout.top_k),
                 self.merged_rows, self.merged_slots, self.merged_count, np.int32(self.merge_smem)),
                shared_mem=self.merge_smem,
            )

    def launch_gather_merged(self, desc, stream, group_layers=None) -> None:
        """Enqueue ``skv_gather_merged``: the merged plan (:meth:`launch_merge_plan`),
        pool -> slab, for every layer of the descriptor's group (``group_layers`` as for
        :meth:`launch_gather`). Fixed grid, no dynamic shared memory."""
        lay = self.layout
        i32, i64 = np.int32, np.int64
        slots = lay.max_reqs * lay.region_stride
        table = self.group_layers if group_layers is None else group_layers
        with stream:
            self._gather_merged(
                (self.blocks,), (self.threads,),
                (desc, self._pool(), i64(lay.host_rows), i32(lay.num_layers), self.slab, i64(slots),
                 table, i32(table.shape[1]), i32(lay.num_groups),
                 self.merged_rows, self.merged_slots, self.merged_count, i32(lay.max_batch * lay.top_k),
                 *self._geo),
            )

    def launch_write_staged(self, layers, n_layers: int, rows, stream) -> None:
        """Write mirror in place: row i of the staging buffer, for each listed layer ->
        host row ``rows[1 + i]`` of that layer, for i < ``rows[0]`` (device int32
        ``[1 + staging_rows]``: the count, then the rows in staging order). ``layers`` is
        a device int32 array of ``n_layers`` layer numbers. Fixed grid; the count is read
        on the device; rows outside [0, host_rows) are skipped."""
        lay = self.layout
        if self.staging is None:
            raise ResidencyError("BAD_ARGUMENT", "layout has no staging buffer (staging_rows = 0)")
        self._launch(stream, self.blocks, self.staging, lay.staging_rows, lay.staging_rows, lay.num_layers,
                     self._pool(), lay.host_rows, lay.host_rows, lay.num_layers, None, 3, None,
                     rows[1:], None, 1, lay.staging_rows, count_dev=rows, layers_dev=(layers, int(n_layers)))

    def stage_async(self, rows, layers, stream=None, blocks: int | None = None) -> None:
        """Copy host ``rows`` (int32 [n], device) of each of ``layers`` to the front of the
        staging buffer; rows outside [0, host_rows) are skipped."""
        lay = self.layout
        if self.staging is None:
            raise ResidencyError("BAD_ARGUMENT", "layout has no staging buffer (staging_rows = 0)")
        with (stream if stream is not None else self.stream):
            rows = _device_i32(rows, "rows", 1)
        n = rows.shape[0]
        if n > lay.staging_rows:
            raise ResidencyError("TOO_LARGE", f"{n} rows do not fit the staging buffer of {lay.staging_rows}")
        self._launch(stream, blocks or self._blocks_for(n, len(layers)), self._pool(), lay.host_rows,
                     lay.host_rows, lay.num_layers, self.staging, lay.staging_rows, lay.staging_rows,
                     lay.num_layers, layers, 3, rows, None, None, 1, n)

    def write_async(self, layers, rows, src, stream=None, blocks: int | None = None) -> None:
        """Write mirror: ``src`` (uint8 [len(layers), n, row_bytes], device) row i of layer
        li -> host row ``rows[i]`` (int32 [n], device) of layer ``layers[li]``. Rows
        outside [0, host_rows) (e.g. -1 padding) are skipped. Invalidate hot copies
        separately (``CudaResidency.invalidate_async``)."""
        cp = _cp()
        lay = self.layout
        n = rows.shape[0]
        want = (len(layers), n, lay.row_bytes)
        if tuple(src.shape) != want or src.dtype != cp.uint8:
            raise ResidencyError("BAD_ARGUMENT", f"src must be uint8 {want}, got {src.dtype} {src.shape}")
        with (stream if stream is not None else self.stream):
            rows = _device_i32(rows, "rows", 1)
            src = cp.ascontiguousarray(src)
        self._launch(stream, blocks or self._blocks_for(n, len(layers)), src, n, n, len(layers),
                     self._pool(), lay.host_rows, lay.host_rows, lay.num_layers, layers, 2, None, rows,
                     None, 1, n)

    # -- host convenience (same results as CpuMover) ---------------------------------

    def gather(self, plan: Plan, layers: tuple[int, ...]) -> int:
        cp = _cp()
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
        cp = _cp()
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
                self.stage_async(cp.asarray(rows), layers)
            self.stream.synchronize()
        return n * len(layers) * lay.row_bytes

    def write(self, layers: tuple[int, ...], rows: np.ndarray, src) -> int:
        """Host convenience of :meth:`write_async` (``src`` NumPy or CuPy); returns bytes."""
        cp = _cp()
        rows = np.asarray(rows, dtype=np.int32).reshape(-1)
        live = int(((rows >= 0) & (rows < self.layout.host_rows)).sum())
        if rows.size:
            with self.stream:
                self.write_async(layers, cp.asarray(rows), cp.asarray(src))
            self.stream.synchronize()
        return live * len(layers) * self.layout.row_bytes
