"""The synthetic trace generator (``sparsekv trace synth``, docs/TRACES.md): requests
arriving on batch rows, each drawing its top-k from its context with a step-to-step
overlap; host-row or position traces (:class:`~sparsekv.bench.trace.Trace`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from sparsekv.proto import Layout

from .trace import Trace, TraceError, check_room

# Copies of a request's context ids (int64 [span]) synth makes at once while it draws a
# top-k row: the ids, the position mask and table lookups, setdiff1d's sort, choice's pool
# (measured: 2**24 rows a request, host rows or positions, peaked at 7.5-7.6 copies).
SYNTH_CONTEXT_COPIES = 8
NULL_BLOCK = 0.05  # position traces: chance a logical block of a new request's own context is null


@dataclass
class _Request:
    """One request of the generator: its context is host rows ``base .. base + length``, or
    (position traces) positions ``0 .. length`` not on a null block of ``table``."""

    state: int  # its state row
    base: int  # host-row traces: first host row of its context (a donor's when it shares a prefix)
    own: int  # first host row of its state row's own range
    length: int  # context tokens
    left: int  # decode steps to go
    prev: np.ndarray | None = None  # its last top-k row, before stray ids
    new: bool = True
    table: list[int] | None = None  # position traces only
    free: list[int] = field(default_factory=list)  # position traces: own host blocks not used yet

    def context(self, block_size: int) -> np.ndarray:
        """The ids its top-k may name: host rows, or positions on a mapped block."""
        if self.table is None:
            return np.arange(self.base, self.base + self.length, dtype=np.int64)
        pos = np.arange(self.length, dtype=np.int64)
        return pos[np.asarray(self.table, np.int64)[pos // block_size] >= 0]

    def host_rows_of(self, ids: np.ndarray, block_size: int) -> np.ndarray:
        if self.table is None:
            return ids
        return np.asarray(self.table, np.int64)[ids // block_size] * block_size + ids % block_size

    def strays(self, host_rows: int, block_size: int, max_blocks: int) -> list[int]:
        """Ids that name no row: out of range, or (positions) negative, past the table or on a null block."""
        if self.table is None:
            return [host_rows, host_rows + 7, -5]
        past = max_blocks * block_size
        nulls = [i * block_size for i, blk in enumerate(self.table) if blk < 0]
        return [-1, -5, past, past + 3] + nulls[:1]

    def grow(self, span: int, block_size: int, max_blocks: int) -> None:
        """Decode appends one token, in the request's own range (a new block when the last is full)."""
        if self.table is None:
            if self.base == self.own and self.length < span - 1:
                self.length += 1
            return
        if self.length // block_size == len(self.table):
            if not self.free or len(self.table) >= max_blocks:
                return
            self.table.append(self.free.pop())
        self.length += 1


