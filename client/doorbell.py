"""The engine's handle on the doorbell transport: ``swap_in`` on device tensors, on the
caller's current stream, capturable into the engine's CUDA graph.

    c = Client(run_dir, rank=r, device="cuda:0").connect()
    c.attach(layout, engine="glm", transport="doorbell")
    h = c.doorbell_handle()   # then begin_step, swap_in and kv as HostSwapIn's, on tensors;
    # a whole decode step can be captured into one torch.cuda.CUDAGraph
    h.check()   # now and then: raises what the daemon refused, or DaemonUnavailable

On the engine's stream, no host code of either process in between: ``begin_step``'s
``skv_db_begin`` writes the step block into the daemon's ring and rings the step bell; a
group leader's ``swap_in`` runs ``skv_db_topk``, which maps positions to host rows into
the group's top-k block and rings the group's bell; every layer's ``swap_in`` waits for
the layer's ready word, then ``skv_db_indices`` clears it and turns the group's slots into
attention indices. The wait: up to :data:`POLL_TOKENS` tokens, the kernel itself, in one
block, polls the word (a ``cuStreamWaitValue32`` in the engine's graph cost the batch-1
step ~7 µs a layer beside the model's kernels), and makes the indices as soon as the
daemon's gather has marked the group's slots written (the TOPK block's ``D_SLOTS`` word),
while the rows still cross PCIe, then waits for the ready word; more tokens, ``cuStreamWaitValue32`` on
the stream, then the kernel on its full grid (polling blocks hold SMs, and the daemon's
resolve needs a whole SM a block). ``finish_step`` consumes a skipped layer's word with an
``skv_db_indices`` of no token (alternatives: docs/DESIGN.md, "Rejected designs").
Indexing is the portable handle's (client/README.md, "The engine's handle"), a refused row
also -1; the step's order is ``step_order.py``'s.

**Failure.** A thread watches the daemon. If it dies, the handle sets its own "dead" word
(``skv_db_indices`` then returns -1 everywhere) and keeps setting every ready word, so the
engine's stream never hangs; ``check()`` then raises ``DaemonUnavailable``. The release
uses stream memory operations only: loading a CUDA module (a CuPy kernel's first use, a
lazy torch kernel) can wait for the context's running work, a stream parked on a ready
word included; ``CUDA_MODULE_LOADING=EAGER`` in the engine removes that window. A polling
``skv_db_indices`` also ends once the dead word is set; like a stream parked on a
ready word, it must not outlive the handle (synchronize before ``close``). Under MPS a
daemon killed with a kernel still polling broke its engines' contexts (DESIGN.md §8).
"""

from __future__ import annotations

import abc
import logging
import threading
import time

import numpy as np

from sparsekv.csrc.build import get_cache
from sparsekv.proto import ErrorCode
from sparsekv.proto.args import whole_number
from sparsekv.proto.device_errors import ErrorRecord
from sparsekv.proto.positions import INT32_MAX
from sparsekv.proto.step_block import D_SLOTS
from sparsekv.proto.stream_ops import wait32, write32

from .cuda_stream import external_stream
from .device_wait import WATCH_INTERVAL_S
from .errors import BadRequest, DaemonUnavailable, error_for
from .step_order import StepOrder

log = logging.getLogger("sparsekv.client")

RELEASE_INTERVAL_S = 0.0002  # once it is dead: how often every ready word is set again
THREADS = 256
POLL_TOKENS = 4  # up to this many tokens a layer's skv_db_indices polls its ready word itself, in one block


def zeroed(cp, *specs) -> list:
    """Device arrays of ``(size, dtype)`` each, zeroed on a stream of their own and only it
    waited for: a device-wide wait would also wait for another rank's engine stream of this
    process, which may be waiting on its ready words."""
    init = cp.cuda.Stream(non_blocking=True)
    with init:
        out = [cp.zeros(n, dtype=dt) for n, dt in specs]
    init.synchronize()
    return out


