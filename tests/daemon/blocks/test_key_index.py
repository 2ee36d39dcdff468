"""``KeyIndex`` (the block store's open-addressing table of 16-byte keys) against a dict,
on random inserts, deletes and finds of keys that share words (long probe runs,
tombstones, rebuilds)."""

import numpy as np
from hypothesis import given, settings, strategies as st

import helpers

from sparsekv.daemon.blocks.index import KeyIndex

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
        assert index.tombs <= index.size // 4


@settings(max_examples=helpers.examples(50, 500), deadline=None)
@given(seed=st.integers(0, 2**32), words=st.lists(st.tuples(st.integers(-2**63, 2**63 - 1),
                                                             st.integers(-2**63, 2**63 - 1)), min_size=1, max_size=40))
def test_a_keys_slot_is_the_same_in_python_integers_and_in_numpy(seed, words):
    index = KeyIndex(64, seed=seed)
    lo, hi = np.array([w[0] for w in words], np.int64), np.array([w[1] for w in words], np.int64)
    assert [index._start_one(a, b) for a, b in words] == index._start(lo, hi).tolist()
