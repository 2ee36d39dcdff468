"""``skv_prefetch`` and the residency kernels' prefetch marks on the emulator, against the
reference model itself (``contract.RegionModel``, one per region), the NumPy engine
beside them, on shapes the shared programs do not draw: top_k 1, a region one slot above
top_k, batches of more rows than the block has threads (several tiles of one state row),
narrower batches than top_k, groups resolved out of order, a prefetch into a group other
than the next, resets and invalidations between a group's resolve and its prefetch."""

from __future__ import annotations

import numpy as np
import pytest

import cpu_kernels
from kernel_traces import layout
from sparsekv.daemon.residency.contract import RegionModel
from sparsekv.daemon.residency.cpu import CpuResidency

pytestmark = pytest.mark.skipif(cpu_kernels.compiler() is None, reason="no C++ compiler for the kernel emulator")
PF = ("prefetched", "prefetch_hits", "prefetch_wasted")


class Regions:
    """One RegionModel per (group, state row); batches applied row by row in batch order."""

    def __init__(self, lay):
        self.lay = lay
        self.m = {(g, s): RegionModel(lay.region_stride) for g in range(lay.num_groups) for s in range(lay.max_reqs)}

    def resolve(self, g, sr, tk):
        for b, s in enumerate(sr):
            if s >= 0:
                self.m[g, s].resolve(tk[b], self.lay.host_rows)

    def prefetch(self, g, sr, tk) -> list:
        last = {}  # flat slot -> row: a later token's take replaces an earlier one's
        for b, s in enumerate(sr):
            if s >= 0:
                for row, slot in self.m[g, s].prefetch(tk[b], self.lay.host_rows, self.lay.top_k):
                    last[s * self.lay.region_stride + slot] = row
        return sorted((row, flat) for flat, row in last.items())

    def reset(self, rows):
        for s in {int(x) for x in rows if x >= 0}:
            for g in range(self.lay.num_groups):
                self.m[g, s].reset()

    def invalidate(self, s, rows):
        for g in range(self.lay.num_groups):
            self.m[g, s].invalidate([int(x) for x in rows if x >= 0])

    def check(self, emu, where):
        S = self.lay.region_stride
        for (g, s), m in self.m.items():
            assert emu.owner[g, s].tolist() == m.owner, f"owner {g} {s} {where}"
            assert emu.lru[g, s].tolist() == m.lru, f"lru {g} {s} {where}"
            assert set(np.flatnonzero(emu.fresh[g, s][:S]).tolist()) == m.fresh, f"fresh {g} {s} {where}"
        want = tuple(sum(getattr(m, a) for m in self.m.values()) for a in PF)
        assert tuple(getattr(emu, a) for a in PF) == want, where


def gen_row(rng, lay, k, prev):
    """k ids: most from ``prev``, some junk (out of range), unique in range."""
    pool, ids, seen = list(prev), [], set()
    for _ in range(k):
        x = rng.random()
        if x < 0.05:
            g = int(rng.choice([-1, -5, lay.host_rows, lay.host_rows + 3, 2**31 - 1]))
        elif x < 0.6 and pool:
            g = int(pool.pop(int(rng.integers(len(pool)))))
        else:
            g = int(rng.integers(lay.host_rows))
        if 0 <= g < lay.host_rows:
            g = -1 if g in seen else g
            seen.add(g)
        ids.append(g)
    return ids


# top_k, region_stride, host_rows, max_reqs, groups, max_batch, threads
SHAPES = [
    (1, 2, 10, 3, 2, 4),     # top_k 1
    (1, 3, 5, 2, 3, 6),
    (4, 5, 20, 3, 3, 6),     # one slot above top_k
    (3, 7, 12, 2, 2, 5),
    (4, 16, 30, 2, 3, 70),   # batch > 32 threads: a state row's rows over several tiles
    (33, 70, 200, 2, 2, 4),  # top_k > threads
]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"k{s[0]}-S{s[1]}-B{s[5]}" for s in SHAPES])
def test_prefetch_kernels_equal_the_reference_model(shape):
    k, S, host_rows, reqs, groups, max_batch = shape
    lay = layout(k, S, host_rows, reqs, groups=groups, max_batch=max_batch)
    emu = cpu_kernels.Resolve(lay, threads=32, prefetch=True)
    ref = Regions(lay)
    cpu = CpuResidency(lay)
    rng = np.random.default_rng(sum(shape))
    prev: dict = {}
    for step in range(25):
        where = f"step {step}"
        if rng.random() < 0.1:
            rs = rng.integers(0, reqs, size=int(rng.integers(1, 4))).astype(np.int32)
            for r in (ref, cpu, emu):
                r.reset(rs)
        batch = int(rng.integers(1, max_batch + 1))
        used: dict = {}
        sr = []
        for _ in range(batch):
            s = int(rng.integers(reqs))
            s = -1 if rng.random() < 0.15 or used.get(s, 0) >= S // k else s
            used[s] = used.get(s, 0) + 1
            sr.append(s)
        sr = np.array(sr, np.int32)
        kk = int(rng.integers(1, k + 1)) if rng.random() < 0.3 else k
        tk = np.array([gen_row(rng, lay, kk, prev.get(s, ())) for s in sr], np.int32)
        order = rng.permutation(groups) if rng.random() < 0.3 else range(groups)
        for g in order:
            ref.resolve(g, sr, tk)
            cpu.resolve(g, sr, tk)
            emu.resolve(g, sr, tk)
            ref.check(emu, f"{where} resolve {g}")
            ref.check(cpu, f"{where} resolve {g} (NumPy)")
            if rng.random() < 0.2:  # between the resolve and its prefetch
                s, rows = int(rng.integers(reqs)), tk[int(rng.integers(batch))][:2].copy()
                for r in (cpu, emu):
                    r.invalidate(s, rows)
                ref.invalidate(s, rows)
            if rng.random() < 0.1:
                rs = np.array([rng.integers(reqs)], np.int32)
                for r in (ref, cpu, emu):
                    r.reset(rs)
            target = g + 1 if rng.random() < 0.8 else int(rng.integers(groups))
            if target < groups:
                ptk = np.array([gen_row(rng, lay, kk, [x for x in row if 0 <= x < host_rows]) for row in tk], np.int32)
                want = ref.prefetch(target, sr, ptk)
                for plan in (emu.prefetch(target, sr, ptk), cpu.prefetch(target, sr, ptk)):
                    assert sorted(zip(plan.rows.tolist(), plan.slots.tolist())) == want, f"{where} prefetch {target}"
                ref.check(emu, f"{where} prefetch {target}")
                ref.check(cpu, f"{where} prefetch {target} (NumPy)")
        for b, s in enumerate(sr):
            if s >= 0:
                prev[s] = [x for x in tk[b] if 0 <= x < host_rows]
        assert not emu.err[:8].any(), where
    assert emu.prefetched and emu.prefetch_hits, (emu.prefetched, emu.prefetch_hits)
