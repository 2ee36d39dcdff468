"""The daemon's block store of one namespace: the contract of ``contract.py`` (DESIGN §9)
kept in arrays (keys in ``index.py``'s table), so that a lookup or a release is a few
array operations whatever its length (DESIGN §9 has the figures). The event loop's
thread only.

The store knows blocks, not bytes: ``zero(blocks)``, given by its engine, writes zeros
over a block's rows in every layer (and its indexer keys) and drops their hot copies; it
runs whenever a block becomes free or is evicted, so a block handed out again holds
zeros. Who may write or read a block's bytes it answers (``writable``, ``keys_writable``,
``keys_readable``); its engine moves them.

Each uid's count against ``max_blocks_per_uid`` (clause 7, the shared ``UidLedger``) moves
with a session's own pins of each block (``_pinned``): a lookup adds the blocks whose
count goes from 0 (less those its reservation pays for), counted over the whole prefix
at once, and a release gives back those whose count returns to 0; a commit changes it
not (private, then pinned by the committer).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable

import numpy as np

from sparsekv.proto import LIMITS

from .chains import ChainMemo, last_key
from .contract import BlockError, PoolExhausted, UidLedger
from .index import KeyIndex

FREE, CACHED = -1, -2  # ``state`` of a block that is not private (else: the owning session)
# The store's arrays of a block: state, pins, stamp, _mark, _arange, key_lo, key_hi (int64), _arange32
ARRAY_BYTES_PER_BLOCK = 7 * 8 + 4
STORE_FIXED_BYTES = 8 << 10  # its objects whatever its size (4.5 KiB measured for a store of one block)


@dataclass(slots=True)
class Found:
    """What ``BlockStore.find`` pinned: ``blocks`` (int32 [m], the whole prefix found);
    ``token``: the chain of exactly those blocks, remembered (the session may name it in its
    next lookups), or None; ``head``: how many of the first blocks are those of the chain the
    request named (all of them, or 0 when the prefix found is shorter)."""

    blocks: np.ndarray
    token: int | None
    head: int = 0


def _hash_array(hashes) -> np.ndarray:
    """Chain hashes as the wire carries them (int64 [n, 2]: 16 bytes each); BAD_ARGUMENT
    for another shape or dtype."""
    a = np.asarray(hashes)
    if a.ndim != 2 or a.shape[1] != 2 or a.dtype != np.int64:
        raise BlockError("BAD_ARGUMENT", f"hashes must be int64 [n, 2] (16 bytes each), got {a.dtype} {list(a.shape)}")
    return a


def key_words(hashes) -> tuple[np.ndarray, np.ndarray]:
    """Chain hashes (``_hash_array``) -> their two words (int64 [n] each)."""
    a = _hash_array(hashes)
    return np.ascontiguousarray(a[:, 0]), np.ascontiguousarray(a[:, 1])


class BlockStore:
    """``n_blocks`` blocks of one namespace (see the module and ``contract.py``).

    Per block: ``state`` (FREE, CACHED or the owning session), ``pins`` (of a cached
    block, by every session) and ``stamp`` (when it was last unpinned: the LRU order of
    evictable blocks is their stamps'); per session, its pins of each block. A lookup or a
    release is a few array operations whatever its length; only ``alloc`` (which evictable
    blocks are oldest) and ``close`` scan every block.

    Args:
        n_blocks: blocks in the store.
        zero: called with a list of blocks to zero (their rows in every layer, and hot copies dropped).
        ledger: private, reserved and pinned blocks per uid (clause 7), shared by every
            store of the daemon.
    """

    def __init__(self, n_blocks: int, zero: Callable[[list[int]], None], ledger: UidLedger | None = None):
        self.n_blocks = n_blocks
        self._zero = zero
        self.ledger = ledger if ledger is not None else UidLedger()
        self.state = np.full(n_blocks, FREE, dtype=np.int64)
        self.pins = np.zeros(n_blocks, dtype=np.int64)
        self.stamp = np.zeros(n_blocks, dtype=np.int64)
        self._mark = np.zeros(n_blocks, dtype=np.int64)  # scratch: finds blocks named twice in a lookup
        self._arange = np.arange(n_blocks, dtype=np.int64)
        self._arange32 = self._arange.astype(np.int32)
        self._clock = 0
        self.free_blocks = n_blocks
        self.evictable_blocks = 0  # cached, pinned by nobody
        self.index = KeyIndex(n_blocks)  # key -> cached block
        self.key_lo = np.zeros(n_blocks, dtype=np.int64)  # a cached block's key, its two words
        self.key_hi = np.zeros(n_blocks, dtype=np.int64)
        self.cached_blocks = 0
        self.reserved: dict[int, int] = {}
        self.reserved_total = 0
        self._uid: dict[int, int] = {}
        self._pinned: dict[int, np.ndarray] = {}  # session -> its pins of each block
        self.counts = collections.Counter()  # lookups, hit_blocks, commits, evictions
        self.chains = ChainMemo(n_blocks, self._still_cached)  # chains found lately (chains.py)

    @staticmethod
    def bookkeeping_bytes(n_blocks: int) -> int:
        """The most of the daemon's memory a store of ``n_blocks`` blocks takes, its
        sessions apart (``store_room.py``): its objects, its arrays, its key table, its
        chain memo full."""
        return (STORE_FIXED_BYTES + n_blocks * ARRAY_BYTES_PER_BLOCK + KeyIndex.table_bytes(n_blocks)
                + ChainMemo.max_bytes(n_blocks))

    # -- what the store has ------------------------------------------------------------
    @property
    def referenced_blocks(self) -> int:
        return self.cached_blocks - self.evictable_blocks

    @property
    def lru(self) -> list[int]:
        """The evictable blocks, least recently unpinned first."""
        return self._oldest(self.evictable_blocks)

    def _oldest(self, k: int) -> list[int]:
        """The ``k`` least recently unpinned evictable blocks, oldest first (a partition,
        then a sort of ``k``: an eviction does not sort every evictable block)."""
        cand = np.flatnonzero((self.state == CACHED) & (self.pins == 0))
        if k < cand.size:
            cand = cand[np.argpartition(self.stamp[cand], k)[:k]]
        return cand[np.argsort(self.stamp[cand])].tolist()

    def gauges(self) -> dict:
        """The store's counts of blocks: all, free, cached, referenced (cached and pinned),
        evictable (cached, unpinned), private, and reserved_total (promised to sessions)."""
        return {"blocks": self.n_blocks, "free": self.free_blocks, "cached": self.cached_blocks,
                "referenced": self.referenced_blocks, "evictable": self.evictable_blocks,
                "private": self.n_blocks - self.free_blocks - self.cached_blocks, "reserved_total": self.reserved_total}

    def _exhausted(self, wanted: int) -> PoolExhausted:
        return PoolExhausted(wanted, self.free_blocks, self.evictable_blocks, self.reserved_total)

    def open(self, session: int, uid: int) -> None:
        """``session`` (of ``uid``) may use the store from now on."""
        self._uid[session] = uid
        if session not in self._pinned:
            self._pinned[session] = np.zeros(self.n_blocks, dtype=np.int64)  # pins can pass 2**31
            self.chains.open(session)

    def is_open(self, session: int) -> bool:
        return session in self._uid

    def sessions_of(self, uid: int | None = None) -> int:
        """Sessions that opened the store (of ``uid`` only, when given)."""
        return len(self._uid) if uid is None else sum(1 for u in self._uid.values() if u == uid)

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
        out = np.flatnonzero(self.state == FREE)[:take] if take else np.empty(0, np.int64)
        if n > take:
            evicted = self._oldest(n - take)
            self.index.delete(self.key_lo[evicted], self.key_hi[evicted])
            self.chains.evicted()
            self.cached_blocks -= len(evicted)
            self.evictable_blocks -= len(evicted)
            self.counts["evictions"] += len(evicted)
            self._zero(evicted)
            out = np.concatenate([out, np.asarray(evicted, dtype=np.int64)])
        self.state[out] = session
        self.free_blocks -= take
        return out.astype(np.int32)

    def commit(self, session: int, blocks, hashes) -> np.ndarray:
        """Cache private ``blocks`` (int [n]) under ``hashes`` (int64 [n, 2]), each pinned
        once for ``session``; returns the block holding each hash (int32 [n]): the block
        itself, or the one cached under that hash before (the given one stays private)."""
        self._uid_of(session)
        blocks = self._block_ids(blocks)
        lo, hi = key_words(hashes)
        if lo.size != blocks.size or np.unique(blocks).size != blocks.size:
            raise BlockError("BAD_ARGUMENT", f"commit needs distinct blocks and one hash each, got {blocks.size} "
                             f"blocks and {lo.size} hashes")
        if blocks.size and (self.state[blocks] != session).any():
            bad = int(blocks[self.state[blocks] != session][0])
            raise BlockError("BAD_ARGUMENT", f"block {bad} is not private to this session (allocate it, write it, "
                             "then commit it; a cached block is read-only)")
        out = self.index.find(lo, hi)
        new = np.flatnonzero(out < 0)
        if new.size:  # a key twice in this commit: its first block takes it
            _, first, inverse = np.unique(np.stack([lo[new], hi[new]], axis=1), axis=0, return_index=True,
                                          return_inverse=True)
            firsts = new[first]
            out[new] = blocks[firsts][inverse.reshape(-1)]
            self.index.insert_many(lo[firsts], hi[firsts], blocks[firsts].astype(np.int64))
        done = blocks[out == blocks]
        self.key_lo[done], self.key_hi[done] = lo[out == blocks], hi[out == blocks]
        self.cached_blocks += done.size
        self.state[done] = CACHED
        self.pins[done] = 1
        self._pinned[session][done] += 1  # (private, now pinned by the committer: its uid's count stays)
        self.counts["commits"] += done.size
        return out.astype(np.int32)

    def lookup(self, session: int, hashes) -> np.ndarray:
        """Pin and return (int32 [m]) the blocks of the longest cached prefix of the chain
        ``hashes`` (int64 [n, 2]). A block ``session`` does not pin yet takes one block of
        its reservation while it has one; past that, it adds one to the session's uid's
        count, and the lookup stops before the block that would take the uid past its
        quota, or an evictable block that the reservations need."""
        blocks = self.find(session, hashes).blocks
        return blocks.copy() if not blocks.flags.writeable else blocks  # (never a memo's own array)

    def find(self, session: int, hashes, chain: int | None = None) -> Found | None:
        """:meth:`lookup` of the chain whose keys are those of remembered chain ``chain`` (a
        token this session was given by an earlier ``find``, among its last CHAIN_GRANTS)
        followed by ``hashes``; or of ``hashes`` alone when ``chain`` is None. None, and
        nothing pinned, when ``chain`` is not such a token any longer (forgotten since, or
        never given to this session): the caller sends the keys instead."""
        uid = self._uid_of(session)
        hashes = _hash_array(hashes)
        chains = self.chains
        ref = named = None  # the chain named; ref: while every block of it is cached under its key
        if chain is not None:
            ref = chains.named(session, chain)
            if ref is None:
                return None
            if ref.blocks.size + hashes.shape[0] > LIMITS.max_blocks:
                raise BlockError("TOO_LARGE", f"a chain of {ref.blocks.size} blocks and {hashes.shape[0]} more "
                                 f"exceeds {LIMITS.max_blocks} blocks a request")
            named, rest = ref, hashes
            if not chains.valid(ref):
                ref = None  # not cached whole now: its keys are probed
            hashes = None  # the whole chain's keys, made when needed
            if ref is not None and not rest.shape[0]:
                memo = ref
            elif ref is not None and not chains.has(last_key(rest)):
                memo = None  # not remembered whole: only the rest is probed
            else:
                hashes = np.concatenate([named.hashes(), rest])
                memo = chains.get(hashes)
        else:
            memo = chains.get(hashes)
        if memo is not None:
            arr, run = memo.blocks, memo.run
        else:
            # A remembered chain it begins with (the one named, or a head tried): only the rest is probed.
            n = hashes.shape[0] if hashes is not None else ref.blocks.size + rest.shape[0]
            head = ref if ref is not None else chains.head(hashes)
            start = 0 if head is None else head.blocks.size
            part = self.index.find(*key_words(rest if hashes is None else hashes[start:]))
            missing = np.flatnonzero(part < 0)
            if missing.size:
                part = part[: missing[0]]
            if head is not None and not part.size:
                arr, run = head.blocks, head.run
            else:
                arr = np.concatenate([head.blocks, part]) if head is not None else part
                run = self._run(arr)  # blocks allocated together: slices instead of gathers and scatters
            memo = chains.probed(lambda: hashes if hashes is not None else np.concatenate([named.hashes(), rest]),
                                 arr, run, not missing.size, n, head)
        at = run if run is not None else arr
        pinned = self._pinned[session]
        twice = False
        if run is None:
            self._mark[arr] = np.arange(arr.size)  # a block named twice keeps only its last position here
            twice = bool((self._mark[arr] != np.arange(arr.size)).any())  # (np.unique costs 10x more)
        # taken: evictable blocks it pins; fresh: blocks the session does not pin yet (taken among them),
        # each one more for its uid (clause 7) unless its reservation pays. A block named twice counts at
        # its first mention only.
        if twice:
            first = np.zeros(arr.size, dtype=bool)
            first[np.unique(arr, return_index=True)[1]] = True
            unpinned = (self.pins[at] == 0) & first
            new = (pinned[at] == 0) & first
            taken, fresh = int(np.count_nonzero(unpinned)), int(np.count_nonzero(new))
        else:  # (views of a run; of blocks apart, the gathers kept for the pins below)
            unpinned = new = None
            were, mine = self.pins[at], pinned[at]
            taken = arr.size - int(np.count_nonzero(were))
            fresh = arr.size - int(np.count_nonzero(mine))
        own = self.reserved.get(session, 0)
        slack = self.free_blocks + self.evictable_blocks - self.reserved_total
        room = self.ledger.room(uid)
        if taken > own + slack or fresh > own + room:
            # Stop before the first evictable block the others' promises need (the caller's promise pays
            # for its first ``own`` fresh blocks, and one it spends on a block pinned already leaves one
            # more evictable block to the others: so the bound is on evictable blocks, ``own + slack``),
            # or before the first fresh block past the uid's quota.
            if unpinned is None:
                unpinned, new = were == 0, mine == 0
            cut = arr.size
            if taken > own + slack:
                cut = int(np.flatnonzero(np.cumsum(unpinned) > own + slack)[0])
            if fresh > own + room:
                cut = min(cut, int(np.flatnonzero(np.cumsum(new) > own + room)[0]))
            arr, unpinned, new = arr[:cut], unpinned[:cut], new[:cut]
            if not twice:
                were, mine = were[:cut], mine[:cut]
            taken, fresh = int(np.count_nonzero(unpinned)), int(np.count_nonzero(new))
            memo = None
        self.evictable_blocks -= taken
        paid = min(own, fresh)  # the caller's promise pays first: reserved, now pinned
        if paid:
            self.reserved[session] = own - paid
            self.reserved_total -= paid
        if fresh > paid:
            self.ledger.add(uid, fresh - paid)
        if twice:
            np.add.at(self.pins, arr, 1)
            np.add.at(pinned, arr, 1)
        elif run is not None:  # in place
            were += 1
            mine += 1
        else:  # each block once: scatters only
            self.pins[arr] = were + 1
            pinned[arr] = mine + 1
        self.counts["lookups"] += 1
        self.counts["hit_blocks"] += arr.size
        token = chains.grant(session, memo, ref)  # (the chain named stays answered while the session names it)
        head = ref.blocks.size if ref is not None and arr.size >= ref.blocks.size else 0
        return Found(memo.ids if memo is not None else arr.astype(np.int32), token, head)

    def _still_cached(self, at, hashes: np.ndarray) -> bool:
        """Whether blocks ``at`` (a slice or ids) are each cached under the key of ``hashes``."""
        return bool((self.key_lo[at] == hashes[:, 0]).all() and (self.key_hi[at] == hashes[:, 1]).all()
                    and (self.state[at] == CACHED).all())

    def release(self, session: int, blocks) -> None:
        """Unpin cached ``blocks`` (int [n]; named twice: unpinned twice) and free private
        ones (zeroed); all or nothing. The blocks whose last pin goes become evictable in
        the order of their last mention."""
        uid = self._uid_of(session)
        run = self._run_of(blocks)
        if run is not None and self._release_run(session, uid, run):
            return
        blocks = self._block_ids(blocks)
        self._mark[blocks] = np.arange(blocks.size)  # as in lookup: a block named twice keeps its last position
        if (self._mark[blocks] == np.arange(blocks.size)).all():  # the common case, without np.unique's cost
            uniq, last, count = blocks, np.arange(blocks.size), np.ones(blocks.size, np.int64)
        else:
            uniq, first_rev, count = np.unique(blocks[::-1], return_index=True, return_counts=True)
            last = blocks.size - 1 - first_rev  # where each block is named last
        self._release(session, uid, uniq, last, count)

    def _release_run(self, session: int, uid: int, run: slice) -> bool:
        """``release`` of a run of consecutive blocks, each named once, all pinned by
        ``session`` (what it looked up): slices, no gathers; False (nothing done) for any
        other run."""
        pinned = self._pinned[session]
        # (CACHED is the least state: all are CACHED when the largest is)
        if self.state[run].max() != CACHED or pinned[run].min() < 1:
            return False
        mine = pinned[run]
        mine -= 1
        n = run.stop - run.start
        dropped = n - int(np.count_nonzero(mine))  # the session's last pin of each: one less for its uid
        if dropped:
            self.ledger.add(uid, -dropped)
        pins = self.pins[run]
        pins -= 1
        gone = n - int(np.count_nonzero(pins))
        if gone == n:  # evictable in the order named (each named once: last mention = position)
            np.add(self._arange[:n], self._clock, out=self.stamp[run])
        elif gone:
            at = np.flatnonzero(pins == 0)
            self.stamp[run.start + at] = self._clock + self._arange[:gone]
        self._clock += gone
        self.evictable_blocks += gone
        return True

    def _run(self, ids: np.ndarray) -> slice | None:
        """Block ids of the store (int64 [n]) as a slice when they are consecutive and
        ascending (blocks allocated together), else None."""
        n = ids.size
        if n < 2:
            return None
        first = int(ids[0])
        if int(ids[-1]) - first != n - 1 or not (ids == self._arange[first:first + n]).all():
            return None
        return slice(first, first + n)

    def _run_of(self, blocks) -> slice | None:
        """``blocks`` as a slice when they are a NumPy integer array of consecutive ascending
        ids within the store (blocks allocated together), else None (``_block_ids`` checks
        them)."""
        if type(blocks) is not np.ndarray or blocks.ndim != 1 or blocks.dtype.kind not in "iu" or blocks.size < 2:
            return None
        first, n = int(blocks[0]), blocks.size
        if first < 0 or first + n > self.n_blocks or int(blocks[-1]) != first + n - 1:
            return None
        ids = self._arange32 if blocks.dtype == np.int32 else self._arange  # (the wire's int32: no cast)
        if not (blocks == ids[first:first + n]).all():
            return None
        return slice(first, first + n)

    def _release(self, session: int, uid: int, uniq: np.ndarray, last: np.ndarray, count: np.ndarray) -> None:
        """``release`` of distinct blocks ``uniq``, each named ``count`` times, last at
        position ``last`` of the request."""
        pinned = self._pinned[session]
        private = self.state[uniq] == session
        mine = pinned[uniq]
        held = np.where(private, 1, mine)
        if (count > held).any():
            i = int(np.flatnonzero(count > held)[0])
            raise BlockError("BAD_ARGUMENT", f"block {int(uniq[i])} is not held by this session {int(count[i])} time(s)")
        shared = ~private
        u, c = uniq[shared], count[shared]
        left = mine[shared] - c  # (each block once: scatters, not gathers again)
        pinned[u] = left
        dropped = u.size - int(np.count_nonzero(left))  # the session's last pin of each: one less for its uid
        if dropped:
            self.ledger.add(uid, -dropped)
        left = self.pins[u] - c
        self.pins[u] = left
        gone = left == 0
        if gone.any():  # stamped in the order of each block's last mention
            order = np.argsort(last[shared][gone], kind="stable")
            self.stamp[u[gone][order]] = self._clock + np.arange(order.size)
            self._clock += order.size
            self.evictable_blocks += order.size
        freed = uniq[private]
        if freed.size:
            freed = freed[np.argsort(last[private], kind="stable")]
            self.ledger.add(uid, -freed.size)
            self._zero(freed.tolist())
            self.state[freed] = FREE
            self.free_blocks += freed.size

    def close(self, session: int) -> None:
        """``session`` is gone: its pins released, its private blocks freed, its
        reservation dropped."""
        if session not in self._uid:
            return
        # By counts, in block order (what releasing every pin and private block would do):
        # a pin count can be large, so never one id a pin.
        pinned = self._pinned[session]
        held = np.flatnonzero((self.state == session) | (pinned > 0))
        self._release(session, self._uid[session], held, np.arange(held.size),
                      np.where(self.state[held] == session, 1, pinned[held]).astype(np.int64))
        self.reserve(session, -self.reserved.get(session, 0))
        self.reserved.pop(session, None)
        del self._uid[session], self._pinned[session]
        self.chains.close(session)

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

    def keys_writable(self, session: int, blocks) -> np.ndarray:
        """``blocks`` (int64 [n]) if they are distinct and all private to ``session``: whose
        indexer keys it may write (a cached block's keys were committed with it and are
        read-only); BAD_ARGUMENT otherwise."""
        self._uid_of(session)
        blocks = self._block_ids(blocks)
        if len(set(blocks.tolist())) != blocks.size:
            raise BlockError("BAD_ARGUMENT", "write_keys needs distinct blocks")
        bad = self.state[blocks] != session
        if bad.any():
            raise BlockError("BAD_ARGUMENT", f"block {int(blocks[bad][0])} is not private to this session: an engine "
                             "writes the indexer keys of the blocks it allocated, before it commits them (a cached "
                             "block's keys are read-only)")
        return blocks

    def keys_readable(self, session: int, blocks) -> np.ndarray:
        """``blocks`` (int64 [n]) if each is pinned by ``session`` or private to it;
        BAD_ARGUMENT otherwise."""
        self._uid_of(session)
        blocks = self._block_ids(blocks)
        bad = (self.state[blocks] != session) & (self._pinned[session][blocks] == 0)
        if bad.any():
            raise BlockError("BAD_ARGUMENT", f"block {int(blocks[bad][0])} is neither pinned by nor private to this "
                             "session: look it up (or allocate it) before reading its indexer keys")
        return blocks

    def _block_ids(self, blocks) -> np.ndarray:
        a = np.asarray(blocks)
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise BlockError("BAD_ARGUMENT", f"blocks must be integers [n], got {a.dtype} {list(a.shape)}")
        if a.size and (a.min() < 0 or a.max() >= self.n_blocks):
            raise BlockError("BAD_ARGUMENT", f"blocks must lie in [0, {self.n_blocks})")
        return a.astype(np.int64)
