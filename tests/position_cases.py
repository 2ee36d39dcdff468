"""Random cases of the positions -> host rows rule, and the answer a kernel must give: the
GPU test (tests/client/test_map_positions.py) and the emulator's (tests/csrc/
test_positions_on_cpu.py) compare ``skv_map_positions_*`` with the host rule on them."""

from __future__ import annotations

import numpy as np

from sparsekv.proto.positions import INT32_MAX, UNMAPPED, host_rows


def cases(n: int, block_sizes, seed: int = 11):
    """``n`` cases ``(case, bs, pos, table, reqs)``: random tables (null blocks, blocks whose
    rows pass int32), positions (negative, past the table), block sizes from
    ``block_sizes``, request rows (padding, past the table, several tokens on one row),
    int32 and int64 tables and positions."""
    rng = np.random.default_rng(seed)
    for case in range(n):
        bs = int(rng.choice(block_sizes))
        rows_n, max_blocks, k, tokens = (int(rng.integers(1, 6)), int(rng.integers(1, 9)), int(rng.integers(1, 12)),
                                         int(rng.integers(1, 7)))
        tdt, pdt = rng.choice([np.int32, np.int64]), rng.choice([np.int32, np.int64])
        hi = min(np.iinfo(tdt).max, (INT32_MAX // bs + 3) if case % 3 == 0 else 40)
        table = rng.integers(-1, hi, (rows_n, max_blocks), endpoint=True).astype(tdt)
        pos = rng.integers(-2 * bs, max_blocks * bs + 2 * bs, (tokens, k)).astype(pdt)
        reqs = rng.integers(-1, rows_n + 1, tokens).astype(np.int32)
        yield case, bs, pos, table, reqs


def expected(pos, table, bs, reqs):
    """host_rows, with a token whose table row is outside [0, rows) mapping nothing (the
    kernel's rule; host_rows refuses such a row)."""
    inside = (reqs >= 0) & (reqs < table.shape[0])
    want = host_rows(pos, table, bs, table_rows=np.where(inside, reqs, -1))
    return np.where(inside[:, None], want, UNMAPPED)
