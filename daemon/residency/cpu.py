"""NumPy backend: the residency contract and the byte mover on host arrays, shaped as on
the GPU: ``owner`` and ``lru`` int32 ``[groups, max_reqs, region_stride]``; the hot slab
``[num_layers, max_reqs, region_stride, row_bytes]`` bytes in shared memory clients map.
"""

from __future__ import annotations

import numpy as np

from sparsekv.proto.layout import Layout

from .base import Mover, Plan, Residency, ResidencyError, Resolved, check_batch


def row_view(a: np.ndarray, row_bytes: int) -> np.ndarray:
    """View a byte array as one opaque element per row, so fancy indexing moves whole rows."""
    return a.reshape(-1, row_bytes).view(np.dtype((np.void, row_bytes))).reshape(-1)


def slab_views(layout: Layout, geometry, buffer: np.ndarray) -> list[np.ndarray]:
    """Each layer's hot rows in ``buffer`` (uint8, 1-D) laid out by ``geometry`` (a
    checked :class:`~sparsekv.proto.slab.SlabGeometry`), one opaque element per row: 1-D
    ``[hot rows]`` when the rows follow each other, else ``[blocks, block_rows]``."""
    rb, br, stride = layout.row_bytes, geometry.block_rows, int(geometry.block_stride)
    nb = geometry.blocks(layout)
    linear = geometry.is_linear(layout)
    out = []
    for off in geometry.layer_offsets:
        off = int(off)
        end = off + (nb * br * rb if linear else (nb - 1) * stride + br * rb)
        if off < 0 or stride < 0 or end > buffer.size:  # check() refuses these; a view must never leave the buffer
            raise ValueError(f"slab geometry reaches bytes [{off}, {end}) outside the buffer's {buffer.size}")
        if linear:
            out.append(row_view(buffer[off: off + nb * br * rb], rb))
            continue
        base = buffer[off: off + (nb - 1) * stride + br * rb]
        blocks = np.lib.stride_tricks.as_strided(base, shape=(nb, br, rb), strides=(stride, rb, 1))
        out.append(blocks.view(np.dtype((np.void, rb)))[..., 0])
    return out


PAIRS_AT_ONCE = 1 << 20  # CpuResidency.invalidate_pairs: region slots of one vectorised pass at most


