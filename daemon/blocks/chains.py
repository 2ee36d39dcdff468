"""The chains a block store found lately (DESIGN §9, "Cost" and "Chains named by token"):
remembered by their last key with their hashes and blocks, so that the next lookup of the
same chain (requests sharing a system prompt) compares its hashes instead of probing the
index, a longer chain probes only what follows a remembered one, and a session may name a
chain by the token its lookup's reply gave. Only a hint: a remembered chain is answered
only while every block of it is still cached under its key (checked after any eviction),
so the store answers the same with or without it. The event loop's thread only.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np

# At most this many block ids together, and this many a block of the store (a chain may name
# one block many times: a small store's memo stays small); the least recently used goes
# first: CHAIN_MEMO_BYTES_PER_ID each (80 MiB at most a store).
CHAIN_MEMO_IDS = 1 << 20
CHAIN_MEMO_IDS_PER_BLOCK = 8
# What the memo takes of the daemon's memory for each id its bound counts, at most: chains
# of CHAIN_MEMO_ENTRY_IDS blocks (the most entries for the bound) measured 75 B an id with
# tracemalloc (a Memo, its two arrays and raw keys, its dict entries).
CHAIN_MEMO_BYTES_PER_ID = 80
CHAIN_MEMO_MIN = 1  # shorter chains take the index (~20 us more in the store than the memo for 1 to 63 blocks)
CHAIN_MEMO_ENTRY_IDS = 16  # what a chain counts against CHAIN_MEMO_IDS at least (its entry's own bytes)
# A chain not remembered whole may begin with one that is (a cached system prompt, then a
# request's own blocks): the lengths of the most recently found remembered chains shorter
# than it are tried as its head, at most this many (a try is one dict look-up).
CHAIN_MEMO_HEAD_TRIES = 4
CHAIN_MEMO_HEAD_MIN = 64  # chains shorter than this are probed whole
# A remembered chain has a token (a number never reused in the process) that the lookup's reply
# gives the session; the session's next lookup may name the chain by it instead of sending its
# hashes (``BlockStore.find``). The tokens each session was given last, at most:
CHAIN_GRANTS = 16
# Tokens, one sequence for every store of the process: a token names one chain of one store,
# never another (a client's token from another engine's store is not answered).
_TOKENS = itertools.count(1)


def last_key(hashes: np.ndarray) -> tuple[int, int]:
    """The last key of chain ``hashes`` (int64 [n, 2], n >= 1): where a memo of it is kept."""
    return int(hashes[-1, 0]), int(hashes[-1, 1])


def _memo_cost(n: int) -> int:
    """What a remembered chain of ``n`` blocks counts against the memo's bound."""
    return max(n, CHAIN_MEMO_ENTRY_IDS)


@dataclass(slots=True)
class Memo:
    """A chain found whole (or the part found of a long one)."""

    blocks: np.ndarray  # int64 [n], in chain order
    run: slice | None  # the blocks as a slice, when consecutive (``BlockStore._run``)
    raw: bytes  # the chain's keys (int64 [n, 2]) as the wire carries them: one memcmp to compare
    epoch: int  # the memo's evictions count when it was last checked against the cache
    token: int  # its name in lookups (``BlockStore.find``)
    key: tuple[int, int]  # its last key (where ``ChainMemo`` keeps it)
    ids: np.ndarray  # ``blocks`` as int32, read-only: what a lookup answers

    def hashes(self) -> np.ndarray:
        """Its keys, int64 [n, 2] (a read-only view of ``raw``)."""
        return np.frombuffer(self.raw, np.int64).reshape(-1, 2)


def owned(a: np.ndarray) -> np.ndarray:
    """``a``, or a copy of it when it is a view: a view keeps its whole base alive."""
    return a if a.base is None else a.copy()


