"""``skv_prefetch`` (csrc/prefetch.cu) and the prefetch marks of the residency kernels
(``skv_resolve``, ``skv_reset``, ``skv_invalidate``, ``skv_begin_step``) on the fiber
emulator (``cpu_kernels.py``), against ``CpuResidency.prefetch`` bit for bit: random
programs of resolves, prefetches into the next group, resets, invalidations and begin-step
blocks over several regions, with several tokens of a request in one batch; after every
operation the owners, lru rows and fresh marks, the counters, and each prefetch's plan (as
a set of (host row, flat slot) pairs, no slot twice, a later token's retake dropping the
earlier entry) are the NumPy engine's.
"""

from __future__ import annotations

import numpy as np
import pytest

import cpu_kernels
from kernel_traces import assert_same, gen_batch, layout
from sparsekv.daemon.residency.cpu import CpuResidency

pytestmark = pytest.mark.skipif(cpu_kernels.compiler() is None, reason="no C++ compiler for the kernel emulator")


def drift(rng, lay, topk, share):
    """The next group's top-k: each row's valid ids with ``share`` of them replaced by
    other ids (unique within the row), as the next layer's indexer would pick."""
    out = topk.copy()
    for row in out:
        valid = np.flatnonzero((row >= 0) & (row < lay.host_rows))
        swap = valid[rng.random(valid.size) < share]
        new = np.setdiff1d(rng.choice(lay.host_rows, size=3 * lay.top_k + 8), row)[:swap.size]
        rng.shuffle(new)
        row[swap[:new.size]] = new
    return out


def assert_marks(cpu, emu, where):
    np.testing.assert_array_equal(emu.owner, cpu.owner, err_msg=f"owner {where}")
    np.testing.assert_array_equal(emu.lru, cpu.lru, err_msg=f"lru {where}")
    np.testing.assert_array_equal(emu.fresh.astype(bool), cpu.fresh, err_msg=f"fresh {where}")
    got = (emu.prefetched, emu.prefetch_hits, emu.prefetch_wasted)
    assert got == (cpu.prefetched, cpu.prefetch_hits, cpu.prefetch_wasted), where


def check_prefetch(cpu, emu, lay, group, sr, tk, where):
    """One prefetch on both; the plans equal as sets, no slot twice; returns how many
    entries a later token dropped."""
    want = cpu.prefetch(group, sr, tk)
    out = emu.prefetch(group, sr, tk)
    batch = len(sr)
    entries = [(int(out.prow[b, i]), int(out.pslot[b, i])) for b in range(batch) for i in range(out.counts[b])]
    kept = [e for e in entries if e[1] >= 0]
    assert all(e == (-1, -1) for e in entries if e[1] < 0), where
    assert len({sl for _, sl in kept}) == len(kept), f"a slot twice in the plan {where}"
    assert set(kept) == set(zip(want.rows.tolist(), want.slots.tolist())), where
    np.testing.assert_array_equal(out.plan.rows, want.rows, err_msg=where)
    np.testing.assert_array_equal(out.plan.slots, want.slots, err_msg=where)
    assert (out.counts[batch:] == -7).all()  # rows past the batch untouched
    return len(entries) - len(kept)


# name, top_k, stride, host_rows, max_reqs, groups, batch, steps, threads
PROGRAMS = [
    ("tiny", 4, 12, 40, 3, 3, 6, 60, 32),
    ("three-tokens", 8, 24, 80, 4, 2, 8, 50, 64),
    ("odd", 13, 40, 120, 3, 3, 7, 40, 96),
    ("wide", 64, 200, 2_000, 4, 2, 10, 20, 128),
    ("kept-none", 6, 6, 30, 3, 2, 5, 30, 32),  # region = top_k: a prefetch takes nothing
]


