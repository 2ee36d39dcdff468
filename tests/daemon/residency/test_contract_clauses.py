"""Every clause of the residency contract (DESIGN §4), one named test each, on small
hand-computed examples. Clauses about one region run against both the reference model
(``contract.RegionModel``) and the NumPy engine (``CpuResidency``); clauses about batches
(padding rows, several tokens of one request, index groups, the sorted plan) are
``CpuResidency``'s alone, the model having one region and no batch."""

import numpy as np
import pytest

from sparsekv.daemon.residency.base import ResidencyError
from sparsekv.daemon.residency.contract import DuplicateIdError, RegionModel
from sparsekv.daemon.residency.cpu import CpuResidency
from sparsekv.proto import Layout

HOST_ROWS = 100


class RefRegion:
    """The reference model of one region."""

    def __init__(self, region_stride: int, top_k: int):
        self.m = RegionModel(region_stride)
        self.top_k = top_k

    def resolve(self, row):
        slots, plan, oor = self.m.resolve(row, HOST_ROWS)
        return slots, len(plan), sorted(plan), oor

    def prefetch(self, row):
        return sorted(self.m.prefetch(row, HOST_ROWS, self.top_k))

    @property
    def counts(self):
        return self.m.prefetch_hits, self.m.prefetch_wasted

    def invalidate(self, rows):
        self.m.invalidate(rows)

    def reset(self):
        self.m.reset()

    @property
    def owner(self):
        return list(self.m.owner)

    @property
    def lru(self):
        return list(self.m.lru)

    def assert_duplicate_rejected(self, row):
        with pytest.raises(DuplicateIdError):
            self.m.resolve(row, HOST_ROWS)


class CpuRegion:
    """One region of ``CpuResidency``: state row 1 of 2, so that state row 0 stands by."""

    S = 1

    def __init__(self, region_stride: int, top_k: int):
        self.lay = Layout(num_layers=1, row_bytes=16, top_k=top_k, region_stride=region_stride, max_reqs=2,
                          host_rows=HOST_ROWS)
        self.r = CpuResidency(self.lay)

    def resolve(self, row):
        topk = np.full((1, self.lay.top_k), -1, np.int32)
        topk[0, : len(row)] = row
        res = self.r.resolve(0, np.array([self.S], np.int32), topk)
        base = self.S * self.lay.region_stride
        plan = sorted(zip(res.plan.rows.tolist(), (res.plan.slots - base).tolist(), strict=True))
        # the bystander region must never change
        assert (self.r.owner[0, 0] == -1).all() and self.r.lru[0, 0].tolist() == list(range(self.lay.region_stride))
        return res.slots[0, : len(row)].tolist(), int(res.misses[0]), plan, res.out_of_range

    def prefetch(self, row):
        topk = np.full((1, self.lay.top_k), -1, np.int32)
        topk[0, : len(row)] = row
        plan = self.r.prefetch(0, np.array([self.S], np.int32), topk)
        assert list(plan.rows) == sorted(plan.rows)
        return sorted(zip(plan.rows.tolist(), (plan.slots - self.S * self.lay.region_stride).tolist(), strict=True))

    @property
    def counts(self):
        return self.r.prefetch_hits, self.r.prefetch_wasted

    def invalidate(self, rows):
        self.r.invalidate(self.S, np.array(rows, np.int32))

    def reset(self):
        self.r.reset(np.array([self.S], np.int32))

    @property
    def owner(self):
        return self.r.owner[0, self.S].tolist()

    @property
    def lru(self):
        return self.r.lru[0, self.S].tolist()

    def assert_duplicate_rejected(self, row):
        with pytest.raises(ResidencyError) as ei:
            self.resolve(row)
        assert ei.value.code == "DUPLICATE_IDS"
        assert "twice" in str(ei.value)


@pytest.fixture(params=[RefRegion, CpuRegion], ids=["reference", "cpu"])
def region(request):
    """``region(region_stride, top_k)`` of the implementation under test."""
    return request.param


