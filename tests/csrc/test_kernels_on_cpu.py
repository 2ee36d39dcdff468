"""Kernels of ``csrc/`` compiled for the CPU and run on the fiber emulator
(``cpu_kernels.py``), against the NumPy engine, bit for bit:

* ``skv_resolve`` (``skv_reset`` and ``skv_invalidate`` in its traces): slots, misses,
  counters, the plan and the owner/lru state after every step, for several thread counts,
  both hash table sizes, shared and global workspaces; rows refused for duplicates and for
  too many tokens; corrupt owners and lru rows;
* ``skv_begin_step``: resets, then invalidations;
* ``skv_db_topk`` / ``skv_db_indices`` (the engine side): positions to host rows as
  ``proto/positions.py`` maps them, the bell rung once, indices into hot and resident rows;
* ``skv_gather``: the planned rows of the group's layers, flat or into a paged engine slab.

The same checks as the GPU tests (``daemon/residency/test_cuda_kernels.py``), on any
machine with a C++ compiler.
"""

from __future__ import annotations

import ctypes
import zlib
from types import SimpleNamespace

import numpy as np
import pytest

import cpu_kernels
from kernel_traces import assert_same, gen_batch, layout, run_trace
from sparsekv.client.doorbell import DoorbellSwapIn
from sparsekv.daemon.residency.cpu import CpuResidency
from sparsekv.daemon.residency.cuda import E_CORRUPT_STATE, E_DUPLICATE_IDS, E_TOO_MANY_TOKENS, make_desc
from sparsekv.proto import positions

pytestmark = pytest.mark.skipif(cpu_kernels.compiler() is None, reason="no C++ compiler for the kernel emulator")



# name, top_k, stride, host_rows, max_reqs, groups, batch, steps, overlap, threads, workspace
TRACES = [
    ("tiny", 4, 8, 24, 3, 2, 5, 60, 0.5, 32, "shared"),
    ("tiny-exact", 5, 5, 12, 2, 1, 3, 60, 0.6, 32, "shared"),
    ("tiles", 100, 300, 400, 4, 2, 8, 20, 0.7, 32, "shared"),
    ("tiles-global", 100, 300, 400, 4, 2, 8, 20, 0.7, 64, "global"),
    ("odd", 37, 111, 90, 3, 3, 6, 30, 0.5, 64, "shared"),
    ("wide", 256, 512, 20_000, 8, 1, 12, 10, 0.8, 128, "shared"),
    # more misses in a row than the hash plan ranks by counting (SKV_RANK_MAX): sorted
    ("many-misses", 768, 1024, 40_000, 2, 1, 2, 4, 0.2, 128, "shared"),
    # more batch rows than threads: the rows before a block's own past its first load
    ("batch-past-block", 4, 8, 400, 24, 1, 40, 20, 0.6, 32, "shared"),
]


@pytest.mark.parametrize("case", TRACES, ids=[t[0] for t in TRACES])
def test_resolve_on_cpu_equals_the_numpy_engine(case):
    name, k, stride, host_rows, reqs, groups, batch, steps, overlap, threads, ws = case
    lay = layout(k, stride, host_rows, reqs, groups=groups, max_batch=batch)
    emu = cpu_kernels.Resolve(lay, threads=threads, workspace=ws)
    # resets, invalidations, repeated batches; the state compared after every step
    run_trace(CpuResidency(lay), emu, lay, zlib.crc32(name.encode()) % 1000, steps, batch, overlap)
    assert not emu.err[:8].any()  # nothing refused or mended on a sound trace


@pytest.mark.parametrize("case", [t for t in TRACES if t[0] in ("tiles", "wide", "many-misses")], ids=lambda t: t[0])
def test_the_hash_lookup_with_a_table_four_times_the_columns_equals_the_numpy_engine(case):
    """SKV_HASH_SCALE 4 (hash_scale=4): the same results from a table of 4 x pow2(k)."""
    name, k, stride, host_rows, reqs, groups, batch, steps, overlap, threads, ws = case
    lay = layout(k, stride, host_rows, reqs, groups=groups, max_batch=batch)
    emu = cpu_kernels.Resolve(lay, threads=threads, workspace=ws, hash_scale=4)
    run_trace(CpuResidency(lay), emu, lay, zlib.crc32(name.encode()) % 1000, steps, batch, overlap)
    assert not emu.err[:8].any()


