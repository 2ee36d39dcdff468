"""Clause 7 of the block store contract (DESIGN §9) on small hand-made examples, each run
on the reference model and on the daemon's ``BlockStore``: a uid's private, reserved and
pinned blocks stay within ``max_blocks_per_uid`` (a pinned block once for each session
that pins it), so that allocating and committing again and again pins no more than the
quota; a lookup takes each block it pins anew out of the reservation, then the quota's
room, and stops short of the quota. (The random sequences of test_block_contract.py
check each uid's count after every step.)"""

import pytest

from sparsekv.daemon.blocks.contract import BlockError, BlockStoreModel, UidLedger
from test_block_contract import Real, cache, h


def quota_store(cls, n_blocks: int, quota: int):
    """``cls`` (the model or the store) of ``n_blocks`` under ``max_blocks_per_uid``
    ``quota``: sessions 1 and 2 of uid 7, and 3 of uid 8."""
    m = cls(n_blocks, UidLedger(quota))
    for session, uid in ((1, 7), (2, 7), (3, 8)):
        m.open(session, uid)
    return m


@pytest.fixture(params=[BlockStoreModel, Real], ids=["model", "store"])
def kind(request):
    return request.param


def test_committed_blocks_count_against_the_quota_while_their_committer_pins_them(kind):
    """A commit keeps the block in its uid's count (private, then pinned by the committer):
    allocating and committing again and again stops at ``max_blocks_per_uid`` blocks
    pinned, for every session of the uid; another uid is unaffected; releasing the pins
    gives the room back."""
    m = quota_store(kind, 8, 3)
    blocks = [cache(m, 1, k) for k in range(3)]
    assert m.ledger.held == {7: 3}
    for op, args in (("alloc", (1, 1)), ("reserve", (1, 1)), ("alloc", (2, 1))):
        with pytest.raises(BlockError) as e:
            getattr(m, op)(*args)
        assert e.value.code == "QUOTA_EXCEEDED", op
    assert m.alloc(3, 3) == [3, 4, 5]  # another uid
    m.release(1, blocks[:2])  # cached, evictable: no longer the uid's
    assert m.ledger.held == {7: 1, 8: 3}
    assert cache(m, 2, 10) == 6 and m.alloc(1, 1) == [7]
    with pytest.raises(BlockError, match="max_blocks_per_uid 3"):
        m.alloc(2, 1)
    m.close(1)
    m.close(2)
    m.close(3)
    assert m.ledger.held == {}


def test_lookup_stops_before_the_block_that_would_take_its_uid_past_the_quota(kind):
    """A block a lookup pins for a session that did not pin it counts for the session's
    uid (once for each session that pins it): the lookup stops early, without an error,
    before the block that would take the uid past its quota. What the session pins
    already costs nothing, as does a block's second mention; a block's last unpin by the
    session gives its room back."""
    m = quota_store(kind, 8, 4)
    blocks = [cache(m, 3, k) for k in range(4)]  # uid 8's, pinned by it: not evictable
    chain = [h(k) for k in range(4)]
    m.alloc(1, 2)
    assert m.lookup(1, chain) == blocks[:2]  # the third would be uid 7's fifth block
    assert m.ledger.held == {7: 4, 8: 4}
    assert m.lookup(1, [h(0), h(0), h(1)]) == [blocks[0], blocks[0], blocks[1]]  # pinned already: free
    assert m.lookup(2, chain) == []  # another session of the uid: a pin of its own each
    m.release(1, [blocks[0], blocks[0]])  # pinned once still
    assert m.lookup(2, chain) == []
    m.release(1, [blocks[0]])  # its last pin of block 0
    assert m.ledger.held == {7: 3, 8: 4}
    assert m.lookup(2, [h(0), h(0), h(1)]) == blocks[:1] * 2  # one more block, named twice
    assert m.ledger.held == {7: 4, 8: 4}


def test_lookup_takes_every_hit_the_session_does_not_pin_yet_out_of_its_reservation(kind):
    """A hit stands for a block the caller would otherwise allocate: it takes one block of
    the caller's reservation whether or not another session pins it (the uid's count
    unchanged: reserved, then pinned); past the reservation, the quota's room; a block it
    pins already takes nothing."""
    m = quota_store(kind, 8, 4)
    blocks = [cache(m, 3, k) for k in range(3)]  # uid 8's, pinned by it: not evictable
    assert m.reserve(1, 2) == 2
    assert m.lookup(1, [h(0), h(1), h(2)]) == blocks  # two out of the reservation, one more
    assert m.reserve(1, 0) == 0 and m.ledger.held == {7: 3, 8: 3}
    assert m.reserve(2, 1) == 1
    assert m.lookup(1, [h(2), h(0)]) == [blocks[2], blocks[0]]  # pinned already
    assert m.reserve(1, 0) == 0 and m.ledger.held == {7: 4, 8: 3}
    with pytest.raises(BlockError, match="max_blocks_per_uid 4"):
        m.reserve(1, 1)
    m.close(1)
    assert m.ledger.held == {7: 1, 8: 3}
    m.open(1, 7)
    assert m.reserve(1, 3) == 3