class ChainMemo:
    """The remembered chains of one store of ``n_blocks`` blocks.

    Args:
        n_blocks: the store's blocks (the bound on ids is kept in proportion).
        still_cached: ``(at, hashes) -> bool``, whether the store's blocks ``at`` (a slice
            or an index array) are each still cached under the key of ``hashes`` (int64
            [n, 2]); asked only after an eviction (:meth:`evicted`). A bound method, kept
            weakly: the store that owns the memo is freed as soon as nothing else holds it,
            not at the next collection of reference cycles.
    """

    def __init__(self, n_blocks: int, still_cached: Callable[[object, np.ndarray], bool]):
        self._still_cached = weakref.WeakMethod(still_cached)
        self._chains: collections.OrderedDict[tuple[int, int], Memo] = collections.OrderedDict()
        self._by_token: dict[int, Memo] = {}
        self._grants: dict[int, collections.OrderedDict[int, None]] = {}  # session -> its tokens, latest last
        self._heads: collections.OrderedDict[int, None] = collections.OrderedDict()  # lengths found, latest last
        self._epoch = 0  # evictions so far: a memo checked at this epoch holds
        self.ids = 0  # block ids remembered (each chain at least CHAIN_MEMO_ENTRY_IDS)
        self._ids_max = self.max_ids(n_blocks)

    @staticmethod
    def max_ids(n_blocks: int) -> int:
        """The bound on ids remembered for a store of ``n_blocks`` blocks."""
        return min(CHAIN_MEMO_IDS, CHAIN_MEMO_IDS_PER_BLOCK * n_blocks)

    @classmethod
    def max_bytes(cls, n_blocks: int) -> int:
        """The most memory the memo of a store of ``n_blocks`` blocks takes."""
        return cls.max_ids(n_blocks) * CHAIN_MEMO_BYTES_PER_ID

    def __len__(self) -> int:
        return len(self._chains)

    def evicted(self) -> None:
        """Blocks left the cache (only an eviction takes one out): every memo is checked
        again before it answers."""
        self._epoch += 1

    def has(self, key: tuple[int, int]) -> bool:
        return key in self._chains

    # -- sessions and their tokens -------------------------------------------------------
    def open(self, session: int) -> None:
        self._grants.setdefault(session, collections.OrderedDict())

    def close(self, session: int) -> None:
        self._grants.pop(session, None)

    def named(self, session: int, token: int) -> Memo | None:
        """The chain ``token`` names for ``session``: one of its last CHAIN_GRANTS tokens whose
        chain is still remembered (not checked against the cache: :meth:`valid`)."""
        return self._by_token.get(token) if token in self._grants[session] else None

    def grant(self, session: int, memo: Memo | None, named: Memo | None) -> int | None:
        """``memo``'s token given to ``session`` (its latest), and the chain it ``named``
        kept among its latest; the token, or None without a memo."""
        grants = self._grants[session]
        if named is not None:
            grants.move_to_end(named.token)
        if memo is None:
            return None
        grants[memo.token] = None
        grants.move_to_end(memo.token)
        if len(grants) > CHAIN_GRANTS:
            grants.popitem(last=False)
        return memo.token

    # -- chains ---------------------------------------------------------------------------
    def get(self, hashes: np.ndarray) -> Memo | None:
        """The memo of exactly the chain ``hashes`` (int64 [n, 2]), when it was found whole
        before and every block of that answer is still cached under its key (then the index
        would answer the same: a key names one cached block). Requests sharing a long system
        prompt look the same chain up again and again: one comparison of the hashes when
        nothing was evicted since, a few array operations when something was, no probes."""
        if hashes.shape[0] < CHAIN_MEMO_MIN:
            return None
        memo = self._chains.get(last_key(hashes))
        if memo is None or memo.blocks.size != hashes.shape[0] or memo.raw != hashes.tobytes():
            return None
        return memo if self.valid(memo) else None

    def head(self, hashes: np.ndarray) -> Memo | None:
        """The memo of the longest remembered chain that ``hashes`` begins with, among the
        lengths found most recently (CHAIN_MEMO_HEAD_TRIES), still cached whole (as
        :meth:`get` checks it); None for a chain shorter than CHAIN_MEMO_HEAD_MIN (probed
        whole: the tries cost about what its probes do) or when none is."""
        n = hashes.shape[0]
        if n < CHAIN_MEMO_HEAD_MIN:
            return None
        tries = [m for m in reversed(self._heads) if m < n][:CHAIN_MEMO_HEAD_TRIES]
        for m in sorted(tries, reverse=True):
            memo = self.get(hashes[:m])
            if memo is not None:
                return memo
        return None

    def valid(self, memo: Memo) -> bool:
        """Whether every block of ``memo`` is still cached under its key (one comparison of
        epochs when nothing was evicted since it was last checked); a memo found stale is
        forgotten. Marks it the most recently used."""
        if memo.epoch != self._epoch:
            check = self._still_cached()  # None once the store is gone: nothing of it is cached
            if check is None or not check(memo.run if memo.run is not None else memo.blocks, memo.hashes()):
                self._forget(memo.key)
                return False
            memo.epoch = self._epoch
        self._chains.move_to_end(memo.key)
        self._head_found(memo.blocks.size)
        return True

    def probed(self, hashes: Callable[[], np.ndarray], arr: np.ndarray, run: slice | None, whole: bool, n: int,
               head: Memo | None) -> Memo | None:
        """After a lookup probed the index for a chain of ``n`` keys (``hashes()`` makes
        them) beyond ``head``: the memo of exactly what it found (``arr``, ``run``), or None.
        Found whole: remembered. Found in part (a long chain): that part, the head of the
        next such request, unless it is no more than the head it began with (then the head's)."""
        start = 0 if head is None else head.blocks.size
        if arr.size >= CHAIN_MEMO_MIN and (whole or (n >= CHAIN_MEMO_HEAD_MIN and arr.size > start)):
            return self._remember(hashes()[:arr.size], arr, run)
        return head if head is not None and arr.size == start else None

    def _remember(self, hashes: np.ndarray, arr: np.ndarray, run: slice | None) -> Memo | None:
        """Remember chain ``hashes`` found as ``arr``; its memo (None when it alone is over
        the memo's bound)."""
        key = last_key(hashes)
        if key in self._chains:
            self._forget(key)
        if _memo_cost(arr.size) > self._ids_max:  # (it would push every other chain out, then itself)
            return None
        arr = owned(arr)  # a view of a lookup's answer for every key it named: keep only these
        ids = arr.astype(np.int32)
        ids.flags.writeable = False
        memo = Memo(arr, run, hashes.tobytes(), self._epoch, next(_TOKENS), key, ids)
        self._chains[key] = memo
        self._by_token[memo.token] = memo
        self.ids += _memo_cost(arr.size)
        self._head_found(arr.size)
        while self.ids > self._ids_max:  # (the oldest first: never this one, within the bound alone)
            self._forget(next(iter(self._chains)))
        return memo

    def _forget(self, key: tuple[int, int]) -> None:
        """The memo under ``key`` goes (its token names nothing from now on)."""
        memo = self._chains.pop(key)
        self.ids -= _memo_cost(memo.blocks.size)
        del self._by_token[memo.token]

    def _head_found(self, n: int) -> None:
        """A remembered chain of ``n`` blocks was made or used: its length is tried first."""
        self._heads[n] = None
        self._heads.move_to_end(n)
        if len(self._heads) > 4 * CHAIN_MEMO_HEAD_TRIES:
            self._heads.popitem(last=False)
