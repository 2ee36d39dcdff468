"""The two small interfaces every backend (``cpu``, ``cuda``) implements, the values they
share, and the checks both make. :class:`Residency` decides which hot slot holds which
host row (exact LRU, per index group and request state row) and never moves bytes;
:class:`Mover` moves them (gather, write mirror, staging).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np

from sparsekv.proto.args import carried_number, int32_array, whole_number
from sparsekv.proto.layout import Layout
from sparsekv.proto.settings import format_size, size_text


class ResidencyError(ValueError):
    """Bad input to the residency engine. ``code`` names a ``proto.ErrorCode`` member."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Plan:
    """The rows one resolve must copy, for every layer of its index group.

    ``rows[i]`` (host row) goes to flat hot slot ``slots[i]`` = ``state_row * region_stride
    + slot``. Entries are sorted by host row: the gather reads the pool in address order.
    """

    rows: np.ndarray  # int32 [n]
    slots: np.ndarray  # int32 [n]

    def __len__(self) -> int:
        return int(self.rows.shape[0])


def check_stripe(stripe: int, stripes: int) -> None:
    """Raise BAD_ARGUMENT unless ``stripes`` >= 1 and ``stripe`` in [0, stripes)."""
    if not (isinstance(stripes, (int, np.integer)) and isinstance(stripe, (int, np.integer))) \
            or stripes < 1 or not 0 <= stripe < stripes:
        raise ResidencyError("BAD_ARGUMENT", f"stripe {stripe!r} of {stripes!r}: need stripes >= 1, 0 <= stripe < stripes")


def stripe_bounds(m, stripe: int, stripes: int) -> tuple[np.ndarray, np.ndarray]:
    """Stripe ``stripe`` of ``stripes`` of plan rows of ``m`` entries each (int array,
    counts already clamped to [0, ld]): entries ``[lo, hi)`` with ``lo = m * stripe //
    stripes``, ``hi = m * (stripe + 1) // stripes`` (int64), the rule of ``csrc/copy.cu``'s
    striped ``skv_gather`` and ``skv_push``. Over the stripes every entry falls in exactly
    one; each is a contiguous run of the row's (sorted) host rows."""
    check_stripe(stripe, stripes)
    m = np.asarray(m, dtype=np.int64)
    if (m < 0).any():
        raise ResidencyError("BAD_ARGUMENT", "entry counts must be >= 0 (clamp them to [0, ld] first)")
    return m * stripe // stripes, m * (stripe + 1) // stripes


def stripe_plan(plan_rows, plan_slots, counts, stripe: int, stripes: int) -> Plan:
    """The NumPy reference of what the striped kernels copy: of per-row plans
    (``plan_rows`` / ``plan_slots`` ``[batch, ld]``, row b's first ``counts[b]`` entries,
    clamped to [0, ld]), the entries of stripe ``stripe`` of ``stripes``, as a
    :class:`Plan` (sorted by host row); entries naming no row or slot (-1: a prefetch's
    dropped take) are left out, as the kernels skip them."""
    rows = np.asarray(plan_rows, dtype=np.int32)
    slots = np.asarray(plan_slots, dtype=np.int32)
    if rows.ndim != 2 or rows.shape != slots.shape:
        raise ResidencyError("BAD_ARGUMENT", f"plan rows and slots must be [batch, ld]; got {rows.shape}, {slots.shape}")
    batch, ld = rows.shape
    m = np.clip(np.asarray(counts, dtype=np.int64).reshape(-1)[:batch], 0, ld)
    if m.shape[0] != batch:
        raise ResidencyError("BAD_ARGUMENT", f"{m.shape[0]} counts for {batch} plan rows")
    lo, hi = stripe_bounds(m, stripe, stripes)
    i = np.arange(ld)
    take = (i >= lo[:, None]) & (i < hi[:, None]) & (rows >= 0) & (slots >= 0)
    by_row = np.argsort(rows[take], kind="stable")
    return Plan(rows=rows[take][by_row], slots=slots[take][by_row])


@dataclass(frozen=True)
class Resolved:
    """Result of resolving one top-k batch for one index group."""

    slots: np.ndarray  # int32 [batch, top_k]: slot within the region, -1 if none
    misses: np.ndarray  # int32 [batch]
    hits: int
    out_of_range: int  # columns naming an id < -1 or >= host_rows
    plan: Plan


