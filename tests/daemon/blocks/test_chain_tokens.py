"""Chains named by token (DESIGN §9): a lookup found whole gives the session a token for
the chain, which its next lookups may send instead of the chain's hashes; the store answers
a token only for the session it was given to, among its latest CHAIN_GRANTS, and exactly
as the hashes would be answered. (The random sequences of test_block_contract.py run every
lookup of the memo test this way too.)"""

import numpy as np
import pytest

from sparsekv.daemon.blocks import chains as chains_module
from sparsekv.daemon.blocks.contract import BlockError
from sparsekv.daemon.blocks.store import BlockStore
from sparsekv.proto import LIMITS
from test_block_contract import both, h, wire


def cached_prompt(n: int, n_blocks: int) -> tuple[BlockStore, np.ndarray, list, int]:
    """A store of ``n_blocks`` with two sessions of uid 7 open (ids 1 and 2), of which the
    first committed an ``n``-block prompt and looked it up once: (store, the prompt's blocks,
    its keys, the token that lookup gave it)."""
    s = BlockStore(n_blocks, lambda blocks: None)
    s.open(1, 7)
    s.open(2, 7)
    prompt = [h(i) for i in range(n)]
    blocks = s.alloc(1, n)
    s.commit(1, blocks, wire(prompt))
    first = s.find(1, wire(prompt))
    assert first.blocks.tolist() == blocks.tolist() and first.token is not None and first.head == 0
    return s, blocks, prompt, first.token


def test_a_chain_named_by_its_token_is_answered_as_its_hashes_and_only_what_follows_is_probed():
    """A lookup found whole gives the session a token; naming it (no hashes, or the hashes
    that follow it) pins what sending the whole chain would: the chain's blocks (``head``
    counts them), then the rest found by the index, and the longer chain (found whole) gets
    a token of its own."""
    n = 6
    s, blocks, _, token = cached_prompt(n, 4 * n)
    pins = s.pins.copy()
    again = s.find(1, wire([]), token)
    assert again.blocks.tolist() == blocks.tolist() and again.head == n and again.token == token
    assert (s.pins - pins)[blocks].tolist() == [1] * n
    own = s.alloc(1, 2)
    s.commit(1, own, wire([h(100), h(101)]))
    probed = []
    find = s.index.find
    s.index.find = lambda lo, hi: (probed.append(lo.size), find(lo, hi))[1]
    longer = s.find(1, wire([h(100), h(101)]), token)
    assert probed == [2] and longer.head == n
    assert longer.blocks.tolist() == blocks.tolist() + own.tolist()
    assert longer.token not in (None, token)


def test_a_token_is_answered_only_for_the_session_it_was_given_to_while_its_chain_is_cached_whole():
    """Another session naming the token, the session after it closed, or a token beyond the
    session's CHAIN_GRANTS latest: None and nothing pinned. Once a block of the chain is
    evicted, naming it answers what its hashes would (the index's longest prefix), head 0."""
    n = 4
    s, blocks, prompt, token = cached_prompt(n, 2 * n)
    pins = s.pins.copy()
    assert s.find(2, wire([]), token) is None and s.find(2, wire([]), token + 1) is None
    assert (s.pins == pins).all()
    tokens = [token]
    for k in range(chains_module.CHAIN_GRANTS):  # as many newer tokens: the first falls out of the grants
        tokens.append(s.find(1, wire(prompt[:k % n + 1] if k < n else prompt[1:k % n + 2])).token)
    assert None not in tokens and s.find(1, wire([]), token) is None
    token = s.find(1, wire(prompt)).token  # given again
    assert s.find(1, wire([]), token).head == n
    s.release(1, np.repeat(np.arange(s.n_blocks), s._pinned[1]))  # every pin: evictable, block 0 oldest
    assert s.alloc(2, n + 1).size == n + 1  # the n free blocks, then the oldest evictable one
    got = s.find(1, wire([]), token)
    assert got.head == 0 and got.blocks.size == 0  # the chain's first block is gone: nothing cached of it
    s.close(1)
    s.open(1, 7)
    assert s.find(1, wire([]), token) is None


def test_a_named_chain_cut_short_by_the_reservations_is_answered_whole_with_head_zero():
    """A chain named whose blocks are evictable, with others' reservations needing them:
    the lookup stops early, as with its hashes, and the reply names no head (the blocks it
    sends are all the session gets) nor a token."""
    n = 4
    s, blocks, _, token = cached_prompt(n, n)
    s.release(1, np.concatenate([blocks, blocks]))
    assert s.reserve(2, 3) == 3
    got = s.find(1, wire([]), token)
    assert got.blocks.tolist() == blocks[:1].tolist() and got.head == 0 and got.token is None


