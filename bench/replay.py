"""``sparsekv replay``: drive the whole stack with a recorded trace (DESIGN §6, docs/TRACES.md).

The loop (:func:`replay`) is the same for every transport; one step on a transport is a
:class:`Driver`'s :meth:`~Driver.run_step`. Counts and ``--verify`` use host rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable

import numpy as np

from sparsekv.proto import LIMITS
from sparsekv.proto.cuda_ipc import device_count
from sparsekv.proto.layout import Layout
from sparsekv.proto.slab import SlabGeometry

from sparsekv.client.client import Client
from sparsekv.client.engine_slab import EngineSlab
from sparsekv.client.errors import BadRequest, PoolFull
from sparsekv.embedded.inproc import InprocClient
from .private_daemon import PrivateDaemon
from .trace import Trace, TraceError, save_npz
from .verify import count_mismatches, fill_pool

# run_step's answer: slots int32 [batch, top_k], misses int32 [batch], hits, out_of_range
# (None where the transport does not report them: the loop derives them from the result).
StepResult = tuple[np.ndarray, np.ndarray, int | None, int | None]


SLABS = ("daemon", "engine")
GUARD_BLOCKS = 2  # blocks of the engine's own rows before each layer's hot blocks
GAP_ROWS = 1  # rows of other data after every block (a block stride wider than the block)
GUARD_TAIL_BYTES = 4096  # and bytes after the last layer


class EngineRows:
    """``--slab engine``: the hot region inside a buffer the replay owns, as an engine's
    paged KV cache would hold it (``client/engine_slab.py``), laid out as the GUARD_*
    and GAP_ROWS constants say. Every byte starts as noise; the bytes outside the hot
    rows are checked unchanged at the end (:meth:`guard_changed`). A torch tensor on a
    GPU (``device`` ``"cuda:N"``), else shared memory; a copy of its start beside it."""

    def __init__(self, layout: Layout, device: str):
        hot = layout.max_reqs * layout.region_stride
        rb = self.row_bytes = layout.row_bytes
        self.block = 16 if hot % 16 == 0 else hot
        self.region_stride = layout.region_stride
        self.hot_base = GUARD_BLOCKS * self.block
        self.blocks = GUARD_BLOCKS + hot // self.block  # per layer
        self.block_stride = (self.block + GAP_ROWS) * rb
        self.layer_bytes = self.blocks * self.block_stride
        self.layers = layout.num_layers
        self.shape = (layout.num_layers, layout.max_reqs, layout.region_stride, rb)
        nbytes = layout.num_layers * self.layer_bytes + GUARD_TAIL_BYTES
        bases = [layer * self.layer_bytes for layer in range(layout.num_layers)]
        self.geometry = SlabGeometry.paged(layout, bases, first_block=GUARD_BLOCKS, block_size=self.block,
                                           block_stride=self.block_stride, buffer_bytes=nbytes)
        noise = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        if device.startswith("cuda"):
            import torch  # noqa: PLC0415

            buf = torch.from_numpy(noise).to(device)
            self.slab = EngineSlab.from_tensor(buf)
            self.start = buf.clone()
        else:
            self.slab = EngineSlab.shared_memory(nbytes)
            self.slab.array[:] = noise
            self.start = noise
        self.slab.with_geometry(self.geometry)

    def _blocks(self, a, layer: int):
        """Layer ``layer`` of buffer ``a`` as ``[blocks, block_stride]`` (a view)."""
        v = a[layer * self.layer_bytes: (layer + 1) * self.layer_bytes]
        return v.reshape(self.blocks, self.block_stride)

    def hot(self) -> "HotRows":
        """The hot rows, indexed ``[layer, state_row, slots]`` like the daemon's slab."""
        views = []
        for layer in range(self.layers):
            v = self._blocks(self.slab.array, layer)[GUARD_BLOCKS:, : self.block * self.row_bytes]
            v = v.reshape(v.shape[0], self.block, self.row_bytes)
            if isinstance(v, np.ndarray) and not np.may_share_memory(v, self.slab.array):
                raise AssertionError("the hot rows' view is a copy")  # NumPy could not make a view
            views.append(v)
        return HotRows(views, self.shape, self.region_stride, self.block)

    def guard_changed(self) -> int:
        """Bytes outside the hot rows that differ from their start."""
        a, b, rb = self.slab.array, self.start, self.row_bytes
        changed = 0
        for layer in range(self.layers):
            now, was = self._blocks(a, layer), self._blocks(b, layer)
            changed += int((now[:GUARD_BLOCKS] != was[:GUARD_BLOCKS]).sum())  # the engine's own blocks
            changed += int((now[GUARD_BLOCKS:, self.block * rb:] != was[GUARD_BLOCKS:, self.block * rb:]).sum())
        tail = self.layers * self.layer_bytes
        changed += int((a[tail:] != b[tail:]).sum())
        return changed