def _arrive(rng, state: int, live: list, *, span: int, context: int, lifetime: int, share_prefix: float,
            block_size: int, max_blocks: int) -> _Request:
    """A new request on ``state``; it may share a live request's prefix (prefix cache)."""
    length = int(min(span - lifetime - 1, max(8, rng.normal(context, context / 4))))
    length = max(1, length)
    base = state * span
    others = [r for r in live if r is not None]
    donor = None
    if others and rng.random() < share_prefix:
        donor = others[rng.integers(len(others))]
        base = donor.base  # shares the donor's prefix rows
        length = min(length, donor.length)
    req = _Request(state=state, base=base, own=state * span, length=length,
                   left=int(rng.integers(lifetime // 2, lifetime * 3 // 2 + 1)))
    if block_size:
        _give_blocks(rng, req, donor, others, block_size, max_blocks)
    return req


def _give_blocks(rng, req: _Request, donor: _Request | None, others: list, block_size: int, max_blocks: int) -> None:
    """A position request's block table: a shared prefix's whole blocks from the donor's
    table, the rest from its own host blocks (``max_blocks`` from ``state * max_blocks``)
    in random order, skipping any a live request holds; a few are null (-1), never its last."""
    held = {blk for r in others for blk in r.table if blk >= 0}
    first = req.state * max_blocks
    req.free = [int(blk) for blk in rng.permutation(np.arange(first, first + max_blocks)) if blk not in held]
    req.table = list(donor.table[: req.length // block_size]) if donor is not None else []
    n_blocks = -(-req.length // block_size)
    null = rng.random(n_blocks) < NULL_BLOCK
    for i in range(len(req.table), n_blocks):
        if null[i] and i < n_blocks - 1:
            req.table.append(-1)
        elif req.free:
            req.table.append(req.free.pop())
        else:
            break  # every own block is held by requests sharing an earlier owner's prefix
    req.length = min(req.length, len(req.table) * block_size)


def _pick(rng, ctx: np.ndarray, prev: np.ndarray | None, top_k: int, overlap: float) -> np.ndarray:
    """A top-k row of distinct ids of ``ctx`` keeping a fraction ``overlap`` of ``prev``'s
    ids; -1 after the ids when ``ctx`` has fewer than ``top_k``."""
    if ctx.size <= top_k:
        ids = rng.permutation(ctx)
    else:
        keep = np.empty(0, np.int64)
        if prev is not None:
            prev = prev[prev >= 0]
            keep = rng.choice(prev, int(overlap * prev.size), replace=False) if prev.size else keep
        need = top_k - keep.size
        pool = np.setdiff1d(ctx, keep, assume_unique=False)
        ids = np.concatenate([keep, rng.choice(pool, need, replace=False)])
        ids = rng.permutation(ids)
    row = np.full(top_k, -1, np.int64)
    row[: ids.size] = ids
    return row


def _with_strays(rng, row: np.ndarray, rate: float, strays: list[int]) -> np.ndarray:
    """``row`` with each column replaced, with chance ``rate``, by one of ``strays``."""
    row = row.copy()
    bad = rng.random(row.size) < rate
    row[bad] = rng.choice(strays, int(bad.sum()))
    return row


def trace_bytes(steps: int, batch: int, top_k: int, max_blocks: int = 0) -> int:
    """Bytes of a synthesized trace's arrays: top-k (int32), state rows (int32), reset
    (bool), invalidate (2 x int32), and a position trace's block tables (int32 ``max_blocks``)."""
    return steps * batch * (4 * top_k + 4 + 1 + 8 + 4 * max_blocks)


def synth(
    *,
    steps: int = 200,
    batch: int = 8,
    top_k: int = 256,
    region_stride: int = 512,
    max_reqs: int = 16,
    host_rows: int = 65536,
    row_bytes: int = 656,
    num_layers: int = 2,
    overlap: float = 0.8,
    context: int = 2048,
    lifetime: int = 64,
    arrive: float = 0.5,
    pad: float = 0.1,
    invalidate: float = 0.05,
    out_of_range: float = 0.0005,
    share_prefix: float = 0.1,
    block_size: int = 0,
    spec: float = 0.0,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> Trace:
    """Generate a decode trace. Requests arrive (with probability ``arrive`` per free batch
    row and step), each with a context of about ``context`` host rows, decode one row per
    step for about ``lifetime`` steps, then leave. Each step keeps a fraction ``overlap``
    of the previous top-k and draws the rest from the request's rows. A fraction ``pad``
    of live rows are padding for a step (state row -1, junk ids). ``invalidate``: the
    chance per request and step that one of its rows is rewritten; ``out_of_range``: per
    column of a bad id; ``share_prefix``: that a new request shares a live one's prefix.

    ``block_size`` > 0 writes a position trace: each request's context is whole host
    blocks of its own range (in random order; shared prefix blocks are the donor's) in a
    per-request block table, some of its logical blocks null (-1); ``topk`` holds
    positions, and a bad column is a negative position, one past the table or one on a
    null block. ``spec`` is the chance that a live request also takes a free batch row for
    a step (speculative decoding: the same state row, the same block table, another
    top-k); it needs ``region_stride >= 2 * top_k``. With both 0 they draw no random
    numbers. ``progress(steps_done)`` is called after each step."""
    for name, v in dict(steps=steps, batch=batch, top_k=top_k, region_stride=region_stride, max_reqs=max_reqs,
                        host_rows=host_rows, row_bytes=row_bytes, num_layers=num_layers, context=context,
                        lifetime=lifetime).items():
        if v < 1:
            raise TraceError(f"{name} must be >= 1, got {v}")
    for name, v in dict(context=context, lifetime=lifetime).items():
        if v >= 1 << 31:
            raise TraceError(f"{name} must be < 2**31, got {v}")
    for name, v in dict(overlap=overlap, arrive=arrive, pad=pad, invalidate=invalidate, out_of_range=out_of_range,
                        share_prefix=share_prefix, spec=spec).items():
        if not 0.0 <= v <= 1.0:
            raise TraceError(f"{name} is a probability in [0, 1], got {v}")
    if seed < 0:
        raise TraceError(f"seed must be >= 0, got {seed}")
    try:
        Layout(num_layers=num_layers, row_bytes=row_bytes, top_k=top_k, region_stride=region_stride,
               max_reqs=max_reqs, host_rows=host_rows, index_groups=(tuple(range(num_layers)),)).validate()
    except ValueError as e:
        raise TraceError(f"these parameters do not make a valid layout: {e}") from None
    rng = np.random.default_rng(seed)
    if batch > max_reqs:
        raise TraceError(f"batch {batch} exceeds max_reqs {max_reqs}")
    if block_size < 0:
        raise TraceError(f"block_size must be >= 0 (0: a host-row trace), got {block_size}")
    if spec > 0 and region_stride < 2 * top_k:
        raise TraceError(f"spec needs region_stride >= 2 * top_k (a state row on two batch rows of a step); "
                         f"got region_stride {region_stride}, top_k {top_k}")
    max_blocks = 0  # position traces: blocks of a state row's own range, the table's width
    if block_size:
        max_blocks = host_rows // block_size // max_reqs
        span = max_blocks * block_size
        if span < top_k + 2:
            raise TraceError(f"host_rows {host_rows} gives {max_blocks} blocks of {block_size} ({span} rows per "
                             f"request); need more than top_k {top_k}")
    else:
        span = host_rows // max_reqs  # host rows a state row's requests may use
        if span < top_k + 2:
            raise TraceError(f"host_rows {host_rows} gives {span} rows per request; need more than top_k {top_k}")
    # The arrays' bytes (top-k, state rows, reset, invalidate; a position trace's tables
    # besides), checked as a load checks them, before any is made; with the working memory
    # of a step: a request's context ids (int64, up to ``span``) and their copies while its
    # top-k is drawn (SYNTH_CONTEXT_COPIES), and with ``spec`` every served row's kept too.
    working = ((batch if spec > 0 else 0) + SYNTH_CONTEXT_COPIES) * 8 * span
    check_room(trace_bytes(steps, batch, top_k, max_blocks) + working,
                f"a trace of {steps} steps of batch {batch} and top_k {top_k} takes",
                f" (with {working / 2**30:.1f} GiB of context ids of up to {span} rows a request while it is drawn)")
    t_topk = np.full((steps, batch, top_k), -1, np.int32)
    t_rows = np.full((steps, batch), -1, np.int32)
    t_reset = np.zeros((steps, batch), bool)
    t_inval = np.full((steps, batch, 2), -1, np.int32)
    t_table = np.full((steps, batch, max_blocks), -1, np.int32) if block_size else None
    free_state = list(rng.permutation(max_reqs))
    live: list[_Request | None] = [None] * batch  # the request on each batch row
    for t in range(steps):
        served = []  # (batch row, request, its context) of this step's live rows
        for b in range(batch):
            req = live[b]
            if req is not None and req.left <= 0:
                free_state.append(req.state)
                live[b] = req = None
            if req is None and free_state and rng.random() < arrive:
                req = live[b] = _arrive(rng, int(free_state.pop(0)), live, span=span, context=context,
                                        lifetime=lifetime, share_prefix=share_prefix, block_size=block_size,
                                        max_blocks=max_blocks)
            if req is None or (not req.new and rng.random() < pad):  # padding (a request stays)
                t_topk[t, b] = rng.integers(-1, host_rows, top_k)  # padding rows carry junk
                continue
            t_rows[t, b] = req.state
            t_reset[t, b] = req.new
            req.new = False
            ctx = req.context(block_size)
            req.prev = _pick(rng, ctx, req.prev, top_k, overlap)
            t_topk[t, b] = _with_strays(rng, req.prev, out_of_range, req.strays(host_rows, block_size, max_blocks))
            if t_table is not None:
                t_table[t, b, : len(req.table)] = req.table
            if rng.random() < invalidate and ctx.size:
                t_inval[t, b, 0] = req.host_rows_of(ctx[rng.integers(ctx.size)], block_size)
            served.append((b, req, ctx if spec > 0 else None))  # (a context kept only for speculative rows)
            req.grow(span, block_size, max_blocks)
            req.left -= 1
        if spec > 0:  # speculative rows: a second batch row of a served request, on a free batch row
            free_rows = [b for b in range(batch) if live[b] is None]
            for b, req, ctx in served:
                if free_rows and rng.random() < spec:
                    c = free_rows.pop(0)
                    t_rows[t, c] = req.state  # reset and invalidations ride on the first row
                    row = _pick(rng, ctx, req.prev, top_k, min(overlap, 0.5))
                    t_topk[t, c] = _with_strays(rng, row, out_of_range, req.strays(host_rows, block_size, max_blocks))
                    if t_table is not None:
                        t_table[t, c] = t_table[t, b]
        if progress is not None:
            progress(t + 1)
    return Trace(t_topk, t_rows, t_reset, t_inval, region_stride, host_rows, max_reqs, row_bytes, num_layers,
                 block_table=t_table, block_size=block_size).check()