class Residency(abc.ABC):
    """Residency state of one rank: ``owner`` and ``lru`` per (group, state row)."""

    layout: Layout

    @abc.abstractmethod
    def reset(self, state_rows: np.ndarray) -> None:
        """Empty every group's region of each state row (a new request took it)."""

    @abc.abstractmethod
    def invalidate(self, state_row: int, rows: np.ndarray) -> None:
        """In every group of ``state_row``, empty the slots owning one of ``rows``."""

    def invalidate_pairs(self, state_rows: np.ndarray, rows: np.ndarray) -> None:
        """For each i, in every group of ``state_rows[i]``, empty the slots owning
        ``rows[i]`` (all >= 0): each state row's region once, for all its rows."""
        order = np.argsort(state_rows, kind="stable")
        state_rows, rows = state_rows[order], rows[order]
        states, starts = np.unique(state_rows, return_index=True)
        for s, part in zip(states, np.split(rows, starts[1:])):
            self.invalidate(int(s), part)

    @abc.abstractmethod
    def invalidate_everywhere(self, rows: np.ndarray) -> int:
        """Empty every slot of every state row owning one of ``rows``; return how many."""

    @abc.abstractmethod
    def resolve(self, group: int, state_rows: np.ndarray, topk: np.ndarray) -> Resolved:
        """Resolve a batch: ``state_rows`` int32 [batch] (-1 = padding, untouched) and
        ``topk`` int32 [batch, top_k] host row ids. Rows sharing a state row (several
        query tokens of one request) resolve one after another in batch order.
        Raises :class:`ResidencyError` before changing any state when the input is bad."""

    def prefetch(self, group: int, state_rows: np.ndarray, topk: np.ndarray) -> Plan:
        """Fetch ahead (DESIGN.md §4, prefetch): place the rows of ``topk`` (another
        group's top-k batch) that group ``group``'s regions of ``state_rows`` lack into
        slots outside their latest resolve's; return the plan to gather: one pair per slot,
        the last row taken into it. ``prefetched`` counts, over the residency's life, the
        rows taken (a row a later token's took the slot of included), ``prefetch_hits`` and
        ``prefetch_wasted`` those a resolve then hit and those that lost their slot first."""
        raise ResidencyError("BAD_ARGUMENT", f"the {type(self).__name__} backend has no prefetch")

    prefetched: int = 0
    prefetch_hits: int = 0
    prefetch_wasted: int = 0


class Mover(abc.ABC):
    """Byte mover of one rank: host pool <-> hot slab and staging buffer."""

    @abc.abstractmethod
    def gather(self, plan: Plan, layers: tuple[int, ...]) -> int:
        """Copy ``plan`` for each of ``layers``; return bytes moved."""

    @abc.abstractmethod
    def stage(self, rows: np.ndarray, layers: tuple[int, ...]) -> int:
        """Copy host ``rows`` of each of ``layers`` to the front of the staging buffer."""


def check_batch(layout: Layout, group: int, state_rows, topk) -> tuple[np.ndarray, np.ndarray]:
    """The checks every backend makes before a resolve changes anything: shapes, group,
    state rows, room for several query tokens, unique ids. Returns both arrays as int32."""
    state_rows, topk = check_batch_shape(layout, group, state_rows, topk)
    _check_batch_values(layout, state_rows, topk)
    return state_rows, topk


def check_batch_shape(layout: Layout, group: int, state_rows, topk) -> tuple[np.ndarray, np.ndarray]:
    """The part of :func:`check_batch` that reads no id: the group, the arrays' shapes,
    the batch size (the cuda rank's kernels check the values)."""
    state_rows = np.asarray(state_rows, dtype=np.int32)
    topk = np.asarray(topk, dtype=np.int32)
    group = whole_arg("group", group)
    if not 0 <= group < layout.num_groups:
        raise ResidencyError("BAD_ARGUMENT", f"group {group} out of range [0, {layout.num_groups})")
    if state_rows.ndim != 1 or topk.ndim != 2 or topk.shape[0] != state_rows.shape[0]:
        raise ResidencyError(
            "BAD_ARGUMENT",
            f"state_rows must be [batch] and topk [batch, top_k]; got {state_rows.shape} and {topk.shape}",
        )
    if topk.shape[1] > layout.top_k:
        raise ResidencyError(
            "BAD_ARGUMENT", f"topk has {topk.shape[1]} columns, layout top_k is {layout.top_k}"
        )
    if topk.shape[0] > layout.max_batch:  # padding rows cost a resolve as much as live ones
        raise ResidencyError("TOO_LARGE", f"batch of {topk.shape[0]} rows exceeds max_batch {layout.max_batch}")
    return state_rows, topk


def _check_batch_values(layout: Layout, state_rows: np.ndarray, topk: np.ndarray) -> None:
    bad = (state_rows < -1) | (state_rows >= layout.max_reqs)
    if bad.any():
        raise ResidencyError(
            "BAD_STATE_ROW",
            f"state row {int(state_rows[bad][0])} out of range [-1, {layout.max_reqs})",
        )
    # Several query tokens of one request resolve one after another into one region; a
    # later token may only evict slots no earlier token of the step uses, which holds
    # exactly when the region has top_k slots per token.
    live = state_rows[state_rows >= 0]
    if live.size:
        counts = np.bincount(live)
        worst = int(counts.argmax())
        if int(counts[worst]) * layout.top_k > layout.region_stride:
            raise ResidencyError(
                "BAD_ARGUMENT",
                f"state row {worst} appears {int(counts[worst])} times in the batch; region_stride "
                f"{layout.region_stride} holds {layout.region_stride // layout.top_k} tokens of top_k {layout.top_k}",
            )
    dup = find_duplicates(topk, state_rows, layout.host_rows)
    if dup >= 0:
        raise ResidencyError("DUPLICATE_IDS", f"top-k row {dup} names the same host row twice")


