"""A TP group's follower on the doorbell (csrc/tp.cu) on the emulator: ``skv_tp_check_step``
and ``skv_tp_follow`` against ``daemon/tp.py``'s ``step_matches`` / ``follow_rows``, with
followers that send the leader's blocks, or differ in one state row, one id, the step, the
group, the batch, k, a reset or an invalidation: a differing row is refused (slots -1, 0
misses, TP_MISMATCH with its row), every other row gets the leader's slots, and rows past
the follower's batch are left as they were."""

from __future__ import annotations

import numpy as np
import pytest

import cpu_kernels
from sparsekv.daemon.tp import follow_rows, step_matches
from sparsekv.proto.step_block import BlockView, block_ints, write_step, write_topk

pytestmark = pytest.mark.skipif(cpu_kernels.compiler() is None, reason="no C++ compiler for the kernel emulator")

B, K, INV = 6, 12, 4
TP_MISMATCH = 5  # csrc/common.cuh SKV_E_TP_MISMATCH


def block():
    return BlockView(np.zeros(block_ints(B, K), np.int32), B)


def topk_block(step, group, rows, ids):
    blk = block()
    write_topk(blk, 1, step, group, rows, ids)
    return blk


def run_follow(lead, foll, slots, misses, step_bad: int | None, out_k: int = K):
    out = np.full((B, out_k), -7, np.int32)
    out_m = np.full(B, -7, np.int32)
    err = np.zeros(32, np.int32)
    bad = None if step_bad is None else np.array([step_bad], np.uint32)
    cpu_kernels.run_raw("tp.cu", "skv_tp_follow", B, 32,
                        (lead.block, foll.block, slots, misses, out, out_m, np.int32(out_k), np.int32(B),
                         bad if bad is not None else 0, err))
    return out, out_m, err


VARIANTS = ["same", "a state row", "an id", "the step", "the group", "a shorter batch", "a longer batch",
            "a smaller k", "a failed step"]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_follower_gets_the_leaders_rows_where_it_sent_the_same_and_is_refused_where_not(variant, seed):
    rng = np.random.default_rng(seed)
    batch, k, step, group = 4, 10, 7, 2
    rows = rng.permutation(16)[:batch].astype(np.int32)
    ids = rng.integers(-1, 1000, size=(batch, k), dtype=np.int32)
    lead = topk_block(step, group, rows, ids)
    f_rows, f_ids, f_step, f_group, step_bad = rows.copy(), ids.copy(), step, group, 0
    if variant == "a state row":
        f_rows[1] += 100
    elif variant == "an id":
        f_ids[2, 5] += 1
    elif variant == "the step":
        f_step += 1
    elif variant == "the group":
        f_group += 1
    elif variant == "a shorter batch":
        f_rows, f_ids = f_rows[:3], f_ids[:3]
    elif variant == "a longer batch":
        f_rows = np.concatenate([f_rows, [15]]).astype(np.int32)
        f_ids = np.concatenate([f_ids, f_ids[:1]]).astype(np.int32)
    elif variant == "a smaller k":
        f_ids = f_ids[:, :k - 1].copy()
    elif variant == "a failed step":
        step_bad = 1
    foll = topk_block(f_step, f_group, f_rows, f_ids)
    slots = rng.integers(-1, 50, size=(B, K), dtype=np.int32)
    misses = rng.integers(0, k, size=B, dtype=np.int32)
    got, got_m, err = run_follow(lead, foll, slots, misses, step_bad)
    want, want_m, refused = follow_rows((step, group, rows, ids), (f_step, f_group, f_rows, f_ids), slots, misses,
                                        step_ok=not step_bad)
    fb = f_rows.shape[0]
    assert np.array_equal(got[:fb], want) and np.array_equal(got_m[:fb], want_m), variant
    assert (got[fb:] == -7).all() and (got_m[fb:] == -7).all()  # past its batch: untouched
    assert err[TP_MISMATCH] == int(refused.sum()), variant
    if variant == "same":
        assert not refused.any() and err[TP_MISMATCH] == 0
    else:
        assert refused.any()
        assert err[8 + TP_MISMATCH] in np.flatnonzero(refused) and err[16 + TP_MISMATCH] == f_step


def test_without_a_step_word_the_rows_alone_decide():
    rows = np.arange(3, dtype=np.int32)
    ids = np.arange(30, dtype=np.int32).reshape(3, 10)
    lead = topk_block(1, 0, rows, ids)
    slots = np.arange(B * K, dtype=np.int32).reshape(B, K)
    got, got_m, err = run_follow(lead, topk_block(1, 0, rows, ids), slots, np.arange(B, dtype=np.int32), None)
    assert np.array_equal(got[:3], slots[:3]) and got_m[:3].tolist() == [0, 1, 2] and err[TP_MISMATCH] == 0


def run_check(lead, foll):
    bad = np.array([7], np.uint32)
    err = np.zeros(32, np.int32)
    cpu_kernels.run_raw("tp.cu", "skv_tp_check_step", 1, 64, (lead.block, foll.block, np.int32(B), np.int32(INV),
                                                              bad, err))
    return int(bad[0]), err


STEP_VARIANTS = ["same", "a state row", "a reset", "an invalidation", "no invalidations", "the step", "the batch"]


@pytest.mark.parametrize("variant", STEP_VARIANTS)
def test_a_followers_step_is_bad_unless_every_array_of_it_is_the_leaders(variant):
    rng = np.random.default_rng(3)
    batch = 5
    rows = rng.permutation(20)[:batch].astype(np.int32)
    reset = np.array([0, 1, 0, 0, 1], bool)
    inv = rng.integers(-1, 100, size=(batch, 3), dtype=np.int32)
    f = {"step": 4, "rows": rows.copy(), "reset": reset.copy(), "inv": inv.copy()}
    if variant == "a state row":
        f["rows"][4] = 19 if rows[4] != 19 else 18
    elif variant == "a reset":
        f["reset"][0] = True
    elif variant == "an invalidation":
        f["inv"][2, 1] += 1
    elif variant == "no invalidations":
        f["inv"] = np.empty((batch, 0), np.int32)
    elif variant == "the step":
        f["step"] = 5
    elif variant == "the batch":
        f["rows"], f["reset"], f["inv"] = rows[:4], reset[:4], inv[:4]
    lead, foll = block(), block()
    write_step(lead, 1, 4, rows, reset, inv)
    write_step(foll, 2, f["step"], f["rows"], f["reset"], f["inv"] if f["inv"].shape[1] else None)
    bad, err = run_check(lead, foll)
    want = not step_matches((4, rows, reset, inv), (f["step"], f["rows"], f["reset"], f["inv"]))
    assert bad == int(want) and err[TP_MISMATCH] == int(want), variant
    assert (variant == "same") == (not want)


def test_a_step_descriptor_out_of_range_is_bad_even_when_both_agree():
    lead, foll = block(), block()
    for blk in (lead, foll):
        write_step(blk, 1, 4, np.arange(3, dtype=np.int32), None, None)
        blk.desc[5] = INV + 1  # SKV_D_INV_N past inv_cap
    assert run_check(lead, foll)[0] == 1