@pytest.mark.parametrize("case", PROGRAMS, ids=[p[0] for p in PROGRAMS])
def test_prefetch_programs_on_cpu_equal_the_numpy_engine(case):
    name, k, stride, host_rows, reqs, groups, batch, steps, threads = case
    lay = layout(k, stride, host_rows, reqs, groups=groups, max_batch=batch)
    cpu = CpuResidency(lay)
    emu = cpu_kernels.Resolve(lay, threads=threads, prefetch=True)
    rng = np.random.default_rng(sum(map(ord, name)))
    memory: dict = {}
    dropped = 0
    for step in range(steps):
        where = f"{name} step {step}"
        op = rng.random()
        if op < 0.1:
            rs = rng.choice(reqs, size=int(rng.integers(1, 3)), replace=True).astype(np.int32)
            cpu.reset(rs)
            emu.reset(rs)
        elif op < 0.2 and memory:
            s = int(rng.choice(list(memory)))
            rows = rng.choice(memory[s], size=min(memory[s].size, 3), replace=False) if memory[s].size else []
            rows = np.concatenate([rows, [-1, int(rng.integers(host_rows))]]).astype(np.int32)
            cpu.invalidate(s, rows)
            emu.invalidate(s, rows)
        elif op < 0.27 and memory:
            pool = np.concatenate(list(memory.values()))
            rows = rng.choice(pool, size=min(pool.size, 6), replace=False).astype(np.int32)
            assert emu.invalidate_everywhere(rows) == cpu.invalidate_everywhere(rows), where
        elif op < 0.35:
            rows = rng.choice(reqs, size=min(reqs, 3), replace=False).astype(np.int32)
            reset = (rng.random(rows.size) < 0.4).astype(np.int32)
            inv = np.where(rng.random((rows.size, 4)) < 0.7, rng.integers(0, host_rows, (rows.size, 4)), -1)
            for s, r in zip(rows, reset):
                if r:
                    cpu.reset(np.array([s], np.int32))
            for s, r, ids in zip(rows, reset, inv.astype(np.int32)):
                if not r:
                    cpu.invalidate(int(s), ids)
            emu.begin_step(rows, reset, inv.astype(np.int32))
        else:
            # a decode step: each group resolves, then prefetches its rows into the next
            sr, tk = gen_batch(rng, lay, memory, batch, 0.6)
            for g in range(groups):
                assert_same(cpu.resolve(g, sr, tk), emu.resolve(g, sr, tk), f"{where} resolve {g}")
                assert_marks(cpu, emu, f"{where} resolve {g}")
                if g + 1 < groups:
                    dropped += check_prefetch(cpu, emu, lay, g + 1, sr, tk, f"{where} prefetch {g + 1}")
                    assert_marks(cpu, emu, f"{where} prefetch {g + 1}")
                tk = drift(rng, lay, tk, float(rng.choice([0.0, 0.2, 0.6])))
        assert_marks(cpu, emu, where)
    assert not emu.err[:8].any()
    if stride > k:  # the program exercised what it checks
        assert cpu.prefetched and cpu.prefetch_hits and cpu.prefetch_wasted, name
    else:
        assert cpu.prefetched == 0


def test_a_later_token_retaking_a_slot_drops_the_earlier_entry():
    """Two tokens of one request in one prefetch batch, the second wanting more rows than
    there are slots outside its own and the kept ones: it retakes the slots the first took;
    the first token's entries for them become (-1, -1), the plan holds each slot once, and
    the retakes are counted wasted, as on the NumPy engine."""
    lay = layout(4, 8, 100, 2, groups=2, max_batch=3)  # 4 slots outside the kept 4
    cpu = CpuResidency(lay)
    emu = cpu_kernels.Resolve(lay, threads=32, prefetch=True)
    warm = np.array([[1, 2, 3, 4]], np.int32)
    for r in (cpu, emu):
        r.resolve(1, np.array([0], np.int32), warm)
    sr = np.array([0, 0], np.int32)
    tk = np.array([[10, 11, 12, 13], [20, 21, 22, 23]], np.int32)
    dropped = check_prefetch(cpu, emu, lay, 1, sr, tk, "two tokens")
    assert dropped == 4
    assert cpu.prefetch_wasted == 4 and cpu.prefetched == 8
    assert_marks(cpu, emu, "two tokens")


def test_without_prefetch_the_kernels_touch_no_marks_and_resolve_as_before():
    """The residency kernels given null marks (prefetch off) resolve, reset and invalidate
    exactly as the NumPy engine, whose counters stay 0."""
    lay = layout(8, 24, 80, 4, groups=2, max_batch=8)
    cpu = CpuResidency(lay)
    emu = cpu_kernels.Resolve(lay, threads=64)
    rng = np.random.default_rng(4)
    memory: dict = {}
    for step in range(20):
        sr, tk = gen_batch(rng, lay, memory, 8, 0.6)
        g = step % 2
        assert_same(cpu.resolve(g, sr, tk), emu.resolve(g, sr, tk), f"step {step}")
        if step % 5 == 4:
            cpu.reset(sr[:2])
            emu.reset(sr[:2])
        np.testing.assert_array_equal(emu.owner, cpu.owner)
        np.testing.assert_array_equal(emu.lru, cpu.lru)
    assert emu.fresh is None and not emu.pf.any()