@pytest.mark.parametrize("opts", [{"lru_smem": True, "owner_smem": True}, {"lru_smem": True}, {"owner_smem": True}],
                         ids=["both", "lru", "owner"])
@pytest.mark.parametrize("case", [t for t in TRACES if t[0] in ("tiny", "tiles-global", "odd", "many-misses")],
                         ids=lambda t: t[0])
def test_the_lru_and_owner_rows_in_the_workspace_equal_the_numpy_engine(case, opts):
    """SKV_LRU_SMEM (the new lru built in the workspace, copied out whole) and
    SKV_OWNER_SMEM (the owners read into it first)."""
    name, k, stride, host_rows, reqs, groups, batch, steps, overlap, threads, ws = case
    lay = layout(k, stride, host_rows, reqs, groups=groups, max_batch=batch)
    emu = cpu_kernels.Resolve(lay, threads=threads, workspace=ws, hash_scale=4, **opts)
    run_trace(CpuResidency(lay), emu, lay, zlib.crc32(name.encode()) % 1000, steps, batch, overlap)
    assert not emu.err[:8].any()


def test_a_block_of_threads_not_a_power_of_two_equals_the_numpy_engine():
    """SKV_RESOLVE_THREADS 96 (3 warps; like 768, a multiple of 32 but not a power of two):
    every scan and walk."""
    name, k, stride, host_rows, reqs, groups, batch, steps, overlap, threads, ws = TRACES[4]  # odd
    lay = layout(k, stride, host_rows, reqs, groups=groups, max_batch=batch)
    emu = cpu_kernels.Resolve(lay, threads=96, workspace=ws)
    run_trace(CpuResidency(lay), emu, lay, zlib.crc32(name.encode()) % 1000, steps, batch, overlap)
    assert not emu.err[:8].any()


@pytest.mark.parametrize("opts", [{}, {"lru_smem": True, "owner_smem": True}], ids=["global-rows", "workspace-rows"])
def test_corrupt_lru_rows_stay_in_bounds_and_are_reported(opts):
    """Corrupt lru rows (repeated entries, entries outside [0, S), one slot everywhere so
    that misses go without a slot and the plan is compacted again), with corrupt owners
    (a host row owned twice: the hit marks redone from the column states): every slot in
    [-1, S), each new lru row a permutation of the old one, each plan entry a miss of its
    row in host-row order, CORRUPT_STATE reported; blocks of 32 and of 96 threads (other
    chunks, other scans) resolve every row the same."""
    lay = layout(16, 48, 60, 3, max_batch=6)
    emus = [cpu_kernels.Resolve(lay, threads=n, hash_scale=4, **opts) for n in (32, 96)]
    rng = np.random.default_rng(31)
    S = lay.region_stride
    for trial in range(30):
        owner = rng.integers(-3, 80, size=emus[0].owner.shape).astype(np.int32)
        lru = np.stack([np.stack([rng.permutation(S) for _ in range(lay.max_reqs)])
                        for _ in range(lay.num_groups)]).astype(np.int32)
        if trial % 3 == 1:
            lru[...] = rng.integers(-5, S + 5, size=lru.shape)
        elif trial % 3 == 2:
            lru[...] = rng.integers(0, S)  # one slot everywhere: misses go without a slot
        sr, tk = gen_batch(rng, lay, {}, 6, 0.0)
        got = []
        for emu in emus:
            emu.owner[...] = owner
            emu.lru[...] = lru
            before = int(emu.err[E_CORRUPT_STATE])
            res = emu.resolve(0, sr, tk)
            got.append(res)
            assert ((res.slots >= -1) & (res.slots < S)).all(), f"trial {trial}"
            for s in range(lay.max_reqs):
                np.testing.assert_array_equal(np.sort(emu.lru[0, s]), np.sort(lru[0, s]), err_msg=f"trial {trial}")
            for b in range(len(sr)):
                m = int(res.raw.misses[b])
                rows, flat = res.raw.prow[b, :m], res.raw.pslot[b, :m]
                assert (np.diff(rows) > 0).all(), f"trial {trial}"
                cols = {(int(g), int(sr[b]) * S + int(sl)) for g, sl in zip(tk[b], res.slots[b]) if sl >= 0}
                assert set(zip(rows.tolist(), flat.tolist())) <= cols, f"trial {trial}"
            if trial % 3:
                assert int(emu.err[E_CORRUPT_STATE]) > before, f"trial {trial}"
        assert_same(got[0], got[1], f"trial {trial}")
        np.testing.assert_array_equal(emus[0].lru, emus[1].lru)