class CpuResidency(Residency):
    def __init__(self, layout: Layout):
        self.layout = layout.validate()
        shape = (layout.num_groups, layout.max_reqs, layout.region_stride)
        self.owner = np.full(shape, -1, dtype=np.int32)
        self.lru = np.empty(shape, dtype=np.int32)
        self.lru[...] = np.arange(layout.region_stride, dtype=np.int32)
        self.fresh = np.zeros(shape, dtype=bool)  # filled by a prefetch, not hit since
        self.prefetched = self.prefetch_hits = self.prefetch_wasted = 0

    def reset(self, state_rows: np.ndarray) -> None:
        rows = np.asarray(state_rows, dtype=np.int64)
        rows = rows[rows >= 0]
        if rows.size and rows.max() >= self.layout.max_reqs:
            raise ResidencyError("BAD_STATE_ROW", f"state row {int(rows.max())} >= max_reqs")
        self.owner[:, rows] = -1
        self.lru[:, rows] = np.arange(self.layout.region_stride, dtype=np.int32)
        self._waste(np.s_[:, np.unique(rows)])

    def invalidate(self, state_row: int, rows: np.ndarray) -> None:
        if not 0 <= state_row < self.layout.max_reqs:
            raise ResidencyError("BAD_STATE_ROW", f"state row {state_row} out of range")
        rows = np.asarray(rows, dtype=np.int32)
        rows = rows[rows >= 0]
        if rows.size:
            region = self.owner[:, state_row]
            gone = np.isin(region, rows)
            region[gone] = -1
            fresh = self.fresh[:, state_row]
            self.prefetch_wasted += int(fresh[gone].sum())
            fresh[gone] = False

    def invalidate_pairs(self, state_rows: np.ndarray, rows: np.ndarray) -> None:
        """Up to ``PAIRS_AT_ONCE`` slots of named regions, one vectorised pass (a state row
        a key's high part); more, a region at a time (one sort of them all would cost more)."""
        states, which = np.unique(np.asarray(state_rows, dtype=np.int64), return_inverse=True)
        if states.size and (states[0] < 0 or states[-1] >= self.layout.max_reqs):
            raise ResidencyError("BAD_STATE_ROW", f"state row {int(states[0] if states[0] < 0 else states[-1])} "
                                 "out of range")
        if not states.size:
            return
        if states.size * self.layout.num_groups * self.layout.region_stride > PAIRS_AT_ONCE:
            super().invalidate_pairs(np.asarray(state_rows), np.asarray(rows))
            return
        rows = np.asarray(rows, dtype=np.int64)
        base = max(self.layout.host_rows, int(rows.max()) + 1)
        region = self.owner[:, states]  # [groups, named state rows, stride]: a copy
        at = np.arange(states.size, dtype=np.int64)[None, :, None]
        g, i, slot = np.nonzero((region >= 0) & np.isin(at * base + region, which * base + rows))
        where = (g, states[i], slot)
        self.owner[where] = -1
        self._waste(where)

    def invalidate_everywhere(self, rows: np.ndarray) -> int:
        """Every slot scanned, ``PAIRS_AT_ONCE`` at a time: the temporaries stay a few MB
        whatever the state's size (one pass over 128M slots took 384 MiB)."""
        rows = np.unique(np.asarray(rows, dtype=np.int32))
        rows = rows[rows >= 0]
        if not rows.size:
            return 0
        owner, fresh = self.owner.reshape(-1), self.fresh.reshape(-1)  # views: the state is contiguous
        n = 0
        for start in range(0, owner.size, PAIRS_AT_ONCE):
            part = owner[start:start + PAIRS_AT_ONCE]
            stale = np.flatnonzero(np.isin(part, rows))
            if stale.size:
                n += stale.size
                part[stale] = -1
                gone = fresh[start:start + PAIRS_AT_ONCE]
                self.prefetch_wasted += int(gone[stale].sum())
                gone[stale] = False
        return n

    def _waste(self, where) -> None:
        """The slots at ``where`` (an index of ``fresh``) lost their rows."""
        self.prefetch_wasted += int(self.fresh[where].sum())
        self.fresh[where] = False

    def resolve(self, group: int, state_rows: np.ndarray, topk: np.ndarray) -> Resolved:
        lay = self.layout
        state_rows, topk = check_batch(lay, group, state_rows, topk)
        batch, k = topk.shape
        slots = np.full((batch, k), -1, dtype=np.int32)
        misses = np.zeros(batch, dtype=np.int32)
        plan_rows, plan_slots = [], []
        hits = 0
        live = state_rows >= 0
        out_of_range = int(((topk < -1) | (topk >= lay.host_rows))[live].sum())
        stride = lay.region_stride
        for b in np.flatnonzero(live):
            s = int(state_rows[b])
            owner, lru = self.owner[group, s], self.lru[group, s]
            ids = topk[b]
            valid = (ids >= 0) & (ids < lay.host_rows)
            # Hit lookup: sort the owners once, binary-search each id.
            order = np.argsort(owner, kind="stable")
            sorted_owner = owner[order]
            pos = np.minimum(np.searchsorted(sorted_owner, ids), stride - 1)
            hit = valid & (sorted_owner[pos] == ids)
            hit_slot = order[pos]
            is_hit_slot = np.zeros(stride, dtype=bool)
            is_hit_slot[hit_slot[hit]] = True
            in_hit = is_hit_slot[lru]
            evictable = lru[~in_hit]
            miss = valid & ~hit
            n_miss = int(miss.sum())
            miss_slots = evictable[:n_miss]
            fresh = self.fresh[group, s]
            self.prefetch_hits += int(fresh[hit_slot[hit]].sum())
            fresh[hit_slot[hit]] = False
            self._waste((group, s, miss_slots))
            owner[miss_slots] = ids[miss]
            lru[:] = np.concatenate((evictable[n_miss:], miss_slots, lru[in_hit]))
            row_slots = np.full(k, -1, dtype=np.int32)
            row_slots[hit] = hit_slot[hit]
            row_slots[miss] = miss_slots
            slots[b] = row_slots
            misses[b] = n_miss
            hits += int(hit.sum())
            if n_miss:
                plan_rows.append(ids[miss])
                plan_slots.append(miss_slots + s * stride)
        plan = _plan(plan_rows, plan_slots)
        return Resolved(slots=slots, misses=misses, hits=hits, out_of_range=out_of_range, plan=plan)

    def prefetch(self, group: int, state_rows: np.ndarray, topk: np.ndarray) -> Plan:
        lay = self.layout
        state_rows, topk = check_batch(lay, group, state_rows, topk)
        stride = lay.region_stride
        kept = stride - min(lay.top_k, stride)  # lru positions from here on: the latest resolve's
        plan_rows, plan_slots = [], []
        for b in np.flatnonzero(state_rows >= 0):
            s = int(state_rows[b])
            owner, lru, fresh = self.owner[group, s], self.lru[group, s], self.fresh[group, s]
            ids = topk[b]
            ids = ids[(ids >= 0) & (ids < lay.host_rows)]
            want = ids[~np.isin(ids, owner)]
            candidate = ~np.isin(owner, ids)[lru]  # by lru position; a slot holding one of ids stays
            candidate[kept:] = False
            picked = np.flatnonzero(candidate)[:want.size]  # lru positions taken, oldest first
            if not picked.size:
                continue
            taken = lru[picked]
            self._waste((group, s, taken))
            owner[taken] = want[:taken.size]
            fresh[taken] = True
            rest = np.ones(stride, dtype=bool)
            rest[picked] = False
            rest[kept:] = False
            lru[:] = np.concatenate((lru[rest], taken, lru[kept:]))
            plan_rows.append(want[:taken.size])
            plan_slots.append(taken + s * stride)
            self.prefetched += int(taken.size)
        if not plan_rows:
            return _plan(plan_rows, plan_slots)
        # A later token of a request may take a slot an earlier one just took: only the
        # last row taken into a slot is copied (the plan is sorted by host row, so a copy
        # of the row it replaced could land after it).
        slots = np.concatenate(plan_slots)
        _, last = np.unique(slots[::-1], return_index=True)
        keep = slots.size - 1 - last
        return _plan([np.concatenate(plan_rows)[keep]], [slots[keep]])


