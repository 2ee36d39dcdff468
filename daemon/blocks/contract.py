"""Reference model of the block store contract (DESIGN §9), written for clarity, not speed.

The daemon's :class:`~.store.BlockStore` is checked against it. One namespace's store has
``n_blocks`` blocks of ``block_size`` host rows; each block is in one of three states:

* **free**: holds zeros, belongs to nobody;
* **private** to one session: allocated by it (``alloc``), written by it only;
* **cached** under a 16-byte chain hash (``commit``): read-only from then on, pinned by
  any number of sessions (a reference count per session); an unpinned cached block is
  *evictable* and sits in ``lru`` (least recently unpinned first).

Clauses, each one visible step below:

1. ``alloc`` hands out free blocks first (lowest id first), then evicts cached blocks in
   LRU order; a block leaves free or cached zeroed. A pinned block is never evicted.
2. Only a block's private owner may write it or commit it; a cached block is never
   written again until it is evicted.
3. ``commit`` caches a private block under a hash and pins it for its committer; a hash
   already cached keeps its block (the committed one stays private: first commit wins).
4. ``lookup`` pins the longest prefix of a hash chain that is cached. Each block of it
   the caller does not pin yet (its first mention, for a block named twice) uses one
   block of the caller's reservation while it has one (a hit stands for a block it would
   have allocated), evictable or not; past its reservation, each adds one to its uid's
   count (clause 7), and the lookup stops early, with the shorter prefix, rather than
   take the uid past its quota or pin an evictable block that others' reservations
   need. A block the caller pins already costs nothing.
5. ``release`` unpins cached blocks (the last unpin appends the block to ``lru``) and
   frees private ones (zeroed); all or nothing.
6. ``reserve(n)`` promises ``n`` more blocks to a session, or raises
   :class:`PoolExhausted` naming free, evictable and reserved blocks. At all times
   ``free + evictable >= reserved`` (summed over sessions), so an ``alloc`` within a
   session's reservation never fails. ``reserve`` of a negative ``n`` gives blocks back.
7. A uid's private, reserved and pinned blocks, over every store sharing a
   :class:`UidLedger`, stay within ``max_blocks_per_uid``: ``reserve`` or ``alloc`` past
   it is QUOTA_EXCEEDED, a lookup stops short of it (clause 4). A pinned block counts once
   for each session of the uid that pins it (its first pin adds one, its last unpin
   takes it back); a commit turns a private block into one pinned by its committer, so
   the count stays: a uid cannot keep more blocks from eviction than its quota.
8. ``close(session)``: everything the session held is released, its reservation dropped.
9. A block's indexer keys (its second plane, ``keys``) follow its rows: ``write_keys``
   only into distinct blocks private to the writer (all or nothing; a cached block's keys
   are committed with it and never rewritten), ``read_keys`` only of blocks the reader
   pinned or holds private; zeroed whenever the block is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ZERO = 0  # the content of a zeroed block, in the model's ``data``


class BlockError(ValueError):
    """A refused block store request; ``code`` names a ``proto.ErrorCode`` member."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.detail: dict = {}


class PoolExhausted(BlockError):
    """``reserve`` or ``alloc`` of ``wanted`` blocks that the store cannot promise: it has
    ``free`` free blocks and ``evictable`` cached unpinned ones, of which ``reserved`` are
    promised to sessions already."""

    def __init__(self, wanted: int, free: int, evictable: int, reserved: int):
        super().__init__("POOL_EXHAUSTED", f"{wanted} blocks wanted; the store has {free} free, {evictable} cached "
                         f"and evictable, {reserved} of those reserved")
        self.detail = {"wanted": wanted, "free": free, "evictable": evictable, "reserved": reserved}


@dataclass
class UidLedger:
    """Private, reserved and pinned blocks per uid (a block once for each of the uid's
    sessions that pins it), over every store of the daemon (clause 7)."""

    max_blocks_per_uid: int = 0  # 0: no quota
    held: dict[int, int] = field(default_factory=dict)

    def check(self, uid: int, more: int) -> None:
        have = self.held.get(uid, 0)
        if self.max_blocks_per_uid and more > 0 and have + more > self.max_blocks_per_uid:
            raise BlockError("QUOTA_EXCEEDED", f"{more} more blocks would bring uid {uid} to {have + more} private, "
                             f"reserved and pinned blocks (max_blocks_per_uid {self.max_blocks_per_uid})")

    def room(self, uid: int) -> int:
        """How many more blocks ``uid`` may hold (a huge number without a quota)."""
        if not self.max_blocks_per_uid:
            return 1 << 62
        return max(0, self.max_blocks_per_uid - self.held.get(uid, 0))

    def add(self, uid: int, n: int) -> None:
        self.held[uid] = self.held.get(uid, 0) + n
        if not self.held[uid]:
            del self.held[uid]