def apply_step(residency: Residency, state_rows: np.ndarray, reset, invalidate) -> None:
    """A step's resets, then its invalidations (checked arrays; either may be None)."""
    if reset is not None and reset.any():
        residency.reset(state_rows[reset & (state_rows >= 0)])
    if invalidate is not None and invalidate.size:
        live = state_rows >= 0
        owners, inv = np.broadcast_to(state_rows[live][:, None], invalidate[live].shape), invalidate[live]
        keep = inv >= 0
        if keep.any():
            residency.invalidate_pairs(owners[keep], inv[keep])


def prefetch_into_next(resolved_at: dict, step: int, group: int, num_groups: int) -> bool:
    """The prefetch rule of DESIGN §4: record group ``group``'s top-k batch of ``step`` in
    ``resolved_at`` (index group -> the step of its latest batch); whether its rows go ahead
    into group + 1's regions: not past the last group, and not into a group that had a
    batch of this step already."""
    resolved_at[group] = step
    return group + 1 < num_groups and resolved_at.get(group + 1) != step


# Per (index group, state row, slot): owner and lru, int32 each, and the prefetch mark (a
# byte: the cpu residency keeps it always, the cuda one with prefetch).
STATE_BYTES_PER_SLOT = 9


def rank_bytes(layout: Layout, engine_slab: bool = False) -> dict[str, int]:
    """What one rank of ``layout`` costs the daemon, by part: ``slab`` (every layer's hot
    regions; 0 for an ``engine_slab``, which the engine owns), ``staging``, ``state`` (9
    bytes a slot and group: tiny rows cost far more in state than in slab) and ``total``."""
    slab, staging = 0 if engine_slab else layout.slab_bytes, layout.staging_bytes
    state = layout.num_groups * layout.max_reqs * layout.region_stride * STATE_BYTES_PER_SLOT
    return {"slab": slab, "staging": staging, "state": state, "total": slab + staging + state}


def check_layout_limits(layout: Layout, max_rank_bytes: int, engine_slab: bool = False) -> dict[str, int]:
    """Refuse (``ResidencyError`` TOO_LARGE, before anything is allocated) a layout whose
    rank would take more than ``max_rank_bytes`` (ATTACH: the daemon's ``max_slab_bytes``)
    by :func:`rank_bytes`, whose parts it returns; an ``engine_slab`` costs nothing."""
    parts = rank_bytes(layout, engine_slab)
    if parts["total"] > max_rank_bytes:
        size = {k: format_size(v) for k, v in parts.items()}
        raise ResidencyError(
            "TOO_LARGE",
            f"a rank of this layout takes {size['total']} (hot slab {size['slab']}, staging "
            f"{size['staging']}, residency state {size['state']}), more than the daemon's "
            f"max_slab_bytes of {size_text(max_rank_bytes)}; lower max_reqs, region_stride or num_layers "
            "(or index groups), or raise max_slab_bytes",
        )
    return parts


def find_duplicates(topk: np.ndarray, state_rows: np.ndarray, host_rows: int) -> int:
    """Return the first batch row whose in-range ids repeat, or -1."""
    if topk.size == 0:
        return -1
    # Sort the raw ids (int32: NumPy's vectorised sort is fastest on it) and look for equal
    # neighbours that are in range: out-of-range ids may repeat.
    s = np.sort(topk.astype(np.int32, copy=False), axis=1)
    nxt = s[:, 1:]
    dup = (nxt == s[:, :-1]) & (nxt >= 0) & (nxt < host_rows)
    dup_rows = np.flatnonzero(dup.any(axis=1) & (state_rows >= 0))
    return int(dup_rows[0]) if dup_rows.size else -1


def as_ids(name: str, a: np.ndarray, ndim: int) -> np.ndarray:
    """Integer array of ``ndim`` dims as int32, or a BAD_ARGUMENT error naming it."""
    try:
        return int32_array(name, a, ndim)  # as the client takes it
    except ValueError as e:
        raise ResidencyError("BAD_ARGUMENT", str(e)) from None


def whole_arg(name: str, v, carried: bool = False) -> int:
    """An exact integer argument (``proto.args.whole_number``; with ``carried``, one a
    request can carry: ``carried_number``), or BAD_ARGUMENT."""
    try:
        return (carried_number if carried else whole_number)(name, v)
    except ValueError as e:
        raise ResidencyError("BAD_ARGUMENT", str(e)) from None
