"""How ``sparsekv bench serve`` turns the CUDA events of its step's parts into per-part
times (no torch: the events' intervals are given): each part's total over a run of the
step, its median over the replays, divided by the layers it runs in, a missing event."""

from types import SimpleNamespace

import pytest

from sparsekv.bench import serve_report
from sparsekv.bench.serve_report import Result, median_parts, set_parts, step_totals

SH = SimpleNamespace(layers=4, dense_layers=1)  # 1 dense layer, 3 MoE


def test_a_parts_total_over_a_step_sums_its_intervals():
    run = [("begin", 2.0), ("proj", 10.0), ("attention", 5.0), ("proj", 3.0), ("proj", 10.0), ("head", 7.0)]
    assert step_totals(run) == {"begin": 2.0, "proj": 23.0, "attention": 5.0, "head": 7.0}


def test_an_interval_not_read_makes_its_parts_total_unknown_in_that_run_only():
    assert step_totals([("proj", 10.0), ("attention", None), ("proj", 3.0), ("attention", 4.0)]) == {
        "proj": 13.0, "attention": None}
    runs = [{"proj": 10.0, "attention": None}, {"proj": 12.0, "attention": 6.0}, {"proj": 11.0, "attention": 8.0}]
    assert median_parts(runs) == {"proj": 11.0, "attention": 7.0}  # attention: the median of the two runs read
    assert median_parts([{"proj": 1.0, "swap_in": None}, {"proj": 3.0, "swap_in": None}]) == {"proj": 2.0}


def test_each_part_is_its_median_over_the_replays_not_its_mean():
    runs = [{"moe": 30.0, "head": 5.0}, {"moe": 300.0, "head": 6.0}, {"moe": 33.0, "head": 4.0}]
    assert median_parts(runs) == {"moe": 33.0, "head": 5.0}


def test_parts_are_per_layer_they_run_in_and_sum_over_the_step_to_what_was_timed(monkeypatch):
    monkeypatch.setattr(serve_report, "bounds", lambda sh, batch, context, misses: {"moe": 10.0, "proj": 100.0})
    r = Result("daemon", 32768, 1, p50_us=1000.0)
    totals = {"begin": 3.0, "proj": 80.0, "dense_ffn": 20.0, "moe": 90.0, "head": 7.0, "swap_in": 40.0}
    set_parts(r, SH, totals, "graph")
    assert r.parts == {"begin": 3.0, "proj": 20.0, "swap_in": 10.0, "dense_ffn": 20.0, "moe": 30.0, "head": 7.0}
    assert list(r.parts) == [p for p in serve_report.PARTS if p in totals]  # the table's order
    assert r.parts_step_us == pytest.approx(sum(totals.values()))  # not scaled: the sum is what the events timed
    assert r.parts_run == "graph"
    assert r.flagged == ["moe"]  # 30 a layer against a bound of 10 (over 2x); proj 20 against 100 is not
    assert r.p50_at_bound_us == pytest.approx(1000.0 - 3 * (30.0 - 10.0))


def test_a_part_no_replay_read_is_left_out_and_no_parts_give_no_sum(monkeypatch):
    monkeypatch.setattr(serve_report, "bounds", lambda sh, batch, context, misses: {"swap_in": 1.0})
    r = Result("inproc", 32768, 1, p50_us=1000.0)
    set_parts(r, SH, median_parts([{"proj": 40.0, "swap_in": None}]), "graph")
    assert r.parts == {"proj": 10.0} and r.flagged == [] and r.p50_at_bound_us == 1000.0
    empty = Result("inproc", 32768, 1, p50_us=1000.0)
    set_parts(empty, SH, {}, "eager")
    assert empty.parts == {} and empty.parts_step_us is None
    assert "parts_step_us" in serve_report.PARTS_NOTE  # the JSON says what the parts are


def test_the_side_streams_marks_time_the_rows_and_leave_the_steps_intervals_alone():
    points = [("topk", 0.0), ("rows", 1.0), ("query", 2.0), ("write", 12.0), ("rows_end", 30.0), ("swap_in", 15.0),
              ("attention", 31.0), (None, 40.0)]
    assert serve_report.intervals_of(points) == [("topk", 2.0), ("query", 10.0), ("write", 3.0), ("swap_in", 16.0),
                                                 ("attention", 9.0), ("rows", 29.0)]
    assert ("rows", None) in serve_report.intervals_of([("rows", 1.0), ("rows_end", None), ("head", 3.0), (None, 4.0)])


def test_at_the_bound_the_wait_is_the_rows_beyond_the_query_beside_them(monkeypatch):
    """A flagged query made at its bound hides less of the rows: the wait grows by what it
    no longer hides, and the other flagged parts give back their excess."""
    monkeypatch.setattr(serve_report, "bounds", lambda sh, batch, context, misses:
                        {"query": 5.0, "moe": 10.0, "swap_in": 100.0})
    r = Result("daemon", 32768, 1, p50_us=10000.0)
    # per layer: query 30 (flagged), swap_in wait 4, rows 34 beside; moe 30 (flagged) in 3 layers
    set_parts(r, SH, {"query": 120.0, "swap_in": 16.0, "moe": 90.0, "rows": 136.0}, "graph")
    assert r.rows_us == 34.0 and r.flagged == ["query", "moe"]
    # query 30 -> 5 saves 25 a layer, the wait 4 -> 34 - 5 = 29 costs 25 a layer, moe saves 20 x 3
    assert r.p50_at_bound_us == pytest.approx(10000.0 - 4 * 25.0 + 4 * 25.0 - 3 * 20.0)
    # rows over 2x their bound (the link's time): at the bound they take that
    monkeypatch.setattr(serve_report, "bounds", lambda sh, batch, context, misses: {"query": 50.0, "swap_in": 10.0})
    r = Result("daemon", 32768, 1, p50_us=10000.0)
    set_parts(r, SH, {"query": 120.0, "swap_in": 16.0, "rows": 136.0}, "graph")
    assert r.flagged == ["rows"] and r.p50_at_bound_us == pytest.approx(10000.0 - 4 * (4.0 - 0.0))
