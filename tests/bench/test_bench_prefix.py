"""``sparsekv bench prefix``: its figures come from a real private daemon and a restarted
engine process that finds the whole cached prefix (the bench asserts every lookup hits it all)."""

import subprocess
import sys

import cli_inproc
import helpers
from sparsekv.bench import prefix
from sparsekv.bench.prefix import bench_prefix


def test_bench_prefix_reports_lookup_and_restart():
    r = bench_prefix(blocks=32, block_size=4, reps=5, restarts=1, pool_gib=0.05)
    assert r["bench"] == "prefix" and r["blocks"] == 32 and 0.04 < r["pool_gib"] <= 0.05
    assert 0 < r["prefix_lookup_us_p50"] <= r["prefix_lookup_us_p99"]
    legs = r["lookup_send_us"], r["lookup_daemon_us"], r["lookup_reply_us"]
    assert all(x > 0 for x in legs) and sum(legs) <= 1.5 * r["prefix_lookup_us_p99"], r
    assert 0 < r["restart_s_median"] < 30


def test_an_unknown_bench_name_lists_prefix_among_the_choices():
    r = cli_inproc.run("bench", "nope")
    assert r.returncode == 2 and "prefix" in r.stderr


def test_the_restarted_engine_imports_what_an_engine_imports_and_no_daemon_module():
    """restart_s times an engine process from its start: its script's imports are the
    client's, not the daemon's (each module imported is time counted in the figure)."""
    head = prefix._RESTART.split("run_dir,")[0]
    out = subprocess.run([sys.executable, "-c", head + "print(sorted(m for m in sys.modules if m.startswith("
                          "'sparsekv.daemon')))"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
