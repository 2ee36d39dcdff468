"""The TOPK block's D_SLOTS word on the emulator: the daemon's gather marks the block's
slots written (``mark_slots``); the kernels' descriptor fields are the protocol's. The
engine's side (``skv_db_indices`` making its indices at the word): test_ready_poll_on_cpu.py."""

from __future__ import annotations

import numpy as np
import pytest

import cpu_kernels
from sparsekv.daemon.residency.cuda.device import make_desc

pytestmark = pytest.mark.skipif(cpu_kernels.compiler() is None, reason="no C++ compiler for the kernel emulator")


@pytest.mark.parametrize("grid", [1, 3])
def test_the_gather_marks_the_blocks_slots_written_only_when_asked(grid):
    """skv_gather with mark_slots (a doorbell TOPK block's first gather) sets the
    descriptor's D_SLOTS word to 1, also for a descriptor out of range (its slots are the
    resolve's -1s, final too); the rest of the descriptor and the copy are as without it,
    and without mark_slots the word stays 0."""
    from sparsekv.proto.step_block import D_SLOTS

    pool, groups, rows, slots, misses, slots_n = cpu_kernels.small_plan(4)
    L, rb, ld = pool.shape[0], pool.shape[2], rows.shape[1]
    for desc in (make_desc(3, ld, 0), make_desc(3, ld, 5)):
        for mark in (False, True):
            d = desc.copy()
            slab, want = np.zeros((L, slots_n, rb), np.uint8), np.zeros((L, slots_n, rb), np.uint8)
            cpu_kernels.gather(d, pool, want, slots_n, groups, rows, slots, misses, grid=grid)
            cpu_kernels.gather(d, pool, slab, slots_n, groups, rows, slots, misses, grid=grid, mark_slots=mark)
            assert d[D_SLOTS] == (1 if mark else 0)
            np.testing.assert_array_equal(np.delete(d, D_SLOTS), np.delete(desc, D_SLOTS))
            np.testing.assert_array_equal(slab, want)


def test_the_kernels_descriptor_fields_are_the_protocols():
    """csrc/common.cuh's SKV_D_* and SKV_DESC_INTS are proto/step_block.py's numbers."""
    import re

    from sparsekv.csrc.build import load_source
    from sparsekv.proto import step_block

    text = load_source("common.cuh")
    fields = {m[0]: int(m[1]) for m in re.findall(r"#define SKV_D_([A-Z_]+)\s+(\d+)", text)}
    assert fields == {n[2:]: getattr(step_block, n) for n in dir(step_block) if re.fullmatch(r"D_[A-Z_]+", n)}
    assert int(re.search(r"#define SKV_DESC_INTS\s+(\d+)", text)[1]) == step_block.DESC_INTS