class HotRows:
    """An engine slab's hot rows as ``count_mismatches`` reads a slab: ``[layer,
    state_row, slots]`` -> the rows ``[n, row_bytes]`` (per layer a ``[blocks, block_rows,
    row_bytes]`` view; hot row ``state_row * region_stride + slot``)."""

    def __init__(self, views, shape, region_stride: int, block: int):
        self.views, self.shape, self.region_stride, self.block = views, shape, region_stride, block

    def __getitem__(self, key):
        layer, row, slots = key
        h = int(row) * self.region_stride + np.asarray(slots, dtype=np.int64)
        v = self.views[int(layer)]
        i, j = h // self.block, h % self.block
        if not isinstance(v, np.ndarray):
            import torch  # noqa: PLC0415

            i, j = torch.as_tensor(i, device=v.device), torch.as_tensor(j, device=v.device)
        return v[i, j]


class Driver:
    """One transport's side of a replay: opens a client (its resources on ``stack``),
    attaches the trace's layout, and runs one step at a time. A subclass provides
    :meth:`open`; the default :meth:`run_step` sends the step and its top-k batch of
    index group 0 in host rows, and waits for the result."""

    attach_kw: dict = {}  # extra arguments of Client.attach (the transport)

    def __init__(self, trace: Trace, stack: contextlib.ExitStack, *, backend: str, engine: str,
                 connect: str | None = None, daemon_log: str | None = None, slab: str = "daemon",
                 prefetch: bool = False, rank: int = 0, tp_size: int = 1):
        if slab not in SLABS:
            raise ValueError(f"unknown slab {slab!r}; use {' or '.join(SLABS)}")
        self.trace = trace
        self.prefetch = prefetch
        self.rank = rank
        self.run_dir = connect  # (a daemon's: set by open)
        self.layout = ahead_layout(trace) if prefetch else trace.layout()
        self.client = self.open(stack, backend=backend, connect=connect, daemon_log=daemon_log)
        kw = dict(self.attach_kw, **({"prefetch": True} if prefetch else {}))
        if tp_size > 1:
            kw["tp_size"] = tp_size
        self.engine_rows = None
        if slab == "engine":
            self.engine_rows = EngineRows(self.layout, self.client.device)
            stack.callback(self.engine_rows.slab.close)
            kw["slab"] = self.engine_rows.slab
        self.att = self.client.attach(self.layout, engine=engine, **kw)

    @property
    def hot_base(self) -> int:
        return self.engine_rows.hot_base if self.engine_rows is not None else 0

    def hot_rows(self):
        """The slab's hot rows ``[layers, max_reqs, region_stride, row_bytes]`` (--verify)."""
        return self.engine_rows.hot() if self.engine_rows is not None else self.att.slab

    def open(self, stack: contextlib.ExitStack, *, backend: str, connect: str | None, daemon_log: str | None):
        """Return a connected client (``Client`` API), its cleanup entered on ``stack``."""
        raise NotImplementedError

    def run_step(self, t: int) -> StepResult:
        """Step ``t`` of the trace; returns once its rows are in the slab (cuda: once the
        gather is done)."""
        tr = self.trace
        self.client.step(t, tr.state_rows[t], tr.reset[t], tr.invalidate[t])
        r = self.client.topk(t, 0, tr.host_topk(t))
        slots, misses = r.host()  # cuda: waits for the gather (the step's end)
        return slots, misses, r.hits, r.out_of_range

    def run_ahead(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """(prefetch) Index group 1 of step ``t``, its top-k the next step's rows
        (:func:`ahead_rows`): the prefetch from group 0 guessed them with the trace's
        step-to-step overlap. Its (slots, misses)."""
        r = self.client.topk(t, 1, ahead_rows(self.trace, t))
        return r.host()

    def close(self) -> None:
        self.client.detach()


class InprocDriver(Driver):
    """The residency engine and mover in this process (cpu backend)."""

    def __init__(self, trace, stack, *, slab="daemon", **kw):
        if slab == "engine":
            raise ValueError("an engine-owned slab is given to a daemon: use --transport zmq or doorbell")
        try:
            super().__init__(trace, stack, **kw)
        except PoolFull as e:  # the attach's check, before allocating: the trace is too large here (exit 2)
            raise TraceError(f"the trace's layout needs more host memory than this machine has: {e.args[0]}") from None

    def open(self, stack, *, backend, connect, daemon_log):
        return stack.enter_context(InprocClient(backend=backend))


class ZmqDriver(Driver):
    """A daemon over its ZeroMQ socket: ``connect`` (a run dir), else a private daemon."""

    def open(self, stack, *, backend, connect, daemon_log):
        run_dir = connect
        if run_dir is None:
            pool_bytes = self.layout.pool_bytes + (8 << 20)
            run_dir = stack.enter_context(PrivateDaemon(pool_bytes=pool_bytes, backend=backend,
                                                        log_path=daemon_log)).run_dir
        self.run_dir = run_dir
        # Rank r on GPU r modulo the GPUs this process sees (ranks share GPUs when fewer).
        device = f"cuda:{self.rank % device_count()}" if backend == "cuda" else "cpu"
        return stack.enter_context(Client(run_dir, name=f"replay-r{self.rank}", rank=self.rank, device=device))


class DoorbellDriver(ZmqDriver):
    """The engine's handle on the doorbell transport (cuda only): ``begin_step`` and every
    layer of group 0's ``swap_in`` on the current stream, positions mapped on the GPU
    (with prefetch: then group 1's, in host rows, :meth:`run_ahead`). Slots come back from
    the indices, misses from the group's device counts."""

    attach_kw = {"transport": "doorbell"}

    def __init__(self, trace, stack, *, backend, **kw):
        if backend != "cuda":
            raise ValueError("the doorbell transport needs --backend cuda")
        import torch  # noqa: PLC0415 - torch only where a GPU is driven

        self.torch = torch
        super().__init__(trace, stack, backend=backend, **kw)
        self.handle = self.client.doorbell_handle(hot_base=self.hot_base)
        stack.callback(self.handle.close)
        # Its own stream: the ranks of a TP group enqueue their steps one after the other
        # before any waits for its rows (their group's step waits for every rank's bells).
        self.stream = torch.cuda.Stream(device=self.client.device)
        self._pending = None

    def run_step(self, t: int) -> StepResult:
        self.start_step(t)
        return self.finish()

    def start_step(self, t: int) -> None:
        """Enqueue step ``t`` (``begin_step``, group 0's layers) on this rank's stream;
        :meth:`finish` waits for it."""
        tr, h, lay = self.trace, self.handle, self.layout
        state = tr.state_rows[t]
        with self.torch.cuda.stream(self.stream):
            dev = self._dev
            h.begin_step(dev(state), dev(tr.reset[t]), dev(tr.invalidate[t]))
            table, block_size = None, 1
            if tr.positional:
                rows = np.full((lay.max_reqs, tr.block_table.shape[2]), -1, np.int32)
                live = state >= 0
                rows[state[live]] = tr.block_table[t][live]  # a request's rows share its table (Trace.check)
                table, block_size = dev(rows), tr.block_size
            self._start_group(0, state, tr.topk[t], table, block_size)

    def run_ahead(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """Group 1's layers, their top-k the next step's host rows (no block table)."""
        self.start_ahead(t)
        return self.finish()[:2]

    def start_ahead(self, t: int) -> None:
        with self.torch.cuda.stream(self.stream):
            self._start_group(1, self.trace.state_rows[t], ahead_rows(self.trace, t), None, 1)

    def _dev(self, a):
        """``a`` on this rank's GPU (rank r's: cuda:r modulo the GPUs, not the current one)."""
        return self.torch.as_tensor(np.ascontiguousarray(a)).to(self.client.device)

    def _start_group(self, g: int, state, topk, table, block_size: int) -> None:
        """Every layer of group ``g``'s ``swap_in`` enqueued (on the current stream)."""
        h, lay = self.handle, self.layout
        req, topk = self._dev(state), self._dev(topk)
        first = None
        for layer in lay.groups[g]:
            idx = h.swap_in(req, table, topk, layer=layer, block_size=block_size)
            first = idx if first is None else first
        self._pending = (g, state, first)

    def finish(self) -> StepResult:
        """The enqueued group's (slots, misses, None, None) once this rank's stream is done."""
        (g, state, first), self._pending = self._pending, None
        lay, h = self.layout, self.handle
        self.stream.synchronize()
        idx = first.cpu().numpy()
        slots = np.where(idx >= 0, idx - self.hot_base - state[:, None].astype(np.int64) * lay.region_stride,
                         -1).astype(np.int32)
        misses = h.misses(g)[: len(state)].cpu().numpy().copy()
        h.check()
        return slots, misses, None, None


DRIVERS: dict[str, type[Driver]] = {"inproc": InprocDriver, "zmq": ZmqDriver, "doorbell": DoorbellDriver}


def ahead_layout(trace: Trace) -> Layout:
    """``--prefetch``: the trace's layers as index group 0 and as many again as group 1
    (the group a prefetch fills)."""
    n = trace.num_layers
    try:
        return dataclasses.replace(trace.layout(), num_layers=2 * n,
                                   index_groups=(tuple(range(n)), tuple(range(n, 2 * n)))).validate()
    except ValueError as e:
        raise TraceError(f"--prefetch doubles the trace's {n} layers (a second index group): {e}") from None


def ahead_rows(trace: Trace, t: int) -> np.ndarray:
    """Group 1's top-k at step ``t``: step ``t + 1``'s host rows of each batch row that
    serves the same request then (same state row, no reset), else step ``t``'s own."""
    rows = trace.host_topk(t)
    if t + 1 < trace.steps:
        same = (trace.state_rows[t + 1] == trace.state_rows[t]) & ~trace.reset[t + 1].astype(bool)
        rows = np.where(same[:, None], trace.host_topk(t + 1), rows)
    return rows


def replay(trace: Trace, *, transport: str = "inproc", backend: str = "cpu", verify: bool = False,
           connect: str | None = None, engine: str = "replay", daemon_log: str | None = None,
           slab: str = "daemon", prefetch: bool = False, ranks: int = 1, tp: bool = False,
           progress: Callable[[int], None] | None = None) -> tuple[dict, dict]:
    """Run ``trace``; return (summary, result arrays ``slots`` and ``misses``).
    ``slab="engine"``: the hot rows in a buffer the replay owns (:class:`EngineRows`),
    with guard bytes around them that must stay unchanged (``guard_bytes_changed``).
    ``prefetch``: attach with prefetch and replay each step as index group 0 and then
    group 1 (the next step's rows, :func:`ahead_rows`); the results stay group 0's (a
    prefetch never fills group 0), the summary adds group 1's misses and hits, and
    ``--verify`` checks group 1's rows too. ``ranks``: that many rank clients of one
    engine (a daemon's; on cuda rank r on GPU r modulo the GPUs), each sending every step
    in turn; the results are rank 0's, ``ranks_differing`` counts the (step, rank) whose
    slots or misses differ from rank 0's, and ``--verify`` checks every rank's rows.
    ``tp``: the ranks form a TP group (``tp_size``: one resolve for them all, DESIGN §5.6).
    ``progress(steps_done)`` is called after each step."""
    if transport not in DRIVERS:
        raise ValueError(f"unknown transport {transport!r}; use {' or '.join(DRIVERS)}")
    if not 1 <= ranks <= LIMITS.max_tp_size:
        raise ValueError(f"ranks must lie in [1, {LIMITS.max_tp_size}], got {ranks}")
    if ranks > 1 and transport == "inproc":
        raise ValueError("several ranks attach to a daemon: use --transport zmq or doorbell")
    if tp and ranks < 2:
        raise ValueError("a TP group needs 2 ranks or more (--ranks)")
    with contextlib.ExitStack() as stack:
        drivers = []
        for r in range(ranks):
            drivers.append(DRIVERS[transport](trace, stack, backend=backend, engine=engine,
                                              connect=connect if r == 0 else drivers[0].run_dir,
                                              daemon_log=daemon_log, slab=slab, prefetch=prefetch, rank=r,
                                              tp_size=ranks if tp else 1))
        driver = drivers[0]
        layout = driver.layout
        hot = [d.hot_rows() for d in drivers]
        if verify:
            fill_pool(driver.client, layout)
        slots = np.full(trace.topk.shape, -1, np.int32)
        misses = np.zeros(trace.topk.shape[:2], np.int32)
        lat = np.zeros(trace.steps)
        hits = out_of_range = mismatched = ahead_misses = ahead_hits = differing = 0
        layers = layout.groups[0]
        # A TP group on the doorbell resolves once every rank's bell rang: the ranks' steps
        # are enqueued together, then read (one after another, each rank's would wait for ever).
        together = tp and transport == "doorbell"
        t_start = time.perf_counter()
        for t in range(trace.steps):
            t0 = time.perf_counter()
            rows = trace.host_topk(t)  # what the step asked for, in host rows
            if together:  # every rank's step enqueued before any is waited for
                for d in drivers:
                    d.start_step(t)
            for r, d in enumerate(drivers):
                try:
                    got_slots, got_misses, step_hits, step_oob = d.finish() if together else d.run_step(t)
                except BadRequest as e:  # the trace breaks the contract: say where
                    raise BadRequest(f"step {t}{f', rank {r}' if ranks > 1 else ''}: {e.args[0]}", e.code) from None
                if r == 0:
                    slots[t], misses[t], hits_0, oob_0 = got_slots, got_misses, step_hits, step_oob
                else:
                    differing += not (np.array_equal(got_slots, slots[t]) and np.array_equal(got_misses, misses[t]))
                if verify:
                    mismatched += count_mismatches(hot[r], layers, trace.state_rows[t], rows, got_slots,
                                                   layout.host_rows)
            lat[t] = time.perf_counter() - t0
            step_hits, step_oob = hits_0, oob_0
            ids = rows[trace.state_rows[t] >= 0]
            if step_hits is None:  # cuda: counted on the GPU; derive them from the result
                step_hits = int(((ids >= 0) & (ids < layout.host_rows)).sum()) - int(misses[t].sum())
            if step_oob is None:
                step_oob = int(((ids < -1) | (ids >= layout.host_rows)).sum())
            hits += step_hits
            out_of_range += step_oob
            if prefetch:
                nxt_rows = ahead_rows(trace, t)
                if together:
                    for d in drivers:
                        d.start_ahead(t)
                for r, d in enumerate(drivers):
                    ahead_slots, ahead = d.finish()[:2] if together else d.run_ahead(t)
                    if r == 0:
                        nxt = nxt_rows[trace.state_rows[t] >= 0]
                        ahead_misses += int(ahead.sum())
                        ahead_hits += int(((nxt >= 0) & (nxt < layout.host_rows)).sum()) - int(ahead.sum())
                        first_ahead = (ahead_slots, ahead)
                    else:
                        differing += not (np.array_equal(ahead_slots, first_ahead[0])
                                          and np.array_equal(ahead, first_ahead[1]))
                    if verify:
                        mismatched += count_mismatches(hot[r], layout.groups[1], trace.state_rows[t], nxt_rows,
                                                       ahead_slots, layout.host_rows)
            if progress is not None:
                progress(t + 1)
        elapsed = time.perf_counter() - t_start
        for d in drivers:
            d.close()
        guard = sum(d.engine_rows.guard_changed() for d in drivers) if driver.engine_rows is not None else None
    summary = {
        "transport": transport,
        "backend": backend,
        "steps": trace.steps,
        "batch": trace.batch,
        "top_k": trace.top_k,
        "hits": int(hits),
        "misses": int(misses.sum()),
        "hit_rate": round(hits / max(1, hits + int(misses.sum())), 6),
        "out_of_range": int(out_of_range),
        "rows_moved": int(misses.sum()) * len(layers),
        "bytes_moved": int(misses.sum()) * len(layers) * layout.row_bytes,
        "slab": slab,
        "verified": verify,
        "mismatched_rows": int(mismatched) if verify else None,
        "guard_bytes_changed": guard,
        **({"prefetch": True, "next_group_hits": int(ahead_hits), "next_group_misses": int(ahead_misses)}
           if prefetch else {}),
        **({"ranks": ranks, "tp_group": tp, "ranks_differing": int(differing)} if ranks > 1 else {}),
        "elapsed_s": round(elapsed, 4),
        "step_p50_us": round(float(np.percentile(lat, 50)) * 1e6, 1) if trace.steps else 0.0,
        "step_p99_us": round(float(np.percentile(lat, 99)) * 1e6, 1) if trace.steps else 0.0,
    }
    return summary, {"slots": slots, "misses": misses}


def save_result(path: str, result: dict) -> None:
    """Write the result to ``path`` (:func:`~.trace.save_npz`)."""
    save_npz(path, slots=result["slots"], misses=result["misses"])
