"""EngineRegistry on the cpu backend: the first rank of an engine reserves its pool range,
later ranks join it with the same layout (else LAYOUT_MISMATCH), a failed attach of a new
engine leaves nothing allocated, and the last rank's detach frees the engine's range."""

import numpy as np
import pytest

import helpers
from helpers import registry_attach as attach
from sparsekv.daemon.backends import CpuBackend
from sparsekv.daemon.pool import HostPool, PoolError
from sparsekv.daemon.registry import EngineRegistry
from sparsekv.daemon.residency.base import ResidencyError
from sparsekv.proto import ErrorCode, ProtocolError

MiB = 1 << 20


@pytest.fixture
def pool():
    p = HostPool(8 * MiB, threads=1)
    yield p
    p.close()


@pytest.fixture
def backend(tmp_path):
    b = CpuBackend(str(tmp_path), shm_dir=str(tmp_path))
    yield b
    b.close()


@pytest.fixture
def reg(pool, backend):
    return EngineRegistry(pool, backend)


def test_first_rank_creates_the_engine_with_its_pool_range(reg, pool, tmp_path):
    lay = helpers.layout()
    state, handles = attach(reg, 1, 0, "cpu", "e", lay)
    assert len(reg) == 1 and "e" in reg and list(reg) == ["e"]
    space = reg.space("e")
    assert space.layout == lay and space.ranks == {1: state}
    assert pool.used_bytes >= lay.pool_bytes
    assert space.pool.shape == (lay.num_layers, lay.host_rows, lay.row_bytes)
    assert handles["kind"] == "shm" and len(helpers.shm_slabs(str(tmp_path), str(tmp_path))) == 1
    assert reg.gauges() == {"engines": 1, "pool_bytes": pool.size_bytes, "pool_used_bytes": pool.used_bytes,
                            "pool_huge_bytes": pool.huge_bytes}
    assert 0 <= pool.huge_bytes <= pool.size_bytes


def test_second_rank_joins_the_same_engine_and_pool_range(reg, pool):
    lay = helpers.layout()
    s1, _ = attach(reg, 1, 0, "cpu", "e", lay)
    used = pool.used_bytes
    s2, _ = attach(reg, 2, 1, "cpu", "e", lay)
    assert len(reg) == 1 and pool.used_bytes == used
    assert reg.space("e").ranks == {1: s1, 2: s2}
    # one engine, one pool: a write reaches the rows both ranks gather from
    reg.space("e").write([0], np.array([3], np.int32), np.full((1, 1, lay.row_bytes), 7, np.uint8))
    assert s1.mover is not s2.mover and (reg.space("e").pool[0, 3] == 7).all()


def test_another_layout_for_an_existing_engine_is_layout_mismatch(reg, pool, tmp_path):
    attach(reg, 1, 0, "cpu", "e", helpers.layout())
    used = pool.used_bytes
    with pytest.raises(ProtocolError) as ei:
        attach(reg, 2, 1, "cpu", "e", helpers.layout(top_k=2))
    assert ei.value.code == ErrorCode.LAYOUT_MISMATCH and "engine 'e' is attached with" in str(ei.value)
    assert pool.used_bytes == used and list(reg.space("e").ranks) == [1]
    assert len(helpers.shm_slabs(str(tmp_path), str(tmp_path))) == 1  # no slab for the refused rank
    attach(reg, 2, 1, "cpu", "other", helpers.layout(top_k=2))  # another engine may differ
    assert len(reg) == 2


def test_layout_larger_than_the_pool_is_pool_full_and_allocates_nothing(reg, pool):
    with pytest.raises(PoolError, match="no free range"):
        attach(reg, 1, 0, "cpu", "e", helpers.layout(host_rows=2**20, row_bytes=16, num_layers=1))
    assert pool.used_bytes == 0 and len(reg) == 0


