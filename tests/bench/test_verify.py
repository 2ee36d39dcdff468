"""The ``--verify`` machinery must be able to fail: the pattern differs per (layer, row)
and count_mismatches catches one wrong byte, a missing slot, and a row in the wrong slot."""

import numpy as np

from sparsekv.bench.verify import count_mismatches, pattern


def test_pattern_is_deterministic_and_differs_by_layer_and_row():
    rows = np.arange(512)
    a = pattern(0, rows, 64)
    assert a.dtype == np.uint8 and a.shape == (512, 64)
    assert np.array_equal(a, pattern(0, rows, 64))
    assert len({r.tobytes() for r in a}) == 512  # every row distinct
    assert (a != pattern(1, rows, 64)).any(axis=1).all()  # every row differs in another layer


def slab_with_pattern(topk, slots, state_rows, layers=(0, 1), region=8, row_bytes=32):
    slab = np.zeros((2, 3, region, row_bytes), np.uint8)
    for b, s in enumerate(state_rows):
        for col, g in enumerate(topk[b]):
            if g >= 0 and s >= 0:
                for layer in layers:
                    slab[layer, s, slots[b, col]] = pattern(layer, [g], row_bytes)[0]
    return slab


TOPK = np.array([[5, 9, -1], [7, 2, 3]], np.int32)
SLOTS = np.array([[0, 1, -1], [4, 2, 3]], np.int32)
ROWS = np.array([1, 2], np.int32)


def test_a_correct_slab_has_no_mismatch():
    slab = slab_with_pattern(TOPK, SLOTS, ROWS)
    assert count_mismatches(slab, (0, 1), ROWS, TOPK, SLOTS, 100) == 0


def test_one_wrong_byte_is_one_mismatched_row():
    slab = slab_with_pattern(TOPK, SLOTS, ROWS)
    slab[1, 2, 3, 31] ^= 1
    assert count_mismatches(slab, (0, 1), ROWS, TOPK, SLOTS, 100) == 1


def test_swapped_slots_and_missing_slots_are_counted():
    slab = slab_with_pattern(TOPK, SLOTS, ROWS)
    swapped = SLOTS.copy()
    swapped[1, [1, 2]] = swapped[1, [2, 1]]
    assert count_mismatches(slab, (0, 1), ROWS, TOPK, swapped, 100) == 4  # 2 columns x 2 layers
    missing = SLOTS.copy()
    missing[0, 0] = -1
    assert count_mismatches(slab, (0, 1), ROWS, TOPK, missing, 100) == 2


def test_padding_rows_and_out_of_range_ids_are_not_checked():
    slab = slab_with_pattern(TOPK, SLOTS, ROWS)
    topk = TOPK.copy()
    topk[1, 0] = 100  # out of range: never read, so no slot is expected
    slots = SLOTS.copy()
    slots[1, 0] = -1
    assert count_mismatches(slab, (0, 1), np.array([-1, 2]), topk, slots, 100) == 0
