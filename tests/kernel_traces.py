"""Random top-k traces for the kernel tests, shared by the GPU tests
(``daemon/residency/test_cuda_kernels.py``) and the CPU emulation of the kernels
(``csrc/test_kernels_on_cpu.py``): small layouts, top-k rows with carried-over ids, junk,
short rows and padding, several tokens of one request, and the comparison of a resolve
with the NumPy engine's; ``run_trace`` drives a whole trace (resets, invalidations, repeated
batches) through any residency with the CudaResidency interface.

Imported as ``kernel_traces`` (``tests/`` is on ``sys.path``, as for ``helpers``).
"""

import numpy as np

from sparsekv.proto.layout import Layout

JUNK = (-1, -2, -7, -(2**31))  # plus host_rows, host_rows + 5, 2**31 - 1 (made per layout)


def layout(top_k, stride, host_rows, max_reqs, groups=1, layers_per_group=1, row_bytes=32, staging_rows=0,
           max_batch=64):
    """``max_batch`` above ``max_reqs``: the traces carry several tokens of a request and
    padding rows (the layout's limit on a batch is checked like any other)."""
    n = groups * layers_per_group
    idx = tuple(tuple(range(g * layers_per_group, (g + 1) * layers_per_group)) for g in range(groups))
    return Layout(num_layers=n, row_bytes=row_bytes, top_k=top_k, region_stride=stride, max_reqs=max_reqs,
                  host_rows=host_rows, index_groups=idx, staging_rows=staging_rows, max_batch=max_batch).validate()


# -- random traces --------------------------------------------------------------------


def junk_values(lay):
    return np.array(JUNK + (lay.host_rows, lay.host_rows + 5, 2**31 - 1), dtype=np.int64).astype(np.int32)


def gen_row(rng, lay, prev, overlap, junk_p):
    """One top-k row: ``overlap`` of ``prev`` kept, the rest fresh, unique, then junk."""
    k = lay.top_k
    keep = np.empty(0, np.int64)
    if prev is not None and prev.size and overlap > 0:
        keep = rng.choice(prev, size=min(prev.size, int(round(overlap * k))), replace=False)
    fresh = rng.choice(lay.host_rows, size=min(lay.host_rows, 2 * k + 8), replace=False)
    cand = np.concatenate([keep, fresh])
    _, first = np.unique(cand, return_index=True)
    ids = cand[np.sort(first)][:k]
    row = np.full(k, -1, np.int64)
    row[: ids.size] = ids
    row = rng.permutation(row)
    if rng.random() < 0.15:  # a short row: trailing columns -1
        row[rng.integers(0, k + 1):] = -1
    junk = rng.random(k) < junk_p
    row[junk] = rng.choice(junk_values(lay), size=int(junk.sum()))
    return row.astype(np.int32)


def gen_batch(rng, lay, memory, batch, overlap, pad_p=0.15, junk_p=0.05, fresh=False):
    tokens = lay.region_stride // lay.top_k
    used: dict[int, int] = {}
    states = []
    for _ in range(batch):
        s = int(rng.integers(lay.max_reqs))
        if rng.random() < pad_p or used.get(s, 0) >= tokens:
            s = -1
        else:
            used[s] = used.get(s, 0) + 1
        states.append(s)
    topk = np.empty((batch, lay.top_k), np.int32)
    for b, s in enumerate(states):
        prev = None if (fresh or s < 0) else memory.get(s)
        topk[b] = gen_row(rng, lay, prev, overlap, junk_p)
        if s >= 0:
            ok = topk[b][(topk[b] >= 0) & (topk[b] < lay.host_rows)]
            memory[s] = ok.astype(np.int64)
    return np.array(states, np.int32), topk


def assert_same(want, got, where=""):
    np.testing.assert_array_equal(got.slots, want.slots, err_msg=f"slots {where}")
    np.testing.assert_array_equal(got.misses, want.misses, err_msg=f"misses {where}")
    assert got.hits == want.hits, where
    assert got.out_of_range == want.out_of_range, where
    np.testing.assert_array_equal(got.plan.rows, want.plan.rows, err_msg=f"plan rows {where}")
    np.testing.assert_array_equal(got.plan.slots, want.plan.slots, err_msg=f"plan slots {where}")
    assert got.plan.rows.dtype == np.int32 and got.plan.slots.dtype == np.int32
    assert got.slots.dtype == np.int32 and got.misses.dtype == np.int32


def assert_state(cpu, gpu, where=""):
    owner, lru = gpu.state()
    np.testing.assert_array_equal(owner, cpu.owner, err_msg=f"owner {where}")
    np.testing.assert_array_equal(lru, cpu.lru, err_msg=f"lru {where}")