class BlockStoreModel:
    """One namespace's blocks. Sessions are ints, each with a uid given at ``open``."""

    def __init__(self, n_blocks: int, ledger: UidLedger | None = None):
        self.n_blocks = n_blocks
        self.ledger = ledger if ledger is not None else UidLedger()
        self.private: dict[int, int] = {}  # block -> session
        self.hash_of: dict[int, bytes] = {}  # cached block -> hash
        self.block_of: dict[bytes, int] = {}  # hash -> cached block
        self.pins: dict[int, dict[int, int]] = {}  # cached block -> {session: count}
        self.lru: list[int] = []  # unpinned cached blocks, least recently unpinned first
        self.reserved: dict[int, int] = {}  # session -> blocks promised
        self.uid: dict[int, int] = {}  # session -> uid
        self.data: list[int] = [ZERO] * n_blocks  # what each block holds (the model's bytes)
        self.keys: list[int] = [ZERO] * n_blocks  # its indexer keys (the second plane)
        self.evictions = 0

    # -- what the store has ------------------------------------------------------------
    def free(self) -> list[int]:
        return [b for b in range(self.n_blocks) if b not in self.private and b not in self.hash_of]

    def total_reserved(self) -> int:
        return sum(self.reserved.values())

    def _exhausted(self, wanted: int) -> PoolExhausted:
        return PoolExhausted(wanted, len(self.free()), len(self.lru), self.total_reserved())

    def uid_counts(self) -> dict[int, int]:
        """Clause 7's count of each uid, from this store's blocks: its sessions' private and
        reserved blocks, and each cached block once for each session of it that pins it
        (what ``ledger`` holds when no other store shares it)."""
        out: dict[int, int] = {}
        held = [self.uid[s] for s in self.private.values()]
        held += [self.uid[s] for pins in self.pins.values() for s in pins]
        for uid in held:
            out[uid] = out.get(uid, 0) + 1
        for s, n in self.reserved.items():
            out[self.uid[s]] = out.get(self.uid[s], 0) + n
        return {uid: n for uid, n in out.items() if n}

    def open(self, session: int, uid: int) -> None:
        self.uid[session] = uid

    # -- clause 6, 7 -------------------------------------------------------------------
    def reserve(self, session: int, n: int) -> int:
        """Promise ``n`` more blocks to ``session`` (give back ``-n``, at most what it
        holds); return its reservation now."""
        have = self.reserved.get(session, 0)
        if n < 0:
            n = -min(-n, have)
        else:
            if len(self.free()) + len(self.lru) - self.total_reserved() < n:
                raise self._exhausted(n)
            self.ledger.check(self.uid[session], n)
        self.ledger.add(self.uid[session], n)
        self.reserved[session] = have + n
        return self.reserved[session]

    # -- clause 1 ----------------------------------------------------------------------
    def alloc(self, session: int, n: int) -> list[int]:
        """``n`` zeroed blocks private to ``session``: its reservation used first."""
        mine = min(n, self.reserved.get(session, 0))
        if len(self.free()) + len(self.lru) - (self.total_reserved() - mine) < n:
            raise self._exhausted(n)
        self.ledger.check(self.uid[session], n - mine)
        self.ledger.add(self.uid[session], n - mine)  # the reserved part is counted already
        self.reserved[session] = self.reserved.get(session, 0) - mine
        out = []
        for _ in range(n):
            free = self.free()
            if free:
                b = free[0]
            else:
                b = self.lru.pop(0)
                del self.block_of[self.hash_of.pop(b)]
                del self.pins[b]
                self.data[b] = self.keys[b] = ZERO
                self.evictions += 1
            assert self.data[b] == self.keys[b] == ZERO
            self.private[b] = session
            out.append(b)
        return out

    # -- clause 2 ----------------------------------------------------------------------
    def write(self, session: int, block: int, value: int) -> None:
        """The engine writes ``block`` (any of its rows): its own private blocks only."""
        if self.private.get(block) != session:
            raise BlockError("BAD_ARGUMENT", f"block {block} is not private to this session")
        self.data[block] = value

    # -- clause 9 ----------------------------------------------------------------------
    def write_keys(self, session: int, blocks: list[int], values: list[int]) -> None:
        """Write the indexer keys of distinct ``blocks``, all private to ``session``."""
        if len(set(blocks)) != len(blocks):
            raise BlockError("BAD_ARGUMENT", "write_keys needs distinct blocks")
        for b in blocks:
            if self.private.get(b) != session:
                raise BlockError("BAD_ARGUMENT", f"block {b} is not private to this session")
        for b, v in zip(blocks, values):
            self.keys[b] = v

    def read_keys(self, session: int, blocks: list[int]) -> list[int]:
        """The indexer keys of ``blocks``, each pinned by ``session`` or private to it."""
        for b in blocks:
            if self.private.get(b) != session and not self.pins.get(b, {}).get(session):
                raise BlockError("BAD_ARGUMENT", f"block {b} is neither pinned by nor private to this session")
        return [self.keys[b] for b in blocks]

    # -- clause 3 ----------------------------------------------------------------------
    def commit(self, session: int, blocks: list[int], hashes: list[bytes]) -> list[int]:
        """Cache each private block under its hash, pinned for ``session``; returns the
        block holding each hash (another one where the hash was cached already)."""
        if len(blocks) != len(hashes) or len(set(blocks)) != len(blocks):
            raise BlockError("BAD_ARGUMENT", "commit needs one hash per block and distinct blocks")
        for b in blocks:
            if self.private.get(b) != session:
                raise BlockError("BAD_ARGUMENT", f"block {b} is not private to this session")
        out = []
        for b, h in zip(blocks, hashes):
            if h not in self.block_of:  # private, then pinned by its committer: the uid's count stays
                del self.private[b]
                self.hash_of[b], self.block_of[h] = h, b
                self.pins[b] = {session: 1}
            out.append(self.block_of[h])
        return out

    # -- clause 4 ----------------------------------------------------------------------
    def lookup(self, session: int, hashes: list[bytes]) -> list[int]:
        """Pin and return the blocks of the longest cached prefix of ``hashes``."""
        uid = self.uid[session]
        out = []
        for h in hashes:
            b = self.block_of.get(h)
            if b is None:
                break
            if not self.pins[b].get(session):  # a pin of the uid's more
                if self.reserved.get(session, 0):  # the caller's own promise pays for it: reserved, now pinned
                    self.reserved[session] -= 1
                elif b in self.lru and len(self.free()) + len(self.lru) - 1 < self.total_reserved():
                    break  # pinning it would break a promise (clause 6)
                elif not self.ledger.room(uid):
                    break  # past the uid's quota (clause 7)
                else:
                    self.ledger.add(uid, 1)
                if b in self.lru:
                    self.lru.remove(b)
            self.pins[b][session] = self.pins[b].get(session, 0) + 1
            out.append(b)
        return out

    # -- clause 5 ----------------------------------------------------------------------
    def release(self, session: int, blocks: list[int]) -> None:
        """Unpin cached ``blocks`` (a block named twice is unpinned twice) and free private
        ones; refused as a whole if ``session`` holds any of them fewer times than named."""
        want: dict[int, int] = {}
        for b in blocks:
            want[b] = want.get(b, 0) + 1
        for b, k in want.items():
            held = 1 if self.private.get(b) == session else self.pins.get(b, {}).get(session, 0)
            if k > held:
                raise BlockError("BAD_ARGUMENT", f"block {b} is not held by this session {k} time(s)")
        for b in blocks:
            if b in self.private:
                del self.private[b]
                self.ledger.add(self.uid[session], -1)
                self.data[b] = self.keys[b] = ZERO
                continue
            pins = self.pins[b]
            pins[session] -= 1
            if not pins[session]:  # the session's last pin of it: its uid's count less one
                del pins[session]
                self.ledger.add(self.uid[session], -1)
            if not pins:
                self.lru.append(b)

    # -- clause 8 ----------------------------------------------------------------------
    def close(self, session: int) -> None:
        held = [b for b, s in self.private.items() if s == session]
        held += [b for b, pins in self.pins.items() for _ in range(pins.get(session, 0))]
        self.release(session, sorted(held))
        self.reserve(session, -self.reserved.get(session, 0))
        self.reserved.pop(session, None)
        self.uid.pop(session, None)

    def check(self) -> None:
        """The invariants every step keeps."""
        assert len(self.free()) + len(self.lru) >= self.total_reserved()
        assert set(self.lru) == {b for b, p in self.pins.items() if not p}
        assert len(self.lru) == len(set(self.lru))
        for b in self.free():
            assert self.data[b] == self.keys[b] == ZERO
