"""Random top-k traces for the kernel tests, shared by the GPU tests
(``daemon/residency/test_cuda_kernels.py``) and the CPU emulation of the kernels
(``csrc/test_kernels_on_cpu.py``): small layouts, top-k rows with carried-over ids, junk,
short rows and padding, several tokens of one request, and the comparison of a resolve
with the NumPy engine's.

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