def run_trace(cpu, gpu, lay, seed, steps, batch, overlap, state_every=1):
    rng = np.random.default_rng(seed)
    memory: dict[int, np.ndarray] = {}
    last = None
    stats = {"hits": 0, "misses": 0, "all_hit_steps": 0}
    for step in range(steps):
        where = f"seed {seed} step {step}"
        mode = rng.random()
        if mode < 0.1 and last is not None:  # all-hit: the same batch again, nothing in between
            group, sr, tk = last
            stats["all_hit_steps"] += 1
        else:
            if rng.random() < 0.2:
                rs = rng.choice(lay.max_reqs, size=int(rng.integers(1, 3)), replace=True).astype(np.int32)
                cpu.reset(rs)
                gpu.reset(rs)
            if rng.random() < 0.3 and memory:
                s = int(rng.choice(list(memory)))
                rows = rng.choice(memory[s], size=min(memory[s].size, int(rng.integers(1, 6))), replace=False) \
                    if memory[s].size else np.empty(0, np.int64)
                rows = np.concatenate([rows, [-1, int(rng.integers(lay.host_rows))]]).astype(np.int32)
                cpu.invalidate(s, rows)
                gpu.invalidate(s, rows)
            if rng.random() < 0.15 and memory:
                pool = np.concatenate(list(memory.values()))
                if pool.size:
                    rows = rng.choice(pool, size=min(pool.size, 8), replace=False).astype(np.int32)
                    assert gpu.invalidate_everywhere(rows) == cpu.invalidate_everywhere(rows), where
            fresh = mode < 0.2  # all-miss-ish: fresh ids
            sr, tk = gen_batch(rng, lay, memory, batch, overlap, fresh=fresh)
            group = int(rng.integers(lay.num_groups))
        want = cpu.resolve(group, sr, tk)
        got = gpu.resolve(group, sr, tk)
        assert_same(want, got, where)
        assert gpu.last_errors == 0, where
        stats["hits"] += want.hits
        stats["misses"] += int(want.misses.sum())
        last = (group, sr, tk)
        if step % state_every == 0 or step == steps - 1:
            assert_state(cpu, gpu, where)
    # The trace must have exercised both paths.
    assert stats["hits"] > 0 and stats["misses"] > 0, stats
    return stats


# -- prefetch programs ------------------------------------------------------------------


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


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def assert_marks(cpu, other, where=""):
    """Owners, lru rows, prefetch marks and counters of ``other`` (``owner``, ``lru``,
    ``fresh`` arrays, host or device) equal the NumPy engine's."""
    np.testing.assert_array_equal(_host(other.owner), cpu.owner, err_msg=f"owner {where}")
    np.testing.assert_array_equal(_host(other.lru), cpu.lru, err_msg=f"lru {where}")
    np.testing.assert_array_equal(_host(other.fresh).astype(bool), cpu.fresh, err_msg=f"fresh {where}")
    got = (other.prefetched, other.prefetch_hits, other.prefetch_wasted)
    assert got == (cpu.prefetched, cpu.prefetch_hits, cpu.prefetch_wasted), where


def run_prefetch_program(cpu, other, lay, seed, steps, batch, begin_step, check_plan=None):
    """A random program on both residencies: resets, invalidations (one region and
    everywhere), begin-step blocks (``begin_step(other, state_rows, reset, invalidate)``),
    and decode steps in which each group resolves a batch and then prefetches it into the
    next group, whose batch drifts from it. After every operation the state, marks and
    counters are compared; each prefetch's plan equals the NumPy engine's (host row, then
    slot order), no slot twice; ``check_plan(want_plan, where)``, if given, checks more."""
    rng = np.random.default_rng(seed)
    memory: dict = {}
    reqs, host_rows = lay.max_reqs, lay.host_rows
    for step in range(steps):
        where = f"seed {seed} step {step}"
        op = rng.random()
        if op < 0.1:
            rs = rng.choice(reqs, size=int(rng.integers(1, 3)), replace=True).astype(np.int32)
            cpu.reset(rs)
            other.reset(rs)
        elif op < 0.2 and memory:
            s = int(rng.choice(list(memory)))
            rows = rng.choice(memory[s], size=min(memory[s].size, 3), replace=False) if memory[s].size else []
            rows = np.concatenate([rows, [-1, int(rng.integers(host_rows))]]).astype(np.int32)
            cpu.invalidate(s, rows)
            other.invalidate(s, rows)
        elif op < 0.27 and memory:
            pool = np.concatenate(list(memory.values()))
            rows = rng.choice(pool, size=min(pool.size, 6), replace=False).astype(np.int32)
            assert other.invalidate_everywhere(rows) == cpu.invalidate_everywhere(rows), where
        elif op < 0.35:
            rows = rng.choice(reqs, size=min(reqs, 3), replace=False).astype(np.int32)
            reset = (rng.random(rows.size) < 0.4).astype(np.int32)
            inv = np.where(rng.random((rows.size, 4)) < 0.7, rng.integers(0, host_rows, (rows.size, 4)), -1)
            inv = inv.astype(np.int32)
            for s, r in zip(rows, reset):
                if r:
                    cpu.reset(np.array([s], np.int32))
            for s, r, ids in zip(rows, reset, inv):
                if not r:
                    cpu.invalidate(int(s), ids)
            begin_step(other, rows, reset, inv)
        else:
            sr, tk = gen_batch(rng, lay, memory, batch, 0.6)
            for g in range(lay.num_groups):
                assert_same(cpu.resolve(g, sr, tk), other.resolve(g, sr, tk), f"{where} resolve {g}")
                assert_marks(cpu, other, f"{where} resolve {g}")
                if g + 1 < lay.num_groups:
                    w = f"{where} prefetch {g + 1}"
                    want = cpu.prefetch(g + 1, sr, tk)
                    got = other.prefetch(g + 1, sr, tk)
                    np.testing.assert_array_equal(got.rows, want.rows, err_msg=w)
                    np.testing.assert_array_equal(got.slots, want.slots, err_msg=w)
                    assert np.unique(got.slots).size == got.slots.size, f"a slot twice in the plan {w}"
                    if check_plan is not None:
                        check_plan(want, w)
                    assert_marks(cpu, other, w)
                tk = drift(rng, lay, tk, float(rng.choice([0.0, 0.2, 0.6])))
        assert_marks(cpu, other, where)
    if lay.region_stride > lay.top_k:  # the program exercised what it checks
        assert cpu.prefetched and cpu.prefetch_hits and cpu.prefetch_wasted, (cpu.prefetched, cpu.prefetch_hits)
    else:
        assert cpu.prefetched == 0
