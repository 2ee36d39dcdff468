"""tests/gpu/probe_lookup.py (device_run.sh's ``lookup`` step) on this machine: the timeline
of a few lookups has the client's and the daemon's stamps in the order the request takes,
and every placement that the host allows is timed."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import probe_lookup  # noqa: E402


def test_the_timeline_puts_each_stamp_at_its_median_from_its_lookups_start():
    marks = [(100, 200), (1000, 1100)]
    events = [("b", 150), ("a", 110), ("a", 120), ("a", 1005), ("a", 1030), ("b", 1090), ("x", 500)]
    rows = dict(probe_lookup.timeline(marks, events))
    assert rows == {"a#1": 7.5 / 1e3, "a#2": 25 / 1e3, "b#1": 70 / 1e3, "lookup returns": 100 / 1e3}


def test_the_probe_runs_and_reports_the_daemon_and_client_stamps(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["probe_lookup.py", "--lookups", "40", "--out", str(tmp_path)])
    assert probe_lookup.main() == 0
    import json

    out = json.loads((tmp_path / "probe-lookup.json").read_text())
    steps = list(out["timeline_us"])
    for tag in ("client send#1", "daemon received#1", "store find#1", "daemon send#1", "client decode#1"):
        assert tag in steps, (tag, steps)
    assert steps.index("client send#1") < steps.index("daemon received#1") < steps.index("store find#1") \
        < steps.index("daemon send#1") < steps.index("client decode#1")
    assert steps[-1] == "lookup returns" and out["placements_p50_us"]["free"]
