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


def rule(pos, table, bs, table_rows):
    """The rule of DESIGN §6 written out, one position at a time."""
    want = np.full(pos.shape, U)
    for b in range(pos.shape[0]):
        r = table_rows[b]
        for j, p in enumerate(pos[b]):
            if r >= 0 and 0 <= p < table.shape[1] * bs and table[r, p // bs] >= 0:
                row = int(table[r, p // bs]) * bs + int(p) % bs
                want[b, j] = row if row <= I32_MAX else U
    return want


@pytest.mark.parametrize("bs", [8, 6, 1, 64])
@pytest.mark.parametrize("pos_dtype, table_dtype", [(np.int32, np.int32), (np.int64, np.int32), (np.int32, np.int64),
                                                    (np.int16, np.int16), (np.uint32, np.int32)])
def test_agrees_with_the_rule_written_out_on_random_tables(bs, pos_dtype, table_dtype):
    """Power-of-two block sizes and others, 16- to 64-bit arrays, and tables whose blocks
    reach past int32 rows: the fast paths agree with the rule."""
    rng = np.random.default_rng(5 + bs)
    batch, max_blocks, k = 5, 6, 40
    top = 50 if np.dtype(table_dtype).itemsize < 4 else min(I32_MAX // bs + 3, np.iinfo(table_dtype).max)  # past int32
    table = rng.integers(-1, 50, (batch, max_blocks)).astype(table_dtype)
    table[0, :2] = [top, top - 5]
    lo = 0 if np.dtype(pos_dtype).kind == "u" else -10
    pos = rng.integers(lo, max_blocks * bs + 10, (batch, k)).astype(pos_dtype)
    np.testing.assert_array_equal(host_rows(pos, table, bs), rule(pos, table, bs, range(batch)))


def test_table_rows_pick_each_tokens_row_and_minus_one_maps_nothing():
    """table_rows: several tokens of one request share its row of the table (speculative
    decoding), a padding token (-1) maps nothing; rows outside the table are refused."""
    rng = np.random.default_rng(9)
    bs, reqs, max_blocks, k = 16, 4, 5, 30
    table = rng.integers(-1, 40, (reqs, max_blocks)).astype(np.int32)
    which = np.array([2, 2, -1, 0, 3, 2], np.int32)
    pos = rng.integers(-5, max_blocks * bs + 5, (len(which), k)).astype(np.int32)
    got = host_rows(pos, table, bs, table_rows=which)
    np.testing.assert_array_equal(got, rule(pos, table, bs, which))
    assert (got[2] == U).all()
    with pytest.raises(ValueError, match=r"table_rows must lie in \[-1, 4\)"):
        host_rows(pos, table, bs, table_rows=np.array([0, 1, 4, 0, 0, 0]))
    with pytest.raises(ValueError, match="table_rows must be integers"):
        host_rows(pos, table, bs, table_rows=np.zeros(3, np.int32))


def test_block_sizes_and_table_values_past_int32_never_wrap():
    """A block size beyond int32 (the 32-bit path must not take it), and int64 or uint64
    table values whose rows are past int32 (their product must not wrap into range)."""
    assert host_rows(np.array([[5, -1]], np.int32), np.array([[0]], np.int32), 2**31).tolist() == [[5, U]]
    assert host_rows(np.array([[127]], np.int8), np.array([[-3]], np.int32), 3 * 2**31).tolist() == [[U]]
    for dtype in (np.int64, np.uint64):
        table = np.array([[2**62, 2**62 + 3, 1]], dtype)
        assert host_rows(np.array([[1, 5, 9]]), table, 4).tolist() == [[U, U, 5]]