@pytest.mark.parametrize("opts", [{}, {"lru_smem": True, "owner_smem": True}], ids=["global-rows", "workspace-rows"])
def test_corrupt_owners_resolve_as_on_the_numpy_engine(opts):
    """Owners outside the host rows or owning one row twice (the lowest slot wins)."""
    lay = layout(16, 48, 60, 3, max_batch=6)
    cpu = CpuResidency(lay)
    emu = cpu_kernels.Resolve(lay, threads=32, **opts)
    rng = np.random.default_rng(7)
    for trial in range(20):
        bad = rng.integers(-3, 80, size=cpu.owner.shape).astype(np.int32)
        cpu.owner[...] = bad
        emu.owner[...] = bad
        sr, tk = gen_batch(rng, lay, {}, 6, 0.0)
        assert_same(cpu.resolve(0, sr, tk), emu.resolve(0, sr, tk), f"trial {trial}")
        np.testing.assert_array_equal(emu.owner, cpu.owner)
        np.testing.assert_array_equal(emu.lru, cpu.lru)


def test_a_repeated_lru_entry_is_corrupt_state():
    """The seen marks (set as phase 1 copies the lru, then every slot's bit required) find
    exactly the corrupt lru rows: a shuffled permutation is sound, one entry repeated or
    outside [0, S) is corrupt (reported with its batch row); blocks of 32 and of 96 threads
    resolve every row the same, bit for bit."""
    lay = layout(8, 40, 200, 3, max_batch=3)  # S = 40: the last seen word is partial
    rng = np.random.default_rng(29)
    emus = [cpu_kernels.Resolve(lay, threads=n) for n in (32, 96)]
    S = lay.region_stride
    for trial in range(24):
        lru = np.stack([np.stack([rng.permutation(S) for _ in range(lay.max_reqs)])
                        for _ in range(lay.num_groups)]).astype(np.int32)
        kind = trial % 3  # 0 sound, 1 a repeated entry, 2 an entry outside [0, S)
        row = int(rng.integers(lay.max_reqs))
        if kind == 1:
            i, j = rng.choice(S, 2, replace=False)
            lru[0, row, i] = lru[0, row, j]
        elif kind == 2:
            lru[0, row, int(rng.integers(S))] = S + int(rng.integers(3))
        sr, tk = gen_batch(rng, lay, {}, 3, 0.0)
        sr[:] = np.arange(3, dtype=np.int32)
        got = []
        for emu in emus:
            emu.owner[...] = -1
            emu.lru[...] = lru
            before = int(emu.err[E_CORRUPT_STATE])
            got.append(emu.resolve(0, sr, tk))
            assert int(emu.err[E_CORRUPT_STATE]) - before == (1 if kind else 0), (trial, kind)
            if kind:
                assert emu.err[8 + E_CORRUPT_STATE] == row  # the batch row of state row `row`
        for e, g in zip(emus[1:], got[1:]):
            assert_same(got[0], g, f"trial {trial}")
            np.testing.assert_array_equal(emus[0].owner, e.owner)
            np.testing.assert_array_equal(emus[0].lru, e.lru)


def test_a_row_with_duplicate_ids_is_refused_and_the_rest_resolves():
    lay = layout(6, 12, 40, 2)
    cpu = CpuResidency(lay)
    emu = cpu_kernels.Resolve(lay, threads=32)
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


def test_masks_set_in_phase_1_are_clear_for_the_next_token_after_a_refused_row():
    """Phase 1 marks the lru as it copies it, and the masks are cleared when a row is done: a row refused for duplicate ids (after its marks were set), then a sound
    token of the same request, then another, resolve as the NumPy engine does, with no
    CORRUPT_STATE."""
    lay = layout(6, 18, 40, 2, max_batch=4)
    cpu = CpuResidency(lay)
    emu = cpu_kernels.Resolve(lay, threads=32)
    warm = np.array([[1, 2, 3, 4, 5, 6]], np.int32)
    cpu.resolve(0, np.array([0], np.int32), warm)
    emu.resolve(0, np.array([0], np.int32), warm)
    tk = np.array([[9, 3, 9, 7, 3, 9], [1, 2, 7, 8, -1, -1], [3, 4, 11, 12, 13, -1]], np.int32)
    sr = np.array([0, 0, 0], np.int32)
    want = cpu.resolve(0, sr[1:], tk[1:])
    got = emu.resolve(0, sr, tk)
    assert emu.err[E_DUPLICATE_IDS] == 1 and emu.err[E_CORRUPT_STATE] == 0
    np.testing.assert_array_equal(got.slots[1:], want.slots)
    np.testing.assert_array_equal(got.misses[1:], want.misses)
    np.testing.assert_array_equal(emu.owner, cpu.owner)
    np.testing.assert_array_equal(emu.lru, cpu.lru)


