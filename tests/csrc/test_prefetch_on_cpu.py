"""``skv_prefetch`` (csrc/prefetch.cu) and the prefetch marks of the residency kernels
(``skv_resolve``, ``skv_reset``, ``skv_invalidate``, ``skv_begin_step``) on the fiber
emulator (``cpu_kernels.py``), against ``CpuResidency.prefetch`` bit for bit: random
programs (``kernel_traces.run_prefetch_program``) of resolves, prefetches into the next
group, resets, invalidations and begin-step blocks over several regions, with several
tokens of a request in one batch; after every operation the owners, lru rows and fresh
marks, the counters, and each prefetch's plan are the NumPy engine's. The per-row plans
the gather reads: each (host row, flat slot) once, no slot twice, an entry a later token
retook dropped (-1, -1). The same programs run on a GPU in
``daemon/residency/test_cuda_prefetch.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

import cpu_kernels
from kernel_traces import assert_marks, assert_same, drift, gen_batch, layout, run_prefetch_program
from sparsekv.daemon.cuda.buffers import prefetch_layers
from sparsekv.daemon.residency.cpu import CpuResidency
from sparsekv.daemon.residency.cuda.device import E_BAD_STATE_ROW, E_BAD_STEP, make_desc

pytestmark = pytest.mark.skipif(cpu_kernels.compiler() is None, reason="no C++ compiler for the kernel emulator")


def raw_entries(out, batch):
    """The per-row plans of a prefetch as the gather reads them: (row, flat slot) pairs."""
    return [(int(out.prow[b, i]), int(out.pslot[b, i])) for b in range(batch) for i in range(out.counts[b])]


def check_raw(emu, batch_of):
    """``check_plan`` of the programs: the last launch's per-row plans hold exactly the
    plan's pairs, each slot once, the rest dropped as (-1, -1), each row's in host-row
    order; rows past the batch untouched."""
    def check(want, where):
        out = emu.last_prefetch
        batch = batch_of()
        entries = raw_entries(out, batch)
        kept = [e for e in entries if e[1] >= 0]
        assert all(e == (-1, -1) for e in entries if e[1] < 0), where
        assert len({sl for _, sl in kept}) == len(kept), f"a slot twice in the per-row plans {where}"
        assert set(kept) == set(zip(want.rows.tolist(), want.slots.tolist())), where
        assert (out.counts[batch:] == -7).all(), where
        for b in range(batch):  # each row's entries in host-row order
            rows = out.prow[b, :out.counts[b]]
            rows = rows[rows >= 0]
            assert (np.diff(rows) > 0).all(), where
    return check


def emu_begin_step(emu, rows, reset, inv):
    emu.begin_step(rows, reset, inv)


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
    emu = cpu_kernels.Resolve(lay, threads=threads, prefetch=True)
    run_prefetch_program(CpuResidency(lay), emu, lay, sum(map(ord, name)), steps, batch, emu_begin_step,
                         check_raw(emu, lambda: batch))
    assert not emu.err[:8].any()


def test_a_later_token_retaking_a_slot_drops_the_earlier_entry():
    """Two tokens of one request in one prefetch batch, the second wanting as many rows as
    there are slots outside the kept ones: it retakes every slot the first took; the first
    token's entries become (-1, -1), the plan holds each slot once with the second token's
    rows, and the retakes count as wasted, as on the NumPy engine; skv_gather of those
    plans writes what the NumPy mover writes. The descriptor names the source group, the
    launch adds 1 (group_offset)."""
    lay = layout(4, 8, 100, 2, groups=2, max_batch=3)  # 4 slots outside the kept 4
    cpu = CpuResidency(lay)
    emu = cpu_kernels.Resolve(lay, threads=32, prefetch=True)
    warm = np.array([[1, 2, 3, 4]], np.int32)
    for r in (cpu, emu):
        r.resolve(1, np.array([0], np.int32), warm)
    sr = np.array([0, 0], np.int32)
    tk = np.array([[10, 11, 12, 13], [20, 21, 22, 23]], np.int32)
    want = cpu.prefetch(1, sr, tk)
    out = emu.prefetch(1, sr, tk, group_offset=1)  # the descriptor of group 0's top-k block
    assert raw_entries(out, 1) == [(-1, -1)] * 4
    assert sorted(e[0] for e in raw_entries(out, 2)[4:]) == [20, 21, 22, 23]
    np.testing.assert_array_equal(out.rows, want.rows)
    np.testing.assert_array_equal(out.slots, want.slots)
    assert cpu.prefetch_wasted == 4 and cpu.prefetched == 8
    assert_marks(cpu, emu, "two tokens")
    # skv_gather of the per-row plans (group 1: layer 1) copies what the NumPy mover
    # copies for the engine's plan: each slot the second token's row
    rng = np.random.default_rng(2)
    pool = rng.integers(0, 256, size=(2, lay.host_rows, 32), dtype=np.uint8)
    slab = np.zeros((2, lay.max_reqs * lay.region_stride, 32), np.uint8)
    want_slab = slab.copy()
    want_slab[1, want.slots] = pool[1, want.rows]
    groups = np.array([[1, 0], [1, 1]], np.int32)
    cpu_kernels.gather(make_desc(2, lay.top_k, 1), pool, slab, slab.shape[1], groups, out.prow, out.pslot,
                       out.counts)
    np.testing.assert_array_equal(slab, want_slab)


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
            emu.invalidate(int(max(sr[0], 0)), tk[0, :3])
            cpu.invalidate(int(max(sr[0], 0)), tk[0, :3])
        np.testing.assert_array_equal(emu.owner, cpu.owner)
        np.testing.assert_array_equal(emu.lru, cpu.lru)
    assert emu.fresh is None and not emu.pf.any()


def test_device_path_bad_input_is_padding_refused_or_deduplicated():
    """What the device path does with input the host path refuses: a state row outside
    [-1, max_reqs) is padding (count 0, BAD_STATE_ROW with its batch row); a group out of
    range does nothing (every count 0, BAD_STEP); an id repeated in a row is prefetched once
    (its first column), as the NumPy engine prefetches the row without the repeat."""
    lay = layout(4, 12, 100, 3, groups=2, max_batch=4)
    cpu = CpuResidency(lay)
    emu = cpu_kernels.Resolve(lay, threads=32, prefetch=True)
    sr = np.array([0, 7, -1, 2], np.int32)
    tk = np.array([[5, 6, 5, 7], [1, 2, 3, 4], [8, 9, 10, 11], [12, 13, 14, -1]], np.int32)
    out = emu.prefetch(1, sr, tk)
    assert out.counts[1] == 0 and out.counts[2] == 0
    assert emu.err[E_BAD_STATE_ROW] == 1 and emu.err[8 + E_BAD_STATE_ROW] == 1
    want = cpu.prefetch(1, np.array([0, -1, -1, 2], np.int32), np.array([[5, 6, -1, 7]] + tk[1:].tolist(), np.int32))
    np.testing.assert_array_equal(out.rows, want.rows)
    np.testing.assert_array_equal(out.slots, want.slots)
    assert_marks(cpu, emu, "bad rows")
    before = emu.owner.copy(), emu.lru.copy(), emu.fresh.copy()
    out = emu.prefetch(2, sr, tk)  # group 2 of 2
    assert (out.counts == 0).all() and emu.err[E_BAD_STEP] == 1
    for a, b in zip(before, (emu.owner, emu.lru, emu.fresh)):
        np.testing.assert_array_equal(a, b)


def test_corrupt_lru_rows_stay_in_bounds_and_no_slot_is_planned_twice():
    """lru rows with entries outside [0, S) or repeated, owners outside the host rows or
    repeated: the prefetch writes nothing out of bounds, each new lru row holds the old
    row's entries, every planned slot is in the region and planned once, its entry's row
    one of the batch row's ids."""
    lay = layout(8, 32, 60, 3, groups=2, max_batch=6)
    emu = cpu_kernels.Resolve(lay, threads=32, prefetch=True)
    rng = np.random.default_rng(17)
    S = lay.region_stride
    for trial in range(20):
        emu.owner[...] = rng.integers(-3, 80, size=emu.owner.shape)
        lru = rng.integers(-4, S + 4, size=emu.lru.shape) if trial % 2 else rng.integers(0, S, size=emu.lru.shape)
        emu.lru[...] = lru
        sr, tk = gen_batch(rng, lay, {}, 6, 0.0)
        out = emu.prefetch(1, sr, tk)
        for s in range(lay.max_reqs):
            np.testing.assert_array_equal(np.sort(emu.lru[1, s]), np.sort(lru[1, s]), err_msg=f"trial {trial}")
        np.testing.assert_array_equal(emu.lru[0], lru[0])  # the other group untouched
        entries = [e for e in raw_entries(out, len(sr)) if e[1] >= 0]
        assert len({sl for _, sl in entries}) == len(entries), f"trial {trial}"
        for b in range(len(sr)):
            for i in range(out.counts[b]):
                g, flat = int(out.prow[b, i]), int(out.pslot[b, i])
                if flat >= 0:
                    assert flat // S == sr[b] and g in tk[b], f"trial {trial}"