class FailingBackend(CpuBackend):
    """A cpu backend whose new_rank fails; records release_engine calls."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.released = []

    def new_rank(self, *a, **kw):
        raise ResidencyError("TOO_LARGE", "no room for the slab")

    def release_engine(self, space, give_back):
        self.released.append(space.name)
        give_back()


def test_failed_new_rank_of_a_new_engine_leaves_no_pool_range(pool, tmp_path):
    backend = FailingBackend(str(tmp_path), shm_dir=str(tmp_path))
    reg = EngineRegistry(pool, backend)
    with pytest.raises(ResidencyError, match="no room"):
        attach(reg, 1, 0, "cpu", "e", helpers.layout())
    assert pool.used_bytes == 0 and len(reg) == 0 and "e" not in reg
    assert backend.released == ["e"]  # the backend's per-engine resources are let go too
    pool.release(pool.allocate(pool.size_bytes))  # the whole pool is free again


def test_failed_new_rank_joining_an_engine_keeps_the_engine(reg, pool, backend, monkeypatch):
    s1, _ = attach(reg, 1, 0, "cpu", "e", helpers.layout())
    used = pool.used_bytes

    def fail(*a, **kw):
        raise ResidencyError("TOO_LARGE", "no room for the slab")

    monkeypatch.setattr(backend, "new_rank", fail)
    with pytest.raises(ResidencyError):
        attach(reg, 2, 1, "cpu", "e", helpers.layout())
    assert pool.used_bytes == used and reg.space("e").ranks == {1: s1}


def test_last_rank_detaching_frees_the_engine_and_its_range(reg, pool, tmp_path):
    lay = helpers.layout()
    attach(reg, 1, 0, "cpu", "e", lay)
    attach(reg, 2, 1, "cpu", "e", lay)
    used = pool.used_bytes
    reg.detach(1, "e")
    assert "e" in reg and pool.used_bytes == used and list(reg.space("e").ranks) == [2]
    assert len(helpers.shm_slabs(str(tmp_path), str(tmp_path))) == 1  # rank 1's slab is gone
    reg.detach(2, "e")
    assert len(reg) == 0 and pool.used_bytes == 0
    assert helpers.shm_slabs(str(tmp_path), str(tmp_path)) == []
    with pytest.raises(KeyError):
        reg.space("e")
    reg.detach(2, "e")  # detaching twice is harmless
    # a new first rank of the name gets a fresh engine
    attach(reg, 3, 0, "cpu", "e", helpers.layout(top_k=2))
    assert reg.space("e").layout.top_k == 2


def test_detaching_one_engine_leaves_the_others(reg, pool):
    attach(reg, 1, 0, "cpu", "a", helpers.layout())
    attach(reg, 2, 0, "cpu", "b", helpers.layout())
    reg.detach(1, "a")
    assert list(reg) == ["b"] and pool.used_bytes > 0


# -- an attach in steps (the daemon runs prepare on a worker thread) --------------------------
def test_an_engine_with_an_attach_pending_outlives_its_last_rank(reg, pool):
    lay = helpers.layout()
    attach(reg, 1, 0, "cpu", "e", lay)
    p = reg.begin_attach(2, 1, "cpu", "e", lay)
    reg.prepare(p)
    reg.detach(1, "e")  # the last rank leaves while rank 2's attach is pending
    assert "e" in reg and pool.used_bytes >= lay.pool_bytes
    state, _ = reg.commit(p)
    assert reg.space("e").ranks == {2: state}
    reg.detach(2, "e")
    assert len(reg) == 0 and pool.used_bytes == 0


def test_an_aborted_attach_releases_its_rank_and_the_engine_it_made(reg, pool, tmp_path):
    lay = helpers.layout()
    p = reg.begin_attach(1, 0, "cpu", "e", lay)
    assert "e" in reg and pool.used_bytes >= lay.pool_bytes  # reserved from the first step
    reg.prepare(p)
    assert len(helpers.shm_slabs(str(tmp_path), str(tmp_path))) == 1
    reg.abort(p)
    reg.abort(p)  # once only
    del p
    assert len(reg) == 0 and pool.used_bytes == 0 and pool.zeroing_bytes == 0
    assert helpers.shm_slabs(str(tmp_path), str(tmp_path)) == []


def test_an_aborted_join_keeps_the_engine_and_a_committed_attach_cannot_be_aborted(reg, pool):
    lay = helpers.layout()
    s1, _ = attach(reg, 1, 0, "cpu", "e", lay)
    p = reg.begin_attach(2, 1, "cpu", "e", lay)
    reg.prepare(p)
    reg.abort(p)
    assert reg.space("e").ranks == {1: s1}
    q = reg.begin_attach(3, 1, "cpu", "e", lay)
    reg.prepare(q)
    s3, _ = reg.commit(q)
    reg.abort(q)  # after commit: nothing
    assert reg.space("e").ranks == {1: s1, 3: s3}


class LoopRanksBackend(CpuBackend):
    """Ranks made on the owner's thread, a prepare_rank before (as the cuda backend)."""

    new_rank_on_loop = True

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = []

    def prepare_rank(self, space, client_id, rank, device, fence_events=None):
        self.calls.append(("prepare_rank", space.name, client_id))

    def new_rank(self, space, client_id, *a, **kw):
        self.calls.append(("new_rank", space.name, client_id))
        return super().new_rank(space, client_id, *a, **kw)


