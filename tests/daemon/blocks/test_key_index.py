"""``KeyIndex`` (the block store's open-addressing table of 16-byte keys) against a dict,
on random inserts, deletes and finds of keys that share words (long probe runs,
tombstones, rebuilds)."""

import numpy as np
from hypothesis import given, settings, strategies as st

import helpers

from sparsekv.daemon.blocks.index import EMPTY, TOMB, KeyIndex

KEYS = st.tuples(st.integers(-3, 3), st.integers(-2, 2))  # few distinct words: many collisions


@settings(max_examples=helpers.examples(50, 3000), deadline=None)
@given(max_keys=st.integers(1, 12), seed=st.integers(0, 3),
       ops=st.lists(st.tuples(st.sampled_from(["insert", "delete", "find"]), st.lists(KEYS, max_size=6)),
                    max_size=60))
def test_key_index_equals_a_dict(max_keys, seed, ops):
    index, ref, block = KeyIndex(max_keys, seed=seed), {}, 0
    for op, keys in ops:
        if op == "insert":
            for k in keys:
                if k not in ref and len(ref) < max_keys:
                    index.insert(k[0], k[1], block)
                    ref[k] = block
                    block += 1
        elif op == "delete":
            gone = list(dict.fromkeys(k for k in keys if k in ref))
            index.delete(np.array([k[0] for k in gone], np.int64), np.array([k[1] for k in gone], np.int64))
            for k in gone:
                del ref[k]
        lo = np.array([k[0] for k in keys], np.int64)
        hi = np.array([k[1] for k in keys], np.int64)
        want = [ref.get(k, -1) for k in keys]
        # key by key (few keys) and in vectorised passes (many), the same answers
        assert index.find(lo, hi).tolist() == index._find_few(lo, hi).tolist() == want
        assert index._probe(lo, hi)[1].tolist() == want
        assert index.tombs <= index.size // 4 and index.tombs == int((index.block == TOMB).sum())


@settings(max_examples=helpers.examples(50, 500), deadline=None)
@given(seed=st.integers(0, 2**32), words=st.lists(st.tuples(st.integers(-2**63, 2**63 - 1),
                                                             st.integers(-2**63, 2**63 - 1)), min_size=1, max_size=40))
def test_a_keys_slot_is_the_same_in_python_integers_and_in_numpy(seed, words):
    index = KeyIndex(64, seed=seed)
    lo, hi = np.array([w[0] for w in words], np.int64), np.array([w[1] for w in words], np.int64)
    assert [index._start_one(a, b) for a, b in words] == index._start(lo, hi).tolist()


@settings(max_examples=helpers.examples(40, 1000), deadline=None)
@given(seed=st.integers(0, 3), draws=st.integers(0, 2**32 - 1))
def test_keys_inserted_many_at_once_equal_a_dict(seed, draws):
    """``insert_many`` (commits and rebuilds: whole-array rounds, found by a review to stall
    the loop for seconds key by key) leaves what inserting key by key would: every key
    found, over tombstones and through rebuilds (twelve rounds, the table rebuilt after the
    fourth and eighth if it was not rebuilt by then: tombstones that end their run are
    emptied, so few pile up), on keys sharing words (long runs)."""
    rng = np.random.default_rng(draws)
    index, ref, block = KeyIndex(40, seed=seed), {}, 0
    rebuilds = [0]
    rebuild = index._rebuild

    def counted():
        rebuilds[0] += 1
        rebuild()

    index._rebuild = counted
    for round_ in range(12):
        if round_ in (4, 8) and rebuilds[0] < round_ // 4:
            counted()
        drawn = zip(rng.integers(-40, 41, 40).tolist(), rng.integers(-3, 4, 40).tolist())
        fresh = [k for k in dict.fromkeys(drawn) if k not in ref][:40 - len(ref)]
        blocks = np.arange(block, block + len(fresh), dtype=np.int64)
        index.insert_many(np.array([k[0] for k in fresh], np.int64), np.array([k[1] for k in fresh], np.int64),
                          blocks)
        ref.update(zip(fresh, blocks.tolist()))
        block += len(fresh)
        gone = [k for k in ref if rng.random() < 0.75]  # most of them: tombstones pile up
        index.delete(np.array([k[0] for k in gone], np.int64), np.array([k[1] for k in gone], np.int64))
        for k in gone:
            del ref[k]
        keys = list(ref) + list(zip(rng.integers(-40, 41, 20).tolist(), rng.integers(-3, 4, 20).tolist()))
        lo, hi = np.array([k[0] for k in keys], np.int64), np.array([k[1] for k in keys], np.int64)
        want = [ref.get(k, -1) for k in keys]
        assert index.find(lo, hi).tolist() == index._find_few(lo, hi).tolist() == want
        assert index.tombs == int((index.block == TOMB).sum()) and int((index.block >= 0).sum()) == len(ref)
        assert (index.block >= TOMB).all()  # no claim mark left behind
        nxt = np.roll(index.block, -1)
        assert not ((index.block == TOMB) & (nxt == EMPTY)).any()  # none ends its run
    assert rebuilds[0] >= 2


def test_a_large_index_inserted_at_once_and_rebuilt_finds_every_key():
    """A quarter-full table of 2^18 random keys (the rounds' case: many keys, short runs)."""
    n = 1 << 18
    rng = np.random.default_rng(0)
    index = KeyIndex(n, seed=1)
    lo, hi = rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64), rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64)
    index.insert_many(lo, hi, np.arange(n, dtype=np.int64))
    assert (index.find(lo, hi) == np.arange(n)).all()
    index.delete(lo[::2], hi[::2])
    index._rebuild()
    assert index.tombs == 0 and (index.find(lo, hi) == np.where(np.arange(n) % 2, np.arange(n), -1)).all()


def test_a_rebuild_wraps_the_keys_pushed_past_the_tables_end():
    """The rebuild lays keys out in the order of their start slots; those pushed past the
    last slot wrap round to the table's start, after the keys that start there."""
    index = KeyIndex(4, seed=3)  # 16 slots
    rng = np.random.default_rng(5)
    by_start: dict[int, list] = {}
    while len(by_start.get(index.size - 1, [])) < 3 or len(by_start.get(0, [])) < 1:
        a, b = (int(x) for x in rng.integers(-2**63, 2**63 - 1, 2, dtype=np.int64))
        by_start.setdefault(index._start_one(a, b), []).append((a, b))
    keys = by_start[index.size - 1][:3] + by_start[0][:1]  # three start at the last slot, one at slot 0
    lo, hi = np.array([k[0] for k in keys], np.int64), np.array([k[1] for k in keys], np.int64)
    index.insert_many(lo, hi, np.arange(4, dtype=np.int64))
    index.delete(lo[3:], hi[3:])  # a tombstone at slot 0 or 1 (keys run on past it)
    index.insert_many(lo[3:], hi[3:], np.array([3], np.int64))
    wrapped = []
    insert_many = index.insert_many
    index.insert_many = lambda a, b, c: (wrapped.append(c.tolist()), insert_many(a, b, c))
    index._rebuild()
    assert index.tombs == 0 and (index.block >= EMPTY).all()
    assert index.find(lo, hi).tolist() == [0, 1, 2, 3]
    # the key of slot 0 stays there, one of the three takes slot 15, the other two wrap
    # round to slots 1 and 2: every slot from a key's start to its own holds a key
    assert len(wrapped) == 1 and sorted(wrapped[0] + [index.block[15]]) == [0, 1, 2]
    assert index.block[0] == 3 and sorted(index.block[[1, 2]].tolist()) == sorted(wrapped[0]) and index.block[3] == EMPTY
