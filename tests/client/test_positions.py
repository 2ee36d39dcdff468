"""``proto.positions.host_rows``: the one rule that maps logical positions to host rows
(DESIGN §6, docs/TRACES.md). Every position that does not name a row of a real block
becomes UNMAPPED (-2), which the residency counts as out of range."""

import numpy as np
import pytest

from sparsekv.proto.positions import UNMAPPED, host_rows

U = UNMAPPED
I32_MAX = np.iinfo(np.int32).max


def test_unmapped_is_an_out_of_range_id_not_the_none_id():
    assert UNMAPPED < -1  # -1 is "no id" in host-row batches and is not counted


def test_positions_map_through_their_block_at_block_boundaries():
    table = np.array([[5, 0, 2]], np.int32)  # logical blocks 0, 1, 2 -> host blocks 5, 0, 2
    pos = np.array([[0, 3, 4, 7, 8, 11]], np.int32)
    out = host_rows(pos, table, 4)
    assert out.dtype == np.int32 and out.shape == (1, 6)
    np.testing.assert_array_equal(out, [[20, 23, 0, 3, 8, 11]])


def test_each_batch_row_uses_its_own_table_row():
    table = np.array([[1, 2], [7, 3]], np.int32)
    pos = np.array([[0, 5], [0, 5]], np.int32)
    np.testing.assert_array_equal(host_rows(pos, table, 4), [[4, 9], [28, 13]])


def test_negative_positions_are_unmapped():
    table = np.array([[3, 4]], np.int32)
    np.testing.assert_array_equal(host_rows(np.array([[-1, -2, -4, -5, -(2**31)]]), table, 4), [[U] * 5])


def test_positions_past_the_table_are_unmapped():
    table = np.array([[3, 4]], np.int32)
    pos = np.array([[7, 8, 9, 2**31 - 1, 2**40]], np.int64)  # 7 is the table's last position
    np.testing.assert_array_equal(host_rows(pos, table, 4), [[19, U, U, U, U]])


def test_positions_on_a_null_block_are_unmapped():
    table = np.array([[-1, 6, -1]], np.int32)
    pos = np.array([[0, 3, 4, 7, 8, 11]], np.int32)
    np.testing.assert_array_equal(host_rows(pos, table, 4), [[U, U, 24, 27, U, U]])


def test_an_empty_table_maps_nothing():
    out = host_rows(np.array([[0, 1], [2, -1]]), np.zeros((2, 0), np.int32), 4)
    np.testing.assert_array_equal(out, [[U, U], [U, U]])


def test_a_row_beyond_int32_is_unmapped_and_the_last_int32_row_maps():
    # block_size 2: host block 2**30 - 1 holds rows 2**31 - 2 and 2**31 - 1 (int32 max);
    # host block 2**30 would start at 2**31, which no int32 id can name.
    table = np.array([[2**30 - 1, 2**30, I32_MAX]], np.int32)
    pos = np.array([[0, 1, 2, 3, 4, 5]], np.int32)
    out = host_rows(pos, table, 2)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, [[I32_MAX - 1, I32_MAX, U, U, U, U]])


def test_block_size_one_is_the_table_itself():
    table = np.array([[9, -1, 4]], np.int32)
    np.testing.assert_array_equal(host_rows(np.array([[0, 1, 2, 3]]), table, 1), [[9, U, 4, U]])


def test_an_empty_batch_and_an_empty_row_work():
    assert host_rows(np.zeros((0, 4), np.int32), np.zeros((0, 3), np.int32), 4).shape == (0, 4)
    assert host_rows(np.zeros((2, 0), np.int32), np.zeros((2, 3), np.int32), 4).shape == (2, 0)


@pytest.mark.parametrize(
    "pos, table, bs, words",
    [
        (np.array([0, 1]), np.zeros((1, 2), np.int32), 4, "positions must be [batch, k]"),
        (np.zeros((1, 2, 3), np.int32), np.zeros((1, 2), np.int32), 4, "positions must be [batch, k]"),
        (np.zeros((2, 3), np.int32), np.zeros((3, 2), np.int32), 4,
         "block_table must be [batch, max_blocks] with batch 2"),
        (np.zeros((2, 3), np.int32), np.zeros(2, np.int32), 4, "block_table must be [batch, max_blocks]"),
        (np.zeros((1, 3), np.float32), np.zeros((1, 2), np.int32), 4, "must be integer arrays"),
        (np.zeros((1, 3), np.int32), np.zeros((1, 2), np.float64), 4, "must be integer arrays"),
        (np.zeros((1, 3), bool), np.zeros((1, 2), np.int32), 4, "must be integer arrays"),
        (np.zeros((1, 3), np.int32), np.zeros((1, 2), np.int32), 0, "block_size must be positive"),
        (np.zeros((1, 3), np.int32), np.zeros((1, 2), np.int32), -4, "block_size must be positive"),
    ],
)
def test_wrong_shapes_and_values_raise_naming_the_argument(pos, table, bs, words):
    with pytest.raises(ValueError) as ei:
        host_rows(pos, table, bs)
    assert words in str(ei.value)


def test_agrees_with_the_rule_written_out_on_random_tables():
    rng = np.random.default_rng(5)
    bs, batch, max_blocks, k = 8, 5, 6, 40
    table = rng.integers(-1, 50, (batch, max_blocks)).astype(np.int32)
    pos = rng.integers(-10, max_blocks * bs + 10, (batch, k)).astype(np.int32)
    want = np.full((batch, k), U)
    for b in range(batch):
        for j, p in enumerate(pos[b]):
            if 0 <= p < max_blocks * bs and table[b, p // bs] >= 0:
                want[b, j] = table[b, p // bs] * bs + p % bs
    np.testing.assert_array_equal(host_rows(pos, table, bs), want)
