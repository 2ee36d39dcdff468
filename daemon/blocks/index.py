"""``KeyIndex``: 16-byte keys (two int64 words) -> block, an open-addressing hash table in
NumPy arrays, so that finding a whole chain of keys is a few vectorised probes instead of
one dictionary look-up (and one bytes object) a key.

Linear probing from a slot that mixes both words with a per-index random salt (a client
that picks its keys cannot aim them at one run of slots without knowing it); the table
is kept at most a quarter full of live keys (a find is one vectorised pass per slot of
the longest run it meets: at half full it took 7 passes for a 2,048-key chain, 1.3x the
time); a deleted key leaves a tombstone unless it ends its run (then it, and the tombstones it
leaves at the end, are emptied), and the table is rebuilt once tombstones pass a quarter of
it.
"""

from __future__ import annotations

import numpy as np

EMPTY, TOMB = -1, -2
CLAIM = -3  # insert_many: key i claims a free slot by writing CLAIM - i there for a moment
_M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F)
_U64 = (1 << 64) - 1
# Up to this many keys a find probes key by key in Python integers (each NumPy operation
# costs about a microsecond whatever its size: the vectorised passes took ~20 us for 4 keys).
FEW = 16
_M1_INT, _M2_INT = int(_M1), int(_M2)


class KeyIndex:
    """Keys of at most ``max_keys`` blocks at once."""

    def __init__(self, max_keys: int, seed: int | None = None):
        self.size = self.slots(max_keys)
        self.mask = np.uint64(self.size - 1)
        self.salt = np.random.default_rng(seed).integers(0, 2**63, dtype=np.uint64)
        self._salt = int(self.salt)
        self.lo = np.zeros(self.size, dtype=np.int64)
        self.hi = np.zeros(self.size, dtype=np.int64)
        self.block = np.full(self.size, EMPTY, dtype=np.int64)
        self.tombs = 0

    @staticmethod
    def slots(max_keys: int) -> int:
        """The table's slots for ``max_keys`` keys: the power of two >= 4 x max_keys (4 to 8 a key)."""
        return 1 << max(4, (4 * max(1, max_keys) - 1).bit_length())

    @classmethod
    def table_bytes(cls, max_keys: int) -> int:
        """Bytes of the table for ``max_keys`` keys (three int64 arrays)."""
        return 24 * cls.slots(max_keys)

    def _start(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            h = (lo.view(np.uint64) ^ self.salt) * _M1 ^ hi.view(np.uint64) * _M2
        return ((h ^ (h >> np.uint64(29))) & self.mask).astype(np.int64)

    def _start_one(self, lo: int, hi: int) -> int:
        """``_start`` of one key, in Python integers (the same slot)."""
        h = ((((lo & _U64) ^ self._salt) * _M1_INT) & _U64) ^ (((hi & _U64) * _M2_INT) & _U64)
        return (h ^ (h >> 29)) & (self.size - 1)

    def _find_few(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """``find`` key by key (few keys)."""
        return np.array([self._probe_one(a, b, self._start_one(a, b))[1] for a, b in zip(lo.tolist(), hi.tolist())],
                        dtype=np.int64)

    def _probe(self, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The slot holding each key and its block (int64 [n] each), -1 where it is absent.
        The first pass covers every key with whole-array operations (most keys end there:
        at a quarter full a run is short); later ones only the keys still going on."""
        pos = self._start(lo, hi)
        b = self.block[pos]
        hit = (b >= 0) & (self.lo[pos] == lo) & (self.hi[pos] == hi)
        slots, blocks = np.where(hit, pos, -1), np.where(hit, b, -1)
        todo = np.flatnonzero(~hit & (b != EMPTY))  # another key or a tombstone: the run goes on
        pos = (pos[todo] + 1) & (self.size - 1)
        while todo.size > FEW:
            b = self.block[pos]
            hit = (b >= 0) & (self.lo[pos] == lo[todo]) & (self.hi[pos] == hi[todo])
            slots[todo[hit]], blocks[todo[hit]] = pos[hit], b[hit]
            go_on = ~hit & (b != EMPTY)
            todo, pos = todo[go_on], (pos[go_on] + 1) & (self.size - 1)
        for i, p in zip(todo.tolist(), pos.tolist()):  # the last few, key by key
            slots[i], blocks[i] = self._probe_one(int(lo[i]), int(hi[i]), p)
        return slots, blocks

    def _probe_one(self, lo: int, hi: int, pos: int) -> tuple[int, int]:
        """The slot holding key (lo, hi) and its block, probing from slot ``pos`` on; (-1, -1)
        where it is absent."""
        block, klo, khi, mask = self.block, self.lo, self.hi, self.size - 1
        while True:
            x = int(block[pos])
            if x == EMPTY:
                return -1, -1
            if x >= 0 and int(klo[pos]) == lo and int(khi[pos]) == hi:
                return pos, x
            pos = (pos + 1) & mask

    def find(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The block of each key (int64 [n]), -1 where none."""
        return self._find_few(lo, hi) if lo.size <= FEW else self._probe(lo, hi)[1]

    def insert(self, lo: int, hi: int, block: int) -> None:
        """Add a key that is not in the index."""
        pos = self._start_one(lo, hi)
        while self.block[pos] >= 0:
            pos = (pos + 1) & (self.size - 1)
        self.tombs -= self.block[pos] == TOMB
        self.lo[pos], self.hi[pos], self.block[pos] = lo, hi, block

    def insert_many(self, lo: np.ndarray, hi: np.ndarray, block: np.ndarray) -> None:
        """Add distinct keys that are not in the index (int64 [n] each), in whole-array
        rounds: each key still going on claims its slot when that slot holds no live key,
        one of the keys claiming one slot in a round takes it, the others move on one slot.
        Every slot a key passes holds a live key, as :meth:`insert` leaves them."""
        if lo.size <= FEW:
            for a, b, x in zip(lo.tolist(), hi.tolist(), block.tolist()):
                self.insert(a, b, x)
            return
        pos = self._start(lo, hi)
        todo = np.arange(lo.size)
        while todo.size:
            p = pos[todo]
            free = self.block[p] < 0
            cand, slot = todo[free], p[free]
            was = self.block[slot]
            self.block[slot] = CLAIM - cand  # each claimant marks its slot; one mark stays
            won = self.block[slot] == CLAIM - cand
            win, at = cand[won], slot[won]
            self.tombs -= int((was[won] == TOMB).sum())
            self.lo[at], self.hi[at], self.block[at] = lo[win], hi[win], block[win]
            todo = np.concatenate([todo[~free], cand[~won]])
            pos[todo] = (pos[todo] + 1) & (self.size - 1)

    def delete(self, lo: np.ndarray, hi: np.ndarray) -> None:
        """Remove distinct keys that are in the index."""
        s = self._probe(lo, hi)[0]
        s = s[s >= 0]
        self.block[s] = TOMB
        self.tombs += int(s.size)
        self._clear_run_ends(s)
        if self.tombs > self.size // 4:
            self._rebuild()

    def _clear_run_ends(self, slots: np.ndarray) -> None:
        """Empty the tombstones among ``slots`` that end their run (the next slot empty: a
        probe that reaches one stops at the next slot anyway), then those each leaves at the
        end in turn: most deletions leave no tombstone, and the rebuild (0.14 s on the loop
        for 2,097,152 keys) comes seldom."""
        mask = self.size - 1
        while slots.size:
            slots = slots[(self.block[slots] == TOMB) & (self.block[(slots + 1) & mask] == EMPTY)]
            if slots.size > 1:  # (two runs' tombstones could meet in one slot: counted once)
                slots = np.sort(slots)
                slots = slots[np.r_[True, slots[1:] != slots[:-1]]]
            self.block[slots] = EMPTY
            self.tombs -= int(slots.size)
            slots = (slots - 1) & mask

    def _rebuild(self) -> None:
        """The live keys laid out again without tombstones, in one pass: taken in the order
        of their start slots, each goes to its start or to the slot after the key before
        it, whichever is later (the layout linear probing makes: every slot from a key's
        start to its own holds a key); the few pushed past the table's end wrap round
        through :meth:`insert_many`. 0.14 s on the loop for 2,097,152 keys on the dev VM
        (0.20-0.26 s inserted again in rounds)."""
        live = np.flatnonzero(self.block >= 0)
        lo, hi, block = self.lo[live], self.hi[live], self.block[live]
        self.block[:] = EMPTY
        self.tombs = 0
        start = self._start(lo, hi)
        order = np.argsort(start, kind="stable")  # (in table order the starts are nearly sorted)
        s = start[order]
        n = np.arange(s.size)
        pos = np.maximum.accumulate(s - n) + n
        inside = pos < self.size
        at, keys = pos[inside], order[inside]
        self.lo[at], self.hi[at], self.block[at] = lo[keys], hi[keys], block[keys]
        wrap = order[~inside]
        if wrap.size:
            self.insert_many(lo[wrap], hi[wrap], block[wrap])