def test_fresh_region_is_empty_with_identity_lru(region):
    r = region(4, 2)
    assert r.owner == [-1, -1, -1, -1]
    assert r.lru == [0, 1, 2, 3]


def test_all_misses_take_the_oldest_slots_in_column_order(region):
    r = region(6, 3)
    slots, n_miss, plan, oor = r.resolve([42, 7, 19])
    assert slots == [0, 1, 2]
    assert n_miss == 3 and oor == 0
    assert plan == [(7, 1), (19, 2), (42, 0)]
    assert r.owner == [42, 7, 19, -1, -1, -1]
    # evictables[n_miss:] + evictables[:n_miss] + hits
    assert r.lru == [3, 4, 5, 0, 1, 2]


def test_all_hits_keep_their_slots_and_become_newest(region):
    r = region(6, 3)
    r.resolve([42, 7, 19])
    r.resolve([50])  # slot 3; lru [4, 5, 0, 1, 2, 3]
    assert r.lru == [4, 5, 0, 1, 2, 3]
    slots, n_miss, plan, _ = r.resolve([19, 42, 7])
    assert slots == [2, 0, 1]
    assert n_miss == 0 and plan == []
    assert r.owner == [42, 7, 19, 50, -1, -1]
    assert r.lru == [4, 5, 3, 0, 1, 2]


def test_hits_keep_their_previous_relative_lru_order_not_column_order(region):
    r = region(4, 4)
    r.resolve([10, 11, 12, 13])
    assert r.lru == [0, 1, 2, 3]
    slots, n_miss, _, _ = r.resolve([13, 10])
    assert slots == [3, 0] and n_miss == 0
    assert r.lru == [1, 2, 0, 3]  # column order would give [1, 2, 3, 0]


# Hand-computed: region_stride 4, top_k 2. Each step: top-k row -> slots, plan, owner, lru.
EVICTION_STEPS = [
    ([10, 11], [0, 1], [(10, 0), (11, 1)], [10, 11, -1, -1], [2, 3, 0, 1]),
    ([11, 12], [1, 2], [(12, 2)], [10, 11, 12, -1], [3, 0, 2, 1]),
    ([13, 10], [3, 0], [(13, 3)], [10, 11, 12, 13], [2, 1, 3, 0]),
    ([14, 15], [2, 1], [(14, 2), (15, 1)], [10, 15, 14, 13], [3, 0, 2, 1]),
    ([11, 13], [0, 3], [(11, 0)], [11, 15, 14, 13], [2, 1, 0, 3]),
]


def test_eviction_order_matches_hand_computed_sequence(region):
    r = region(4, 2)
    for step, (row, slots, plan, owner, lru) in enumerate(EVICTION_STEPS):
        got_slots, n_miss, got_plan, _ = r.resolve(row)
        assert (got_slots, got_plan, n_miss) == (slots, plan, len(plan)), f"step {step}"
        assert (r.owner, r.lru) == (owner, lru), f"step {step}"


def test_empty_slot_is_evictable_but_not_preferred_over_an_older_full_slot(region):
    r = region(4, 2)
    for row, *_ in EVICTION_STEPS[:3]:
        r.resolve(row)
    assert (r.owner, r.lru) == ([10, 11, 12, 13], [2, 1, 3, 0])
    r.invalidate([13])  # slot 3 empty, but slots 2 and 1 are older
    slots, _, plan, _ = r.resolve([20])
    assert slots == [2] and plan == [(20, 2)]
    assert r.owner == [10, 11, 20, -1] and r.lru == [1, 3, 0, 2]
    assert r.resolve([21])[0] == [1]
    assert r.resolve([22])[0] == [3]  # the empty slot's turn comes by age
    assert r.owner == [10, 21, 20, 22]


def test_minus_one_columns_resolve_to_minus_one_and_are_not_misses(region):
    r = region(4, 4)
    slots, n_miss, plan, oor = r.resolve([-1, 5, -1, 7])
    assert slots == [-1, 0, -1, 1]
    assert n_miss == 2 and plan == [(5, 0), (7, 1)]
    assert oor == 0  # -1 means "none", it is not out of range
    assert r.owner == [5, 7, -1, -1] and r.lru == [2, 3, 0, 1]


