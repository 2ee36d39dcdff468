"""``max_store_bytes``: the daemon memory the block stores' bookkeeping takes (at most
``BlockStore.bookkeeping_bytes`` a store, 8 B a block for each session using one, whatever
the rows' size; measured here against what a store really takes) is capped, at most
``max_store_share_per_uid`` of it for one uid, so engines of tiny rows cannot grow the
daemon without bound. A new store or session past a cap is refused
(POOL_FULL, or QUOTA_EXCEEDED for the uid's share) before anything is allocated, unless
engines kept for their cached blocks yield: the longest kept first, only as many as
needed, the uid's own first for its share, once the attach commits (an attach refused at
any step before releases none); an engine with a rank never yields."""

import gc
import tracemalloc
import weakref

import numpy as np
import pytest

import helpers
from sparsekv.client import Client, PoolFull, QuotaExceeded
from sparsekv.daemon.backends import CpuBackend
from sparsekv.daemon.block_requests import lookup_reply
from sparsekv.daemon.config import Config
from sparsekv.daemon.engine import Owner
from sparsekv.daemon.blocks.store import BlockStore
from sparsekv.daemon.pool import HostPool, PoolError
from sparsekv.daemon.residency.base import ResidencyError
from sparsekv.daemon.registry import EngineRegistry
from sparsekv.daemon.store_room import StoreRoom, session_bytes
from sparsekv.proto import LIMITS, ErrorCode, ProtocolError

MiB = 1 << 20
LAY = helpers.layout(host_rows=4096)  # one 2 MiB range each
BS = 4
BLOCKS = LAY.host_rows // BS  # 1024 blocks a store
STORE = BlockStore.bookkeeping_bytes(BLOCKS)  # one store's bookkeeping, at most
SESSION = session_bytes(BLOCKS)  # one rank using it
ENGINE = STORE + SESSION  # what a new engine's first rank needs
ROOT, ALICE, BOB = Owner(0, 0), Owner(1000, 1000), Owner(2000, 2000)


def attach(reg, *args, owner=ROOT, **kw):
    """``helpers.registry_attach`` as a client of ``owner`` (root unless given)."""
    return helpers.registry_attach(reg, *args, owner=owner, **kw)


@pytest.fixture
def reg(request, tmp_path):
    pool = HostPool(getattr(request, "param", 32) * MiB, threads=1)
    backend = CpuBackend(str(tmp_path), shm_dir=str(tmp_path))
    r = EngineRegistry(pool, backend)
    r.store_room = StoreRoom(3 * ENGINE, share_per_uid=1.0)
    yield r
    backend.close()
    pool.close()


def keep(reg, client: int, name: str, owner=ROOT) -> None:
    """Engine ``name`` with a store, kept for one cached block with no rank."""
    attach(reg, client, 0, "cpu", name, LAY, block_size=BS, owner=owner)
    assert reg.store_room.cost(reg.space(name)) == ENGINE  # its rank's session opened at the commit
    store = reg.space(name).blocks
    store.commit(client, store.alloc(client, 1), np.full((1, 2), client + 1, dtype=np.int64))
    reg.detach(client, name)
    assert name in reg and reg.store_room.cost(reg.space(name)) == STORE  # its session closed with its rank


def test_a_store_past_the_cap_is_pool_full_before_anything_is_allocated(reg):
    for i, name in enumerate("abc"):
        attach(reg, i, 0, "cpu", name, LAY, block_size=BS)
    used = reg.pool.used_bytes
    with pytest.raises(ProtocolError, match=r"block stores' bookkeeping .*max_store_bytes") as e:
        attach(reg, 9, 0, "cpu", "d", LAY, block_size=BS)
    assert e.value.code == ErrorCode.POOL_FULL
    assert "d" not in reg and reg.pool.used_bytes == used
    attach(reg, 9, 0, "cpu", "plain", LAY)  # no store: not counted
    reg.detach(0, "a")
    attach(reg, 10, 0, "cpu", "d", LAY, block_size=BS)  # a's store gone: room


