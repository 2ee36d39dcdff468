"""Kernels of ``csrc/`` compiled for the CPU and run on the fiber emulator
(``cpu_kernels.py``), against the NumPy engine, bit for bit. ``skv_resolve``: slots,
misses, counters, the plan and the owner/lru state after every step, for both lookups
(sort, hash), several thread counts, shared and global workspaces; rows refused for
duplicates and for too many tokens; corrupt owners. ``skv_merge_plan``: the stable
host-row order. The same checks as the GPU tests (``daemon/residency/test_cuda_kernels.py``),
on any machine with a C++ compiler.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import cpu_kernels
from kernel_traces import assert_same, gen_batch, layout
from sparsekv.daemon.residency.cpu import CpuResidency

pytestmark = pytest.mark.skipif(cpu_kernels.compiler() is None, reason="no C++ compiler for the kernel emulator")

E_DUPLICATE_IDS, E_TOO_MANY_TOKENS = 0, 3  # csrc/common.cuh error kinds

# name, top_k, stride, host_rows, max_reqs, groups, batch, steps, overlap, threads, workspace
TRACES = [
    ("tiny", 4, 8, 24, 3, 2, 5, 60, 0.5, 32, "shared"),
    ("tiny-exact", 5, 5, 12, 2, 1, 3, 60, 0.6, 32, "shared"),
    ("tiles", 100, 300, 400, 4, 2, 8, 20, 0.7, 32, "shared"),
    ("tiles-global", 100, 300, 400, 4, 2, 8, 20, 0.7, 64, "global"),
    ("odd", 37, 111, 90, 3, 3, 6, 30, 0.5, 64, "shared"),
    ("wide", 256, 512, 20_000, 8, 1, 12, 10, 0.8, 128, "shared"),
]


def run_trace(lay, emu, seed: int, steps: int, batch: int, overlap: float) -> tuple[int, int]:
    cpu = CpuResidency(lay)
    rng = np.random.default_rng(seed)
    memory: dict = {}
    hits = misses = 0
    for step in range(steps):
        sr, tk = gen_batch(rng, lay, memory, batch, overlap, fresh=rng.random() < 0.2)
        group = int(rng.integers(lay.num_groups))
        want = cpu.resolve(group, sr, tk)
        got = emu.resolve(group, sr, tk)
        where = f"step {step}"
        assert_same(want, got, where)
        assert got.misses_counted == int(want.misses.sum()), where
        np.testing.assert_array_equal(emu.owner, cpu.owner, err_msg=f"owner {where}")
        np.testing.assert_array_equal(emu.lru, cpu.lru, err_msg=f"lru {where}")
        hits += want.hits
        misses += int(want.misses.sum())
    return hits, misses


@pytest.mark.parametrize("lookup", ["sort", "hash"])
@pytest.mark.parametrize("case", TRACES, ids=[t[0] for t in TRACES])
def test_resolve_on_cpu_equals_the_numpy_engine(case, lookup):
    name, k, stride, host_rows, reqs, groups, batch, steps, overlap, threads, ws = case
    lay = layout(k, stride, host_rows, reqs, groups=groups, max_batch=batch)
    emu = cpu_kernels.Resolve(lay, lookup, threads=threads, workspace=ws)
    hits, misses = run_trace(lay, emu, zlib.crc32(name.encode()) % 1000, steps, batch, overlap)
    assert hits > 0 and misses > 0  # both paths exercised
    assert not emu.err[:8].any()  # nothing refused or mended on a sound trace


@pytest.mark.parametrize("lookup", ["sort", "hash"])
def test_corrupt_owners_resolve_as_on_the_numpy_engine(lookup):
    """Owners outside the host rows or owning one row twice (the lowest slot wins)."""
    lay = layout(16, 48, 60, 3, max_batch=6)
    cpu = CpuResidency(lay)
    emu = cpu_kernels.Resolve(lay, lookup, threads=32)
    rng = np.random.default_rng(7)
    for trial in range(20):
        bad = rng.integers(-3, 80, size=cpu.owner.shape).astype(np.int32)
        cpu.owner[...] = bad
        emu.owner[...] = bad
        sr, tk = gen_batch(rng, lay, {}, 6, 0.0)
        assert_same(cpu.resolve(0, sr, tk), emu.resolve(0, sr, tk), f"trial {trial}")
        np.testing.assert_array_equal(emu.owner, cpu.owner)
        np.testing.assert_array_equal(emu.lru, cpu.lru)


@pytest.mark.parametrize("lookup", ["sort", "hash"])
def test_a_row_with_duplicate_ids_is_refused_and_the_rest_resolves(lookup):
    lay = layout(6, 12, 40, 2)
    cpu = CpuResidency(lay)
    emu = cpu_kernels.Resolve(lay, lookup, threads=32)
    warm = np.array([[1, 2, 3, 4, 5, 6]], np.int32)
    cpu.resolve(0, np.array([0], np.int32), warm)
    emu.resolve(0, np.array([0], np.int32), warm)
    before = emu.owner.copy(), emu.lru.copy()
    dup = np.array([[9, 3, 9, 7, 3, 9], [1, 2, 3, -1, -1, -1]], np.int32)
    sr = np.array([0, 1], np.int32)
    want = cpu.resolve(0, sr[1:], dup[1:])
    got = emu.resolve(0, sr, dup)
    assert emu.err[E_DUPLICATE_IDS] == 1 and emu.err[8 + E_DUPLICATE_IDS] == 0  # batch row 0
    assert (got.slots[0] == -1).all() and got.misses[0] == 0
    np.testing.assert_array_equal(got.slots[1:], want.slots)
    np.testing.assert_array_equal(got.misses[1:], want.misses)
    assert got.hits == want.hits
    np.testing.assert_array_equal(emu.owner[:, 0], before[0][:, 0])  # the refused row's state untouched
    np.testing.assert_array_equal(emu.lru[:, 0], before[1][:, 0])
    np.testing.assert_array_equal(emu.owner, cpu.owner)


@pytest.mark.parametrize("lookup", ["sort", "hash"])
def test_a_token_beyond_region_stride_over_top_k_is_refused(lookup):
    """Three tokens of one request where the region holds two top-k rows: the first two
    resolve in batch order, the third is refused (TOO_MANY_TOKENS), whichever block
    finds them."""
    lay = layout(4, 8, 40, 2, max_batch=4)
    emu = cpu_kernels.Resolve(lay, lookup, threads=32)
    cpu = CpuResidency(lay)
    topk = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]], np.int32)
    sr = np.array([1, 0, 1, 1], np.int32)  # state row 1 three times: rows 0, 2, 3
    got = emu.resolve(0, sr, topk)
    want = cpu.resolve(0, sr[:3], topk[:3])  # the cpu engine takes two tokens of row 1
    np.testing.assert_array_equal(got.slots[:3], want.slots)
    assert (got.slots[3] == -1).all() and got.misses[3] == 0
    assert emu.err[E_TOO_MANY_TOKENS] == 1 and emu.err[8 + E_TOO_MANY_TOKENS] == 3
    np.testing.assert_array_equal(emu.owner, cpu.owner)
    np.testing.assert_array_equal(emu.lru, cpu.lru)


@pytest.mark.parametrize("in_shared", [True, False])
def test_the_batch_wide_plan_is_the_stable_host_row_order(in_shared):
    """skv_merge_plan: every row's plan (sorted by host row, as skv_resolve leaves it)
    merged into one list in host-row order, ties in batch order (the cpu backend's
    stable sort), the lists in shared memory or searched in global memory."""
    rng = np.random.default_rng(3)
    B, ld = 8, 40
    for trial in range(10):
        batch = int(rng.integers(1, B + 1))
        misses = rng.integers(0, ld + 1, size=B).astype(np.int32)
        rows = np.full((B, ld), -1, np.int32)
        slots = np.full((B, ld), -1, np.int32)
        for b in range(B):
            m = misses[b]
            rows[b, :m] = np.sort(rng.choice(60, m, replace=m > 60))  # rows shared by several batch rows
            slots[b, :m] = b * 1000 + np.arange(m)
        head = (B + 1 + ld) * 4
        smem = head + B * ld * 4 if in_shared else head  # room for the lists, or none
        got_rows, got_slots, n = cpu_kernels.merge_plan(rows, slots, misses, batch, smem)
        take = np.arange(ld)[None, :] < misses[:batch, None]
        want_rows, want_slots = rows[:batch][take], slots[:batch][take]
        order = np.argsort(want_rows, kind="stable")
        assert n == want_rows.size, trial
        np.testing.assert_array_equal(got_rows, want_rows[order], err_msg=f"trial {trial}")
        np.testing.assert_array_equal(got_slots, want_slots[order], err_msg=f"trial {trial}")