def test_prepare_runs_only_prepare_rank_when_ranks_are_made_on_the_owners_thread(pool, tmp_path):
    backend = LoopRanksBackend(str(tmp_path), shm_dir=str(tmp_path))
    reg = EngineRegistry(pool, backend)
    try:
        p = reg.begin_attach(1, 0, "cpu", "e", helpers.layout())
        reg.prepare(p)
        assert backend.calls == [("prepare_rank", "e", 1)] and p.state is None
        reg.commit(p)
        assert backend.calls[1:] == [("new_rank", "e", 1)] and list(reg.space("e").ranks) == [1]
    finally:
        backend.close()


def test_an_engine_caching_blocks_outlives_its_ranks_until_dropped(reg, pool):
    lay = helpers.layout()
    attach(reg, 1, 0, "cpu", "e", lay, block_size=4)
    store = reg.space("e").blocks
    store.open(1, 0)
    [b] = store.alloc(1, 1)
    reg.space("e").pool[:, b * 4:(b + 1) * 4] = 9
    store.commit(1, [b], np.arange(2, dtype=np.int64).reshape(1, 2))
    reg.detach(1, "e")
    assert "e" in reg and store.cached_blocks == 1 and store.pins[b] == 0  # unpinned, kept
    with pytest.raises(ProtocolError) as e:
        attach(reg, 2, 0, "cpu", "e", lay)  # the same name without the block store
    assert e.value.code == ErrorCode.LAYOUT_MISMATCH
    assert reg.drop_kept() == ["e"]
    assert "e" not in reg and pool.used_bytes == 0


