"""The block store contract (DESIGN §9): each clause on a small hand-made example, run on
the reference model and on the daemon's ``BlockStore``; then both on random sequences of
requests from several sessions and uids (hypothesis), step for step equal, with the
model's invariants (zeroed free blocks, pinned blocks never evicted nor rewritten,
reservations always covered) checked after every step."""

import collections
import contextlib
import functools
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import helpers

from sparsekv.client.blocks import Blocks
from sparsekv.daemon.block_requests import lookup_hashes, lookup_reply
from sparsekv.daemon.blocks.contract import ZERO, BlockError, BlockStoreModel, PoolExhausted, UidLedger
from sparsekv.daemon.blocks import chains as chains_module
from sparsekv.daemon.blocks.store import BlockStore
from sparsekv.proto import MsgType


def h(i: int) -> bytes:
    """Key ``i``: keys 3 apart share their first word (the store compares both)."""
    return (i % 3).to_bytes(8, "little") + (i // 3).to_bytes(8, "little")


def wire(keys) -> np.ndarray:
    """16-byte keys as the wire carries them: int64 [n, 2]."""
    return np.frombuffer(b"".join(keys), dtype=np.int64).reshape(-1, 2).copy()


class Real:
    """``BlockStore`` with the model's interface, and ``data`` and ``keys`` lists (a
    block's rows and indexer keys) its zeroing writes. With ``refs``, each session looks
    chains up as a daemon's client does (``client.blocks.Blocks``: a chain it found before
    named by the token the store gave, the reply as the daemon makes it), keeping its
    tokens across a close of the session (a stale token must be refused, never answered)."""

    def __init__(self, n_blocks: int, ledger: UidLedger, refs: bool = False):
        self.data = [ZERO] * n_blocks
        self.keys = [ZERO] * n_blocks
        self.s = BlockStore(n_blocks, self._zero, ledger)
        self.clients: dict[int, Blocks] | None = {} if refs else None
        self.tally = collections.Counter()  # lookup requests: by chain ("named"), answered "resend", "head"

    def _lookup_call(self, session, kind, fields=None, arrays=None):
        assert kind == MsgType.BLOCK_LOOKUP
        chain = (fields or {}).get("chain")
        found = self.s.find(session, lookup_hashes(chain, arrays or {}), chain)
        self.tally.update(["named"] * (chain is not None) + ["resend"] * (found is None)
                          + ["head"] * bool(found is not None and found.head))
        return lookup_reply(found, chain)

    def _zero(self, blocks):
        for b in blocks:
            self.data[b] = self.keys[b] = ZERO

    def open(self, session, uid):
        self.s.open(session, uid)

    def reserve(self, session, n):
        return self.s.reserve(session, n)

    def alloc(self, session, n):
        return self.s.alloc(session, n).tolist()

    def write(self, session, block, value):
        self.s.writable(session, np.asarray([block * 4 + 3]), 4)
        self.data[block] = value

    def write_keys(self, session, blocks, values):
        for b, v in zip(self.s.keys_writable(session, np.asarray(blocks, dtype=np.int64)).tolist(), values):
            self.keys[b] = v

    def read_keys(self, session, blocks):
        return [self.keys[b] for b in self.s.keys_readable(session, np.asarray(blocks, dtype=np.int64)).tolist()]

    def commit(self, session, blocks, keys):
        return self.s.commit(session, np.asarray(blocks, dtype=np.int64), wire(keys)).tolist()

    def lookup(self, session, keys):
        if self.clients is None:
            return self.s.lookup(session, wire(keys)).tolist()
        if session not in self.clients:
            self.clients[session] = Blocks(functools.partial(self._lookup_call, session), "ns", 4, chain_refs=True)
        return self.clients[session].lookup(wire(keys)).tolist()

    def release(self, session, blocks):
        self.s.release(session, np.asarray(blocks, dtype=np.int64))

    def close(self, session):
        self.s.close(session)

    @property
    def lru(self):
        return list(self.s.lru)

    @property
    def ledger(self):
        return self.s.ledger


def both(n_blocks=4, quota=0):
    """The model and the store, each with its own ledger, sessions 1 and 2 of uid 7 open."""
    out = []
    for cls in (BlockStoreModel, Real):
        m = cls(n_blocks, UidLedger(quota))
        m.open(1, 7)
        m.open(2, 7)
        out.append(m)
    return out


def cache(m, session, key, value=5):
    """Allocate, write and commit one block under ``h(key)``; return the block."""
    [b] = m.alloc(session, 1)
    m.write(session, b, value)
    assert m.commit(session, [b], [h(key)]) == [b]
    return b


@pytest.fixture(params=["model", "store"])
def one(request):
    m = both()[0 if request.param == "model" else 1]
    return m


def test_alloc_takes_free_blocks_lowest_first_then_evicts_in_lru_order(one):
    blocks = [cache(one, 1, k) for k in range(4)]
    assert blocks == [0, 1, 2, 3]
    one.release(1, [2, 0, 3, 1])  # unpinned in this order: the LRU order
    assert one.alloc(2, 2) == [2, 0]
    assert one.data[2] == ZERO and one.data[0] == ZERO
    assert one.lookup(2, [h(2)]) == []  # block 2 held key 2: evicted, forgotten
    assert one.lookup(2, [h(3)]) == [3]


def test_a_pinned_block_is_never_evicted(one):
    cache(one, 1, 0)  # block 0, pinned by its committer
    b = cache(one, 1, 1)
    one.release(1, [b])
    one.alloc(2, 2)  # two free ones
    assert one.alloc(2, 1) == [1]  # the unpinned one
    with pytest.raises(PoolExhausted) as e:
        one.alloc(2, 1)
    assert e.value.detail == {"wanted": 1, "free": 0, "evictable": 0, "reserved": 0}


def test_only_the_private_owner_writes_or_commits_and_a_cached_block_is_read_only(one):
    [b] = one.alloc(1, 1)
    with pytest.raises(BlockError):
        one.write(2, b, 9)
    with pytest.raises(BlockError):
        one.commit(2, [b], [h(1)])
    one.commit(1, [b], [h(1)])
    with pytest.raises(BlockError):
        one.write(1, b, 9)


def test_first_commit_wins_and_the_second_block_stays_private(one):
    a = cache(one, 1, 1)
    [b] = one.alloc(2, 1)
    assert one.commit(2, [b], [h(1)]) == [a]
    one.write(2, b, 3)  # still its own
    one.release(2, [b])
    assert one.data[b] == ZERO


def test_lookup_pins_the_longest_cached_prefix(one):
    blocks = [cache(one, 1, k) for k in (10, 11, 12)]
    one.release(1, blocks)
    assert one.lookup(2, [h(10), h(11), h(99), h(12)]) == blocks[:2]
    assert one.alloc(2, 2) == [3, blocks[2]]  # the pinned prefix stays
    with pytest.raises(BlockError):
        one.release(1, blocks[:1])  # its committer unpinned it already


def test_lookup_stops_before_a_block_a_reservation_needs(one):
    blocks = [cache(one, 1, k) for k in range(4)]
    one.release(1, blocks)
    assert one.reserve(2, 3) == 3
    assert one.lookup(1, [h(k) for k in range(4)]) == blocks[:1]
    assert one.alloc(2, 3) == blocks[1:]  # the promise holds


def test_lookup_pins_evictable_blocks_out_of_the_callers_own_reservation(one):
    blocks = [cache(one, 1, k) for k in range(4)]
    one.release(1, blocks)
    assert one.reserve(2, 4) == 4  # everything
    assert one.lookup(2, [h(k) for k in range(3)]) == blocks[:3]  # paid by its own promise
    assert one.reserve(2, 0) == 1
    assert one.alloc(2, 1) == blocks[3:]


def test_reserve_refuses_with_free_evictable_and_reserved(one):
    a = cache(one, 1, 1)
    cache(one, 1, 2)
    one.release(1, [a])
    assert one.reserve(1, 2) == 2
    with pytest.raises(PoolExhausted) as e:
        one.reserve(2, 2)
    assert e.value.detail == {"wanted": 2, "free": 2, "evictable": 1, "reserved": 2}
    assert e.value.code == "POOL_EXHAUSTED"
    assert one.reserve(1, -5) == 0
    assert one.reserve(2, 3) == 3


def test_quota_per_uid_counts_private_and_reserved_blocks_over_stores():
    ledger = UidLedger(3)
    for cls in (BlockStoreModel, Real):
        x, y = cls(4, ledger), cls(4, ledger)
        x.open(1, 7)
        y.open(2, 7)
        y.open(3, 8)
        x.alloc(1, 1)
        x.reserve(1, 1)
        with pytest.raises(BlockError) as e:
            y.alloc(2, 2)
        assert e.value.code == "QUOTA_EXCEEDED"
        assert y.alloc(3, 3)  # another uid
        y.close(3)
        x.close(1)
        y.close(2)
        assert ledger.held == {}


def test_close_releases_pins_and_frees_private_blocks(one):
    a = cache(one, 1, 1)
    [b] = one.alloc(1, 1)
    one.write(1, b, 4)
    one.reserve(1, 1)
    one.close(1)
    assert one.lru == [a]
    assert one.data[b] == ZERO
    assert one.reserve(2, 4) == 4


def test_a_session_holding_a_block_past_two_billion_pins_keeps_the_count_and_closes():
    """A session's pins of one block are counted exactly past 2**31 (a lookup may name a
    hash 65,536 times), and ``close`` releases them by count: its cost does not grow with
    the pins (it once built one block id a pin)."""
    zeroed = []
    s = BlockStore(2, zeroed.extend)
    s.open(1, 1000)
    s.open(2, 1000)
    [b] = s.alloc(1, 1)
    s.commit(1, [b], wire([h(1)]))
    s._pinned[1][b] = s.pins[b] = 2**31 - 1  # as after 32,768 lookups naming the hash 65,536 times
    assert s.lookup(1, wire([h(1)] * 3)).tolist() == [b] * 3
    assert s._pinned[1][b] == s.pins[b] == 2**31 + 2
    s._pinned[1][b] = s.pins[b] = 2**40  # as many as a session could ever take: one id a pin would not fit memory
    assert s.lookup(2, wire([h(1)])).tolist() == [b]  # another session's pin stays
    s.close(1)
    assert s.pins[b] == 1 and s.evictable_blocks == 0
    s.close(2)
    assert s.pins[b] == 0 and s.evictable_blocks == 1
    s.open(3, 1000)
    assert s.alloc(3, 2).tolist() == [1, b] and zeroed == [b]  # the free block, then b evicted


def test_indexer_keys_are_written_by_the_private_owner_only_and_read_by_holders(one):
    [b] = one.alloc(1, 1)
    with pytest.raises(BlockError, match="not private"):
        one.write_keys(2, [b], [9])
    with pytest.raises(BlockError, match="distinct"):
        one.write_keys(1, [b, b], [1, 2])
    one.write_keys(1, [b], [8])
    assert one.read_keys(1, [b]) == [8]
    with pytest.raises(BlockError, match="neither pinned"):
        one.read_keys(2, [b])  # another session's private block
    assert one.commit(1, [b], [h(1)]) == [b]
    with pytest.raises(BlockError, match="not private"):
        one.write_keys(1, [b], [9])  # committed with the block: read-only
    with pytest.raises(BlockError, match="neither pinned"):
        one.read_keys(2, [b])  # cached, but not pinned by this other session
    assert one.lookup(2, [h(1)]) == [b]
    assert one.read_keys(2, [b, b]) == [8, 8]


def test_indexer_keys_are_zeroed_with_their_block(one):
    [a, b] = one.alloc(1, 2)
    one.alloc(2, 2)  # the rest of the store
    one.write_keys(1, [a, b], [3, 4])
    one.release(1, [a])  # a private block freed
    one.commit(1, [b], [h(1)])
    one.release(1, [b])
    assert one.alloc(2, 2) == [a, b]  # a free, b evicted
    assert one.read_keys(2, [a, b]) == [ZERO, ZERO]


def test_a_long_chain_looked_up_again_after_evictions_and_recommits_answers_as_the_model():
    """A chain of 72 blocks: found whole (remembered), then partly evicted, freed, committed
    again elsewhere, by two sessions, with runs of consecutive blocks and scattered ones:
    every answer, pin count and LRU order as the model's."""
    n = max(chains_module.CHAIN_MEMO_MIN, 72)
    model, real = both(n_blocks=2 * n)
    chain = [h(1000 + i) for i in range(n)]

    def same(op, *args):
        got = []
        for m in (model, real):
            try:
                got.append(getattr(m, op)(*args))
            except BlockError as e:
                got.append((e.code, e.detail))
        assert got[0] == got[1], (op, got)
        assert model.lru == real.lru
        return got[0]

    blocks = same("alloc", 1, n)
    same("commit", 1, blocks, chain)
    same("release", 1, blocks)
    for _ in range(2):  # found whole: the second from the memo
        got = same("lookup", 2, chain)
        assert got == blocks
        same("release", 2, got)
    same("alloc", 1, n + 3)  # every free block, then the 3 least recently unpinned: a prefix is gone
    assert same("lookup", 2, chain) == []
    same("close", 1)
    model.open(1, 7)
    real.open(1, 7)
    again = same("alloc", 1, n)
    held = same("commit", 1, again[::-1], chain)  # the same keys in other blocks (those still cached keep theirs)
    assert held[:3] == again[::-1][:3] and held[3:] == blocks[3:]
    same("release", 1, again)
    got = same("lookup", 2, chain)
    assert got == held
    assert same("lookup", 1, chain) == got  # (the memo's answer now)
    same("release", 2, got[:5] + got[5:])
    same("release", 1, got)
    assert int(real.s.pins.sum()) == 0


@pytest.mark.parametrize("other", [(0, 2), (99, 1)], ids=["first word kept", "second word kept"])
def test_a_remembered_chain_whose_block_holds_another_key_now_is_not_answered_from_memory(other):
    """A chain found whole twice (the second from the memo); its first block evicted and
    committed again under a key sharing one of the two words of its old key, every other
    block still cached: the chain misses at its first key, as in the model."""
    def key(lo: int, hi: int) -> bytes:
        return lo.to_bytes(8, "little") + hi.to_bytes(8, "little")

    n = max(chains_module.CHAIN_MEMO_MIN, 64)
    model, real = both(n_blocks=n)
    chain = [key(i, 1) for i in range(n)]
    _, blocks = same(model, real, 1, "alloc", [n])
    same(model, real, 1, "commit", [blocks, chain])
    same(model, real, 1, "release", [blocks])
    for _ in range(2):
        assert same(model, real, 2, "lookup", [chain]) == ("ok", blocks)
        same(model, real, 2, "release", [blocks])
    assert same(model, real, 1, "alloc", [1]) == ("ok", blocks[:1])  # the least recently unpinned, evicted
    same(model, real, 1, "commit", [blocks[:1], [key(*other)]])
    assert same(model, real, 2, "lookup", [chain]) == ("ok", [])


def test_the_memo_of_a_small_store_stays_in_proportion_to_its_blocks():
    """A client that commits a new key into a one-block store, again and again, each time
    looking up that key named 65,536 times (a chain found whole, remembered): the store
    keeps no more than a few bytes a block for it, not 8 MiB of remembered ids."""
    s = BlockStore(1, lambda blocks: None)
    s.open(1, 7)

    def again(i):
        s.commit(1, s.alloc(1, 1), wire([h(i)]))
        got = s.lookup(1, wire([h(i)] * 65536))
        assert got.size == 65536 and s.pins[0] == 65537
        s.release(1, np.concatenate([got, got[:1]]))

    again(0)  # (what numpy imports on first use is not the store's)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(1, 20):
            again(i)
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 64 << 10, kept


def test_a_chain_over_the_memos_bound_is_not_remembered_and_pushes_no_other_out():
    s = BlockStore(4, lambda blocks: None)  # a bound of 32 ids
    s.open(1, 7)
    s.commit(1, s.alloc(1, 2), wire([h(0), h(1)]))
    s.lookup(1, wire([h(0), h(1)]))
    s.lookup(1, wire([h(0)] * 64))  # 64 ids: over the bound
    assert len(s.chains) == 1 and s.chains.get(wire([h(0), h(1)])) is not None


def test_a_long_chain_given_as_nested_lists_is_looked_up_as_its_array():
    """``lookup`` takes a chain as ``commit`` does (anything int64 [n, 2] converts from),
    remembered chains included."""
    n = max(chains_module.CHAIN_MEMO_MIN, 64)
    s = BlockStore(n, lambda blocks: None)
    s.open(1, 7)
    chain = wire([h(i) for i in range(n)])
    blocks = s.alloc(1, n)
    s.commit(1, blocks, chain.tolist())
    for _ in range(2):
        assert s.lookup(1, chain.tolist()).tolist() == blocks.tolist()


# -- random sequences ---------------------------------------------------------------------
OPS = ("alloc", "commit", "lookup", "release", "alloc", "commit", "lookup", "release", "write", "reserve", "close",
       "write_keys", "read_keys")


def pick(model, session, a: int, n: int, pinned: bool) -> list[int]:
    """``n`` blocks for ``session`` to name: mostly distinct ones it holds (private, or
    pinned too when ``pinned``), from the ``a``-th on; for ``a >= 8`` any blocks, to reach
    the refusals."""
    held = sorted(b for b, s in model.private.items() if s == session)
    if pinned:
        held += sorted(b for b, p in model.pins.items() if p.get(session))
    if not held or a >= 8:
        return [(a + i) % model.n_blocks for i in range(n)]
    return [held[(a + i) % len(held)] for i in range(min(n, len(held)))]


def request(model, session: int, op: str, a: int, b: int, stamp: int, last: list) -> list:
    """The arguments of one request drawn as two integers ``a`` and ``b`` (``last``: the
    chain looked up last, by any session)."""
    if op == "reserve":
        return [a % 5 - 1]
    if op == "alloc":
        return [a % 4]
    if op == "write":
        return [pick(model, session, a, 1, False)[0], stamp]
    if op == "write_keys":  # mostly its own blocks (a >= 8: anyone's; b == 9: one named twice)
        blocks = pick(model, session, a, b % 2 + 1, False)
        blocks = blocks + blocks[:1] if b == 9 else blocks
        return [blocks, [stamp + 1000 * i for i in range(len(blocks))]]
    if op == "read_keys":
        return [pick(model, session, a, b % 3 + 1, True)]
    if op == "commit":  # up to 3 blocks, hashes from a small set (chains of keys b, b+1, ...)
        blocks = pick(model, session, a, b % 3 + 1, False)
        first = 0 if b < 5 else b % 5  # mostly a chain's first blocks (then another's commit finds them cached)
        return [blocks, [h(first + i) for i in range(len(blocks))]]
    if op == "release":
        return [pick(model, session, a, b % 3 + 1, True)]
    if op == "lookup":  # mostly a chain from the first key (the keys commits use most)
        if a < 3 and last:  # the last chain again (as the memo remembers it), or another ending in its key:
            return [[last[1], last[0], *last[2:]] if a == 1 and len(last) > 2 else  # its first two keys swapped
                    [last[-1]] * len(last) if a == 2 else last]  # its last key repeated (blocks named twice)
        return [[h((0 if a < 6 else a % 5) + i) for i in range(b % 6)]]
    return []


@settings(max_examples=helpers.examples(50, 3000), deadline=None)
@given(n_blocks=st.integers(1, 6), quota=st.sampled_from([0, 1, 3, 6]),
       steps=st.lists(st.tuples(st.sampled_from([1, 2, 1, 2, 3]), st.sampled_from(OPS), st.integers(0, 9),
                                st.integers(0, 9)), min_size=20, max_size=80))
def test_store_equals_model_and_keeps_the_invariants(n_blocks, quota, steps):
    equal_runs(n_blocks, quota, steps)


# Mostly what fills the store with chains and looks them up again (the memo's paths).
MEMO_OPS = ("cache", "cache", "lookup", "lookup", "lookup", "release", "release", "alloc", "reserve", "close")


@settings(max_examples=helpers.examples(50, 3000), deadline=None)
@given(n_blocks=st.integers(2, 8), quota=st.sampled_from([0, 2, 3, 6]),
       steps=st.lists(st.tuples(st.sampled_from([1, 2, 1, 2, 3]), st.sampled_from(MEMO_OPS), st.integers(0, 9),
                                st.integers(0, 9)), min_size=20, max_size=80))
def test_chains_found_before_take_the_memo_and_answer_as_the_model(n_blocks, quota, steps):
    """The same with every chain remembered once found whole, and the part found of every
    chain found in part (CHAIN_MEMO_HEAD_MIN set to 1 here: a remembered chain is tried as
    the head of any longer one), so a lookup answers from the memo after checking it; the requests
    mostly commit and look chains up again (the same chain, or one ending in the same key
    with keys swapped or repeated) between evictions, recommits and releases. The sessions
    look up as a daemon's clients do: a chain found before named by its token (two tokens
    a session here, so that older ones are refused too)."""
    with memo_everywhere():
        equal_runs(n_blocks, quota, steps, refs=True)


def test_long_runs_of_memo_requests_name_chains_and_are_answered_and_refused_as_the_model():
    """Fixed long sequences of the memo test's requests (random, seeded), each step equal to
    the model, in which chains are named by token, answered with their blocks, and refused."""
    tally = collections.Counter()
    rng = np.random.default_rng(7)
    with memo_everywhere():
        for n_blocks in (3, 5, 8):
            steps = [(int(rng.choice([1, 2, 1, 2, 3])), str(rng.choice(MEMO_OPS)), int(rng.integers(10)),
                      int(rng.integers(10))) for _ in range(400)]
            tally.update(equal_runs(n_blocks, 3, steps, refs=True).tally)
    assert tally["named"] > 20 and tally["head"] > 10 and tally["resend"] > 5, tally  # (88, 19, 68 here)


@contextlib.contextmanager
def memo_everywhere():
    """Every chain remembered and tried as a head (CHAIN_MEMO_MIN, CHAIN_MEMO_HEAD_MIN 1),
    two tokens a session (CHAIN_GRANTS 2)."""
    old = chains_module.CHAIN_MEMO_MIN, chains_module.CHAIN_MEMO_HEAD_MIN, chains_module.CHAIN_GRANTS
    chains_module.CHAIN_MEMO_MIN = chains_module.CHAIN_MEMO_HEAD_MIN = 1
    chains_module.CHAIN_GRANTS = 2
    try:
        yield
    finally:
        chains_module.CHAIN_MEMO_MIN, chains_module.CHAIN_MEMO_HEAD_MIN, chains_module.CHAIN_GRANTS = old


def equal_runs(n_blocks, quota, steps, refs: bool = False) -> "Real":
    model, real = BlockStoreModel(n_blocks, UidLedger(quota)), Real(n_blocks, UidLedger(quota), refs)
    uids = {1: 7, 2: 7, 3: 8}
    for m in (model, real):
        for s, uid in uids.items():
            m.open(s, uid)
    content = {}  # hash -> what its block held (rows, indexer keys) when committed
    last = []  # the chain looked up last
    for stamp, (session, op, a, b) in enumerate(steps, start=100):
        if op == "cache":  # allocate blocks, then commit them under a chain (from key a % 5)
            kind, blocks = same(model, real, session, "alloc", [b % 3 + 1])
            if kind != "ok":
                continue
            op, args = "commit", [blocks, [h(a % 5 + i) for i in range(len(blocks))]]
        else:
            args = request(model, session, op, a, b, stamp, last)
        last = args[0] if op == "lookup" else last
        kind, answer = same(model, real, session, op, args)
        if op == "close":
            for m in (model, real):
                m.open(session, uids[session])
        if op == "commit" and kind == "ok":
            for b, key, held in zip(args[0], args[1], answer):
                if held == b:
                    content[key] = (model.data[b], model.keys[b])
        if op == "lookup" and kind == "ok":
            for key, b in zip(args[0], answer):  # rows and keys never rewritten while cached
                assert (model.data[b], model.keys[b]) == (real.data[b], real.keys[b]) == content[key]
    return real


def same(model, real, session: int, op: str, args: list) -> tuple:
    """Request ``op`` of both: ("ok", its answer) or (error code, detail), the same from
    each; then the model's invariants and the store's counts checked."""
    got = []
    for m in (model, real):
        try:
            got.append(("ok", getattr(m, op)(session, *args)))
        except BlockError as e:
            got.append((e.code, e.detail))
    assert got[0] == got[1], (op, args)
    model.check()
    assert model.lru == real.lru
    assert real.data == model.data and real.keys == model.keys
    assert real.s.reserved_total == model.total_reserved()
    assert int(real.s.pins.sum()) == sum(sum(p.values()) for p in model.pins.values())
    assert real.s.ledger.held == model.ledger.held == model.uid_counts()
    return got[0]


def test_short_chains_are_remembered_too_and_each_counts_at_least_an_entrys_worth():
    """A chain of any length found whole is remembered (a system prompt of a few blocks is
    looked up again and again too); each counts at least CHAIN_MEMO_ENTRY_IDS against the
    bound, so a flood of one-block chains keeps few entries, the newest."""
    s = BlockStore(8, lambda blocks: None)  # bound: 8 ids a block -> 64 ids -> 4 one-block entries
    s.open(1, 7)
    for i in range(10):
        b = s.alloc(1, 1)
        s.commit(1, b, wire([h(i)]))
        s.release(1, b)
        got = s.lookup(1, wire([h(i)]))
        s.release(1, got)
        assert s.chains.get(wire([h(i)])) is not None  # remembered
    assert len(s.chains) == 64 // chains_module.CHAIN_MEMO_ENTRY_IDS
    assert s.chains.ids == len(s.chains) * chains_module.CHAIN_MEMO_ENTRY_IDS


def test_a_cached_prompt_found_in_part_heads_the_next_requests_and_only_their_own_blocks_are_probed():
    """Requests share a cached 72-block system prompt and differ after it: the first is
    probed whole, and the part found is remembered; each next one takes that part from the
    memo and probes only its own blocks; evicting a block of the prompt makes the memo stale
    and the next lookup probes the whole chain again, with the index's answer."""
    n = 72
    s = BlockStore(2 * n, lambda blocks: None)
    s.open(1, 7)
    prompt = [h(i) for i in range(n)]
    blocks = s.alloc(1, n)
    s.commit(1, blocks, wire(prompt))
    s.release(1, blocks)
    probed = []
    find = s.index.find
    s.index.find = lambda lo, hi: (probed.append(lo.size), find(lo, hi))[1]
    for r in range(3):
        got = s.lookup(1, wire(prompt + [h(1000 + 10 * r + i) for i in range(5)]))
        assert got.tolist() == blocks.tolist()
        s.release(1, got)
    assert probed == [n + 5, 5, 5]
    # two more blocks cached, then the least recently unpinned goes: a prompt block
    s.commit(1, s.alloc(1, n + 1), wire([h(5000 + i) for i in range(n + 1)]))
    probed.clear()
    got = s.lookup(1, wire(prompt + [h(2000)]))
    assert probed == [n + 1] and got.size < n  # the stale head dropped; the index answered
    s.release(1, got)