def test_out_of_range_columns_resolve_to_minus_one_are_not_misses_and_are_counted(region):
    r = region(5, 5)
    slots, n_miss, plan, oor = r.resolve([HOST_ROWS, 5, -3, HOST_ROWS - 1, -1])
    assert slots == [-1, 0, -1, 1, -1]
    assert n_miss == 2 and plan == [(5, 0), (HOST_ROWS - 1, 1)]
    assert oor == 2  # only ids < -1 or >= host_rows count
    assert r.owner == [5, HOST_ROWS - 1, -1, -1, -1]
    assert r.lru == [2, 3, 4, 0, 1]


def test_out_of_range_columns_do_not_disturb_hits(region):
    r = region(4, 3)
    r.resolve([5, 6])
    lru_before = r.lru
    slots, n_miss, plan, oor = r.resolve([10**6, 6, -2])
    assert slots == [-1, 1, -1] and n_miss == 0 and plan == [] and oor == 2
    assert r.owner == [5, 6, -1, -1]
    assert r.lru == [x for x in lru_before if x != 1] + [1]


def test_invalidate_empties_the_slot_and_keeps_lru_order(region):
    r = region(4, 2)
    for row, *_ in EVICTION_STEPS[:3]:
        r.resolve(row)
    lru = r.lru
    r.invalidate([11, 13])
    assert r.owner == [10, -1, 12, -1]
    assert r.lru == lru
    slots, n_miss, _, _ = r.resolve([11, 10])  # the invalidated row misses again
    assert n_miss == 1 and slots[1] == 0


def test_invalidate_of_rows_not_held_changes_nothing(region):
    r = region(4, 2)
    r.resolve([10, 11])
    owner, lru = r.owner, r.lru
    r.invalidate([12, 99])
    assert (r.owner, r.lru) == (owner, lru)


def test_reset_empties_every_slot_and_restores_identity_lru(region):
    r = region(4, 2)
    for row, *_ in EVICTION_STEPS:
        r.resolve(row)
    r.reset()
    assert r.owner == [-1] * 4 and r.lru == [0, 1, 2, 3]
    slots, n_miss, _, _ = r.resolve([11, 13])  # held before the reset: misses now
    assert slots == [0, 1] and n_miss == 2


def test_duplicate_ids_are_rejected_and_change_no_state(region):
    r = region(4, 3)
    r.resolve([10, 11])
    owner, lru = r.owner, r.lru
    r.assert_duplicate_rejected([12, 13, 12])
    r.assert_duplicate_rejected([10, 10])  # a duplicated hit, too
    assert (r.owner, r.lru) == (owner, lru)


def test_repeated_minus_one_and_out_of_range_ids_are_not_duplicates(region):
    r = region(6, 6)
    slots, n_miss, _, oor = r.resolve([-1, 3, -1, HOST_ROWS, HOST_ROWS, -5])
    assert slots == [-1, 0, -1, -1, -1, -1]
    assert n_miss == 1 and oor == 3


def test_plan_is_exactly_the_misses(region):
    r = region(8, 4)
    r.resolve([1, 2, 3])
    slots, n_miss, plan, _ = r.resolve([2, 9, 3, 8])
    assert n_miss == 2
    assert plan == sorted([(9, slots[1]), (8, slots[3])])
    assert set(slots[i] for i in (1, 3)).isdisjoint({slots[0], slots[2]})


# -- batch clauses: CpuResidency ---------------------------------------------------------
def cpu(**kw) -> CpuResidency:
    base = dict(num_layers=1, row_bytes=16, top_k=2, region_stride=4, max_reqs=3, host_rows=HOST_ROWS)
    base.update(kw)
    return CpuResidency(Layout(**base))


def snapshot(r: CpuResidency):
    return r.owner.copy(), r.lru.copy()