def keep_two_engines(reg):
    """Engines "old" then "newer", each kept for one cached block with no rank; returns
    their layout (one 2 MiB range each: 2 layers of 32-byte rows)."""
    lay = helpers.layout(host_rows=(2 * MiB) // 64)
    for i, name in enumerate(("old", "newer")):
        attach(reg, i, 0, "cpu", name, lay, block_size=4)
        store = reg.space(name).blocks
        store.open(i, 0)
        store.commit(i, store.alloc(i, 1), np.full((1, 2), i, dtype=np.int64))
        reg.detach(i, name)
    return lay


def test_engines_kept_for_their_blocks_yield_to_a_new_engine_oldest_first(reg, pool):
    """The pool full: old, newer (kept), busy, busy2 (a rank each), 2 MiB each."""
    lay = keep_two_engines(reg)
    attach(reg, 9, 0, "cpu", "busy", lay)
    attach(reg, 10, 0, "cpu", "busy2", lay)
    assert reg.make_room(2 * MiB) == ["old"]  # either would do: the longest kept
    assert reg.make_room(2 * MiB) == []  # it fits as it is (old's range)
    assert reg.make_room(4 * MiB) == ["newer"]  # its range and old's, side by side
    assert "busy" in reg and "busy2" in reg  # never an engine with a rank


def test_make_room_releases_only_the_kept_engines_whose_ranges_the_new_one_needs(reg, pool):
    """busy [0, 2), old (kept) [2, 4), newer (kept) [4, 6), free [6, 8) MiB: a 4 MiB engine
    needs newer's range beside the free one, not old's (the longer kept). Then, busy gone,
    6 MiB are free in two holes, [0, 2) and [4, 8): a 6 MiB engine needs old's range
    between them. Seen: the free bytes counted, not a free range: nothing released, and
    the attach POOL_FULL."""
    lay = helpers.layout(host_rows=(2 * MiB) // 64)
    attach(reg, 9, 0, "cpu", "busy", lay)
    keep_two_engines(reg)
    assert reg.make_room(4 * MiB) == ["newer"]
    assert "old" in reg
    reg.detach(9, "busy")  # free [0, 2) and [4, 8): 6 MiB in two holes
    assert "busy" not in reg
    assert reg.make_room(6 * MiB) == ["old"]  # seen: nothing released (the free bytes were enough), POOL_FULL


def test_make_room_releases_nothing_that_cannot_open_a_range_large_enough(reg, pool):
    """busy [0, 2), kept [2, 4), busy2 [4, 6), free [6, 8): a 6 MiB engine cannot fit
    whatever is released (the busy ranges stay): kept stays. Seen: kept released (4 MiB
    free once it went, and 6 MiB counted in bytes), then POOL_FULL all the same."""
    lay = helpers.layout(host_rows=(2 * MiB) // 64)
    attach(reg, 9, 0, "cpu", "busy", lay)
    attach(reg, 0, 0, "cpu", "kept", lay, block_size=4)
    store = reg.space("kept").blocks
    store.open(0, 0)
    store.commit(0, store.alloc(0, 1), np.full((1, 2), 5, dtype=np.int64))
    reg.detach(0, "kept")
    attach(reg, 10, 0, "cpu", "busy2", lay)
    assert reg.make_room(4 * MiB) == []  # [2, 4) and [6, 8) are not side by side either
    assert reg.make_room(6 * MiB) == []
    assert "kept" in reg and reg.space("kept").blocks.cached_blocks == 1


def test_a_tp_rank_whose_attach_is_under_way_when_its_peers_begin_reaches_their_entries(reg):
    # The daemon prepares a joining rank on a worker thread while its peers are served:
    # the entries they make meanwhile are kept for it (the group's slab sequence is every rank's).
    lay = helpers.layout(host_rows=64)
    s0, _ = attach(reg, 1, 0, "cpu", "e", lay, tp_size=2)
    late = reg.begin_attach(2, 1, "cpu", "e", lay, tp_size=2)
    space = reg.space("e")
    rows = np.arange(64, dtype=np.int32)
    space.write(None, rows, np.stack([helpers.gen_pattern(layer, rows, lay.row_bytes) for layer in range(2)]))
    state_rows, topk = np.array([0], np.int32), np.array([[1, 2, 3, 4]], np.int32)
    s0.begin_step(0, state_rows)
    want = s0.topk(0, 0, topk)[0]
    assert space.tp.lag() == 2 and reg.tp_ledger.held  # kept for rank 1
    reg.prepare(late)
    s1, _ = reg.commit(late)
    s1.begin_step(0, state_rows)
    got = s1.topk(0, 0, topk)[0]
    np.testing.assert_array_equal(got.slots, want.slots)
    assert helpers.bad_rows(s1.slab, lay.groups[0], state_rows, topk, got.slots, 64) == 0
    assert space.tp.lag() == 0 and not reg.tp_ledger.held
    s0.begin_step(1, state_rows)  # the group goes on as one sequence
    s1.begin_step(1, state_rows)


def test_entries_kept_for_a_tp_rank_whose_attach_fails_go_with_it(reg):
    lay = helpers.layout()
    s0, _ = attach(reg, 1, 0, "cpu", "e", lay, tp_size=2)
    late = reg.begin_attach(2, 1, "cpu", "e", lay, tp_size=2)
    s0.begin_step(0, np.array([0], np.int32))
    assert reg.tp_ledger.held
    reg.abort(late)
    assert reg.space("e").tp.lag() == 0 and not reg.tp_ledger.held


def _kept_bytes(x) -> int:
    """Bytes of the arrays an entry of a TP group keeps (its own, its results' and plans')."""
    if isinstance(x, np.ndarray):
        return x.nbytes
    fields = ("state_rows", "reset", "invalidate", "topk", "resolved", "pf_plan", "slots", "misses", "plan", "rows")
    return sum(_kept_bytes(getattr(x, f)) for f in fields if getattr(x, f, None) is not None)


@pytest.mark.parametrize("prefetch", [False, True])
def test_the_tp_ledger_counts_at_least_what_the_entries_keep(reg, prefetch):
    lay = helpers.layout(num_layers=2, top_k=64, region_stride=128, max_reqs=8, host_rows=1024,
                         index_groups=((0,), (1,)))
    s0, _ = attach(reg, 1, 0, "cpu", "e", lay, tp_size=2, prefetch=prefetch)
    attach(reg, 2, 1, "cpu", "e", lay, tp_size=2, prefetch=prefetch)
    rng = np.random.default_rng(0)
    s0.begin_step(0, np.arange(8, dtype=np.int32))  # every batch row misses every column
    s0.serve_topk(0, 0, np.stack([rng.permutation(1024)[:64] for _ in range(8)]).astype(np.int32))
    if prefetch:
        s0.run_prefetch()
    kept = sum(_kept_bytes(e) for e, _ in reg.space("e").tp.entries)
    assert kept <= reg.tp_ledger.held[None] < 2 * kept



def test_make_room_counts_a_range_the_backend_gives_back_later_and_stops_releasing(pool, tmp_path):
    """A backend that holds an engine's unregister (cuda, a doorbell rank attached) gives
    its range back later: make_room counts those bytes as coming and releases no more
    kept engines for them; the range is free once the backend gives it back."""
    held = []

    class Holding(CpuBackend):
        def release_engine(self, space, give_back):
            held.append(give_back)

    backend = Holding(str(tmp_path), shm_dir=str(tmp_path))
    reg = EngineRegistry(pool, backend)
    try:
        lay = keep_two_engines(reg)
        attach(reg, 9, 0, "cpu", "busy", lay)
        attach(reg, 10, 0, "cpu", "busy2", lay)  # the pool full
        assert reg.make_room(2 * MiB) == ["old"]
        assert reg.make_room(2 * MiB) == []  # "newer" stays: old's range is coming
        assert len(held) == 1 and reg.returning_bytes == 2 * MiB
        assert pool.free_bytes + pool.zeroing_bytes == 0  # not given back yet
        held.pop()()
        assert reg.returning_bytes == 0 and pool.free_bytes + pool.zeroing_bytes == 2 * MiB
    finally:
        backend.close()


def _keep(reg, client: int, name: str, lay, owner):
    """Engine ``name`` of ``owner``, kept for one cached block with no rank."""
    attach(reg, client, 0, "cpu", name, lay, block_size=4, owner=owner)
    store = reg.space(name).blocks
    store.open(client, owner.uid)
    store.commit(client, store.alloc(client, 1), np.full((1, 2), client, dtype=np.int64))
    reg.detach(client, name)


def test_a_uids_own_kept_engines_yield_to_its_next_engine_past_its_pool_share(pool, backend):
    """max_pool_bytes_per_uid 4 MiB: uid 7 keeps "v1" and "v0" (2 MiB each), uid 8 keeps
    "other". uid 7's "v2" (2 MiB) needs one of its own to go: the longest kept ("v0"),
    not uid 8's. A 6 MiB engine of uid 7 cannot fit its share whatever goes: nothing goes.
    Seen (an adversarial review): QUOTA_EXCEEDED for good while the pool had room (no
    operator command drops a kept engine)."""
    from sparsekv.daemon.registry import Owner

    reg = EngineRegistry(pool, backend, max_pool_bytes_per_uid=4 * MiB)
    lay = helpers.layout(host_rows=(2 * MiB) // 64)
    _keep(reg, 1, "v0", lay, Owner(7, 7))
    _keep(reg, 2, "v1", lay, Owner(7, 7))
    _keep(reg, 3, "other", lay, Owner(8, 8))
    with pytest.raises(ProtocolError) as e:
        reg.make_room(6 * MiB, Owner(7, 7))
    assert e.value.code == ErrorCode.QUOTA_EXCEEDED
    assert {"v0", "v1", "other"} <= set(reg._engines)
    assert reg.make_room(2 * MiB, Owner(7, 7)) == ["v0"]
    assert "v1" in reg and "other" in reg
    attach(reg, 4, 0, "cpu", "v2", lay, owner=Owner(7, 7))
    assert reg.pool_bytes_of(7) == 4 * MiB


def test_a_uids_own_kept_engine_stays_when_the_pool_has_no_range_for_its_next_one(pool, backend):
    """8 MiB pool, 4 MiB share: uid 7 keeps "v0" [0, 2), three engines of other uids with a
    rank fill [2, 8). uid 7's 4 MiB engine needs v0 gone for its share, and would still
    find no 4 MiB range: nothing is released. Seen (a review): v0 went, then POOL_FULL."""
    from sparsekv.daemon.registry import Owner

    reg = EngineRegistry(pool, backend, max_pool_bytes_per_uid=4 * MiB)
    lay = helpers.layout(host_rows=(2 * MiB) // 64)
    _keep(reg, 1, "v0", lay, Owner(7, 7))
    for i in range(3):
        attach(reg, 10 + i, 0, "cpu", f"busy{i}", lay, owner=Owner(20 + i, 20 + i))
    assert reg.make_room(4 * MiB, Owner(7, 7)) == []
    assert "v0" in reg and reg.space("v0").blocks.cached_blocks == 1


def test_a_gone_clients_large_zeros_are_left_to_the_caller_and_its_engine_stays_meanwhile(reg, pool):
    """A client of an engine kept for its cached blocks goes holding private blocks:
    ``detach`` returns their zeros (from ``heavy_bytes`` on) unwritten; between
    ``zeroing`` and ``zeroed`` the engine neither yields to a new one nor is dropped."""
    lay = helpers.layout(host_rows=(2 * MiB) // 64)
    attach(reg, 9, 0, "cpu", "busy", lay)
    keep_two_engines(reg)  # old, newer: kept, one cached block each
    attach(reg, 1, 0, "cpu", "old", lay, block_size=4)  # a client of old again
    store = reg.space("old").blocks
    store.open(1, 0)
    mine = store.alloc(1, 3)
    space = reg.space("old")
    rows = (np.asarray(mine)[:, None] * 4 + np.arange(4)).reshape(-1)
    space.pool[:, rows] = 7
    reg.heavy_bytes = 1
    zeros = reg.detach(1, "old")
    assert zeros and sum(z.nbytes for z in zeros) == rows.size * lay.num_layers * lay.row_bytes
    assert (space.pool[:, rows] == 7).all()  # not written yet
    reg.zeroing("old")
    assert reg.make_room(4 * MiB) == ["newer"]  # [4, 8): newer's range beside the free one; old held
    assert reg.make_room(6 * MiB) == []  # old's range would be needed: held, nothing released
    assert reg.drop_kept() == [] and "old" in reg
    for z in zeros:
        z()
    reg.zeroed("old")
    assert not space.pool[:, rows].any() and "old" in reg and store.cached_blocks == 1  # kept, as before
    assert reg.drop_kept() == ["old"]


def test_a_gone_clients_zeros_are_not_written_when_its_engine_goes_or_they_are_small(reg, pool, monkeypatch):
    """The last rank's blocks: none to write (the pool zeroes the whole range it takes
    back); below ``heavy_bytes``: written in ``detach``."""
    from sparsekv.daemon.engine_blocks import ZeroWrite
    written = []
    call = ZeroWrite.__call__
    monkeypatch.setattr(ZeroWrite, "__call__", lambda self: written.append(self.nbytes) or call(self))
    lay = helpers.layout()
    reg.heavy_bytes = 1
    attach(reg, 1, 0, "cpu", "e", lay, block_size=4)
    reg.space("e").blocks.open(1, 0)
    reg.space("e").blocks.alloc(1, 2)
    assert reg.detach(1, "e") == [] and "e" not in reg and written == []
    attach(reg, 2, 0, "cpu", "f", lay, block_size=4)
    attach(reg, 3, 0, "cpu", "f", lay, block_size=4)  # a second rank keeps it
    space = reg.space("f")
    for c in (2, 3):
        space.blocks.open(c, 0)
    [b] = space.blocks.alloc(2, 1)
    space.pool[:, b * 4:(b + 1) * 4] = 5
    reg.heavy_bytes = 1 << 30
    assert reg.detach(2, "f") == [] and written and not space.pool[:, b * 4:(b + 1) * 4].any()
