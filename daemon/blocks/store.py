"""The daemon's block store of one namespace: the contract of ``contract.py`` (DESIGN §10)
kept in arrays and C-speed containers, so a lookup of a 2,048-block chain costs tens of
microseconds. The event loop's thread only.

The store knows blocks, not bytes: ``zero(blocks)``, given by its engine, writes zeros
over a block's rows in every layer and drops their hot copies; it runs whenever a block
becomes free or is evicted, so a block handed out again holds zeros.
"""

from __future__ import annotations

import collections
import heapq
from typing import Callable

import numpy as np

from .contract import BlockError, PoolExhausted, UidLedger

FREE, CACHED = -1, -2  # ``state`` of a block that is not private (else: the owning session)
HASH_BYTES = 16


def hash_keys(hashes) -> list[bytes]:
    """Chain hashes as the wire carries them (int64 [n, 2]) -> 16-byte keys; BAD_ARGUMENT
    for another shape or dtype."""
    a = np.asarray(hashes)
    if a.ndim != 2 or a.shape[1] != 2 or a.dtype != np.int64:
        raise BlockError("BAD_ARGUMENT", f"hashes must be int64 [n, 2] (16 bytes each), got {a.dtype} {list(a.shape)}")
    return np.ascontiguousarray(a).view(np.dtype((np.void, HASH_BYTES))).ravel().tolist()