def assert_unchanged(r: CpuResidency, snap) -> None:
    assert np.array_equal(r.owner, snap[0]) and np.array_equal(r.lru, snap[1])


def test_padding_rows_are_untouched_resolve_to_minus_one_and_count_nothing():
    r = cpu()
    r.resolve(0, np.array([1], np.int32), np.array([[10, 11]], np.int32))
    snap = snapshot(r)
    # Padding rows carry junk: ids held elsewhere, out-of-range ids, even duplicates.
    res = r.resolve(0, np.array([-1, -1], np.int32), np.array([[10, 11], [HOST_ROWS + 5, HOST_ROWS + 5]], np.int32))
    assert (res.slots == -1).all()
    assert res.misses.tolist() == [0, 0]
    assert res.hits == 0 and res.out_of_range == 0 and len(res.plan) == 0
    assert_unchanged(r, snap)


def test_padding_row_between_live_rows_does_not_shift_results():
    r = cpu()
    res = r.resolve(0, np.array([0, -1, 2], np.int32), np.array([[5, 6], [7, 8], [9, -1]], np.int32))
    assert res.slots.tolist() == [[0, 1], [-1, -1], [0, -1]]
    assert res.misses.tolist() == [2, 0, 1]
    assert (r.owner[0, 1] == -1).all()
    assert r.owner[0, 0].tolist()[:2] == [5, 6] and r.owner[0, 2].tolist()[0] == 9


def test_plan_is_sorted_by_host_row_with_flat_slots():
    r = cpu(top_k=3, region_stride=3)
    res = r.resolve(0, np.array([2, 0], np.int32), np.array([[50, 20, 40], [30, 10, 60]], np.int32))
    assert res.plan.rows.tolist() == [10, 20, 30, 40, 50, 60]
    # flat slot = state_row * region_stride + slot
    assert res.plan.slots.tolist() == [0 * 3 + 1, 2 * 3 + 1, 0 * 3 + 0, 2 * 3 + 2, 2 * 3 + 0, 0 * 3 + 2]
    assert res.plan.rows.dtype == np.int32 and res.plan.slots.dtype == np.int32


def test_several_tokens_of_one_state_row_resolve_in_batch_order():
    r = cpu(top_k=2, region_stride=4)
    ref = RegionModel(4)
    rows = [[10, 11], [11, 12]]
    res = r.resolve(0, np.array([1, 1], np.int32), np.array(rows, np.int32))
    want_plan = []
    for b, row in enumerate(rows):
        slots, plan, _ = ref.resolve(row, HOST_ROWS)
        assert res.slots[b].tolist() == slots
        assert res.misses[b] == len(plan)
        want_plan += [(g, 4 + s) for g, s in plan]
    assert res.slots.tolist() == [[0, 1], [1, 2]]  # token 2 hits what token 1 brought in
    assert sorted(zip(res.plan.rows.tolist(), res.plan.slots.tolist(), strict=True)) == sorted(want_plan)
    assert r.owner[0, 1].tolist() == ref.owner and r.lru[0, 1].tolist() == ref.lru


def test_several_tokens_of_one_state_row_cannot_evict_each_others_rows():
    r = cpu(top_k=2, region_stride=4)
    r.resolve(0, np.array([0], np.int32), np.array([[1, 2]], np.int32))
    res = r.resolve(0, np.array([0, 0], np.int32), np.array([[3, 4], [5, 6]], np.int32))
    # every plan entry has its own slot: nothing gathered for token 1 is overwritten by token 2
    assert len(set(res.plan.slots.tolist())) == 4
    assert sorted(r.owner[0, 0].tolist()) == [3, 4, 5, 6]


def test_several_tokens_need_region_stride_of_top_k_per_token():
    r = cpu(top_k=2, region_stride=3, max_reqs=2)
    snap = snapshot(r)
    with pytest.raises(ResidencyError) as ei:
        r.resolve(0, np.array([1, 1], np.int32), np.array([[10, 11], [12, 13]], np.int32))
    assert ei.value.code == "BAD_ARGUMENT"
    assert "region_stride 3" in str(ei.value) and "appears 2 times" in str(ei.value)
    assert_unchanged(r, snap)
    # one token per state row fits
    r.resolve(0, np.array([1, 0], np.int32), np.array([[10, 11], [12, 13]], np.int32))