def test_a_token_beyond_region_stride_over_top_k_is_refused():
    """Three tokens of one request where the region holds two top-k rows: the first two
    resolve in batch order, the third is refused (TOO_MANY_TOKENS), whichever block
    finds them."""
    lay = layout(4, 8, 40, 2, max_batch=4)
    emu = cpu_kernels.Resolve(lay, threads=32)
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


def _positions_case(rng, tokens=7, k=24, reqs=5, max_blocks=6, bs=4):
    req = rng.integers(-1, reqs + 1, size=tokens).astype(np.int32)  # padding and a request past the table
    table = rng.integers(-1, 50, size=(reqs, max_blocks)).astype(np.int32)  # -1: a null block
    resident = np.where(rng.random((reqs, max_blocks // 2)) < 0.3,
                        rng.integers(0, 9, size=(reqs, max_blocks // 2)), -1).astype(np.int32)
    topk = rng.integers(-3, max_blocks * bs + 6, size=(tokens, k)).astype(np.int32)  # negatives, past the table
    return req, table, resident, topk, bs


@pytest.mark.parametrize("grid", [1, 3])
def test_the_engine_side_maps_positions_as_proto_positions_does_and_rings_once(grid):
    """skv_db_topk: position -> host row by the request's block table (proto/positions.py's
    rule), resident blocks -> -1 (no host row), unmapped -> -2; the step block's head; and
    the bell rung once every block is done, its arrival counter back at 0. k = 300 spans
    two tiles of a block's unrolled columns (32 threads x 8), the second one partial. Each
    of the kernel's specialised paths: with and without a resident table, a block size that
    is a power of two (a shift) and one that is not (a division)."""
    rng = np.random.default_rng(grid)
    for trial in range(18):
        with_res, block = trial % 4 < 2, (4, 3, 1, 5)[trial % 4]
        threads = 8 if trial >= 16 else 32  # fewer threads than the descriptor's ints too
        req, table, resident, topk, bs = _positions_case(rng, k=(24, 300)[trial % 2], bs=block)
        if not with_res:
            resident = np.full((table.shape[0], 1), -1, np.int32)  # the expectation's: nothing resident
        tokens, k = topk.shape
        max_batch = 8
        blk = np.full(16 + 2 * max_batch + max_batch * k, -9, np.int32)
        counter = np.array([41], np.int32)
        done, bell = np.zeros(1, np.uint32), np.zeros(1, np.uint32)
        cpu_kernels.db_topk(grid, threads, blk, counter, req, table, resident if with_res else None, topk, bs, group=2,
                            max_batch=max_batch, done=done, bell=bell, local_bell=trial % 2 == 1)
        live = (req >= 0) & (req < table.shape[0])
        rows_tab = np.where(live[:, None], table[np.clip(req, 0, table.shape[0] - 1)], -1)
        want = positions.host_rows(topk, rows_tab, bs)
        blkno = np.where(topk >= 0, topk // bs, -1)
        res_tab = np.where(live[:, None], resident[np.clip(req, 0, resident.shape[0] - 1)], -1)
        in_res = (blkno >= 0) & (blkno < resident.shape[1])
        is_res = in_res & (np.take_along_axis(res_tab, np.clip(blkno, 0, resident.shape[1] - 1), axis=1) >= 0)
        want = np.where(is_res, -1, np.where(live[:, None], want, positions.UNMAPPED))
        payload = blk[16 + 2 * max_batch:16 + 2 * max_batch + tokens * k].reshape(tokens, k)
        np.testing.assert_array_equal(payload, want, err_msg=f"trial {trial}")
        np.testing.assert_array_equal(blk[16:16 + tokens], np.where(req < 0, -1, req))
        assert blk[2] == tokens and blk[3] == k and blk[4] == 2 and blk[0] == blk[1] == 41  # batch, k, group, seq
        assert (blk[5:16] == 0).all(), f"trial {trial}: the descriptor's other ints"
        assert bell[0] == 1 and done[0] == 0


@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("grid", [1, 3])
def test_the_handles_own_arguments_ring_the_groups_bell(grid, local):
    """The doorbell handle's argument tuple for skv_db_topk (the one swap_in and
    finish_step launch), run against the kernel's parameter order: the group's bell ends at
    1 and its arrival counter at 0, its fence device-scope where the daemon said only this
    GPU waits on the bells (``bells_local``). (The handle once passed the
    two the other way round: the kernel counted arrivals on the bell, which the daemon's
    stream then never saw settle at 1, and the engine waited for ever.)"""
    tokens, k, max_batch, groups = 4, 8, 8, 2
    blks = [np.full(16 + 2 * max_batch + max_batch * k, -9, np.int32) for _ in range(groups)]
    counter = np.array([7], np.int32)
    arrivals = np.zeros(groups, np.uint32)
    bells = np.zeros(groups, np.uint32)
    h = object.__new__(DoorbellSwapIn)  # no GPU: only the argument builder is used
    h.layout = SimpleNamespace(max_batch=max_batch)
    h._topk_blocks = [b.ctypes.data for b in blks]
    h._counter = SimpleNamespace(data=SimpleNamespace(ptr=counter.ctypes.data))
    h._arrivals = SimpleNamespace(data=SimpleNamespace(ptr=arrivals.ctypes.data))
    h._bells = [bells.ctypes.data + 4 * g for g in range(groups)]
    h._bells_local = local
    req = np.arange(tokens, dtype=np.int32)
    topk = np.arange(tokens * k, dtype=np.int32).reshape(tokens, k)
    args = h._topk_args(1, tokens, req.ctypes.data, 0, max_batch, 0, 0, 0, topk.ctypes.data, k, 1)
    assert isinstance(args[-1], np.int32) and int(args[-1]) == local
    cpu_kernels.db_topk_raw(grid, 32, args)
    assert bells.tolist() == [0, 1] and arrivals.tolist() == [0, 0]
    payload = blks[1][16 + 2 * max_batch:16 + 2 * max_batch + tokens * k].reshape(tokens, k)
    np.testing.assert_array_equal(payload, topk)  # no table: host rows as they are
    assert blks[1][0] == 7 and blks[1][4] == 1  # seq, group


def test_the_engine_side_indices_point_at_hot_or_resident_rows():
    """skv_db_indices: resident positions -> resident_base + block * bs + offset, hot slots
    -> hot_base + req * stride + slot, everything else -1; valid counts; all -1 once dead
    (the handle's word) or stopped (the rank's word in the daemon's arena: its TP group
    stopped). k = 300: two tiles of unrolled columns, as above; with and without a resident
    table, block sizes a power of two and not (the kernel's specialised paths)."""
    rng = np.random.default_rng(5)
    stride, hot, res_base = 64, 1000, 50_000
    for k_cols, dead_flag, stop_flag, block, with_res in ((24, 0, 0, 4, True), (24, 1, 0, 4, True),
                                                          (24, 0, 1, 4, True), (300, 0, 0, 4, True),
                                                          (300, 0, 0, 3, True), (24, 0, 0, 5, True),
                                                          (300, 0, 0, 4, False), (24, 0, 0, 3, False),
                                                          (24, 1, 0, 4, False)):
        req, table, resident, topk, bs = _positions_case(rng, k=k_cols, bs=block)
        if not with_res:
            resident = np.full((table.shape[0], 1), -1, np.int32)  # the expectation's: nothing resident
        tokens, k = topk.shape
        slots = rng.integers(-1, stride, size=(8, k)).astype(np.int32)
        out = np.full((tokens, k), -9, np.int32)
        valid = np.full(tokens, -9, np.int32)
        dead = np.array([dead_flag], np.int32)
        stopped = np.array([stop_flag * 7], np.uint32)
        cpu_kernels.db_indices(3, 32, slots, req, topk if with_res else None, resident if with_res else None,
                               table.shape[0], bs, stride, hot, res_base, dead, out, valid, stopped=stopped)
        want = np.full((tokens, k), -1, np.int64)
        for t in range(tokens):
            r = int(req[t])
            if dead_flag or stop_flag or not 0 <= r < table.shape[0]:
                continue
            for j in range(k):
                p = int(topk[t, j])
                b = p // bs if p >= 0 else -1
                rb = resident[r, b] if 0 <= b < resident.shape[1] else -1
                if p >= 0 and rb >= 0:
                    want[t, j] = res_base + rb * bs + p % bs
                elif slots[t, j] >= 0:
                    want[t, j] = hot + r * stride + slots[t, j]
        np.testing.assert_array_equal(out, want, err_msg=f"dead {dead_flag} stopped {stop_flag} bs {bs} {with_res}")
        np.testing.assert_array_equal(valid, (want >= 0).sum(axis=1))


def test_the_indices_clear_the_layers_ready_word():
    """The handle passes each layer's ready word to skv_db_indices, which sets it to 0 (in
    place of a stream operation after the wait); the indices are those of a launch without
    it."""
    rng = np.random.default_rng(8)
    req, table, resident, topk, bs = _positions_case(rng)
    tokens, k = topk.shape
    slots = rng.integers(-1, 64, size=(8, k)).astype(np.int32)
    readys = np.ones(3, np.uint32)
    h = object.__new__(DoorbellSwapIn)  # no GPU: only the argument choice is used
    h._readys = [readys.ctypes.data + 4 * i for i in range(3)]
    word = h._cleared_by_indices(1)
    assert word == h._readys[1]
    outs = []
    for clear in (None, word):
        out = np.full((tokens, k), -9, np.int32)
        cw = None
        if clear:  # the emulator takes arrays: a view of the very word the handle named
            cw = np.frombuffer((ctypes.c_uint32 * 1).from_address(clear), np.uint32)
        cpu_kernels.db_indices(3, 32, slots, req, topk, resident, table.shape[0], bs, 64, 1000, 50_000,
                               np.zeros(1, np.int32), out, clear=cw)
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])
    assert readys.tolist() == [1, 0, 1]


def test_the_indices_that_wait_for_the_ready_word_clear_it_once_every_block_has_seen_it():
    """skv_db_indices given the layer's arrival counter waits for the ready word itself:
    every block counts in, the last sets the word and the counter back to 0, and the
    indices are those of a launch that did not wait. (In the emulator the blocks run one
    after another: a block that cleared the word for the others would leave the next
    one polling for ever.)"""
    rng = np.random.default_rng(9)
    req, table, resident, topk, bs = _positions_case(rng)
    tokens, k = topk.shape
    slots = rng.integers(-1, 64, size=(8, k)).astype(np.int32)
    outs = []
    for grid in (3, tokens):
        for wait in (False, True):
            ready, arrivals = np.ones(1, np.uint32), np.zeros(1, np.uint32)
            out = np.full((tokens, k), -9, np.int32)
            run = cpu_kernels.start(cpu_kernels.db_indices, grid, 32, slots, req, topk, resident, table.shape[0], bs,
                                    64, 1000, 50_000, np.zeros(1, np.int32), out, clear=ready,
                                    arrivals=arrivals if wait else None)
            cpu_kernels.finish(run, ready, f"grid {grid}: a block still polled after another cleared the word")
            assert ready.tolist() == [0] and arrivals.tolist() == [0], (grid, wait)
            outs.append(out)
    for out in outs[1:]:
        np.testing.assert_array_equal(outs[0], out)


def test_the_doorbell_handles_wait_for_an_unconsumed_layer_clears_its_ready_word():
    """finish_step's wait for a layer no swap_in consumed: the handle's own argument
    tuple for skv_db_indices of no token, run against the kernel's parameter order, waits
    for the layer's ready word and clears it and the layer's arrival counter (left set, the
    word would let the next step's wait pass before the daemon has the new rows)."""
    L = 3
    readys, idx_arrivals = np.ones(L, np.uint32), np.zeros(L, np.uint32)
    counter, dead = np.array([5], np.int32), np.zeros(1, np.int32)
    h = object.__new__(DoorbellSwapIn)  # no GPU: only the argument builder is used
    h.layout = SimpleNamespace(top_k=16, region_stride=32)
    h._slots, h.hot_base, h.resident_base = [counter.ctypes.data], 0, 0  # (no token: nothing of them is read)
    h._readys = [readys.ctypes.data + 4 * i for i in range(L)]
    h._counter = SimpleNamespace(data=SimpleNamespace(ptr=counter.ctypes.data))
    h._dead = SimpleNamespace(data=SimpleNamespace(ptr=dead.ctypes.data))
    h._stopped_word = 0
    h._idx_arrivals = SimpleNamespace(data=SimpleNamespace(ptr=idx_arrivals.ctypes.data))
    launched = []

    def launch(fn, grid, stream_ptr, args, threads=32):
        launched.append(grid)
        cpu_kernels.run_raw("handle.cu", "skv_db_indices", grid, threads, args)

    h._launch = launch
    h._k_indices = None
    h._wait_alone(1, 0, 0)
    assert launched == [1]
    assert readys.tolist() == [1, 0, 1] and idx_arrivals.tolist() == [0, 0, 0] and counter.tolist() == [5]


def test_the_resolve_clears_the_word_it_is_given_and_resolves_the_same():
    """skv_resolve's ``clear`` (the doorbell's group bell): the word ends
    at 0 and the slots, plan and state are those of a launch without it."""
    lay = layout(64, 128, 2_000, 4, groups=1, max_batch=4)
    rng = np.random.default_rng(3)
    topk = np.stack([rng.choice(2_000, 64, replace=False) for _ in range(3)]).astype(np.int32)
    rows = np.array([0, 2, 3], np.int32)
    res = []
    for clear in (None, np.ones(1, np.uint32)):
        emu = cpu_kernels.Resolve(lay, threads=64, workspace="shared")
        out = emu.run(0, rows, topk, clear=clear)
        res.append((out, emu.state(), clear))
    (a, sa, _), (b, sb, word) = res
    assert word.tolist() == [0]
    for name in ("slots", "misses", "prow", "pslot", "counters"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    for x, y in zip(sa, sb):
        np.testing.assert_array_equal(x, y)


# skv_gather as the daemon builds it, and with the loads in flight bench kernels also
# times (csrc/copy.cu): each must copy exactly the plan.
GATHER_VARIANTS = {
    "default": {},
    "one load in flight": {"SKV_COPY_UNROLL": 1},
    "8 loads in flight": {"SKV_COPY_UNROLL": 8},
}


@pytest.mark.parametrize("grid", [1, 4, 16])  # batches of 1-5 rows: blocks shared by rows, a row's own, rows split
@pytest.mark.parametrize("variant", list(GATHER_VARIANTS))
@pytest.mark.parametrize("rb", [48, 656])
@pytest.mark.parametrize("geometry", ["daemon", "engine"])
def test_the_gather_copies_each_planned_row_of_the_groups_layers_and_nothing_else(geometry, rb, variant, grid):
    """skv_gather: for each layer of the descriptor's group, row plan_rows[b, i] of the pool
    to slot plan_slots[b, i] of the slab (i < misses[b]), into the daemon's flat slab or an
    engine's paged buffer (blocks of block_rows rows at block_stride bytes, a gap after
    each); every other byte stays as it was; an entry outside the pool is skipped. Rows of
    3 and of 41 vectors (more than a warp's lanes); every variant of the kernel; grids of
    fewer blocks than rows, and of more (a row's entries split over its blocks, some
    blocks idle)."""
    rng = np.random.default_rng(11)
    L, host_rows = 4, 300
    B, ld, slots_n = 5, 12, 40  # slab rows per layer (max_reqs x region_stride)
    pool = rng.integers(0, 256, size=(L, host_rows, rb), dtype=np.uint8)
    groups = np.array([[2, 0, 3], [1, 1, -1]], np.int32)  # group 0: layers 0 and 3; group 1: layer 1
    block_rows, gap = 4, 2
    block_stride = (block_rows + gap) * rb
    per_layer = slots_n // block_rows * block_stride
    for trial in range(6):
        batch = int(rng.integers(1, B + 1))
        group = trial % 2
        misses = rng.integers(0, ld + 1, size=B).astype(np.int32)
        rows = rng.integers(0, host_rows, size=(B, ld)).astype(np.int32)
        out_of_pool = rng.random((B, ld)) < 0.15  # past the pool or negative: skipped
        rows[out_of_pool] = rng.choice([host_rows, host_rows + 1, -1, -5], size=int(out_of_pool.sum()))
        # Slots distinct over the whole batch (the bytes then do not depend on write order);
        # past the first slots_n // B entries of a row, -1 (skipped).
        per_row = slots_n // B
        slots = np.full((B, ld), -1, np.int32)
        slots[:, :per_row] = rng.choice(slots_n, B * per_row, replace=False).reshape(B, per_row)
        desc = make_desc(batch, ld, group)
        if geometry == "daemon":
            slab = rng.integers(0, 256, size=(L, slots_n, rb), dtype=np.uint8)
            layer_off, bstride = None, 0
        else:
            slab = rng.integers(0, 256, size=(L * per_layer,), dtype=np.uint8)
            layer_off = (np.arange(L) * per_layer).astype(np.int64)
            bstride = block_stride
        want = slab.copy()
        for layer in groups[group, 1:1 + groups[group, 0]]:
            for b in range(batch):
                for i in range(misses[b]):
                    r, sl = rows[b, i], slots[b, i]
                    if not 0 <= r < host_rows or sl < 0:
                        continue
                    if geometry == "daemon":
                        want[layer, sl] = pool[layer, r]
                    else:
                        at = layer * per_layer + (sl // block_rows) * block_stride + (sl % block_rows) * rb
                        want[at:at + rb] = pool[layer, r]
        cpu_kernels.gather(desc, pool, slab, slots_n, groups, rows, slots, misses, layer_off=layer_off,
                           block_rows=block_rows if geometry == "engine" else 1, block_stride=bstride,
                           defines=GATHER_VARIANTS[variant], grid=grid)
        np.testing.assert_array_equal(slab, want, err_msg=f"trial {trial}")


@pytest.mark.parametrize("grid", [1, 2, 4])  # fewer, as many and more blocks than batch rows (3)
def test_the_gather_sets_its_ready_word_once_every_block_is_done(grid):
    """skv_gather with a ready word (the doorbell's signalling): the rows are
    copied as without it, the word is 1 afterwards and the arrival counter back at 0;
    also when the descriptor is out of range (nothing copied, the engine still released);
    without a word nothing is signalled."""
    pool, groups, rows, slots, misses, slots_n = cpu_kernels.small_plan(3)
    L, rb, ld = pool.shape[0], pool.shape[2], rows.shape[1]
    for desc, copies in ((make_desc(3, ld, 0), True), (make_desc(3, ld, 5), False), (make_desc(0, ld, 0), False)):
        slab = np.zeros((L, slots_n, rb), np.uint8)
        ready, arrivals = np.zeros(1, np.uint32), np.zeros(1, np.uint32)
        cpu_kernels.gather(desc, pool, slab, slots_n, groups, rows, slots, misses, grid=grid, ready=ready,
                           arrivals=arrivals)
        assert ready[0] == 1 and arrivals[0] == 0
        assert slab.any() == copies
        if copies:
            np.testing.assert_array_equal(slab[1, slots[0, :4]], pool[1, rows[0, :4]])
    slab = np.zeros((L, slots_n, rb), np.uint8)
    cpu_kernels.gather(make_desc(3, ld, 0), pool, slab, slots_n, groups, rows, slots, misses, grid=grid)
    assert slab.any()  # no word: copied, nothing else to check (a null word is never written)


def test_begin_step_resets_then_invalidates_as_the_numpy_engine():
    """skv_begin_step (one launch for the whole STEP block): rows with reset empty their
    regions, the others lose the slots owning one of their invalidate ids; the result is
    the NumPy engine's (resets first, then invalidations), the lru untouched by the
    invalidations; then resolving goes on equal."""
    lay = layout(8, 16, 60, 4, groups=2, max_batch=6)
    cpu = CpuResidency(lay)
    emu = cpu_kernels.Resolve(lay, threads=32)
    rng = np.random.default_rng(13)
    memory: dict = {}
    for step in range(25):
        sr, tk = gen_batch(rng, lay, memory, 6, 0.6)
        group = int(rng.integers(lay.num_groups))
        assert_same(cpu.resolve(group, sr, tk), emu.resolve(group, sr, tk), f"step {step}")
        rows = rng.choice(lay.max_reqs, size=3, replace=False).astype(np.int32)
        reset = (rng.random(3) < 0.3).astype(np.int32)
        inv = rng.integers(-1, lay.host_rows, size=(3, 5)).astype(np.int32)
        for s, r in zip(rows, reset):
            if r:
                cpu.reset(np.array([s], np.int32))
        for s, r, ids in zip(rows, reset, inv):
            if not r:
                cpu.invalidate(int(s), ids)
        emu.begin_step(rows, reset, inv)
        np.testing.assert_array_equal(emu.owner, cpu.owner, err_msg=f"owner after step {step}")
        np.testing.assert_array_equal(emu.lru, cpu.lru, err_msg=f"lru after step {step}")
    assert not emu.err[:8].any()