def test_a_named_chain_cut_short_by_the_uids_quota_is_answered_with_head_zero():
    """The same when the uid's quota (max_blocks_per_uid, its pins counted) stops the
    lookup: room for 2 of the chain's 4 blocks, the 2 first pinned, no head, no token."""
    n = 4
    s, blocks, _, token = cached_prompt(n, n)
    s.release(1, np.concatenate([blocks, blocks]))
    s.ledger.max_blocks_per_uid = 2
    got = s.find(1, wire([]), token)
    assert got.blocks.tolist() == blocks[:2].tolist() and got.head == 0 and got.token is None
    assert s.ledger.held == {7: 2}


def test_a_named_chain_and_the_hashes_after_it_are_held_to_max_blocks():
    s = BlockStore(8, lambda blocks: None)
    s.open(1, 7)
    blocks = s.alloc(1, 2)
    s.commit(1, blocks, wire([h(0), h(1)]))
    token = s.find(1, wire([h(0), h(1)])).token
    too_many = np.zeros((LIMITS.max_blocks - 1, 2), np.int64)
    with pytest.raises(BlockError) as e:
        s.find(1, too_many, token)
    assert e.value.code == "TOO_LARGE"


def test_tokens_are_never_the_same_in_two_stores_and_one_store_does_not_answer_anothers():
    """One sequence for every store of the daemon: a client holding a token of engine m's
    store that names it to engine n's store (a Blocks object kept over a re-attach) is
    answered ``None`` there, even when it holds tokens of n too."""
    m, _, _, token_m = cached_prompt(3, 8)
    n, _, _, token_n = cached_prompt(3, 8)
    assert token_m != token_n
    assert n.find(1, wire([]), token_m) is None and m.find(1, wire([]), token_n) is None


def test_naming_a_chain_keeps_its_token_answered_while_longer_chains_get_theirs():
    """Requests behind one cached prompt each name the prompt's token with their own blocks
    after it; each gets the token of its whole chain too, more than CHAIN_GRANTS of them: the
    prompt's token, named every time, stays answered."""
    n = 3
    s, blocks, _, token = cached_prompt(n, 4 * n + 2 * chains_module.CHAIN_GRANTS + 2)
    for r in range(chains_module.CHAIN_GRANTS + 2):
        own = s.alloc(1, 1)
        s.commit(1, own, wire([h(1000 + r)]))
        got = s.find(1, wire([h(1000 + r)]), token)
        assert got is not None and got.head == n and got.blocks.tolist() == blocks.tolist() + own.tolist()
        assert got.token not in (None, token)



def test_a_token_whose_chain_lost_a_block_is_answered_as_the_index_answers_its_hashes_then():
    """The chain's first block evicted and its hash committed again into another block:
    naming the token (with a hash after it, or none) pins what sending the chain's hashes
    would now (the model's answer), head 0: its blocks are not the chain's any more."""
    for rest in ([], [h(60)]):
        model, real = both(6)
        keys = [h(i) for i in range(4)]
        for m in (model, real):
            blocks = m.alloc(1, 4)
            assert m.commit(1, blocks, keys) == blocks
        token = real.s.find(1, wire(keys)).token
        model.lookup(1, keys)
        for m in (model, real):
            m.release(1, blocks)
            m.release(1, blocks)  # evictable, the chain's first block the oldest
            assert m.alloc(2, 3) == [4, 5, blocks[0]]
            assert m.commit(2, [5], [keys[0]]) == [5]  # the first hash cached again, in block 5
        found = real.s.find(1, wire(rest), token)
        want = model.lookup(1, keys + rest)
        assert found.blocks.tolist() == want == [5, *blocks[1:]] and found.head == 0
        assert int(real.s.pins.sum()) == sum(sum(p.values()) for p in model.pins.values())


def test_a_client_answer_with_no_blocks_is_an_array_of_the_callers_own():
    """A chain named whose blocks are gone, nothing found (no blocks array in the reply):
    each caller gets a new empty array, so what one does with it reaches no other answer."""
    from test_block_contract import Real
    from sparsekv.daemon.blocks.contract import UidLedger

    got = []
    for _ in range(2):  # two clients, the same story
        real = Real(4, UidLedger(0), refs=True)
        real.open(1, 7)
        b = real.alloc(1, 2)
        real.commit(1, b, [h(0), h(1)])
        real.release(1, b)
        real.lookup(1, [h(0), h(1)])  # found whole: the client keeps the chain and its token
        real.release(1, b)
        real.alloc(1, 4)  # both blocks evicted
        got.append(real.clients[1].lookup(wire([h(0), h(1)])))  # named; nothing found
        assert real.tally["named"] == 1 and got[-1].size == 0
    assert got[0] is not got[1]