def test_the_daemons_prefetch_gather_fills_the_next_groups_layers_with_its_plan():
    """What ``DeviceStep.enqueue_prefetch`` launches, on the emulator: ``skv_prefetch``
    driven by group g's own descriptor (group_offset 1), then ``skv_gather`` of its per-row
    plans with that same descriptor through ``prefetch_layers`` (row g: group g + 1's
    layers). Each slot of the NumPy engine's plan then holds its pool row in every layer of
    group g + 1, nothing else changes; the last group's row of the table copies nothing."""
    lay = layout(8, 24, 300, 3, groups=3, layers_per_group=2, max_batch=6)
    cpu = CpuResidency(lay)
    emu = cpu_kernels.Resolve(lay, threads=32, prefetch=True)
    rng = np.random.default_rng(5)
    pool = rng.integers(0, 256, size=(lay.num_layers, lay.host_rows, 32), dtype=np.uint8)
    slab = np.zeros((lay.num_layers, lay.max_reqs * lay.region_stride, 32), np.uint8)
    table = prefetch_layers(lay)
    B, K = lay.max_batch, lay.top_k
    memory: dict = {}
    for step in range(8):
        sr, tk = gen_batch(rng, lay, memory, B, 0.6)
        for g in range(lay.num_groups):
            assert_same(cpu.resolve(g, sr, tk), emu.resolve(g, sr, tk), f"step {step} resolve {g}")
            expect = slab.copy()
            if g + 1 < lay.num_groups:
                want = cpu.prefetch(g + 1, sr, tk)
                out = emu.prefetch(g + 1, sr, tk, group_offset=1)
                np.testing.assert_array_equal(out.slots, want.slots)
                for layer in lay.groups[g + 1]:
                    expect[layer, want.slots] = pool[layer, want.rows]
                plan = (out.prow, out.pslot, out.counts)
            else:  # never launched by the daemon: a plan of real entries, copied nowhere
                plan = (np.zeros((B, K), np.int32), np.zeros((B, K), np.int32), np.ones(B, np.int32))
            cpu_kernels.gather(make_desc(tk.shape[0], tk.shape[1], g), pool, slab, slab.shape[1], table, *plan)
            np.testing.assert_array_equal(slab, expect, err_msg=f"step {step} group {g}")
            tk = drift(rng, lay, tk, 0.3)
    assert cpu.prefetched and cpu.prefetch_hits
    assert not emu.err[:8].any()