def test_duplicate_in_any_live_row_rejects_the_whole_batch_without_state_change():
    r = cpu()
    snap = snapshot(r)
    with pytest.raises(ResidencyError) as ei:
        r.resolve(0, np.array([0, 1], np.int32), np.array([[1, 2], [3, 3]], np.int32))
    assert ei.value.code == "DUPLICATE_IDS" and "row 1" in str(ei.value)
    assert_unchanged(r, snap)


@pytest.mark.parametrize(
    "group, state_rows, topk, code, words",
    [
        (1, [0], [[1, 2]], "BAD_ARGUMENT", "group 1"),
        (-1, [0], [[1, 2]], "BAD_ARGUMENT", "group -1"),
        (0, [3], [[1, 2]], "BAD_STATE_ROW", "state row 3"),
        (0, [-2], [[1, 2]], "BAD_STATE_ROW", "state row -2"),
        (0, [0], [[1, 2, 3]], "BAD_ARGUMENT", "3 columns"),
        (0, [0, 1], [[1, 2]], "BAD_ARGUMENT", "state_rows must be"),
    ],
)
def test_bad_batches_are_rejected_without_state_change(group, state_rows, topk, code, words):
    r = cpu()
    r.resolve(0, np.array([0], np.int32), np.array([[7, 8]], np.int32))
    snap = snapshot(r)
    with pytest.raises(ResidencyError) as ei:
        r.resolve(group, np.array(state_rows, np.int32), np.array(topk, np.int32))
    assert ei.value.code == code and words in str(ei.value)
    assert_unchanged(r, snap)


def test_fewer_columns_than_top_k_are_accepted():
    r = cpu(top_k=4, region_stride=4)
    res = r.resolve(0, np.array([0], np.int32), np.array([[9, 8]], np.int32))
    assert res.slots.tolist() == [[0, 1]] and res.misses.tolist() == [2]


def test_index_groups_keep_separate_state():
    lay = dict(num_layers=4, index_groups=((0, 1), (2, 3)))
    r = cpu(**lay)
    r.resolve(0, np.array([0], np.int32), np.array([[10, 11]], np.int32))
    g0 = r.owner[0].copy(), r.lru[0].copy()
    res = r.resolve(1, np.array([0], np.int32), np.array([[11, 12]], np.int32))
    assert res.misses.tolist() == [2]  # group 1 holds nothing of group 0
    assert res.slots.tolist() == [[0, 1]]
    assert np.array_equal(r.owner[0], g0[0]) and np.array_equal(r.lru[0], g0[1])
    assert r.owner[1, 0].tolist() == [11, 12, -1, -1]


def test_reset_and_invalidate_apply_to_every_group_of_the_state_row_only():
    r = cpu(num_layers=2)  # one group per layer
    for g in (0, 1):
        r.resolve(g, np.array([0, 1], np.int32), np.array([[10, 11], [10, 11]], np.int32))
    r.invalidate(0, np.array([11], np.int32))
    assert r.owner[:, 0, :2].tolist() == [[10, -1], [10, -1]]
    assert r.owner[:, 1, :2].tolist() == [[10, 11], [10, 11]]
    r.reset(np.array([1], np.int32))
    assert (r.owner[:, 1] == -1).all() and (r.lru[:, 1] == np.arange(4)).all()
    assert r.owner[:, 0, :2].tolist() == [[10, -1], [10, -1]]