class DeviceSwapIn(abc.ABC):
    """The engine-side handle on device tensors: argument checks, the engine-side kernels
    (``csrc/handle.cu``) and the indices. Where the rows come from is a subclass's three
    hand-off points, :meth:`_begun`, :meth:`_rang` and :meth:`_ready`: :class:`DoorbellSwapIn`
    rings the daemon there, ``embedded/inproc_cuda.py`` runs the daemon's kernels inline."""

    def _bind(self, layout, device: int, slab, step_block: int, topk_blocks: list[int], slots: list[int],
              error_mirror=None, resident_base: int = 0, hot_base: int = 0, misses=None,
              inv_cap: int | None = None, engine_slab=None) -> None:
        """Device addresses of the rank's step block, per-group top-k blocks and slots.
        ``inv_cap``: the most invalidate columns a step block takes (None: top_k)."""
        import cupy as cp  # noqa: PLC0415
        import torch  # noqa: PLC0415

        self.layout = lay = layout
        self.device = device
        self.resident_base, self.hot_base = int(resident_base), int(hot_base)
        hot_end = self.hot_base + lay.max_reqs * lay.region_stride
        if self.hot_base < 0 or self.resident_base < 0 or hot_end - 1 > INT32_MAX:
            raise BadRequest(f"hot_base {self.hot_base} and resident_base {self.resident_base} must be >= 0, and the "
                             f"hot rows' indices (up to {hot_end - 1}) must fit int32", ErrorCode.BAD_ARGUMENT)
        self.inv_cap = lay.top_k if inv_cap is None else int(inv_cap)
        self._step_block, self._topk_blocks, self._slots = step_block, topk_blocks, slots
        self._order = StepOrder(lay.groups)
        with cp.cuda.Device(device):
            mod = get_cache().module("handle.cu")
            self._k_begin = mod.get_function("skv_db_begin")
            self._k_topk = mod.get_function("skv_db_topk")
            self._k_indices = mod.get_function("skv_db_indices")
            # the engine's step number (device), and the word that says the daemon is gone
            self._counter, self._dead = zeroed(cp, (1, cp.int32), (1, cp.int32))
        self._torch = torch
        self._slab = slab  # None with an engine-owned slab (kv() reads the engine's tensor)
        self._engine_slab = engine_slab
        self._misses = misses  # torch int32 [groups, max_batch]: each group's misses per batch row
        self._errors = ErrorRecord(error_mirror) if error_mirror is not None else None
        self._gone: str | None = None
        self._stopped_word = 0  # the rank's stop word in the daemon's arena (0: none; DoorbellSwapIn)
        self._gone_code: ErrorCode | None = None  # why it is gone, when not the daemon's end

    # -- hand-off points ---------------------------------------------------------------
    def _step_bell(self) -> int:
        """The word ``skv_db_begin`` rings itself (0: none; :meth:`_begun` hands off)."""
        return 0

    def _group_ring(self, group: int) -> tuple[int, int, int]:
        """``skv_db_topk``'s last three arguments, in its order: (arrival counter, bell,
        local) of the group's bell that the kernel rings itself ((0, 0, 0): none); local 1:
        only this GPU waits on the bell."""
        return 0, 0, np.int32(0)

    def _topk_args(self, group: int, tokens: int, req_ptr: int, table_ptr: int, table_rows: int, max_blocks: int,
                   res_ptr: int, res_blocks: int, topk_ptr: int, k: int, block_size: int) -> tuple:
        """The arguments of ``skv_db_topk`` (csrc/handle.cu), in its parameter order."""
        i32 = np.int32
        return (self._topk_blocks[group], self._counter.data.ptr, req_ptr, i32(tokens), table_ptr, i32(table_rows),
                i32(max_blocks), res_ptr, i32(res_blocks), topk_ptr, i32(k), i32(block_size),
                i32(group), i32(self.layout.max_batch), *self._group_ring(group))

    def _indices_args(self, group: int, layer: int, tokens: int, req_ptr: int, topk_ptr: int, k: int, res_ptr: int,
                      res_blocks: int, table_rows: int, block_size: int, out_ptr: int, valid_ptr: int,
                      arrivals: int) -> tuple:
        """The arguments of ``skv_db_indices`` (csrc/handle.cu) for ``layer``, in its parameter
        order; ``arrivals``: the layer's counter when the kernel polls its ready word, or 0."""
        i32, i64 = np.int32, np.int64
        return (self._slots[group], i32(self.layout.top_k), req_ptr, i32(tokens), topk_ptr, i32(k), res_ptr,
                i32(res_blocks), i32(table_rows), i32(block_size), i32(self.layout.region_stride),
                i64(self.hot_base), i64(self.resident_base), self._dead.data.ptr, self._stopped_word, out_ptr,
                valid_ptr, self._cleared_by_indices(layer), arrivals,
                self._slots_word(group) if arrivals and tokens else 0)

    @abc.abstractmethod
    def _begun(self, stream_ptr: int) -> None:
        """On the engine's stream: the step block is written: hand the step off."""

    @abc.abstractmethod
    def _rang(self, group: int, stream_ptr: int) -> None:
        """On the engine's stream: the group's TOPK block is written: hand it off."""

    @abc.abstractmethod
    def _ready(self, layer: int, group: int, stream_ptr: int) -> None:
        """On the engine's stream: make the stream wait until the layer's rows are in its slab
        (not called where the layer's ``skv_db_indices`` polls: :meth:`_poller`)."""

    # -- the engine's calls ------------------------------------------------------------
    def kv(self, layer: int):
        """The layer's hot slab as ``[max_reqs * region_stride, row_bytes]`` uint8 (a view
        of the daemon's memory, through CUDA IPC); with an engine-owned slab the engine's
        own rows of the layer in its index space (``EngineSlab.layer_rows``)."""
        lay = self.layout
        if self._engine_slab is not None:
            return self._engine_slab.layer_rows(lay, layer, self.hot_base)
        return self._slab[layer].view(lay.max_reqs * lay.region_stride, lay.row_bytes)

    def misses(self, group: int):
        """The group's misses per token of its last resolve (torch int32 [max_batch], a
        view: read it after the stream has passed the group, before the next step)."""
        return self._misses[group]

    def begin_step(self, state_rows, reset=None, invalidate=None) -> None:
        """Begin a decode step on the current stream: ``state_rows`` int32 [n], ``reset``
        bool [n], ``invalidate`` int32 [n, m] on the rank's GPU (meanings: client/README.md).
        The previous step must be complete (``client/step_order.py``)."""
        lay = self.layout
        self._order.check_begin()
        rows = self._ids("state_rows", state_rows, 1)
        n = rows.shape[0]
        if n > lay.max_batch:
            raise BadRequest(f"batch {n} exceeds max_batch {lay.max_batch} of the layout", ErrorCode.TOO_LARGE)
        if reset is not None:
            torch = self._torch
            if tuple(reset.shape) != (n,) or not reset.is_cuda or reset.dtype not in (torch.bool, torch.uint8) \
                    or not reset.is_contiguous():
                raise BadRequest(f"reset must be a contiguous bool tensor [{n}] on the rank's GPU, got "
                                 f"{reset.dtype} {tuple(reset.shape)}", ErrorCode.BAD_ARGUMENT)
        inv_n = 0
        if invalidate is not None:
            invalidate = self._ids("invalidate", invalidate, 2)
            if invalidate.shape[0] != n:
                raise BadRequest(f"invalidate must be [{n}, m], got {tuple(invalidate.shape)}",
                                 ErrorCode.BAD_ARGUMENT)
            if invalidate.shape[1] > self.inv_cap:
                raise BadRequest(f"invalidate has {invalidate.shape[1]} columns; at most {self.inv_cap} per step",
                                 ErrorCode.TOO_LARGE)
            inv_n = invalidate.shape[1]
        i32 = np.int32
        s = self._stream()
        self._launch(self._k_begin, 1, s,
                     (self._step_block, self._counter.data.ptr, rows.data_ptr(), i32(n),
                      reset.data_ptr() if reset is not None else 0,
                      invalidate.data_ptr() if inv_n else 0, i32(inv_n), i32(lay.max_batch), self._step_bell()))
        self._begun(s)
        self._order.began()

    def finish_step(self) -> None:
        """End an interrupted step (an exception between layers, a layer skipped) on the
        current stream: the groups not yet rung are rung with an empty batch, the layers
        not yet consumed are waited for (their rows unused). A no-op on a complete step."""
        groups, layers = self._order.pending()
        if not groups and not layers:
            return
        s = self._stream()
        ctr = self._counter.data.ptr  # any valid address: a batch of 0 tokens reads nothing
        for g in groups:
            self._launch(self._k_topk, 1, s, self._topk_args(g, 0, ctr, 0, 0, 0, 0, 0, ctr, self.layout.top_k, 1))
            self._rang(g, s)
            self._order.rang(g)
        for layer in layers:
            self._wait_alone(layer, self._order.group_of[layer], s)
            self._order.ready(layer)

    def swap_in(self, req_id_per_token, block_table, logical_topk_indices, *, layer: int, block_size: int = 1,
                return_valid_counts: bool = False, attention_indices_out=None, valid_counts_out=None,
                resident_block_table=None):
        """Indices of the rows of ``layer`` that ``logical_topk_indices`` names
        (client/README.md). ``req_id_per_token`` int32 [tokens] (state row of each token, -1 =
        padding); ``block_table`` int32 [requests, max_blocks] indexed by request, or None
        when the top-k holds host rows; ``logical_topk_indices`` int32 [tokens, k]."""
        lay = self.layout
        layer = int(layer)
        leader = self._order.check_layer(layer)
        g = self._order.group_of[layer]
        req = self._ids("req_id_per_token", req_id_per_token, 1)
        topk = self._ids("logical_topk_indices", logical_topk_indices, 2)
        tokens, k = topk.shape
        if req.shape[0] != tokens:
            raise BadRequest(f"req_id_per_token has {req.shape[0]} tokens, the top-k {tokens}", ErrorCode.BAD_ARGUMENT)
        if tokens > lay.max_batch:
            raise BadRequest(f"{tokens} tokens exceed max_batch {lay.max_batch} of the layout", ErrorCode.TOO_LARGE)
        if k > lay.top_k:
            raise BadRequest(f"top-k has {k} columns, layout top_k is {lay.top_k}", ErrorCode.BAD_ARGUMENT)
        try:  # (int() would take 2.5 for 2 and True for 1; the kernels take an int32, table or not)
            block_size = whole_number("block_size", block_size)
        except ValueError as e:
            raise BadRequest(str(e), ErrorCode.BAD_ARGUMENT) from None
        if not 0 < block_size <= INT32_MAX:
            raise BadRequest(f"block_size must lie in [1, 2**31), got {block_size}", ErrorCode.BAD_ARGUMENT)
        if block_table is not None:
            block_table = self._ids("block_table", block_table, 2)
            table_rows, max_blocks = block_table.shape
        else:
            if resident_block_table is not None:
                raise BadRequest("resident_block_table needs a block_table (positions)", ErrorCode.BAD_ARGUMENT)
            table_rows, max_blocks = lay.max_reqs, 0
        res_blocks = 0
        if resident_block_table is not None:
            resident_block_table = self._ids("resident_block_table", resident_block_table, 2)
            if resident_block_table.shape[0] != table_rows:
                raise BadRequest(f"resident_block_table must have {table_rows} rows like block_table, got "
                                 f"{tuple(resident_block_table.shape)}", ErrorCode.BAD_ARGUMENT)
            res_blocks = resident_block_table.shape[1]
        out = self._out("attention_indices_out", attention_indices_out, (tokens, k))
        valid = None
        if return_valid_counts or valid_counts_out is not None:
            valid = self._out("valid_counts_out", valid_counts_out, (tokens,))
        s = self._stream()
        grid = max(1, min(tokens, 1024))
        # A table with no entries still means "positions": never a null pointer (null =
        # the top-k holds host rows); with 0 rows or 0 blocks nothing of it is read.
        table_ptr = 0
        if block_table is not None:
            table_ptr = block_table.data_ptr() if block_table.numel() else self._counter.data.ptr
        res_ptr = resident_block_table.data_ptr() if resident_block_table is not None else 0
        if leader:
            self._launch(self._k_topk, grid, s,
                         self._topk_args(g, tokens, req.data_ptr(), table_ptr, table_rows, max_blocks, res_ptr,
                                         res_blocks, topk.data_ptr(), k, block_size))
            self._rang(g, s)
            self._order.rang(g)
        # A few tokens: one block of skv_db_indices polls the ready word (no stream wait in
        # the engine's graph); more: the stream waits, then the indices on the full grid (a
        # polling grid would hold SMs the daemon's kernels need).
        arrivals = self._poller(layer, tokens)
        if not arrivals:
            self._ready(layer, g, s)
        self._order.ready(layer)
        self._launch(self._k_indices, 1 if arrivals else grid, s,
                     self._indices_args(g, layer, tokens, req.data_ptr(), topk.data_ptr(), k, res_ptr, res_blocks,
                                        table_rows, block_size, out.data_ptr(),
                                        valid.data_ptr() if valid is not None else 0, arrivals))
        return (out, valid) if return_valid_counts else out

    def check(self) -> None:
        """Raise what went wrong since the last check: :class:`DaemonUnavailable` once the
        daemon is gone (``TpLag`` once the rank's TP group stopped: a peer rank left), else
        the typed error of the first kind of row the daemon's kernels refused (the rank's
        error mirror: complete once the stream has passed a step)."""
        if self._gone is not None:
            raise DaemonUnavailable(self._gone) if self._gone_code is None else error_for(int(self._gone_code),
                                                                                          self._gone)
        if self._errors is None:
            return
        found = self._errors.take()
        for code, msg in found[1:]:
            log.warning("also %s: %s", code, msg)
        if found:
            code, msg = found[0]
            raise error_for(int(ErrorCode[code]), msg)

    def close(self) -> None:
        """Refuse every later call (a closed handle's memory may be gone)."""
        self._order.close()

    # -- internals ---------------------------------------------------------------------
    def _cleared_by_indices(self, layer: int) -> int:
        """The word ``skv_db_indices`` of ``layer`` sets to 0 (its ready word), or 0."""
        return 0

    def _waited_by_indices(self, layer: int) -> int:
        """The layer's zeroed arrival counter where ``skv_db_indices`` of one block may wait
        for the ready word itself (then no :meth:`_ready` before it), or 0."""
        return 0

    def _slots_word(self, group: int) -> int:
        """The word a polling ``skv_db_indices`` of ``group`` makes its indices at, before
        the rows are in (the TOPK block's ``D_SLOTS``, set by the daemon's gather), or 0."""
        return 0

    def _poller(self, layer: int, tokens: int) -> int:
        """The arrival counter ``skv_db_indices`` of ``tokens`` tokens polls with (one
        block), or 0: the stream waits (:meth:`_ready`) and the kernel runs on its full grid."""
        return self._waited_by_indices(layer) if tokens <= POLL_TOKENS else 0

    def _wait_alone(self, layer: int, group: int, stream_ptr: int) -> None:
        """The layer's wait with no indices wanted (:meth:`finish_step`): its ready word
        consumed all the same (set to 0), or the next step's wait would pass at once."""
        arrivals = self._waited_by_indices(layer)
        if not arrivals:
            self._ready(layer, group, stream_ptr)
        else:  # skv_db_indices of no token, one block: the wait and the clear only
            ctr = self._counter.data.ptr  # any valid address: a batch of 0 tokens reads nothing
            self._launch(self._k_indices, 1, stream_ptr,
                         self._indices_args(group, layer, 0, ctr, ctr, 0, 0, 0, 0, 1, ctr, 0, arrivals))

    def _stream(self) -> int:
        return self._torch.cuda.current_stream(self.device).cuda_stream

    def _ids(self, name: str, t, ndim: int):
        torch = self._torch
        if not isinstance(t, torch.Tensor) or not t.is_cuda or t.dim() != ndim:
            raise BadRequest(f"{name} must be a {ndim}-d int32 tensor on cuda:{self.device}", ErrorCode.BAD_ARGUMENT)
        if t.dtype != torch.int32:
            raise BadRequest(f"{name} must be int32, got {t.dtype}", ErrorCode.BAD_ARGUMENT)
        if t.device.index != self.device:
            raise BadRequest(f"{name} is on {t.device}, the rank on cuda:{self.device}", ErrorCode.BAD_ARGUMENT)
        if not t.is_contiguous():  # a copy here would be freed under the engine's graph
            raise BadRequest(f"{name} must be contiguous", ErrorCode.BAD_ARGUMENT)
        return t

    def _out(self, name: str, t, shape: tuple):
        """An output tensor the kernels write: ``t`` checked (int32, ``shape``, contiguous,
        on the rank's GPU), or a new one when None."""
        torch = self._torch
        if t is None:
            return torch.empty(shape, dtype=torch.int32, device=torch.device("cuda", self.device))
        if not isinstance(t, torch.Tensor) or not t.is_cuda or t.device.index != self.device \
                or t.dtype != torch.int32 or tuple(t.shape) != shape or not t.is_contiguous():
            got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise BadRequest(f"{name} must be a contiguous int32 {list(shape)} tensor on cuda:{self.device}, got "
                             f"{got}", ErrorCode.BAD_ARGUMENT)
        return t

    def _launch(self, fn, grid: int, stream_ptr: int, args, threads: int = THREADS) -> None:
        import cupy as cp  # noqa: PLC0415

        with cp.cuda.Device(self.device), external_stream(cp, stream_ptr):
            fn((grid,), (threads,), tuple(np.uint64(a) if isinstance(a, int) else a for a in args))