class BlockStore:
    """``n_blocks`` blocks of one namespace (see the module and ``contract.py``).

    Args:
        n_blocks: blocks in the store.
        zero: called with a list of blocks to zero (their rows in every layer, and hot copies dropped).
        ledger: private + reserved blocks per uid, shared by every store of the daemon.
    """

    def __init__(self, n_blocks: int, zero: Callable[[list[int]], None], ledger: UidLedger | None = None):
        self.n_blocks = n_blocks
        self._zero = zero
        self.ledger = ledger if ledger is not None else UidLedger()
        self.state = np.full(n_blocks, FREE, dtype=np.int64)
        self.pins = np.zeros(n_blocks, dtype=np.int64)  # of a cached block, by every session
        self._free = list(range(n_blocks))  # a heap: the lowest free block first
        self.block_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # unpinned cached blocks
        self.reserved: dict[int, int] = {}
        self.reserved_total = 0
        self._uid: dict[int, int] = {}
        self._private: dict[int, set[int]] = {}  # session -> its private blocks
        self._pinned: dict[int, collections.Counter] = {}  # session -> {cached block: pins}
        self.counts = collections.Counter()  # lookups, hit_blocks, commits, evictions

    # -- what the store has ------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def evictable_blocks(self) -> int:
        return len(self.lru)

    @property
    def cached_blocks(self) -> int:
        return len(self.hash_of)

    @property
    def referenced_blocks(self) -> int:
        return len(self.hash_of) - len(self.lru)

    def gauges(self) -> dict:
        return {"blocks": self.n_blocks, "free": self.free_blocks, "cached": self.cached_blocks,
                "referenced": self.referenced_blocks, "private": self.n_blocks - self.free_blocks - self.cached_blocks,
                "reserved": self.reserved_total}

    def _exhausted(self, wanted: int) -> PoolExhausted:
        return PoolExhausted(wanted, self.free_blocks, self.evictable_blocks, self.reserved_total)

    def open(self, session: int, uid: int) -> None:
        """``session`` (of ``uid``) may use the store from now on."""
        self._uid[session] = uid
        self._private.setdefault(session, set())
        self._pinned.setdefault(session, collections.Counter())

    def _uid_of(self, session: int) -> int:
        try:
            return self._uid[session]
        except KeyError:
            raise BlockError("NOT_ATTACHED", f"session {session} has not opened this block store") from None

    # -- requests ----------------------------------------------------------------------
    def reserve(self, session: int, n: int) -> int:
        """Promise ``n`` more blocks to ``session`` (``n < 0``: give back up to ``-n``);
        returns its reservation now. PoolExhausted / QUOTA_EXCEEDED change nothing."""
        uid = self._uid_of(session)
        have = self.reserved.get(session, 0)
        if n < 0:
            n = -min(-n, have)
        else:
            if self.free_blocks + self.evictable_blocks - self.reserved_total < n:
                raise self._exhausted(n)
            self.ledger.check(uid, n)
        self.ledger.add(uid, n)
        self.reserved[session] = have + n
        self.reserved_total += n
        return have + n

    def alloc(self, session: int, n: int) -> np.ndarray:
        """``n`` zeroed blocks private to ``session`` (int32 [n]): free ones (lowest
        first), then the least recently unpinned cached ones, evicted; its reservation is
        used first."""
        uid = self._uid_of(session)
        if n < 0:
            raise BlockError("BAD_ARGUMENT", f"cannot allocate {n} blocks")
        mine = min(n, self.reserved.get(session, 0))
        if self.free_blocks + self.evictable_blocks - (self.reserved_total - mine) < n:
            raise self._exhausted(n)
        self.ledger.check(uid, n - mine)
        self.ledger.add(uid, n - mine)
        self.reserved[session] = self.reserved.get(session, 0) - mine
        self.reserved_total -= mine
        take = min(n, self.free_blocks)
        out = [heapq.heappop(self._free) for _ in range(take)]
        evicted = []
        for _ in range(n - take):
            b, _ = self.lru.popitem(last=False)
            del self.block_of[self.hash_of.pop(b)]
            evicted.append(b)
        if evicted:
            self.counts["evictions"] += len(evicted)
            self._zero(evicted)
        out += evicted
        arr = np.asarray(out, dtype=np.int32)
        self.state[arr] = session
        self._private[session].update(out)
        return arr

    def commit(self, session: int, blocks, hashes) -> np.ndarray:
        """Cache private ``blocks`` (int [n]) under ``hashes`` (int64 [n, 2]), each pinned
        once for ``session``; returns the block holding each hash (int32 [n]): the block
        itself, or the one cached under that hash before (the given one stays private)."""
        uid = self._uid_of(session)
        blocks = self._block_ids(blocks)
        keys = hash_keys(hashes)
        if len(keys) != blocks.size or np.unique(blocks).size != blocks.size:
            raise BlockError("BAD_ARGUMENT", f"commit needs distinct blocks and one hash each, got {blocks.size} "
                             f"blocks and {len(keys)} hashes")
        if blocks.size and (self.state[blocks] != session).any():
            bad = int(blocks[self.state[blocks] != session][0])
            raise BlockError("BAD_ARGUMENT", f"block {bad} is not private to this session (allocate it, write it, "
                             "then commit it; a cached block is read-only)")
        out = np.empty(blocks.size, dtype=np.int32)
        mine, pinned = self._private[session], self._pinned[session]
        for i, (b, h) in enumerate(zip(blocks.tolist(), keys)):
            held = self.block_of.setdefault(h, b)
            out[i] = held
            if held == b:
                self.hash_of[b] = h
                mine.discard(b)
                pinned[b] += 1
        done = out == blocks
        self.state[blocks[done]] = CACHED
        self.pins[blocks[done]] = 1
        self.ledger.add(uid, -int(done.sum()))
        self.counts["commits"] += int(done.sum())
        return out

    def lookup(self, session: int, hashes) -> np.ndarray:
        """Pin and return (int32 [m]) the blocks of the longest cached prefix of the chain
        ``hashes`` (int64 [n, 2]); it stops before an evictable block that the
        reservations need."""
        self._uid_of(session)
        keys = hash_keys(hashes)
        found = list(map(self.block_of.get, keys))
        try:
            found = found[: found.index(None)]
        except ValueError:
            pass
        arr = np.asarray(found, dtype=np.int32)
        unpinned = self.pins[arr] == 0
        if arr.size and np.unique(arr).size != arr.size:  # a block named twice costs one evictable block
            first = np.zeros(arr.size, dtype=bool)
            first[np.unique(arr, return_index=True)[1]] = True
            unpinned &= first
        slack = self.free_blocks + self.evictable_blocks - self.reserved_total
        over = np.flatnonzero(np.cumsum(unpinned) > slack)
        if over.size:
            arr, unpinned = arr[: over[0]], unpinned[: over[0]]
        for b in arr[unpinned].tolist():
            del self.lru[b]
        np.add.at(self.pins, arr, 1)
        self._pinned[session].update(arr.tolist())
        self.counts["lookups"] += 1
        self.counts["hit_blocks"] += arr.size
        return arr

    def release(self, session: int, blocks) -> None:
        """Unpin cached ``blocks`` (int [n]; named twice: unpinned twice) and free private
        ones (zeroed); all or nothing."""
        uid = self._uid_of(session)
        blocks = self._block_ids(blocks)
        want = collections.Counter(blocks.tolist())
        mine, pinned = self._private[session], self._pinned[session]
        for b, k in want.items():
            if k > (1 if b in mine else pinned.get(b, 0)):
                raise BlockError("BAD_ARGUMENT", f"block {b} is not held by this session {k} time(s)")
        freed = [b for b in want if b in mine]
        for b in freed:
            mine.discard(b)
            want.pop(b)
        if want:
            pinned.subtract(want)
            ub = np.fromiter(want.keys(), dtype=np.int64, count=len(want))
            self.pins[ub] -= np.fromiter(want.values(), dtype=np.int64, count=len(want))
            for b in ub[self.pins[ub] == 0].tolist():
                self.lru[b] = None
            for b in want:
                if not pinned[b]:
                    del pinned[b]
        if freed:
            self.ledger.add(uid, -len(freed))
            self._zero(freed)
            self.state[freed] = FREE
            for b in freed:
                heapq.heappush(self._free, b)

    def close(self, session: int) -> None:
        """``session`` is gone: its pins released, its private blocks freed, its
        reservation dropped."""
        if session not in self._uid:
            return
        held = list(self._private[session]) + list(self._pinned[session].elements())
        self.release(session, np.asarray(sorted(held), dtype=np.int64))
        self.reserve(session, -self.reserved.get(session, 0))
        self.reserved.pop(session, None)
        del self._uid[session], self._private[session], self._pinned[session]

    def writable(self, session: int, rows: np.ndarray, block_size: int) -> None:
        """BAD_ARGUMENT unless every host row of ``rows`` lies in a block private to
        ``session`` (a cached block is never rewritten; a free one is nobody's)."""
        if not rows.size:
            return
        blocks = rows // block_size
        bad = (blocks >= self.n_blocks) | (self.state[np.minimum(blocks, self.n_blocks - 1)] != session)
        if bad.any():
            r = int(rows[bad][0])
            raise BlockError("BAD_ARGUMENT", f"host row {r} (block {r // block_size}) is not in a block this "
                             "client allocated: an engine with a block store writes only its own blocks "
                             "(cached blocks are read-only)")

    def _block_ids(self, blocks) -> np.ndarray:
        a = np.asarray(blocks)
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise BlockError("BAD_ARGUMENT", f"blocks must be integers [n], got {a.dtype} {list(a.shape)}")
        if a.size and (a.min() < 0 or a.max() >= self.n_blocks):
            raise BlockError("BAD_ARGUMENT", f"blocks must lie in [0, {self.n_blocks})")
        return a.astype(np.int64)