def _plan(rows: list, slots: list) -> Plan:
    """One plan from per-row parts, sorted by host row (the gather reads the pool in order)."""
    if not rows:
        return Plan(rows=np.empty(0, np.int32), slots=np.empty(0, np.int32))
    rows = np.concatenate(rows)
    flat = np.concatenate(slots).astype(np.int32)
    by_row = np.argsort(rows, kind="stable")
    return Plan(rows=rows[by_row], slots=flat[by_row])


class CpuMover(Mover):
    """Moves rows between the pool ``[L, host_rows, row_bytes]`` and one rank's slab."""

    def __init__(self, layout: Layout, pool: np.ndarray, slab: np.ndarray, staging: np.ndarray | None,
                 geometry=None):
        """``slab``: the daemon's slab ``Layout.slab_shape``, or with ``geometry`` (an
        engine-owned slab, ``proto/slab.py``) the engine's whole buffer (uint8, 1-D)."""
        self.layout = layout
        rb = layout.row_bytes
        self._pool = [row_view(pool[layer], rb) for layer in range(layout.num_layers)]
        if geometry is None:
            self._slab = [row_view(slab[layer], rb) for layer in range(layout.num_layers)]
            self._block_rows = 0
        else:
            self._slab = slab_views(layout, geometry, slab)
            self._block_rows = 0 if geometry.is_linear(layout) else geometry.block_rows
        self._staging = (
            [row_view(staging[layer], rb) for layer in range(layout.num_layers)]
            if staging is not None and layout.staging_rows
            else None
        )

    def _at(self, slots: np.ndarray):
        """Index of flat hot slots in a layer's slab view: an engine's paged slab is
        (block, row in block)."""
        return (slots // self._block_rows, slots % self._block_rows) if self._block_rows else slots

    def gather(self, plan: Plan, layers: tuple[int, ...]) -> int:
        if not len(plan):
            return 0
        dst = self._at(plan.slots)
        for layer in layers:
            self._slab[layer][dst] = self._pool[layer][plan.rows]
        return len(plan) * len(layers) * self.layout.row_bytes

    def push(self, plan: Plan, layers: tuple[int, ...], dst: CpuMover) -> int:
        """The rows of ``plan`` this slab holds (``plan.slots``) -> the same slots of
        ``dst``'s slab, for each of ``layers`` (the NumPy reference of ``skv_push``: a
        stripe gathered here, then given to a peer rank); returns bytes moved."""
        if not len(plan):
            return 0
        src, to = self._at(plan.slots), dst._at(plan.slots)
        for layer in layers:
            dst._slab[layer][to] = self._slab[layer][src]
        return len(plan) * len(layers) * self.layout.row_bytes

    def stage(self, rows: np.ndarray, layers: tuple[int, ...]) -> int:
        if self._staging is None:
            raise ResidencyError("BAD_ARGUMENT", "layout has no staging buffer (staging_rows = 0)")
        n = int(rows.shape[0])
        if n > self.layout.staging_rows:
            raise ResidencyError(
                "TOO_LARGE", f"{n} rows do not fit the staging buffer of {self.layout.staging_rows}"
            )
        for layer in layers:
            self._staging[layer][:n] = self._pool[layer][rows]
        return n * len(layers) * self.layout.row_bytes