class DoorbellSwapIn(DeviceSwapIn):
    """A rank's doorbell handle (``Client.doorbell_handle()``); one per rank, used from the
    thread that drives the rank's stream."""

    def __init__(self, client, resident_base: int = 0, hot_base: int = 0):
        att = client.attachment
        db = (att.handles or {}).get("doorbell") if att is not None else None
        if db is None:
            raise BadRequest("this rank is not attached with transport='doorbell'", ErrorCode.BAD_ARGUMENT)
        self.client, self.att = client, att
        lay = att.layout
        arena = att._arena
        B, K, G = lay.max_batch, lay.top_k, lay.num_groups
        bints = att.handles["block_ints"]
        self._bind(lay, att.device, att.slab, arena.ptr + db["step_block_offset"],
                   [arena.ptr + db["topk_block_offset"] + g * bints * 4 for g in range(G)],
                   [arena.ptr + db["slots_offset"] + g * B * K * 4 for g in range(G)],
                   att.error_mirror, resident_base, hot_base,
                   misses=arena.torch(db["misses_offset"], (G, B), "int32"), inv_cap=db.get("inv_cap"),
                   engine_slab=att.engine_slab)
        ctl = arena.ptr + db["ctl_offset"]
        self._bell_step = ctl + 4 * db["bell_step"]
        self._bells = [ctl + 4 * i for i in db["bells"]]
        # Whether only this GPU waits on the group bells (the daemon's stream; no TP
        # group's leader elsewhere): then skv_db_topk's fence before a ring is device-scope.
        # A daemon that does not say so gets the system-scope one.
        self._bells_local = db.get("bells_local") is True
        self._readys = [ctl + 4 * i for i in db["ready"]]
        # Set by the daemon when the rank's TP group stops (a peer rank left): indices -1 from then on.
        self._stopped_word = ctl + 4 * db["stopped"]
        import cupy as cp  # noqa: PLC0415

        with cp.cuda.Device(self.device):
            # skv_db_topk's arrival counter per group; skv_db_indices' per layer
            self._arrivals, self._idx_arrivals = zeroed(cp, (G, cp.uint32), (lay.num_layers, cp.uint32))
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="sparsekv-doorbell-watch", daemon=True)
        self._watcher.start()

    def _step_bell(self) -> int:
        return self._bell_step

    def _group_ring(self, group: int) -> tuple[int, int, int]:
        return self._arrivals.data.ptr + 4 * group, self._bells[group], np.int32(self._bells_local)

    def _begun(self, stream_ptr: int) -> None:
        pass  # skv_db_begin rang the step bell

    def _rang(self, group: int, stream_ptr: int) -> None:
        pass  # skv_db_topk rang the group's bell

    def _ready(self, layer: int, group: int, stream_ptr: int) -> None:
        wait32(stream_ptr, self._readys[layer], 1)

    def _waited_by_indices(self, layer: int) -> int:
        return self._idx_arrivals.data.ptr + 4 * layer

    def _cleared_by_indices(self, layer: int) -> int:
        return self._readys[layer]

    def _slots_word(self, group: int) -> int:
        return self._topk_blocks[group] + 4 * D_SLOTS

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (the rank may then open another handle)."""
        return self._closed.is_set()

    def close(self) -> None:
        """Stop the watcher and refuse every later call; called before the rank's memory is
        unmapped (the watcher writes into it)."""
        super().close()
        self._closed.set()
        if self._watcher.is_alive() and threading.current_thread() is not self._watcher:
            self._watcher.join(timeout=5.0)

    def _watch(self) -> None:
        """Watch the daemon and the rank's stop word; once the daemon is gone or the rank's
        TP group stopped, release the engine's stream for ever."""
        while not self._closed.wait(WATCH_INTERVAL_S):
            try:
                why = self.client._daemon_dead()  # (only once its process is gone)
                if why is None and self._stopped():
                    why = ("a rank of this engine's TP group left, and the daemon stopped serving the group (the "
                           "leader's log says which)")
                    self._gone_code = ErrorCode.TP_LAG
            except Exception as e:  # noqa: BLE001 - keep watching
                log.debug("daemon check failed: %r", e)
                continue
            if why is not None:
                self._gone = (f"{why}: the doorbell handle released its stream; every index is -1 from now on. "
                              "Create a new Client and attach again")
                log.error("%s", self._gone)
                self._release()
                return

    def _stopped(self) -> bool:
        """Whether the daemon set the rank's stop word, from its host copy in the blocks file:
        a plain load, no CUDA call (one from this thread while the engine captures a CUDA
        graph in global mode, torch's default, would break the capture)."""
        mirror = self.att.stop_mirror
        return mirror is not None and int(mirror[0]) != 0

    def _release(self) -> None:
        """Set the dead word, then every ready word again and again, from a side stream,
        with stream memory operations only (no module load: module docstring)."""
        import cupy as cp  # noqa: PLC0415

        with cp.cuda.Device(self.device):
            side = cp.cuda.Stream(non_blocking=True)
            write32(side.ptr, self._dead.data.ptr, 1)
            done = cp.cuda.Event(block=False, disable_timing=True)
            while not self._closed.is_set():
                for address in self._readys:
                    write32(side.ptr, address, 1)
                done.record(side)
                while not done.done and not self._closed.is_set():  # never an unbounded synchronize
                    time.sleep(RELEASE_INTERVAL_S)
                time.sleep(RELEASE_INTERVAL_S)
