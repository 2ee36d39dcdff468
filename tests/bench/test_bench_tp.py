"""``sparsekv bench tp``: both runs through real private daemons; the follower's TOPK only
gathers, so a group's step costs the daemon less than the same ranks resolving their own."""

import pytest

import cli_inproc
from sparsekv.bench.tp import bench_tp


def test_bench_tp_times_a_group_against_separate_ranks():
    r = bench_tp(ranks=2, steps=30, batch=4, top_k=256)
    assert r["bench"] == "tp" and r["ranks"] == 2
    for k in ("separate_topk_us", "tp_maker_topk_us", "tp_follower_topk_us", "separate_daemon_us_per_step",
              "tp_group_daemon_us_per_step"):
        assert r[k] > 0, k
    assert r["tp_group_daemon_us_per_step_vs_separate"] == pytest.approx(
        r["tp_group_daemon_us_per_step"] / r["separate_daemon_us_per_step"], abs=1e-3)  # (of unrounded times)


def test_an_unknown_bench_name_lists_tp_among_the_choices():
    r = cli_inproc.run("bench", "nope")
    assert r.returncode == 2 and "prefix, tp, cuda_transport" in r.stderr


def test_tp_ranks_is_tps_option_and_bounded():
    r = cli_inproc.run("bench", "resolve", "--tp-ranks", "4")
    assert r.returncode == 2 and r.stderr == "sparsekv bench: --tp-ranks is an option of tp\n"
    r = cli_inproc.run("bench", "tp", "--tp-ranks", "1")
    assert r.returncode == 2 and "--tp-ranks must lie in [2, 64], got 1" in r.stderr