def test_invalidate_everywhere_empties_every_state_row_and_counts_slots():
    r = cpu(num_layers=2)
    for g in (0, 1):
        r.resolve(g, np.array([0, 1, 2], np.int32), np.array([[10, 11], [11, 12], [13, 14]], np.int32))
    lru = r.lru.copy()
    n = r.invalidate_everywhere(np.array([11, -1, 99], np.int32))
    assert n == 4  # row 11 in state rows 0 and 1, in both groups
    assert not (r.owner == 11).any()
    assert np.array_equal(r.lru, lru)
    assert (r.owner == 10).sum() == 2 and (r.owner == 14).sum() == 2


def test_reset_rejects_state_row_out_of_range():
    r = cpu()
    with pytest.raises(ResidencyError) as ei:
        r.reset(np.array([3], np.int32))
    assert ei.value.code == "BAD_STATE_ROW"
    with pytest.raises(ResidencyError) as ei:
        r.invalidate(3, np.array([1], np.int32))
    assert ei.value.code == "BAD_STATE_ROW"


# -- prefetch (DESIGN §4, "prefetch") ---------------------------------------------------
def test_prefetch_fills_the_oldest_slots_outside_the_latest_resolve_in_column_order(region):
    r = region(6, 2)
    r.resolve([10, 11])  # slots 0, 1; lru 2 3 4 5 0 1 (0 and 1 the latest resolve's: kept)
    assert r.prefetch([20, 21]) == [(20, 2), (21, 3)]
    assert r.owner == [10, 11, 20, 21, -1, -1]
    assert r.lru == [4, 5, 2, 3, 0, 1]  # the taken slots just below the kept ones


def test_prefetch_leaves_held_rows_alone_and_a_second_prefetch_keeps_the_same_slots(region):
    r = region(4, 2)
    r.resolve([10, 11])  # slots 0 1; lru 2 3 0 1
    r.resolve([12, 10])  # 12 -> 2, 10 hit; lru 3 1 2 0 (2 and 0 kept)
    assert r.prefetch([11, 30]) == [(30, 3)]  # 11 held in slot 1: left alone, not moved
    assert r.owner == [10, 11, 12, 30]
    assert r.lru == [1, 3, 2, 0]
    assert r.prefetch([40, 41]) == [(40, 1), (41, 3)]  # 2 and 0 still kept
    assert r.owner == [10, 40, 12, 41] and r.lru == [1, 3, 2, 0]
    assert r.counts == (0, 1)  # 30, prefetched, lost its slot before any hit


def test_prefetch_takes_no_slot_past_the_candidates(region):
    r = region(3, 2)
    r.resolve([1, 2])  # lru 2 0 1
    assert r.prefetch([7, 8]) == [(7, 2)]
    assert r.owner == [1, 2, 7] and r.lru == [2, 0, 1]


def test_prefetch_into_a_region_of_top_k_slots_does_nothing(region):
    r = region(3, 3)
    r.resolve([1, 2])
    assert r.prefetch([7, 8]) == []
    assert r.owner == [1, 2, -1] and r.lru == [2, 0, 1]


def test_prefetch_ignores_fillers_and_out_of_range_ids(region):
    r = region(4, 2)
    assert r.prefetch([HOST_ROWS, 5]) == [(5, 0)]
    assert r.lru == [1, 0, 2, 3]


def test_a_prefetched_row_is_a_hit_then_counted_once(region):
    r = region(4, 2)
    r.resolve([1, 2])
    r.prefetch([3])
    slots, misses, _, _ = r.resolve([3, 1])
    assert misses == 0 and slots == [2, 0]
    r.resolve([3, 1])
    assert r.counts == (1, 0)


def test_prefetched_rows_evicted_reset_or_invalidated_before_a_hit_are_wasted(region):
    r = region(4, 2)
    r.resolve([1, 2])  # lru 2 3 0 1
    r.prefetch([3, 4])  # slots 2 3
    r.resolve([5, 6])  # misses take 2 and 3: both prefetched rows lost
    assert r.counts == (0, 2)
    r.prefetch([7])  # the oldest outside the latest resolve's (2 3): slot 0
    assert r.owner[0] == 7
    r.invalidate([7])
    assert r.counts == (0, 3)
    r.prefetch([8])
    r.reset()
    assert r.counts == (0, 4)
