"""The engine's handle, portable: ``swap_in`` over an ordinary ``Client`` or ``InprocClient``.

:class:`HostSwapIn` works over any client (cpu or cuda backend, zmq or in process); the
device handle (``client/doorbell.py``) has the same methods (:class:`SwapInHandle`). The
contract is client/README.md, "The engine's handle".

A top-k on the GPU is mapped there by one kernel (``swap_in_kernels.py``) where CuPy is
installed (integers narrower than 32 bits are widened there first). On a fenced cuda rank
the host waits for the GPU only to read a ``req_id_per_token`` tensor there, once a step
(pass it as NumPy and it never does; modify it only between steps, never between two
layers of one). Without fences
every leader waits for the stream: the top-k comes to the host, and before each request
the GPU's reads of the last reply's slots must be done.
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np

from sparsekv.proto import ErrorCode, Layout
from sparsekv.proto.args import whole_number
from sparsekv.proto.positions import INT32_MAX, host_rows

from . import swap_in_kernels
from .errors import BadRequest, NotAttached, SparseKVError
from .step_order import StepOrder
from .tensors import host_array, is_int_dtype, is_torch, on_gpu

log = logging.getLogger("sparsekv.client")


class SwapInHandle(Protocol):
    """The engine's handle, whichever implements it: :class:`HostSwapIn` (here),
    ``DoorbellSwapIn`` (``doorbell.py``) and ``InprocSwapIn`` (``embedded/inproc_cuda.py``).
    Model code typed with this and calling only these runs unchanged on each."""

    layout: Layout

    def begin_step(self, state_rows, reset=None, invalidate=None) -> None: ...

    def finish_step(self) -> None: ...

    def swap_in(self, req_id_per_token, block_table, logical_topk_indices, *, layer: int, block_size: int,
                return_valid_counts: bool = False, attention_indices_out=None, valid_counts_out=None,
                resident_block_table=None): ...

    def kv(self, layer: int): ...

    def check(self) -> None: ...

    def close(self) -> None: ...


class HostSwapIn:
    """The portable ``swap_in`` handle over a connected, attached client, which it does
    not own (:meth:`close` leaves it open). Not thread-safe, like the client."""

    def __init__(self, client, hot_base: int = 0, resident_base: int = 0):
        """``hot_base``: with an engine-owned slab (``client/engine_slab.py``), the index
        of hot row 0 in the engine's own rows (``kv(layer)`` is then the engine's rows of
        the layer). ``resident_base``: added to the index of a resident row."""
        att = client.attachment
        if att is None:
            raise NotAttached("HostSwapIn needs an attached client: call client.attach(layout) first")
        self._client = client
        self._att = att  # its rank: after a detach (or the client's close) the handle refuses to serve
        self.layout = att.layout
        lay = self.layout
        self._stride = lay.region_stride
        for name, v in (("hot_base", hot_base), ("resident_base", resident_base)):
            try:
                n = whole_number(name, v)
            except ValueError:  # a float, bool or text: refused with the range below
                n = -1
            if not 0 <= n <= INT32_MAX:
                raise BadRequest(f"{name} must be an integer in [0, {INT32_MAX}] (an index of the engine's rows), "
                                 f"got {v!r}", ErrorCode.BAD_ARGUMENT)
        engine_slab = att.engine_slab
        if hot_base and engine_slab is None:
            raise BadRequest("hot_base needs an engine-owned slab (attach with slab=EngineSlab...)",
                             ErrorCode.BAD_ARGUMENT)
        self.hot_base = int(hot_base)
        self.resident_base = int(resident_base)
        self._hot_int32 = 0 <= self.hot_base and self.hot_base + lay.max_reqs * lay.region_stride <= np.iinfo(np.int32).max
        if engine_slab is not None:
            self._kv = [engine_slab.layer_rows(lay, layer, self.hot_base) for layer in range(lay.num_layers)]
        else:
            self._kv = [att.slab[layer].reshape(lay.max_reqs * lay.region_stride, lay.row_bytes)
                        for layer in range(lay.num_layers)]
        # A TP rank's step driver (client/step_driver.py): this handle, numbering on from the
        # last step sent (an in-process client has no TP group: it steps from 0).
        self._driver = driver = getattr(client, "_driver", None)
        if driver is not None:
            driver.claim(client, self)
        self._next_step = 0 if driver is None else driver.next_step
        self._step: int | None = None  # the step begun, None before the first / after a failed one
        self._failed = False  # the last begin_step raised
        self._in_step = np.zeros(lay.max_reqs, dtype=bool)
        self._slots: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # group -> (req ids, slots) of this step
        self._order = StepOrder(lay.groups)
        self._counts = {"batches": 0, "hits": 0, "misses": 0, "out_of_range": 0}
        self._device_misses = None  # cuda: the misses summed on the device (read at .counts)
        self._req_cache = None  # (tensor, key, host copy): a GPU req_id_per_token, this step
        self._req_dev = None  # (its host copy, device, int32 tensor there), this step
        self._reads_on = None  # no fences: the device whose stream reads a reply's slots
        self._fenced = att.caps.fenced
        if att.caps.device and not self._fenced:
            log.info("HostSwapIn on a cuda rank without fence events: each index group's leader waits for the "
                     "stream when an input is on the GPU (attach with fence=True to avoid it)")
        self._asked = False  # a top-k of the step begun was sent (its STEP went before it)
        self._closed = False

    # -- the API ---------------------------------------------------------------------
    def begin_step(self, state_rows, reset=None, invalidate=None) -> None:
        """Begin the next decode step (numbered 0, 1, ... here; arguments: client/README.md).
        The previous step must be complete (or ended by :meth:`finish_step`)."""
        self._open()
        self._order.check_begin()
        self._step, self._failed = None, True  # until it has begun, swap_in refuses to run
        self._asked = False  # no top-k of this step sent yet
        self._slots.clear()
        self._req_cache = self._req_dev = None
        rows = _ints("state_rows", state_rows, 1)
        reset = None if reset is None else _host(reset, "reset")  # (checked by the client's step, no cast)
        invalidate = None if invalidate is None else _ints("invalidate", invalidate, 2)
        step = self._next_step
        step_as = getattr(self._client, "_step_as", None)  # (sent as this handle's: client/step_driver.py)
        if step_as is not None:
            step_as(self, step, rows, reset, invalidate)
        else:
            self._client.step(step, rows, reset=reset, invalidate=invalidate)
        self._next_step = step + 1  # (a step its client or the daemon refused takes no number)
        in_step = np.zeros(self.layout.max_reqs, dtype=bool)
        in_step[rows[(rows >= 0) & (rows < self.layout.max_reqs)]] = True  # (the daemon refuses the others)
        self._step, self._in_step, self._failed = step, in_step, False
        self._order.began()

    def finish_step(self) -> None:
        """End an interrupted step (as the device handle's): the groups not yet called
        resolve nothing this step, the layers not yet called are done."""
        self._open()
        self._complete_order()

    def _refused_this_step(self, e: SparseKVError) -> bool:
        """Whether ``e`` is the refusal of the begun step's own STEP, sent alone (not an
        earlier step's, raised in its place: that step ended without a top-k)."""
        return e.earlier == "STEP" and e.earlier_step == self._step

    def _abandon_step(self) -> None:
        """The step's STEP was refused (over zmq: raised by its first top-k): the step
        ends, swap_in refuses until the next begin_step, and that step takes the refused
        one's number (a TP rank's peers hold their STEP of that number: TpLag refuses a
        rank ahead, which sends the step again once they caught up)."""
        if self._step is not None:
            self._next_step = self._step
            if self._driver is not None:
                self._driver.unstep(self._step)
        self._step, self._failed = None, True
        self._complete_order()

    def _complete_order(self) -> None:
        groups, layers = self._order.pending()
        for g in groups:
            self._order.rang(g)
        for layer in layers:
            self._order.ready(layer)

    def swap_in(self, req_id_per_token, block_table, logical_topk_indices, *, layer: int, block_size: int,
                return_valid_counts: bool = False, attention_indices_out=None, valid_counts_out=None,
                resident_block_table=None):
        """Make the rows of ``logical_topk_indices`` int [tokens, k] readable in ``kv(layer)``;
        return the indices int32 [tokens, k] into it (-1: none), and with ``return_valid_counts``
        the count of indices >= 0 per token (client/README.md). ``resident_block_table`` int
        [like block_table's rows, n]: the block of the engine's own storage that still holds a
        logical block (-1 = none): index ``resident_base + block * block_size + pos % block_size``."""
        self._open()
        like = next((a for a in (logical_topk_indices, req_id_per_token) if is_torch(a)), None)
        group, leader = self._group(layer)
        if self._step is None:
            why = ("the last begin_step, or its step's first swap_in, failed" if self._failed
                   else "swap_in before begin_step")
            raise BadRequest(f"{why}: call begin_step(state_rows, ...) once per decode step before its first swap_in",
                             ErrorCode.BAD_ARGUMENT)
        reqs = self._reqs(req_id_per_token)
        topk = _ints("logical_topk_indices", logical_topk_indices, 2, keep_cuda=True)
        if topk.shape[0] != reqs.shape[0]:
            raise BadRequest(f"logical_topk_indices must be [tokens={reqs.shape[0]}, k], got {tuple(topk.shape)}",
                             ErrorCode.BAD_ARGUMENT)
        if topk.shape[1] > self.layout.top_k:
            raise BadRequest(f"logical_topk_indices has {topk.shape[1]} columns, layout top_k is {self.layout.top_k}",
                             ErrorCode.BAD_ARGUMENT)
        # Everything the caller passed is checked before the step's order moves on.
        _check_out("attention_indices_out", attention_indices_out, topk.shape)
        if return_valid_counts:
            _check_out("valid_counts_out", valid_counts_out, topk.shape[:1])
        self._order.check_layer(int(layer))
        if layer == leader:
            # With an input on the GPU (or on a fenced rank) the indices are made on the GPU
            # from the reply's device slots, without a wait: the daemon must not reuse the
            # slots before the GPU has read them (fences, or the next request waits).
            gpu = self._fenced or any(on_gpu(a) for a in (req_id_per_token, block_table, logical_topk_indices))
            slots, resident = self._lead(group, reqs, topk, block_table, block_size, resident_block_table, gpu,
                                         req_id_per_token)
            self._order.rang(group)
        else:
            slots, resident = self._follow(group, layer, leader, reqs, topk)
        self._order.ready(int(layer))
        if is_torch(slots):  # cuda: the slots stay on the GPU, so do the indices
            return self._on_device(slots, reqs, req_id_per_token, like, return_valid_counts, attention_indices_out,
                                   valid_counts_out)
        if resident is None and self._hot_int32:  # the common case: 32-bit, two passes
            base = self.hot_base + reqs.astype(np.int32, copy=False) * np.int32(self._stride)  # reqs < max_reqs
            idx = np.where(slots >= 0, slots + base[:, None], np.int32(-1))
        else:
            idx = np.where(slots >= 0, self.hot_base + reqs[:, None].astype(np.int64) * self._stride + slots, -1)
            if resident is not None:
                idx = np.where(resident >= 0, self.resident_base + resident, idx)
            if (idx > np.iinfo(np.int32).max).any():
                raise BadRequest("an index passes int32: lower hot_base or resident_base", ErrorCode.BAD_ARGUMENT)
            idx = idx.astype(np.int32)
        counts = (idx >= 0).sum(axis=1, dtype=np.int32)
        idx = _deliver(idx, attention_indices_out, like)
        if not return_valid_counts:
            return idx
        return idx, _deliver(counts, valid_counts_out, like)

    @property
    def counts(self) -> dict:
        """Totals over the handle's life: top-k batches sent, hits, misses, out_of_range
        (the cuda backend leaves hits and out_of_range to its stats, and reading this
        waits for the misses summed on the GPU: check() first)."""
        out = dict(self._counts)
        if self._device_misses is not None:
            out["misses"] += int(self._device_misses.item())
        return out

    def _on_device(self, slots, reqs: np.ndarray, req_arg, like, return_valid_counts, out, counts_out):
        """The indices from device slots (views of the rank's result ring) on the current
        stream, no wait."""
        import torch  # noqa: PLC0415 - slots are a tensor, so torch is there

        dev = slots.device
        r = self._reqs_on(dev, reqs, req_arg)
        if slots.stride(-1) == 1 and swap_in_kernels.available():  # one launch (csrc/handle.cu)
            idx = _own_or_new(out, tuple(slots.shape), dev)
            counts = _own_or_new(counts_out, tuple(slots.shape[:1]), dev) if return_valid_counts else None
            swap_in_kernels.indices(slots, r, self._stride, self.hot_base, self.layout.max_reqs, idx, counts)
        else:
            idx = torch.where(slots >= 0, slots + (r * self._stride + self.hot_base)[:, None], -1)
            counts = (idx >= 0).sum(dim=1, dtype=torch.int32)
        idx = idx if idx is out else _deliver(idx, out, like)
        if not return_valid_counts:
            return idx
        return idx, counts if counts is counts_out else _deliver(counts, counts_out, like)

    def _reqs_on(self, dev, reqs: np.ndarray, req_arg):
        """``req_id_per_token`` as a contiguous int32 tensor on ``dev``, without a wait
        (once per step for the same tensor, as :meth:`_reqs`)."""
        import torch  # noqa: PLC0415 - only reached with tensors

        cached = self._req_dev
        if cached is not None and cached[0] is reqs and cached[1] == dev:
            return cached[2]
        if is_torch(req_arg) and req_arg.device == dev:
            r = req_arg.to(torch.int32).contiguous()
        else:  # a few bytes from the host, staged at once (no wait on the stream)
            r = torch.from_numpy(reqs.astype(np.int32)).to(dev, non_blocking=True)
        if self._req_cache is not None and self._req_cache[2] is reqs:  # this step's copy of a GPU tensor
            self._req_dev = (reqs, dev, r)
        return r

    def kv(self, layer: int):
        """The layer's hot slab, ``[max_reqs * region_stride, row_bytes]`` uint8, a view
        (NumPy, or a torch tensor on a cuda rank's GPU); with an engine-owned slab the
        engine's rows of the layer in its index space (``EngineSlab.layer_rows``)."""
        self._open()
        self._group(layer)  # (checks it)
        return self._kv[int(layer)]

    def check(self) -> None:
        """Wait for the STEPs the zmq client sent without waiting and raise the typed error
        of one the daemon refused (every other error is raised by the call that made it)."""
        self._open()
        try:
            self._client.flush()
        except SparseKVError as e:
            if self._step is not None and self._refused_this_step(e):
                self._abandon_step()
            raise

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (a TP rank's next step driver may then take over)."""
        return self._closed

    def close(self) -> None:
        """Forget the slab views and the step's slots (idempotent). The client stays open:
        it belongs to the caller."""
        self._closed = True
        self._kv = []
        self._slots.clear()
        self._step = None

    def __enter__(self) -> "HostSwapIn":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------
    def _open(self) -> None:
        if self._closed:
            raise NotAttached("this HostSwapIn is closed; make a new one from the attached client")
        if self._client.attachment is not self._att:  # its slab views are of a rank that is gone
            self.close()
            raise NotAttached("this HostSwapIn's rank was detached (or its client closed): its slab is gone; "
                              "make a new HostSwapIn from the attached client")

    def _reqs(self, req_id_per_token) -> np.ndarray:
        """``req_id_per_token`` on the host. On a fenced rank a tensor on the GPU is copied
        (a wait) once per step: the same tensor, not modified in place since (its version
        counter), gives the same copy at the step's later layers."""
        if not (self._fenced and on_gpu(req_id_per_token)):
            return _ints("req_id_per_token", req_id_per_token, 1)
        t = req_id_per_token
        # (An inference-mode tensor has no version counter: the rule of the docstring.)
        key = (None if t.is_inference() else t._version, t.data_ptr(), tuple(t.shape), t.dtype)
        if self._req_cache is not None and self._req_cache[0] is t and self._req_cache[1] == key:
            return self._req_cache[2]
        reqs = _ints("req_id_per_token", t, 1)
        self._req_cache = (t, key, reqs)  # the tensor held: its id is not reused meanwhile
        return reqs

    def _group(self, layer) -> tuple[int, int]:
        """(its index group, the group's leader layer) of a valid ``layer``, else BadRequest."""
        try:
            g = self._order.group_of.get(whole_number("layer", layer))
        except ValueError:  # a float, bool or text (True was layer 1)
            g = None
        if g is None:
            raise BadRequest(f"layer {layer!r} out of range [0, {self.layout.num_layers})", ErrorCode.BAD_ARGUMENT)
        return g, self._order.groups[g][0]

    def _lead(self, group: int, reqs: np.ndarray, topk, block_table, block_size, resident_table,
              gpu: bool = False, req_arg=None):
        """The group's leader: positions -> host rows, one top-k batch, keep the slots
        (and the resident rows: ``[tokens, k]`` row of the engine's storage, -1 = none)."""
        lay = self.layout
        if resident_table is not None and self._att.engine_slab is None:  # its indices would read the daemon's hot rows
            raise BadRequest("resident_block_table needs an engine-owned slab (attach with slab=EngineSlab...): its "
                             "rows are the engine's own", ErrorCode.BAD_ARGUMENT)
        device_map = on_gpu(topk) and resident_table is None and _block_size_ok(block_size) \
            and swap_in_kernels.available()
        table = _ints("block_table", block_table, 2, keep_cuda=device_map)
        bad = (reqs < -1) | (reqs >= lay.max_reqs)
        if bad.any():
            raise BadRequest(f"req_id_per_token holds {int(reqs[bad][0])}, outside [-1, max_reqs={lay.max_reqs})",
                             ErrorCode.BAD_STATE_ROW)
        live = reqs >= 0
        if live.any() and int(reqs.max()) >= table.shape[0]:
            raise BadRequest(f"block_table has {table.shape[0]} row(s); request {int(reqs.max())} has none "
                             "(it is indexed by request state row)", ErrorCode.BAD_ARGUMENT)
        stray = live & ~self._in_step[np.maximum(reqs, 0)]  # reqs < max_reqs: checked above
        if stray.any():
            t = int(np.flatnonzero(stray)[0])
            raise BadRequest(f"token {t} belongs to request {int(reqs[t])}, which is not among this step's state rows; "
                             "pass every request of the step to begin_step", ErrorCode.BAD_STATE_ROW)
        try:
            rows = None
            if device_map:  # on the top-k's GPU (None: dtypes the kernel does not take)
                rows = _device_rows(topk, table, int(block_size), self._reqs_on(topk.device, reqs, req_arg))
            if rows is None:
                topk = _host(topk, "logical_topk_indices")
                rows = host_rows(topk, _host(table, "block_table"), block_size, table_rows=reqs)
            else:
                att = self._client.attachment
                if not (att.caps.device and att.takes_device_topk and topk.device == att.torch_device):
                    rows = rows.cpu().numpy()  # (the client would copy it so; a wait)
        except (TypeError, ValueError) as e:  # e.g. block_size not a positive integer
            raise BadRequest(str(e), ErrorCode.BAD_ARGUMENT) from None
        resident = None
        if resident_table is not None:
            res = _ints("resident_block_table", resident_table, 2)
            if res.size and (int(res.min()) < -1 or
                             (int(res.max()) + 1) * block_size + self.resident_base > INT32_MAX + 1):
                raise BadRequest(f"resident_block_table holds a block outside [-1, {INT32_MAX}] once its rows are "
                                 f"indices (block_size {block_size}, resident_base {self.resident_base})",
                                 ErrorCode.BAD_ARGUMENT)
            if res.shape[0] != table.shape[0]:
                raise BadRequest(f"resident_block_table must have {table.shape[0]} rows like block_table, got "
                                 f"{res.shape}", ErrorCode.BAD_ARGUMENT)
            per_res = np.full((reqs.shape[0], res.shape[1]), -1, dtype=np.int64)
            per_res[live] = res[reqs[live]]
            blk = np.where(topk >= 0, topk // block_size, -1)
            inside = (blk >= 0) & (blk < res.shape[1])
            rb = np.where(inside, np.take_along_axis(per_res, np.clip(blk, 0, max(res.shape[1] - 1, 0)), 1)
                          if res.shape[1] else -1, -1)
            resident = np.where(rb >= 0, rb * block_size + topk % block_size, -1)
            rows = np.where(resident >= 0, -1, rows).astype(np.int32)  # held by the engine: not fetched
        if reqs.shape[0] == 0:
            slots = np.empty((0, topk.shape[1]), np.int32)
        else:
            if self._reads_on is not None:  # no fences: the GPU's reads of earlier slots come first
                import torch  # noqa: PLC0415 - slots on a GPU were read: torch is there

                torch.cuda.current_stream(self._reads_on).synchronize()
                self._reads_on = None
            submit = getattr(self._client, "_submit_as", None)
            first, self._asked = not self._asked, True
            try:
                res = (submit(self, self._step, group, rows, reqs).wait() if submit is not None
                       else self._client.topk(self._step, group, rows, state_rows=reqs))
            except SparseKVError as e:
                if first and self._refused_this_step(e):  # the step's STEP, sent before this request
                    self._abandon_step()  # so the step never began: a retry would serve the last step's rows
                raise
            self._counts["batches"] += 1
            self._counts["hits"] += res.hits or 0
            self._counts["out_of_range"] += res.out_of_range or 0
            if gpu and is_torch(res.slots) and resident is None and self._hot_int32:
                import torch  # noqa: PLC0415 - the reply holds tensors, so torch is there

                # cuda: views of the rank's result ring, ordered after the gather on the current
                # stream. A group's followers use them later in the step: a copy of their own.
                slots = res.slots.clone() if len(lay.groups[group]) > 1 else res.slots
                total = res.misses.sum(dtype=torch.int64)
                self._device_misses = total if self._device_misses is None else self._device_misses + total
                if not self._fenced and res.slots.is_cuda:  # the daemon may reuse the entry at the next request
                    self._reads_on = res.slots.device
            else:
                slots, misses = res.host()  # NumPy (cuda: waits for the current stream)
                slots = np.asarray(slots, dtype=np.int32)
                self._counts["misses"] += int(np.asarray(misses).sum())
        self._slots[group] = (reqs, slots, resident)
        return slots, resident

    def _follow(self, group: int, layer: int, leader: int, reqs: np.ndarray, topk: np.ndarray) -> np.ndarray:
        """A follower: the leader's slots of this step, no request."""
        got = self._slots.get(group)
        if got is None:
            raise BadRequest(f"layer {layer} follows layer {leader} in index group {group}, whose swap_in has not run "
                             f"in step {self._step}: call swap_in for layer {leader} first", ErrorCode.BAD_ARGUMENT)
        lead_reqs, slots, resident = got
        if reqs.shape != lead_reqs.shape or not np.array_equal(reqs, lead_reqs) or topk.shape != slots.shape:
            raise BadRequest(f"layer {layer} reuses the top-k of its leader layer {leader}, so it must pass the same "
                             f"tokens: req_id_per_token {reqs.shape} and logical_topk_indices {tuple(topk.shape)} differ from "
                             f"the leader's {lead_reqs.shape} and {slots.shape}", ErrorCode.BAD_ARGUMENT)
        return slots, resident


def _host(a, name: str) -> np.ndarray:
    """``a`` (a tensor, an array, a list) as a host array, or BadRequest naming it."""
    if is_torch(a):
        return a.detach().cpu().numpy()
    return host_array(name, a, "an array")


def _block_size_ok(bs) -> bool:
    """A block size the mapping on the GPU takes (an int in [1, 2**31)); any other goes
    the host's way, which maps the rest or names what is wrong."""
    return isinstance(bs, (int, np.integer)) and not isinstance(bs, bool) and 0 < bs <= INT32_MAX


def _device_rows(topk, table, block_size: int, reqs):
    """Host rows (int32 tensor) of a top-k on the GPU, mapped there by one kernel on the
    current stream, without a wait; None for a dtype the kernel cannot take (uint64).
    ``reqs``: int32 on the top-k's GPU (checked on the host)."""
    import torch  # noqa: PLC0415 - the top-k is a tensor, so torch is there

    dev = topk.device
    if not is_torch(table):  # staged at once: no wait for the stream
        table = torch.from_numpy(np.ascontiguousarray(table)).to(dev, non_blocking=True)
    elif table.device != dev:
        table = table.to(dev, non_blocking=True)
    return swap_in_kernels.map_positions(topk, table, block_size, reqs)


def _own_or_new(out, shape: tuple, dev):
    """``out`` when a kernel can write the int32 result of ``shape`` into it in place (a
    contiguous tensor on ``dev``; _check_out checked the rest), else a new tensor."""
    import torch  # noqa: PLC0415

    if is_torch(out) and out.device == dev and out.is_contiguous():
        return out
    return torch.empty(shape, dtype=torch.int32, device=dev)


def _ints(name: str, a, ndim: int, keep_cuda: bool = False):
    """An integer array of ``ndim`` dims on the host, or BadRequest naming it; with
    ``keep_cuda`` a tensor on the GPU is checked in place and returned as it is."""
    if keep_cuda and on_gpu(a):
        if a.dim() != ndim:
            raise BadRequest(f"{name} must have {ndim} dimension(s), got shape {tuple(a.shape)}",
                             ErrorCode.BAD_ARGUMENT)
        if not is_int_dtype(a.dtype):
            raise BadRequest(f"{name} must hold integers, got {a.dtype}", ErrorCode.BAD_ARGUMENT)
        return a
    arr = _host(a, name)
    if arr.ndim != ndim:
        raise BadRequest(f"{name} must have {ndim} dimension(s), got shape {arr.shape}", ErrorCode.BAD_ARGUMENT)
    if arr.dtype.kind not in "iu":
        raise BadRequest(f"{name} must hold integers, got {arr.dtype}", ErrorCode.BAD_ARGUMENT)
    return arr


def _check_out(name: str, out, shape: tuple) -> None:
    """Raise unless ``out`` (None: none given) can take an int32 result of ``shape``."""
    if out is None:
        return
    if is_torch(out):
        import torch  # noqa: PLC0415

        if out.dtype != torch.int32:
            raise BadRequest(f"{name} must be int32, got {out.dtype}", ErrorCode.BAD_ARGUMENT)
    elif not isinstance(out, np.ndarray) or out.dtype != np.int32:
        got = out.dtype if isinstance(out, np.ndarray) else type(out).__name__
        raise BadRequest(f"{name} must be an int32 NumPy array or torch tensor, got {got}", ErrorCode.BAD_ARGUMENT)
    if tuple(out.shape) != shape:
        raise BadRequest(f"{name} must have shape {tuple(shape)}, got {tuple(out.shape)}", ErrorCode.BAD_ARGUMENT)
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise BadRequest(f"{name} is read-only", ErrorCode.BAD_ARGUMENT)


def _deliver(result, out, like):
    """``result`` (NumPy or a tensor) written into ``out`` (checked by _check_out; returned),
    or as ``like``'s kind: a tensor on its device, NumPy when ``like`` is None."""
    if is_torch(out) or (out is None and like is not None):
        import torch  # noqa: PLC0415 - only reached with a tensor argument, so torch is there

        result = result if is_torch(result) else torch.from_numpy(result)
        if out is None:
            return result.to(like.device)
        out.copy_(result)
        return out
    result = result.cpu().numpy() if is_torch(result) else result
    if out is None:
        return result
    out[...] = result
    return out