def test_each_rank_counts_its_use_of_the_store_at_its_attach(reg):
    """A rank's session (its pins of every block) counts from its attach, which opens the
    store for it: a rank joining past the cap is refused there, never at its first block
    request."""
    reg.store_room = StoreRoom(STORE + 2 * SESSION + SESSION // 2, share_per_uid=1.0)
    attach(reg, 1, 0, "cpu", "a", LAY, block_size=BS)
    attach(reg, 2, 1, "cpu", "a", LAY, block_size=BS)
    space = reg.space("a")
    assert space.blocks.is_open(1) and space.blocks.is_open(2)
    assert reg.store_room.held(reg._engines.values()) == STORE + 2 * SESSION
    reg.open_store(space, 1, 0)  # open already: nothing more
    with pytest.raises(ProtocolError, match="this rank's use of the block store of 1024 blocks") as e:
        attach(reg, 3, 2, "cpu", "a", LAY, block_size=BS)
    assert e.value.code == ErrorCode.POOL_FULL and 3 not in space.ranks and not space.blocks.is_open(3)
    reg.detach(1, "a")  # its session closed: its pins no longer count
    attach(reg, 3, 2, "cpu", "a", LAY, block_size=BS)


def test_kept_engines_yield_longest_kept_first_and_only_as_many_as_needed(reg):
    keep(reg, 1, "old")
    keep(reg, 2, "newer")
    attach(reg, 3, 0, "cpu", "busy", LAY, block_size=BS)
    assert reg.make_room(LAY.pool_bytes, None, BLOCKS) == []  # checked there; they yield at the attach
    attach(reg, 4, 0, "cpu", "second", LAY, block_size=BS)
    assert "old" not in reg and "newer" in reg and "busy" in reg


def test_when_all_kept_engines_would_not_do_nothing_is_released(reg):
    keep(reg, 1, "old")
    attach(reg, 2, 0, "cpu", "busy", LAY, block_size=BS)
    attach(reg, 3, 0, "cpu", "busy2", LAY, block_size=BS)
    big = helpers.layout(host_rows=2 * LAY.host_rows)
    for call in (lambda: reg.make_room(big.pool_bytes, None, 2 * BLOCKS),
                 lambda: attach(reg, 4, 0, "cpu", "big", big, block_size=BS)):
        with pytest.raises(ProtocolError, match="max_store_bytes") as e:
            call()  # old's store is not enough
        assert e.value.code == ErrorCode.POOL_FULL
        assert "old" in reg and reg.space("old").blocks.cached_blocks == 1


def test_one_uid_takes_at_most_its_share_and_its_own_kept_engines_yield_first(reg):
    reg.store_room = StoreRoom(4 * ENGINE, share_per_uid=0.5)
    keep(reg, 1, "bob-old", BOB)  # longest kept, but another uid's
    keep(reg, 2, "a-kept", ALICE)
    attach(reg, 3, 0, "cpu", "a-busy", LAY, block_size=BS, owner=ALICE)
    with pytest.raises(ProtocolError, match="uid 1000's block stores' bookkeeping") as e:
        attach(reg, 4, 0, "cpu", "a-big", helpers.layout(host_rows=2 * LAY.host_rows), block_size=BS, owner=ALICE)
    assert e.value.code == ErrorCode.QUOTA_EXCEEDED and "a-kept" in reg
    attach(reg, 4, 0, "cpu", "a-new", LAY, block_size=BS, owner=ALICE)  # a-kept yields, not bob-old
    assert "a-kept" not in reg and "bob-old" in reg
    attach(reg, 5, 0, "cpu", "bob", LAY, block_size=BS, owner=BOB)  # alice's share left bob his


def test_the_daemon_takes_the_caps_from_its_config_and_the_client_sees_the_refusals():
    assert (Config().max_store_bytes, Config().max_store_share_per_uid) == (2 << 30, 0.5)
    with helpers.serving_daemon(8 * MiB) as d:
        small = BlockStore.bookkeeping_bytes(BLOCKS // 4) + session_bytes(BLOCKS // 4)
        d.engines.store_room = StoreRoom(ENGINE + small + 1024, share_per_uid=1.0)  # as daemon/main.py does
        with Client(d.run_dir) as a, Client(d.run_dir) as b, Client(d.run_dir, rank=1) as a1:
            a.attach(LAY, engine="a", block_size=BS)
            with pytest.raises(PoolFull, match="max_store_bytes"):
                b.attach(LAY, engine="b", block_size=BS)
            b.attach(LAY, engine="b", block_size=4 * BS)  # 256 blocks: fits
            a.blocks.reserve(1)
            b.blocks.reserve(1)  # (their ranks' use counted at their attach)
            with pytest.raises(PoolFull, match="this rank's use of the block store"):
                a1.attach(LAY, engine="a", block_size=BS)
        d.engines.store_room = StoreRoom(4 * ENGINE, share_per_uid=0.25)
        with Client(d.run_dir) as c, pytest.raises(QuotaExceeded, match="block stores' bookkeeping"):
            c.attach(helpers.layout(host_rows=2 * LAY.host_rows), engine="c", block_size=BS)


@pytest.mark.parametrize("reg", [8], indirect=True)  # an 8 MiB pool
def test_an_attach_the_pool_refuses_makes_no_kept_engine_yield(reg):
    """The pool has no range for the new engine even with the kept engine's (so make_room
    releases nothing): the store cap's yield waits for the store to be made, so the kept
    engine stays, its cached block with it."""
    attach(reg, 1, 0, "cpu", "busy1", LAY, block_size=BS)  # [0, 2) MiB
    keep(reg, 2, "k")  # [2, 4)
    attach(reg, 3, 0, "cpu", "busy2", LAY, block_size=BS)  # [4, 6); [6, 8) free
    big = helpers.layout(host_rows=9 * 4096)  # a 4 MiB range, its store 1024 blocks of 36 rows
    assert reg.make_room(big.pool_bytes, None, big.host_rows // 36) == []
    with pytest.raises(PoolError):
        attach(reg, 9, 0, "cpu", "new", big, block_size=36)
    assert "new" not in reg and "k" in reg and reg.space("k").blocks.cached_blocks == 1


def test_an_attach_the_backend_refuses_after_its_store_is_made_makes_no_kept_engine_yield(reg, monkeypatch):
    """The rank refused by the backend (a bad engine slab, say) after ``begin_attach`` made
    the new store: the attach aborted, the kept engine its store needed stays."""
    reg.store_room = StoreRoom(2 * ENGINE, share_per_uid=1.0)
    keep(reg, 1, "k")
    attach(reg, 2, 0, "cpu", "busy", LAY, block_size=BS)

    def refuse(*a, **k):
        raise ResidencyError("BAD_ARGUMENT", "the engine's slab memfd has 0 bytes")
    monkeypatch.setattr(reg.backend, "new_rank", refuse)
    p = reg.begin_attach(9, 0, "cpu", "new", LAY, block_size=BS)
    with pytest.raises(ResidencyError):
        try:
            reg.prepare(p)
        finally:
            reg.abort(p)
    assert "new" not in reg and "k" in reg and reg.space("k").blocks.cached_blocks == 1
    monkeypatch.undo()
    attach(reg, 9, 0, "cpu", "new", LAY, block_size=BS)  # committed: now k yields
    assert "k" not in reg


def _taken(n: int, fill) -> tuple[int, BlockStore]:
    """The memory a store of ``n`` blocks takes (tracemalloc) after ``fill(store, hashes)``,
    with its one session open, whose pins are counted apart."""
    hashes = np.random.default_rng(n).integers(1, 2**62, size=(n, 2), dtype=np.int64)
    warm = BlockStore(64, lambda b: None)  # (what a first commit and lookup import, outside the count)
    warm.open(1, 1000)
    fill(warm, np.random.default_rng(0).integers(1, 2**62, size=(64, 2), dtype=np.int64))
    del warm
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        store = BlockStore(n, lambda b: None)
        store.open(1, 1000)
        fill(store, hashes)
        del store._pinned[1]
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - base, store
    finally:
        tracemalloc.stop()


def _cache_all(store, hashes):
    blocks = store.alloc(1, len(hashes))
    store.commit(1, blocks, hashes)
    store.release(1, blocks)


def test_a_tiny_store_takes_no_more_than_its_bookkeeping_bytes():
    taken, _ = _taken(1, _cache_all)
    assert taken <= BlockStore.bookkeeping_bytes(1), taken


def test_a_chain_found_in_part_is_remembered_without_the_lookups_whole_answer():
    """A lookup of many keys whose first only is cached, once for each cached block: each
    remembered chain keeps its own blocks, not the lookup's answer for every key it named
    (a view of it had kept 8 B a key named: 32 KiB a chain here, 512 KiB at the wire's
    limit of keys)."""
    junk = np.random.default_rng(5).integers(1, 2**62, size=(4095, 2), dtype=np.int64)
    assert junk.shape[0] < LIMITS.max_blocks

    def fill(store, hashes):
        _cache_all(store, hashes)
        req = np.concatenate([hashes[:1], junk])
        for i in range(min(len(hashes), 64)):
            req[0] = hashes[i]
            store.release(1, store.lookup(1, req))
    taken, store = _taken(256, fill)
    assert len(store.chains) >= 60  # remembered: the case this is about
    assert all(m.blocks.base is None for m in store.chains._chains.values())
    assert taken <= BlockStore.bookkeeping_bytes(256), (taken, BlockStore.bookkeeping_bytes(256))


@pytest.mark.parametrize("n", [(1 << 12) + 1, 1 << 12])
def test_a_store_takes_no_more_than_its_bookkeeping_bytes_with_its_chain_memo_full(n):
    """The worst a session can make of a store (filled, then half its blocks looked up as
    distinct 16-block chains, each remembered: the memo at its bound), measured with
    tracemalloc, stays within ``bookkeeping_bytes`` (which a store of 2**k + 1 blocks, its
    key table twice as large a block, counts too)."""
    def fill(store, hashes):
        _cache_all(store, hashes)
        for start in range(len(hashes) - 16):
            if store.chains.ids >= store.chains.max_ids(len(hashes)) - 16:
                break
            store.release(1, store.lookup(1, hashes[start:start + 16]))
    taken, store = _taken(n, fill)
    assert store.chains.ids >= store.chains.max_ids(n) - 16  # the memo full
    assert taken <= BlockStore.bookkeeping_bytes(n), (taken / n, BlockStore.bookkeeping_bytes(n) / n)
    assert taken >= 0.6 * BlockStore.bookkeeping_bytes(n)  # and the figure not far above it


def test_a_released_engines_store_is_freed_at_once_not_at_the_next_cycle_collection(reg):
    """The caps count the stores that exist: a released engine's store (its arrays, key
    table, chain memo, sessions' pins) must go with it, without waiting for Python's cycle
    collector (the memo had held the store through a bound method: an engine attached,
    used and detached again and again kept its dead stores until a full collection)."""
    gc.collect()
    gc.disable()
    try:
        attach(reg, 1, 0, "cpu", "e", LAY, block_size=BS)
        reg.open_store(reg.space("e"), 1, 0)
        store = weakref.ref(reg.space("e").blocks)
        store().reserve(1, 1)
        reg.detach(1, "e")  # nothing cached: released
        assert "e" not in reg
        assert store() is None
    finally:
        gc.enable()


def test_a_lookup_reply_owns_its_blocks():
    """A lookup that names a remembered chain answers the blocks after it, which are a
    slice of the new chain's own ids: the reply carries a copy, so a reply waiting in the
    outbox (which counts the bytes it sends) keeps no more than those alive."""
    n = 4096
    hashes = np.random.default_rng(3).integers(1, 2**62, size=(n, 2), dtype=np.int64)
    store = BlockStore(n, lambda b: None)
    store.open(1, 1000)
    _cache_all(store, hashes)
    first = store.find(1, hashes[:3000])
    store.release(1, first.blocks.copy())
    found = store.find(1, hashes[3000:4000], first.token)
    assert found is not None and found.head == 3000
    fields, arrays = lookup_reply(found, first.token)
    assert fields["head"] == 3000 and arrays["blocks"].tolist() == found.blocks[3000:].tolist()
    assert arrays["blocks"].base is None
    fields, arrays = lookup_reply(found, None)
    assert arrays["blocks"].base is None or arrays["blocks"].base.nbytes == arrays["blocks"].nbytes


def test_a_process_rejoining_its_kept_engine_past_the_cap_is_refused_before_its_rank_is_made(reg):
    """The engine rejoined does not count as a kept engine that could yield for the join:
    refused at begin_attach, before the backend makes anything."""
    keep(reg, 1, "k")
    reg.store_room = StoreRoom(STORE + SESSION // 2, share_per_uid=1.0)  # the store fits, a rank's use not
    with pytest.raises(ProtocolError, match="this rank's use of the block store") as e:
        reg.begin_attach(2, 0, "cpu", "k", LAY, block_size=BS, owner=ROOT)
    assert e.value.code == ErrorCode.POOL_FULL and "k" in reg and not reg._attaching.get("k")


def test_the_creators_commit_counts_the_ranks_that_joined_before_it(reg):
    """(At registry level: the daemon answers a new engine's creator before its joins.) A
    TP rank joined and committed before the creator: the creator's commit counts that
    rank's use too, and is refused when both do not fit."""
    reg.store_room = StoreRoom(ENGINE + SESSION // 2, share_per_uid=1.0)  # one rank's use only
    p0 = reg.begin_attach(1, 0, "cpu", "a", LAY, block_size=BS, owner=ROOT, tp_size=2)
    p1 = reg.begin_attach(2, 1, "cpu", "a", LAY, block_size=BS, owner=ROOT, tp_size=2)
    reg.prepare(p1)
    reg.commit(p1)
    reg.prepare(p0)
    with pytest.raises(ProtocolError, match="max_store_bytes"):
        try:
            reg.commit(p0)
        finally:
            reg.abort(p0)
    assert not reg.space("a").blocks.is_open(1)
    assert reg.store_room.held(reg._engines.values()) <= reg.store_room.cap_bytes


def test_a_new_engines_block_store_is_made_off_the_loop_by_prepare(reg, monkeypatch):
    """A store of 2M blocks page-faults ~100 MB of tables (0.25 s here): made by the attach's
    slow part (prepare, a worker thread in the daemon), given to the engine at the commit.
    A rank that joins before the creator's commit (registry level only) makes it there."""
    import threading

    from sparsekv.daemon import registry as registry_mod

    made = []

    class Store(BlockStore):
        def __init__(self, *a, **kw):
            made.append(threading.current_thread())
            super().__init__(*a, **kw)

    monkeypatch.setattr(registry_mod, "BlockStore", Store)
    p = reg.begin_attach(1, 0, "cpu", "a", LAY, block_size=BS, owner=ROOT)
    assert made == [] and reg.space("a").blocks is None
    # counted against the cap from the start, as before (another new engine's check sees it)
    assert reg.store_room.held(reg._engines.values()) == BlockStore.bookkeeping_bytes(LAY.host_rows // BS)
    worker = threading.Thread(target=reg.prepare, args=(p,))
    worker.start()
    worker.join()
    assert made == [worker]
    reg.commit(p)
    assert reg.space("a").blocks is p.store and p.store.is_open(1) and p.store.n_blocks == LAY.host_rows // BS
    # the creator second: the joining rank made the store, the creator's commit keeps it
    q0 = reg.begin_attach(2, 0, "cpu", "b", LAY, block_size=BS, owner=ROOT, tp_size=2)
    q1 = reg.begin_attach(3, 1, "cpu", "b", LAY, block_size=BS, owner=ROOT, tp_size=2)
    joined = reg.space("b").blocks
    assert joined is not None and made[-1] is threading.current_thread()
    reg.prepare(q1)
    reg.commit(q1)
    reg.prepare(q0)
    reg.commit(q0)
    assert reg.space("b").blocks is joined and joined.is_open(2) and joined.is_open(3)
