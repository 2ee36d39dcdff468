"""``CpuResidency.invalidate_pairs`` (a STEP's invalidations in one call) against one
``invalidate`` a batch row, on random regions with repeated state rows, rows named twice,
rows no slot owns and prefetch marks; both of its ways (one vectorised pass, a region at a
time past ``PAIRS_AT_ONCE``); ``invalidate_everywhere`` a piece at a time against every
state row invalidated."""

from __future__ import annotations

import numpy as np
import pytest

from sparsekv.daemon.residency import cpu
from sparsekv.daemon.residency.base import ResidencyError, apply_step
from sparsekv.daemon.residency.cpu import CpuResidency
from sparsekv.proto import Layout


def _pair(seed: int):
    rng = np.random.default_rng(seed)
    lay = Layout(num_layers=2, row_bytes=16, top_k=8, region_stride=32, max_reqs=12, host_rows=200,
                 index_groups=((0,), (1,))).validate()
    a, b = CpuResidency(lay), CpuResidency(lay)
    owner = rng.integers(-1, lay.host_rows, a.owner.shape).astype(np.int32)
    fresh = rng.random(a.fresh.shape) < 0.3
    for r in (a, b):
        r.owner[:], r.fresh[:] = owner, fresh
    return rng, lay, a, b


@pytest.mark.parametrize("at_once", [1 << 20, 1])
@pytest.mark.parametrize("seed", range(6))
def test_a_steps_invalidations_in_one_call_equal_one_call_a_batch_row(monkeypatch, at_once, seed):
    monkeypatch.setattr(cpu, "PAIRS_AT_ONCE", at_once)
    rng, lay, a, b = _pair(seed)
    batch = 9
    state_rows = rng.integers(-1, lay.max_reqs, batch).astype(np.int32)
    state_rows[1] = state_rows[0]  # two tokens of one request
    inv = rng.integers(-1, lay.host_rows, (batch, 5)).astype(np.int32)
    inv[2, 1] = inv[2, 0]  # a row named twice
    apply_step(a, state_rows, None, inv)
    for r, s in enumerate(state_rows):  # the plain way: a batch row at a time
        if s >= 0:
            b.invalidate(int(s), inv[r][inv[r] >= 0])
    np.testing.assert_array_equal(a.owner, b.owner)
    np.testing.assert_array_equal(a.fresh, b.fresh)
    assert a.prefetch_wasted == b.prefetch_wasted
    assert (a.owner != -1).sum() < (_pair(seed)[2].owner != -1).sum()  # it emptied some


def test_a_state_row_out_of_range_is_refused_before_anything_changes():
    _, lay, a, _ = _pair(0)
    before = a.owner.copy()
    with pytest.raises(ResidencyError, match="BAD_STATE_ROW|out of range"):
        a.invalidate_pairs(np.array([0, lay.max_reqs]), np.array([1, 2]))
    np.testing.assert_array_equal(a.owner, before)


@pytest.mark.parametrize("at_once", [1 << 20, 7, 1])
@pytest.mark.parametrize("seed", range(4))
def test_a_rewrite_empties_every_slot_of_its_rows_in_pieces_as_at_once(monkeypatch, at_once, seed):
    """A write's drop scans the whole state ``PAIRS_AT_ONCE`` slots at a time (bounded
    temporaries): the same slots emptied, marks dropped and count as every state row's
    ``invalidate``, whatever the pieces' size."""
    monkeypatch.setattr(cpu, "PAIRS_AT_ONCE", at_once)
    rng, lay, a, b = _pair(seed)
    rows = rng.integers(-1, lay.host_rows, 40).astype(np.int32)
    rows[1] = rows[0]  # a row named twice
    owned = int(np.isin(a.owner, rows[rows >= 0]).sum())
    n = a.invalidate_everywhere(rows)
    for s in range(lay.max_reqs):
        b.invalidate(s, rows)
    assert n == owned > 0
    np.testing.assert_array_equal(a.owner, b.owner)
    np.testing.assert_array_equal(a.fresh, b.fresh)
    assert a.prefetch_wasted == b.prefetch_wasted > 0
