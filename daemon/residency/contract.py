"""Reference model of the residency contract (DESIGN.md §4), written for clarity, not speed.

Every backend (``cpu.py``, the CUDA kernels of ``csrc/``) is checked against it. One hot
region is two plain lists: ``owner[slot]`` (the host row the slot holds, or -1) and
``lru`` (a permutation of the slots, oldest first); each clause is one visible step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class DuplicateIdError(ValueError):
    """A top-k row named the same in-range host row twice."""


@dataclass
class RegionModel:
    """One hot region: the state of one (index group, request state row)."""

    region_stride: int
    owner: list[int] = field(default_factory=list)
    lru: list[int] = field(default_factory=list)
    fresh: set[int] = field(default_factory=set)
    prefetched: int = 0  # rows a prefetch took a slot for
    prefetch_hits: int = 0  # resolve hits on a fresh slot (each counted once)
    prefetch_wasted: int = 0  # fresh slots emptied or refilled before any hit

    def __post_init__(self) -> None:
        if not self.owner:
            self.reset()

    def reset(self) -> None:
        """Every slot empty, ``lru = 0..region_stride-1``."""
        self.owner = [-1] * self.region_stride
        self.lru = list(range(self.region_stride))
        self._waste(set(self.fresh))

    def invalidate(self, rows) -> None:
        """Any slot owning one of ``rows`` becomes empty; the LRU order is unchanged."""
        gone = {int(r) for r in rows}
        for slot, held in enumerate(self.owner):
            if held >= 0 and held in gone:
                self.owner[slot] = -1
                self._waste({slot})

    def _waste(self, slots: set[int]) -> None:
        """``slots`` lose their rows: those still fresh were prefetched for nothing."""
        self.prefetch_wasted += len(self.fresh & slots)
        self.fresh -= slots

    def resolve(self, topk, host_rows: int) -> tuple[list[int], list[tuple[int, int]], int]:
        """Resolve one top-k row of host row ids.

        Returns ``(slots, plan, out_of_range)``: the slot of each column (-1 if none), the
        (host row, slot) pairs to copy in miss order, and how many columns named an id
        outside ``[-1, host_rows)`` (ignored, counted for stats).
        """
        topk = [int(g) for g in topk]
        in_range = [g for g in topk if 0 <= g < host_rows]
        if len(set(in_range)) != len(in_range):
            raise DuplicateIdError("duplicate host row id in one top-k row")
        out_of_range = sum(1 for g in topk if g < -1 or g >= host_rows)

        slot_of = {held: slot for slot, held in enumerate(self.owner) if held >= 0}
        slots = [-1] * len(topk)
        hit_slots: set[int] = set()
        miss_cols: list[int] = []
        for col, g in enumerate(topk):
            if not 0 <= g < host_rows:
                continue
            if g in slot_of:
                slots[col] = slot_of[g]
                hit_slots.add(slot_of[g])
            else:
                miss_cols.append(col)

        evictable = [s for s in self.lru if s not in hit_slots]
        hits_in_order = [s for s in self.lru if s in hit_slots]
        n_miss = len(miss_cols)
        assert n_miss <= len(evictable), "region_stride >= top_k guarantees room"
        self.prefetch_hits += len(self.fresh & hit_slots)
        self.fresh -= hit_slots
        self._waste(set(evictable[:n_miss]))
        plan = []
        for m, col in enumerate(miss_cols):
            slot = evictable[m]
            self.owner[slot] = topk[col]
            slots[col] = slot
            plan.append((topk[col], slot))
        self.lru = evictable[n_miss:] + evictable[:n_miss] + hits_in_order
        return slots, plan, out_of_range

    def prefetch(self, ids, host_rows: int, top_k: int) -> list[tuple[int, int]]:
        """Fetch ahead the rows of one top-k row ``ids`` (another group's, unique ids) that
        this region does not hold, into slots outside the last ``top_k`` of ``lru`` (the
        latest resolve's), oldest first, as many as there are; held rows are left alone.
        The taken slots go just below the kept ones in ``lru`` (a later prefetch keeps the
        same slots). Returns the (host row, slot) pairs to copy."""
        ids = [int(g) for g in ids if 0 <= int(g) < host_rows]
        protected = set(self.lru[len(self.lru) - min(top_k, self.region_stride):])
        held = {h for h in self.owner if h >= 0}
        resident = {slot for slot, h in enumerate(self.owner) if h in set(ids)}
        candidates = [s for s in self.lru if s not in protected and s not in resident]
        want = [g for g in ids if g not in held]
        plan = list(zip(want, candidates))
        taken = [slot for _, slot in plan]
        self._waste(set(taken))
        for g, slot in plan:
            self.owner[slot] = g
        self.fresh |= set(taken)
        self.prefetched += len(taken)
        rest = [s for s in self.lru if s not in protected and s not in set(taken)]
        self.lru = rest + taken + [s for s in self.lru if s in protected]
        return plan
