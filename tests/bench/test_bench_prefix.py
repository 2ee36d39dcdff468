"""``sparsekv bench prefix``: its figures come from a real private daemon and a restarted
engine process that finds the whole cached prefix (the bench asserts every lookup hits it all)."""

import subprocess
import sys

import pytest

import cli_inproc
import helpers
from sparsekv.bench import prefix
from sparsekv.bench.prefix import bench_prefix, serve_figures
from sparsekv.bench.serve_capacity import PRESETS, prefill_bound


def test_bench_prefix_reports_lookup_and_restart():
    r = bench_prefix(blocks=32, block_size=4, reps=5, restarts=1, pool_gib=0.05)
    assert r["bench"] == "prefix" and r["blocks"] == 32 and 0.04 < r["pool_gib"] <= 0.05
    assert 0 < r["prefix_lookup_us_p50"] <= r["prefix_lookup_us_p99"]
    assert r["prefix_lookup_sent_us_p50"] > 0 and r["prefix_lookup_cold_us_p50"] > 0
    assert r["prefix_lookup_behind_us_p50"] > 0
    legs = r["lookup_send_us"], r["lookup_daemon_us"], r["lookup_reply_us"]
    assert all(x > 0 for x in legs) and sum(legs) <= 1.5 * r["prefix_lookup_us_p99"], r
    assert 0 < r["restart_s_median"] < 30


def test_the_served_prefix_is_the_chains_first_blocks_looked_up_with_its_recompute_bound():
    r = bench_prefix(blocks=32, block_size=4, reps=5, restarts=1, pool_gib=0.05, serve_tokens=64)
    assert r["prefix_serve_tokens"] == 64 and r["prefix_serve_lookup_us_p50"] > 0
    assert r["prefix_recompute_ms_bound"] == round(prefill_bound(PRESETS["v32"], 64)["bound_s"] * 1e3, 1)
    # longer than the chain: the whole chain is served
    assert bench_prefix(blocks=8, block_size=4, reps=2, restarts=1, pool_gib=0.05,
                        serve_tokens=400)["prefix_serve_tokens"] == 32


def test_a_served_prefix_that_is_not_whole_blocks_is_refused():
    with pytest.raises(ValueError, match="multiple of block_size 4"):
        bench_prefix(blocks=8, block_size=4, reps=2, serve_tokens=6)
    with pytest.raises(ValueError, match="reps must be in"):
        bench_prefix(blocks=8, block_size=4, reps=8)


def test_serving_is_the_lookup_plus_the_keys_load_over_the_recompute_bound():
    base = {"prefix_serve_lookup_us_p50": 500.0, "prefix_serve_load_ms": 4.5, "prefix_recompute_ms_bound": 1000.0}
    got = serve_figures({**base, "prefix_serve_tokens": 32768})
    assert got == {"prefix_serve_ms": 5.0, "prefix_serve_vs_recompute": 0.005, "prefix_serve_vs_recompute_32k": 0.005}
    assert "prefix_serve_vs_recompute_32k" not in serve_figures({**base, "prefix_serve_tokens": 4096})


def test_the_prefill_bound_adds_each_parts_flops_at_its_peak_by_hand():
    """DeepSeek-V3.2 at 32K, counted here from the model's numbers, not the preset's fields."""
    T = 32768
    r = prefill_bound(PRESETS["v32"], T)
    # 60 layers whose outputs the next needs: x -> c_q 1536 | c_kv 512 | k_rope 64 | k_idx 128
    # | w_idx 64; c_q -> 128 heads x (128 + 64) | 64 x 128; o_proj 128 x 128 -> 7168; the
    # last layer only x -> c_kv | k_rope | k_idx
    assert r["projections"] == 60 * T * 2 * (2304 * 7168 + (24576 + 8192) * 1536 + 16384 * 7168) \
        + T * 2 * (512 + 64 + 128) * 7168
    assert r["kv_up"] == 60 * T * 2 * 512 * 128 * (128 + 128)
    # positions 1..2048 attend to themselves and those before, later ones to 2048
    assert r["attention"] == 60 * 2 * 128 * (128 + 64 + 128) * (2048 * 2049 // 2 + (T - 2048) * 2048)
    assert r["indexer"] == 60 * 2 * 64 * 128 * (T * (T - 1) // 2)
    assert r["dense_ffn"] == 3 * T * 2 * 3 * 7168 * 18432
    assert r["shared_expert_and_router"] == 57 * T * (2 * 3 * 7168 * 2048 + 2 * 7168 * 256)
    assert r["routed_experts"] == 57 * T * 8 * 2 * 3 * 7168 * 2048
    fp8 = sum(r[k] for k in ("projections", "kv_up", "indexer", "dense_ffn", "shared_expert_and_router")) \
        + r["routed_experts"] / 8
    assert r["bound_s"] == pytest.approx(fp8 / 1979e12 + r["attention"] / 989e12)
    assert 1.0 < r["bound_s"] < 1.3  # ~1.2 s for 32K on one H200 of the deployment
    # a prompt shorter than top-k attends to every earlier position
    assert prefill_bound(PRESETS["v32"], 1000)["attention"] == 60 * 2 * 128 * 320 * (1000 * 1001 // 2)


def test_an_unknown_bench_name_lists_prefix_among_the_choices():
    r = cli_inproc.run("bench", "nope")
    assert r.returncode == 2 and "prefix" in r.stderr


def test_a_bench_named_twice_is_refused_before_any_work():
    """Found by an adversarial review: `bench transport transport` ran it twice."""
    r = cli_inproc.run("bench", "transport", "resolve", "transport")
    assert r.returncode == 2 and r.stderr == "sparsekv bench: transport named twice; name each benchmark once\n"


def test_the_restarted_engine_imports_what_an_engine_imports_and_no_daemon_module():
    """restart_s times an engine process from its start: its script's imports are the
    client's, not the daemon's (each module imported is time counted in the figure)."""
    head = prefix._RESTART.split("run_dir,")[0]
    out = subprocess.run([sys.executable, "-c", head + "print(sorted(m for m in sys.modules if m.startswith("
                          "'sparsekv.daemon')))"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
