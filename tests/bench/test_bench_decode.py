"""``sparsekv bench decode`` (bench/decode*.py): the top-k generator keeps the
tuned share of each row from step to step and about ``layer_overlap`` between adjacent
layers; the fill helpers; the table and the JSON keys; options and the command line.
The engine-side step code runs on torch's CPU device where torch is installed; the whole
benchmark runs once, tiny, on a GPU (marked ``cuda``).

Longer than 600 lines: it mirrors the four bench/decode*.py modules, whose tests share the
fake handles and the small layouts defined here.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from sparsekv.bench import decode as bd
from sparsekv.bench import decode_modes as dm
from sparsekv.bench import decode_workload as dw
from sparsekv.bench.decode import Options, Result, combine_rounds, derive, generate, summary, table

SMALL = dict(steps=6, layers=6, context=1024, top_k=256, block_size=16)


def overlap(a: np.ndarray, b: np.ndarray) -> int:
    return len(np.intersect1d(a, b))


# -- generation -----------------------------------------------------------------------------
@pytest.mark.parametrize("hits", [0.8, 0.9, 0.95, 1.0, 0.0])
def test_every_layer_keeps_the_tuned_share_of_each_row_from_the_previous_step(hits):
    wl = generate(4, hits, **SMALL, seed=1)
    keep = int(round(hits * 256))
    assert wl.target_hit_rate == keep / 256
    assert abs(wl.target_hit_rate - hits) <= 1 / 256
    for t in range(1, wl.steps):
        cur, prev = wl.topk(t), wl.topk(t - 1)
        for layer in range(wl.layers):
            for r in range(wl.batch):
                assert overlap(cur[layer, r], prev[layer, r]) == keep, (t, layer, r)


def test_rows_are_unique_positions_in_the_context():
    wl = generate(5, 0.8, **SMALL, seed=2)
    assert wl.base.dtype == np.int32 and wl.base.shape == (6, 5, 256)
    for t in range(wl.steps):
        topk = wl.topk(t)
        assert topk.shape == (6, 5, 256) and topk.dtype == np.int32
        assert topk.min() >= 0 and topk.max() < 1024
        for layer in range(wl.layers):
            for r in range(wl.batch):
                assert len(np.unique(topk[layer, r])) == 256


@pytest.mark.parametrize("target", [0.85, 0.7, 1.0])
def test_adjacent_layers_overlap_about_layer_overlap(target):
    wl = generate(16, 0.9, steps=3, layers=8, context=1024, top_k=256, block_size=16, layer_overlap=target, seed=3)
    topk = wl.topk(2)
    shares = [overlap(topk[layer, r], topk[layer - 1, r]) / 256 for layer in range(1, 8) for r in range(16)]
    assert abs(np.mean(shares) - target) < 0.03, np.mean(shares)
    if target < 1:
        assert overlap(topk[7, 0], topk[0, 0]) < 256  # far layers drift apart


def test_block_table_maps_every_position_to_its_own_host_row():
    wl = generate(3, 0.9, **SMALL, seed=4)
    blocks = 1024 // 16
    assert wl.block_table.shape == (3, blocks)
    assert sorted(wl.block_table.ravel().tolist()) == list(range(3 * blocks))  # every host block once
    rows = wl.host_rows_of(2)
    assert rows.min() >= 0 and rows.max() < 3 * 1024
    for layer in range(wl.layers):
        for r in range(3):
            assert len(np.unique(rows[layer, r])) == 256


def test_reset_only_at_the_first_step():
    wl = generate(3, 0.9, **SMALL)
    assert wl.reset[0].all() and not wl.reset[1:].any()


def test_generation_is_deterministic_and_a_batch_shares_its_block_table():
    a = generate(4, 0.9, **SMALL, seed=7)
    b = generate(4, 0.9, **SMALL, seed=7)
    c = generate(4, 0.8, **SMALL, seed=7)
    np.testing.assert_array_equal(a.base, b.base)
    np.testing.assert_array_equal(a.perms, b.perms)
    np.testing.assert_array_equal(a.block_table, c.block_table)
    assert not np.array_equal(a.base, c.base)


def test_a_context_too_short_for_the_new_positions_is_refused():
    with pytest.raises(ValueError, match="context"):
        generate(2, 0.5, steps=2, layers=1, context=300, top_k=256, block_size=16)
    with pytest.raises(ValueError, match="--context"):
        Options(hits=(50.0,), context=3000, top_k=2048).validate()


# -- fill -------------------------------------------------------------------------------------
def test_fill_pattern_fills_every_layer_alike_from_a_repeating_tile():
    pool = np.zeros((4, dw.PATTERN_ROWS + 100, 32), np.uint8)
    dw.fill_pattern(pool, threads=2)
    tile = dw.pattern_tile(dw.PATTERN_ROWS, 32)
    np.testing.assert_array_equal(pool[0, : dw.PATTERN_ROWS], tile)
    np.testing.assert_array_equal(pool[0, dw.PATTERN_ROWS:], tile[:100])
    for layer in range(1, 4):
        np.testing.assert_array_equal(pool[layer], pool[0])
    assert pool[0, 1, 0] == 7 and pool[0, 1, 3] == 10


def test_fill_through_staging_covers_every_row_once_and_ends_with_a_plain_write():
    """The pattern goes to the staging buffer once; WRITE_STAGED then covers the host rows
    in staging-sized pieces; a last one-row WRITE (which quiesces the engine's copies)
    leaves the pool as a fill through client.write of the same pattern would."""
    from types import SimpleNamespace

    lay = dw.Layout(num_layers=2, row_bytes=32, top_k=4, region_stride=4, max_reqs=1, host_rows=100,
                    staging_rows=30)

    class FakeTorch:
        from_numpy = staticmethod(lambda a: a)
        cuda = SimpleNamespace(synchronize=lambda: None)

    class FakeStaging:
        def __init__(self):
            self.a = np.zeros((2, 30, 32), np.uint8)

        def copy_(self, src):
            self.a[...] = src

    class FakeClient:
        def __init__(self):
            self.attachment = SimpleNamespace(staging=FakeStaging())
            self.pool = np.zeros((2, 100, 32), np.uint8)
            self.calls = []

        def write_staged(self, rows, layers=None):
            assert layers is None and rows.dtype == np.int32 and len(rows) <= 30
            self.pool[:, rows] = self.attachment.staging.a[:, : len(rows)]
            self.calls.append(("staged", int(rows[0]), len(rows)))

        def write(self, rows, data, layers=None):
            self.pool[:, rows] = data
            self.calls.append(("write", int(rows[0]), len(rows)))

    c = FakeClient()
    assert dw.fill_through_staging(c, lay, FakeTorch) >= 0
    assert c.calls == [("staged", 0, 30), ("staged", 30, 30), ("staged", 60, 30), ("staged", 90, 10),
                       ("write", 99, 1)]
    block = np.zeros((2, 30, 32), np.uint8)
    dw.fill_pattern(block)
    for r in range(100):
        np.testing.assert_array_equal(c.pool[:, r], block[:, r % 30])


# -- results: derived figures, table, JSON ----------------------------------------------------
def fake_results() -> list[Result]:
    out = []
    for batch in (16, 64):
        for hits in (80.0, 90.0):
            base = 1000.0 * batch / 16
            out.append(Result("gpu", batch, hits, run="graph", p50_us=base / 2, p99_us=base / 2 + 5))
            out.append(Result("inproc", batch, hits, run="graph", p50_us=base, p99_us=base + 10, hit_rate=hits / 100,
                              hit_measured=True, misses_per_step=(1 - hits / 100) * batch * 2048 * 61, fill_s=1.5))
            out.append(Result("doorbell", batch, hits, run="graph", p50_us=base + 122.0, p99_us=base + 200,
                              hit_rate=hits / 100, hit_measured=False,
                              misses_per_step=(1 - hits / 100) * batch * 2048 * 61))
    out.append(Result("zmq", 16, 80.0, skipped="over --budget-s 10"))
    out.append(Result("zmq", 64, 90.0, error="DaemonUnavailable: sparsekvd is gone"))
    return derive(out, 61, 656)


def test_derived_figures_compare_each_mode_with_inproc_of_the_same_config():
    rs = {(r.batch, r.hits, r.mode): r for r in fake_results()}
    db, inproc = rs[(64, 90.0, "doorbell")], rs[(64, 90.0, "inproc")]
    assert db.overhead_us_per_layer == pytest.approx(122.0 / 61)
    assert db.vs_inproc == pytest.approx(db.p50_us / inproc.p50_us)
    assert inproc.inproc_vs_gpu == pytest.approx(2.0)
    assert inproc.gbps == pytest.approx(inproc.misses_per_step * 656 / (inproc.p50_us * 1e-6) / 1e9)
    assert rs[(64, 90.0, "gpu")].gbps is None and rs[(64, 90.0, "gpu")].vs_inproc is None


def test_rounds_merge_into_medians_and_each_rounds_handoff_against_its_own_inproc():
    """--rounds: p50 the median of the rounds' p50s; the daemon mode's overhead per round
    against the inproc of the same round; a failed round is left out; the table and the
    JSON say the spread."""
    rs = []
    for rnd, (inproc, db) in enumerate([(1000.0, 1061.0), (1100.0, 1100.0), (900.0, 1083.0)]):
        rs.append(Result("inproc", 16, 90.0, run="graph", p50_us=inproc, p99_us=inproc + 5, round=rnd,
                         misses_per_step=100.0))
        rs.append(Result("doorbell", 16, 90.0, run="graph", p50_us=db, p99_us=db + 5, round=rnd,
                         misses_per_step=100.0))
    rs.append(Result("doorbell", 16, 90.0, error="daemon died", round=3))
    rs.append(Result("zmq", 16, 90.0, error="refused", round=0))
    merged = derive(combine_rounds(rs, 61), 61, 656)
    by = {r.mode: r for r in merged}
    assert set(by) == {"inproc", "doorbell", "zmq"}
    assert by["inproc"].p50_us == 1000.0 and by["inproc"].round_p50s == (1000.0, 1100.0, 900.0)
    assert by["doorbell"].p50_us == 1083.0 and by["doorbell"].p99_us == 1088.0
    assert by["doorbell"].round_overheads == pytest.approx((1.0, 0.0, 3.0))
    assert by["doorbell"].overhead_us_per_layer == pytest.approx(83.0 / 61)  # medians against medians
    assert by["zmq"].error == "refused"
    d = summary(merged, Options(gather_blocks=32))
    assert d["decode_b16_h90_doorbell_rounds"] == 3
    assert d["decode_b16_h90_doorbell_overhead_us_per_layer_min"] == 0.0
    assert d["decode_b16_h90_doorbell_overhead_us_per_layer_max"] == 3.0
    text = table(merged, Options(gather_blocks=32, rounds=3))
    assert "3 rounds" in text and "+1.00, +0.00, +3.00" in text


def test_json_has_the_headline_keys_at_batch_64_and_90_percent():
    opts = Options(gather_blocks=32)
    d = summary(fake_results(), opts)
    json.dumps(d)  # plain values only
    assert d["decode_reference_config"] == "b64_h90_k2048"
    assert d["doorbell_overhead_us_per_layer"] == pytest.approx(2.0, abs=0.01)
    assert d["doorbell_overhead_paired"] is False  # no --paired: the difference of the p50s
    assert d["decode_daemon_vs_inproc"] == pytest.approx(round((4000 + 122) / 4000, 3))
    assert d["decode_b64_h90_doorbell_p50_us"] == 4122.0
    assert d["decode_b64_h90_inproc_p50_us"] == 4000.0
    assert d["decode_b16_h80_gpu_p99_us"] == 505.0
    assert d["decode_b64_h90_inproc_vs_gpu"] == 2.0
    assert d["decode_b64_h90_doorbell_overhead_us_per_layer"] == 2.0
    assert d["decode_b64_h90_doorbell_hit_rate_measured"] is False
    assert d["decode_b64_inproc_fill_s"] == 1.5
    assert d["decode_b16_h80_zmq_skipped"] == "over --budget-s 10"
    assert d["decode_b64_h90_zmq_error"].startswith("DaemonUnavailable")
    assert d["decode_gather_blocks"] == 32 and d["decode_layers"] == 61
    assert d["doorbell_handoff_us_per_layer"] is None  # no 100 % config ran


def test_the_handoff_alone_is_the_reference_batch_with_nothing_to_gather():
    rs = fake_results()
    rs += derive([Result("inproc", 64, 100.0, run="graph", p50_us=3000.0, p99_us=3010.0),
                  Result("doorbell", 64, 100.0, run="graph", p50_us=3061.0, p99_us=3100.0),
                  Result("inproc", 16, 100.0, run="graph", p50_us=900.0, p99_us=910.0),
                  Result("doorbell", 16, 100.0, run="graph", p50_us=1022.0, p99_us=1100.0)], 61, 656)
    d = summary(rs, Options(gather_blocks=32))
    assert d["decode_reference_config"] == "b64_h90_k2048"
    assert d["doorbell_handoff_us_per_layer"] == pytest.approx(1.0)  # b64's: 61 us over 61 layers
    assert d["doorbell_overhead_us_per_layer"] == pytest.approx(2.0, abs=0.01)
    rs[-1].paired_us_per_layer = rs[-3].paired_us_per_layer = 0.5  # --paired: the paired median
    assert summary(rs, Options(gather_blocks=32))["doorbell_handoff_us_per_layer"] == pytest.approx(0.5)


def test_json_falls_back_to_the_first_config_without_batch_64_at_90_percent():
    rs = [r for r in fake_results() if not (r.batch == 64 and r.hits == 90.0)]
    # Asked for (the default grid) but not run: no headline rather than another config's.
    assert summary(rs, Options(gather_blocks=32))["doorbell_overhead_us_per_layer"] is None
    d = summary(rs, Options(gather_blocks=32, batches=(16,)))
    assert d["decode_reference_config"] == "b16_h80_k2048"
    assert d["doorbell_overhead_us_per_layer"] == pytest.approx(2.0, abs=0.01)
    assert d["decode_daemon_vs_inproc"] == pytest.approx(round(1122 / 1000, 3))
    empty = summary([], Options(gather_blocks=32))
    assert empty["doorbell_overhead_us_per_layer"] is None and empty["decode_daemon_vs_inproc"] is None


def test_table_lists_every_config_in_order_with_notes():
    rs = fake_results()
    rs[0].run = "eager"
    text = table(rs, Options(gather_blocks=32))
    lines = text.splitlines()
    assert lines[0].startswith("sparsekv bench decode: 61 layers, top-k 2048, 656 B rows, context 8192")
    assert "gather_blocks 32" in lines[0]
    for col in ("batch", "hits", "mode", "run", "p50 us", "p99 us", "hit %", "GB/s", "+us/layer", "x inproc",
                "inproc/gpu"):
        assert col in lines[1]
    rows = [ln for ln in lines[2:] if not ln.startswith("note: ")]
    assert len(rows) == 14
    assert [ln.split()[2] for ln in rows[:3]] == ["gpu", "inproc", "doorbell"]  # mode order within a config
    assert [ln.split()[0] for ln in rows].index("64") == 7  # batch 16 first (with its zmq row)
    db = next(ln for ln in rows if ln.split()[:3] == ["64", "90%", "doorbell"])
    assert "4122.0" in db and "+2.00" in db and " 1.03" in db and "90.0~" in db
    assert "skipped: over --budget-s 10" in text and "error: DaemonUnavailable" in text
    assert "generator's target" in text and "capture failed" in text
    assert "zmq: HostSwapIn" not in text  # no zmq row ran: nothing to say how it ran
    rs.append(Result("zmq", 16, 90.0, run="eager", p50_us=5000.0, p99_us=5100.0))
    assert "zmq: HostSwapIn over the socket, the rank with fence events and device wait" in \
        table(rs, Options(gather_blocks=32))


def test_hits_keys_are_names():
    assert dw.hkey(90.0) == "90" and dw.hkey(92.5) == "92p5"


def test_plot_without_matplotlib_says_so_and_skips(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert bd.plot(fake_results(), str(tmp_path / "p.png")) is False
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_plot_writes_a_png_when_matplotlib_is_there(tmp_path):
    pytest.importorskip("matplotlib")
    assert bd.plot(fake_results(), str(tmp_path / "p.png")) is True
    assert (tmp_path / "p.png").stat().st_size > 0


# -- options and the command line -------------------------------------------------------------
def parse(*argv):
    from sparsekv.cli.main import build_parser

    return build_parser().parse_args(["bench", "decode", *argv])


def test_defaults_quick_and_explicit_options():
    o = bd.options_from_args(parse())
    assert (o.batches, o.hits, o.steps, o.modes, o.layers, o.top_k) == (
        (16, 64, 128), (80.0, 90.0, 95.0), 40, ("gpu", "inproc", "doorbell"), 61, 2048)
    q = bd.options_from_args(parse("--quick"))
    assert (q.batches, q.hits, q.steps) == ((16, 64), (90.0, 100.0), 20)
    e = bd.options_from_args(parse("--quick", "--batches", "8,32", "--hits", "0.9,95", "--steps", "5",
                                   "--modes", "zmq,gpu,zmq", "--json", "x.json", "--plot", "p.png"))
    assert (e.batches, e.hits, e.steps, e.modes) == ((8, 32), (90.0, 95.0), 5, ("zmq", "gpu"))
    assert (e.json_path, e.plot_path) == ("x.json", "p.png")


@pytest.mark.parametrize("argv,msg", [
    (["--modes", "gpu,bogus"], "--modes"),
    (["--batches", "0"], "--batches"),
    (["--hits", "120"], "--hits"),
    (["--row-bytes", "650"], "multiple of 16"),
    (["--steps", "-1"], "--steps"),
    (["--context", "2100"], "--context"),
])
def test_bad_options_end_in_one_line_and_exit_2(argv, msg, capsys):
    from sparsekv.cli.main import main

    assert main(["bench", "decode", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sparsekv bench decode:") and msg in err and len(err.splitlines()) == 1


def test_decode_runs_alone(capsys):
    from sparsekv.cli.main import main

    assert main(["bench", "decode", "gather"]) == 2
    assert "decode runs alone" in capsys.readouterr().err


def test_a_list_that_is_not_one_is_an_argparse_error():
    with pytest.raises(SystemExit):
        parse("--batches", "16,x")


# -- the engine-side step code on torch's CPU device ------------------------------------------
@pytest.fixture
def cpu_torch(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(dm, "_device", lambda torch: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return torch


def tiny():
    opts = Options(batches=(3,), hits=(90.0,), layers=3, top_k=64, row_bytes=32, context=256, block_size=16,
                   steps=3, warmup=2, gather_blocks=32).validate()
    lay = dw.make_layout(3, opts)
    wl = generate(3, 0.9, steps=5, layers=3, context=256, top_k=64, block_size=16, seed=5)
    return opts, lay, wl


def expected_out(pool: np.ndarray, rows: np.ndarray, mask=None) -> np.ndarray:
    """[layers, batch]: the sum of every int32 word of every selected row."""
    words = pool.view(np.int32).astype(np.int64)  # [L, R, RB / 4]
    sums = words.sum(axis=2)  # [L, R]
    per = np.take_along_axis(sums[:, None, :], np.maximum(rows, 0).reshape(rows.shape[0], 1, -1), axis=2)
    per = per.reshape(rows.shape)
    if mask is not None:
        per = per * mask
    return per.sum(axis=2)


def test_the_gpu_step_maps_positions_through_the_block_table_and_reads_those_rows(cpu_torch):
    torch = cpu_torch
    opts, lay, wl = tiny()
    pool = np.zeros((3, lay.host_rows, 32), np.uint8)
    pool[:] = np.random.default_rng(0).integers(0, 256, pool.shape, dtype=np.uint8)
    kv32 = torch.from_numpy(pool).view(torch.int32)
    st = dm._Static(torch, lay, opts.blocks)
    inputs = dm._Inputs(torch, wl)
    st.table.copy_(inputs.table)
    step = dm._gpu_step(torch, kv32, st, lay, opts.block_size)
    for t in (0, 3):
        inputs.load(st, t)
        np.testing.assert_array_equal(st.topk.numpy(), wl.topk(t))
        assert st.reset.numpy().tolist() == wl.reset[t].tolist()
        step()
        np.testing.assert_array_equal(st.out.numpy(), expected_out(pool, wl.host_rows_of(t)))


class FakeHandle:
    """The device handle's API on the CPU: indices = host rows, column 0 masked."""

    def __init__(self, torch, pool):
        self.torch, self.pool = torch, torch.from_numpy(pool)
        self.begun = 0
        self.layers: list[int] = []

    def kv(self, layer):
        return self.pool[layer]

    def begin_step(self, state_rows, reset=None, invalidate=None):
        assert invalidate is None and reset.dtype == self.torch.bool
        self.begun += 1

    def swap_in(self, req, table, topk, *, layer, block_size, attention_indices_out):
        assert topk.is_contiguous() and attention_indices_out.is_contiguous()
        blocks = table[req.long()].gather(1, (topk // block_size).long())
        idx = (blocks * block_size + topk % block_size).to(self.torch.int32)
        idx[:, 0] = -1
        attention_indices_out.copy_(idx)
        self.layers.append(layer)
        return attention_indices_out


def test_the_handle_step_calls_begin_once_and_every_layer_in_order_and_masks_minus_one(cpu_torch):
    torch = cpu_torch
    opts, lay, wl = tiny()
    pool = np.random.default_rng(1).integers(0, 256, (3, lay.host_rows, 32), dtype=np.uint8)
    h = FakeHandle(torch, pool)
    st = dm._Static(torch, lay, opts.blocks)
    inputs = dm._Inputs(torch, wl)
    st.table.copy_(inputs.table)
    inputs.load(st, 1)
    dm._handle_step(torch, h, st, lay, opts.block_size)()
    assert h.begun == 1 and h.layers == [0, 1, 2]
    mask = np.ones((3, 3, 64), np.int64)
    mask[:, :, 0] = 0
    np.testing.assert_array_equal(st.out.numpy(), expected_out(pool, wl.host_rows_of(1), mask))


def test_run_sides_times_each_config_and_measures_the_hit_rate(cpu_torch):
    torch = cpu_torch
    opts, lay, _ = tiny()
    workloads = {h: generate(3, h / 100, steps=opts.warmup + opts.steps, layers=3, context=256, top_k=64,
                             block_size=16) for h in (80.0, 90.0)}
    st = dm._Static(torch, lay, opts.blocks)
    calls = []
    counter = iter([(0, 0), (90, 10), (100, 10), (180, 30)])
    out: list = []
    dm._run_sides(torch, [dm._Side("inproc", lambda: calls.append(1), st, counts=lambda: next(counter), fill_s=2.0)],
                  lay, workloads, opts, out, capture=False)
    assert len(calls) == 2 * (opts.warmup + opts.steps)
    assert [(r.mode, r.hits, r.run) for r in out] == [("inproc", 80.0, "eager"), ("inproc", 90.0, "eager")]
    assert out[0].hit_rate == 0.9 and out[0].hit_measured and out[0].misses_per_step == 10 / 3
    assert out[1].hit_rate == 0.8 and out[1].fill_s is None and out[0].fill_s == 2.0
    assert all(r.p50_us >= 0 and r.p99_us >= r.p50_us for r in out)
    # No counters: the generator's target, marked as such.
    out2: list = []
    dm._run_sides(torch, [dm._Side("doorbell", lambda: None, st, counts=lambda: None)], lay, {90.0: workloads[90.0]},
                  opts, out2, capture=False)
    assert out2[0].hit_rate == workloads[90.0].target_hit_rate and not out2[0].hit_measured


def test_paired_sides_run_in_turn_and_report_the_median_per_step_difference(cpu_torch, monkeypatch):
    """--paired: step t of both sides before step t + 1 of either, the first side first on
    even steps and second on odd ones; each side's p50 from its own steps, the doorbell's
    paired figure the median of its per-step differences to inproc, per layer; counters
    and checks per side."""
    import types

    torch = cpu_torch
    opts, lay, _ = tiny()
    workloads = {90.0: generate(3, 0.9, steps=opts.warmup + opts.steps, layers=3, context=256, top_k=64,
                                block_size=16)}
    clock = [0.0]
    monkeypatch.setattr(dm, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    calls = []
    inproc_us = [100.0, 400.0, 100.0, 300.0, 200.0]  # warm-up 2, then 3 timed
    db_us = [130.0, 430.0, 160.0, 309.0, 221.0]  # timed differences: +60, +9, +21

    def side(name, per_step):
        def step():
            calls.append(name)
            clock[0] += per_step[sum(c == name for c in calls) - 1] * 1e-6
        return step

    sides = [dm._Side("inproc", side("i", inproc_us), dm._Static(torch, lay, opts.blocks),
                      counts=lambda: (len(calls), 0), huge_pct=97),
             dm._Side("doorbell", side("d", db_us), dm._Static(torch, lay, opts.blocks),
                      check=lambda: (_ for _ in ()).throw(RuntimeError("refused row")))]
    out: list = []
    dm._run_sides(torch, sides, lay, workloads, opts, out, capture=False)
    assert calls == ["i", "d", "d", "i", "i", "d", "d", "i", "i", "d"]
    inproc, db = out
    assert (inproc.mode, db.mode) == ("inproc", "doorbell")
    assert inproc.p50_us == pytest.approx(200.0) and db.p50_us == pytest.approx(221.0)
    assert db.paired_us_per_layer == pytest.approx(21.0 / 3) and inproc.paired_us_per_layer is None
    assert inproc.hit_measured and not db.hit_measured  # counters of the inproc side only
    assert inproc.error is None and db.error == "RuntimeError: refused row"
    assert (inproc.huge_pct, db.huge_pct) == (97, None)  # each side's pool, with its first config
    d = summary(derive(combine_rounds(out, 3), 3, 656), Options(gather_blocks=32, paired=True))
    assert d["decode_b3_inproc_pool_huge_pct"] == 97 and "decode_b3_doorbell_pool_huge_pct" not in d


def test_paired_figures_merge_over_rounds_into_the_json_and_the_table():
    rs = []
    for rnd, pv in enumerate([1.5, -0.5, 4.0]):
        rs.append(Result("inproc", 64, 90.0, run="graph", p50_us=1000.0, p99_us=1000.0, round=rnd))
        rs.append(Result("doorbell", 64, 90.0, run="graph", p50_us=1100.0, p99_us=1100.0, round=rnd,
                         paired_us_per_layer=pv))
    merged = derive(combine_rounds(rs, 61), 61, 656)
    db = next(r for r in merged if r.mode == "doorbell")
    assert db.paired_us_per_layer == 1.5 and db.round_paired == (1.5, -0.5, 4.0)
    opts = Options(gather_blocks=32, paired=True)
    d = summary(merged, opts)
    assert d["decode_b64_h90_doorbell_paired_overhead_us_per_layer"] == 1.5 and d["decode_paired"] is True
    # The headline takes the paired median (the p50s differ by 100 us / 61 layers = 1.64).
    assert d["decode_b64_h90_doorbell_overhead_us_per_layer"] == pytest.approx(1.64, abs=0.01)
    assert d["doorbell_overhead_us_per_layer"] == 1.5 and d["doorbell_overhead_paired"] is True
    assert "decode_b64_h90_inproc_paired_overhead_us_per_layer" not in d
    text = table(merged, opts)
    assert "median of the per-step differences +1.50 us/layer (rounds +1.50, -0.50, +4.00)" in text


def test_paired_needs_inproc_and_doorbell_and_a_failure_marks_every_mode_it_left(monkeypatch, capsys):
    with pytest.raises(ValueError, match="--paired"):
        Options(modes=("gpu", "doorbell"), paired=True, **SMALL).validate()
    a = parse("--paired", "--modes", "inproc,doorbell,zmq", "--quick")
    assert bd.options_from_args(a).paired is True
    assert bd.options_from_args(parse("--quick")).paired is False
    opts = Options(batches=(4,), hits=(80.0, 90.0), modes=("inproc", "doorbell", "zmq"), paired=True,
                   **SMALL).validate()
    monkeypatch.setattr(bd, "_free", lambda torch: None)

    def half(torch, lay, workloads, opts, out, daemon_first=False):  # one config timed, then the daemon went away
        out.append(Result("inproc", 4, 80.0, run="graph", p50_us=1.0, p99_us=1.0))
        out.append(Result("doorbell", 4, 80.0, run="graph", p50_us=2.0, p99_us=2.0))
        raise RuntimeError("daemon\ngone")

    monkeypatch.setattr(bd, "run_paired", half)
    out: list = []
    bd._run_batch_modes(None, 4, dw.make_layout(4, opts), {80.0: None, 90.0: None}, opts, out, gpu=False)
    left = sorted((r.mode, r.hits, r.error) for r in out if r.error)
    assert left == [("doorbell", 90.0, "RuntimeError: daemon gone"), ("inproc", 90.0, "RuntimeError: daemon gone"),
                    ("zmq", 80.0, "RuntimeError: daemon gone"), ("zmq", 90.0, "RuntimeError: daemon gone")]
    assert "batch 4 paired" in capsys.readouterr().err


def test_control_is_a_second_inproc_pool_compared_like_the_doorbell_and_needs_paired(monkeypatch):
    """--control: inproc2 gets the paired figure, the ratios and the per-round spread
    against inproc like a daemon mode; the JSON's decode_pool_control_us_per_layer is its
    paired figure at the reference config; the table explains it; a failed paired run
    marks it too."""
    with pytest.raises(ValueError, match="--control .* needs --paired"):
        Options(control=True, **SMALL).validate()
    assert bd.options_from_args(parse("--quick", "--paired", "--control")).control is True
    rs = []
    for rnd, (pc, pd) in enumerate([(0.4, 2.0), (-0.2, 3.0)]):
        rs.append(Result("inproc", 64, 90.0, run="graph", p50_us=1000.0, p99_us=1000.0, round=rnd))
        rs.append(Result(dw.CONTROL, 64, 90.0, run="graph", p50_us=1061.0, p99_us=1070.0, round=rnd,
                         paired_us_per_layer=pc))
        rs.append(Result("doorbell", 64, 90.0, run="graph", p50_us=1122.0, p99_us=1130.0, round=rnd,
                         paired_us_per_layer=pd))
    merged = derive(combine_rounds(rs, 61), 61, 656)
    ctl = next(r for r in merged if r.mode == dw.CONTROL)
    assert ctl.vs_inproc == pytest.approx(1.061) and ctl.overhead_us_per_layer == pytest.approx(1.0)
    assert ctl.round_overheads == pytest.approx((1.0, 1.0)) and ctl.paired_us_per_layer == pytest.approx(0.1)
    opts = Options(gather_blocks=32, paired=True, control=True)
    d = summary(merged, opts)
    assert d["decode_pool_control_us_per_layer"] == pytest.approx(0.1) and d["decode_control"] is True
    assert d["doorbell_overhead_us_per_layer"] == pytest.approx(2.5)  # the doorbell's, not the control's
    assert "decode_pool_control_us_per_layer" not in summary(merged[:1] + merged[2:], opts)
    text = table(merged, opts)
    rows = [line.split()[2] for line in text.splitlines()[2:] if not line.startswith("note")]
    assert rows == ["inproc", dw.CONTROL, "doorbell"]
    assert "what two pools alone differ by" in text

    monkeypatch.setattr(bd, "_free", lambda torch: None)
    monkeypatch.setattr(bd, "run_paired", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no memory")))
    opts = Options(batches=(4,), hits=(90.0,), modes=("inproc", "doorbell"), paired=True, control=True,
                   **SMALL).validate()
    out: list = []
    bd._run_batch_modes(None, 4, dw.make_layout(4, opts), {90.0: None}, opts, out, gpu=False)
    assert sorted(r.mode for r in out if r.error == "RuntimeError: no memory") == ["doorbell", "inproc", dw.CONTROL]


def test_paired_run_opens_the_control_pool_and_closes_every_handle(monkeypatch):
    """run_paired with --control hands both in-process sides, inproc first, to the doorbell
    run and closes both handles afterwards, also when the doorbell run fails; a failure
    opening the second closes the first."""
    import types

    opened, closed = [], []

    def fake_open(torch, lay, opts, mode="inproc"):
        if mode in fail_open:
            raise RuntimeError(f"cannot open {mode}")
        opened.append(mode)
        return dm._Side(mode, None, None, handle=types.SimpleNamespace(close=lambda: closed.append(mode)))

    seen = []

    def fake_doorbell(torch, lay, workloads, opts, out, paired_with=None):
        seen.append([s.mode for s in paired_with])
        raise RuntimeError("daemon gone")

    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=lambda: None))
    monkeypatch.setattr(dm, "_open_inproc", fake_open)
    monkeypatch.setattr(dm, "run_doorbell", fake_doorbell)
    opts = Options(modes=("inproc", "doorbell"), paired=True, control=True, **SMALL)
    fail_open: tuple = ()
    with pytest.raises(RuntimeError, match="daemon gone"):
        dm.run_paired(torch, None, {}, opts, [])
    assert seen == [["inproc", dw.CONTROL]] and sorted(closed) == sorted(opened) == ["inproc", dw.CONTROL]
    opened.clear(), closed.clear()
    fail_open = (dw.CONTROL,)
    with pytest.raises(RuntimeError, match="cannot open"):
        dm.run_paired(torch, None, {}, opts, [])
    assert opened == closed == ["inproc"]
    # daemon_first: the sides are opened by the doorbell run (once the daemon's pool is
    # made), through what it is handed; they are closed all the same.
    opened.clear(), closed.clear()
    fail_open = ()

    def late_doorbell(torch, lay, workloads, opts, out, paired_with=None):
        assert callable(paired_with) and opened == []
        seen.append([s.mode for s in paired_with()])

    monkeypatch.setattr(dm, "run_doorbell", late_doorbell)
    dm.run_paired(torch, None, {}, opts, [], daemon_first=True)
    assert seen[-1] == ["inproc", dw.CONTROL] and sorted(closed) == ["inproc", dw.CONTROL]


def test_paired_rounds_alternate_which_pool_is_made_first(monkeypatch):
    """--paired --rounds 4: rounds 2 and 4 make the daemon's pool before the in-process
    ones (host memory handed out later can be slower), rounds 1 and 3 after."""
    firsts = []

    def fake_paired(torch, lay, workloads, opts, out, daemon_first=False):
        firsts.append(daemon_first)
        for h in workloads:
            out += [Result(m, lay.max_batch, h, run="graph", p50_us=1000.0, p99_us=1000.0) for m in ("inproc", "doorbell")]

    torch = _fake_modes(monkeypatch, lambda mode: 1000.0)
    monkeypatch.setattr(bd, "run_paired", fake_paired)
    opts = Options(batches=(4,), hits=(90.0,), rounds=4, paired=True, modes=("inproc", "doorbell"), **SMALL).validate()
    bd.run(opts, torch)
    assert firsts == [False, True, False, True]


def test_a_failing_mode_becomes_error_rows_and_the_run_goes_on(capsys):
    out: list = [Result("inproc", 16, 80.0, run="graph", p50_us=1.0, p99_us=1.0)]

    def boom():
        raise RuntimeError("arena\ntoo small")

    dm.guarded(out, "inproc", 16, {80.0: None, 90.0: None}, boom)
    assert [(r.hits, r.error) for r in out[1:]] == [(90.0, "RuntimeError: arena too small")]
    assert "batch 16 inproc failed" in capsys.readouterr().err


def _fake_modes(monkeypatch, ran):
    """run()'s gpu, inproc and doorbell modes faked: each calls ``ran(mode)`` and gives
    every hit rate a graph row of that p50. Returns a stand-in for torch."""
    def fake(mode):
        def run_mode(torch, lay, workloads, opts, out):
            p50 = ran(mode)
            for h in workloads:
                out.append(Result(mode, lay.max_batch, h, run="graph", p50_us=p50, p99_us=1100.0))
        return run_mode

    for mode in ("gpu", "inproc", "doorbell"):
        monkeypatch.setattr(bd, f"run_{mode}", fake(mode))
    monkeypatch.setattr(bd, "_free", lambda torch: None)
    monkeypatch.setattr(bd, "generate", lambda *a, **k: None)
    return type("T", (), {"cuda": type("C", (), {"set_device": staticmethod(lambda d: None)})})


def test_run_alternates_the_modes_for_each_round_and_the_gpu_baseline_once(monkeypatch):
    """run() with --rounds 3: inproc and the daemon modes three times each, in turn, the
    all-on-GPU mode once; what comes out is one merged row per config."""
    calls = []

    def ran(mode):
        calls.append(mode)
        return 1000.0 + len(calls)

    torch = _fake_modes(monkeypatch, ran)
    opts = Options(batches=(4,), hits=(90.0,), rounds=3, **SMALL).validate()
    rs = bd.run(opts, torch)
    assert calls == ["gpu", "inproc", "doorbell", "inproc", "doorbell", "inproc", "doorbell"]
    by = {r.mode: r for r in rs}
    assert set(by) == {"gpu", "inproc", "doorbell"}
    assert len(by["inproc"].round_p50s) == 3 and len(by["gpu"].round_p50s) == 1
    assert by["doorbell"].round_overheads == pytest.approx((1 / SMALL["layers"],) * 3)


# -- the whole benchmark, tiny, on a GPU ------------------------------------------------------
@pytest.mark.cuda
def test_a_tiny_run_on_the_gpu(tmp_path):
    import torch

    opts = Options(batches=(2, 4), hits=(90.0,), layers=2, top_k=64, row_bytes=656, context=256, block_size=16,
                   steps=3, warmup=2, modes=("gpu", "inproc", "doorbell", "prefetch", "zmq"),
                   daemon_log=str(tmp_path / "sparsekvd.log")).validate()
    results = bd.run(opts, torch)
    by = {(r.batch, r.mode): r for r in results}
    keep = round(0.9 * 64) / 64
    for batch in (2, 4):
        for mode in ("gpu", "inproc", "doorbell", "prefetch"):
            r = by[(batch, mode)]
            assert r.ok, (mode, r.error, (tmp_path / "sparsekvd.log").read_text()[-2000:])
            assert r.run == "graph", mode
        # A region above top-k (the prefetch mode's) keeps some older rows too: at least
        # the kept share hits, the same in process and through the daemon (one contract).
        assert by[(batch, "inproc")].hit_rate >= keep and by[(batch, "inproc")].hit_measured
        assert by[(batch, "doorbell")].hit_rate == by[(batch, "inproc")].hit_rate
        assert by[(batch, "zmq")].ok, by[(batch, "zmq")].error
        pf = by[(batch, "prefetch")]  # layer overlap 0.85: layer 1 found rows layer 0 prefetched
        assert pf.prefetched > 0 and pf.hidden_share > 0, (pf.prefetched, pf.prefetch_hits, pf.misses)
        assert pf.hit_rate > by[(batch, "doorbell")].hit_rate
    d = summary(results, opts)
    json.dumps(d)
    assert d["decode_reference_config"] == "b2_h90_k64"
    assert d["decode_b4_h90_doorbell_p50_us"] > 0
    print(table(results, opts))


@pytest.mark.cuda
def test_a_tiny_paired_run_on_the_gpu(tmp_path):
    """--paired --control on the GPU: two inproc handles and the doorbell rank set up at
    once, all captured, timed in turn; the same hit rate on each side, and the paired
    figures."""
    import torch

    opts = Options(batches=(2,), hits=(90.0,), layers=2, top_k=64, row_bytes=656, context=256, block_size=16,
                   steps=4, warmup=2, modes=("inproc", "doorbell"), paired=True, control=True,
                   daemon_log=str(tmp_path / "sparsekvd.log")).validate()
    by = {r.mode: r for r in bd.run(opts, torch)}
    keep = round(0.9 * 64) / 64
    for mode in ("inproc", dw.CONTROL, "doorbell"):
        r = by[mode]
        assert r.ok, (mode, r.error, (tmp_path / "sparsekvd.log").read_text()[-2000:])
        assert r.run == "graph" and r.hit_rate == pytest.approx(keep), mode
    assert by["doorbell"].paired_us_per_layer is not None and by["inproc"].paired_us_per_layer is None
    assert by[dw.CONTROL].paired_us_per_layer is not None
    d = summary(list(by.values()), opts)
    assert d["decode_b2_h90_doorbell_paired_overhead_us_per_layer"] is not None
    assert d["decode_pool_control_us_per_layer"] is not None


def test_budget_skips_later_batches_and_rounds_and_each_batch_is_handed_over(monkeypatch):
    """--budget-s: no batch size (or later round) starts once the budget is spent; its
    configs are marked skipped. on_batch sees the results after each batch size."""
    clock = [0.0]
    monkeypatch.setattr(bd.time, "monotonic", lambda: clock[0])

    def ran(mode):
        clock[0] += 40.0  # each mode takes 40 s
        return 1000.0

    torch = _fake_modes(monkeypatch, ran)
    seen = []
    opts = Options(batches=(4, 8), hits=(90.0,), rounds=2, budget_s=100.0, **SMALL).validate()
    rs = bd.run(opts, torch, on_batch=lambda got: seen.append(sorted((r.batch, r.mode) for r in got)))
    # batch 4: round 1 (gpu, inproc, doorbell: 120 s) ran, round 2 did not start; batch 8: skipped.
    b4 = {r.mode: r for r in rs if r.batch == 4}
    assert all(r.ok and len(r.round_p50s) == 1 for r in b4.values()) and set(b4) == {"gpu", "inproc", "doorbell"}
    b8 = [r for r in rs if r.batch == 8]
    assert sorted(r.mode for r in b8) == ["doorbell", "gpu", "inproc"]
    assert all(r.skipped == "over --budget-s 100" and not r.ok for r in b8)
    assert len(seen) == 1 and seen[0] == [(4, "doorbell"), (4, "gpu"), (4, "inproc")]
    d = summary(rs, opts)
    assert d["decode_b8_h90_inproc_skipped"] == "over --budget-s 100"
    with pytest.raises(ValueError, match="--budget-s"):
        Options(budget_s=0.0, **SMALL).validate()
    assert bd.options_from_args(parse("--quick", "--budget-s", "300")).budget_s == 300.0


# -- prefetch mode ----------------------------------------------------------------------------
def test_prefetch_is_measured_against_the_doorbell_and_the_gpu_with_its_hidden_share():
    """A prefetch row gets its p50 over the doorbell's and over gpu's of the same config,
    the share of misses its hits took off the critical path; the JSON names the headline
    by the layer overlap, and the table says both."""
    rs = fake_results()
    db = next(r for r in rs if (r.batch, r.hits, r.mode) == (64, 90.0, "doorbell"))
    pf = Result("prefetch", 64, 90.0, run="graph", p50_us=db.p50_us * 0.9, p99_us=db.p50_us, hit_rate=0.97,
                hit_measured=True, misses_per_step=100.0, misses=600, prefetch_hits=2400, prefetched=3000,
                prefetch_wasted=500)
    rs = derive(rs + [pf], 61, 656)
    assert pf.vs_doorbell == pytest.approx(0.9)
    assert pf.vs_gpu == pytest.approx(db.p50_us * 0.9 / 2000.0)
    assert db.vs_gpu == pytest.approx(db.p50_us / 2000.0) and db.vs_doorbell is None
    assert pf.hidden_share == pytest.approx(2400 / 3000)
    assert db.hidden_share is None
    opts = Options(gather_blocks=32, layer_overlap=0.7, modes=("gpu", "inproc", "doorbell", "prefetch"))
    d = summary(rs, opts)
    assert d["decode_prefetch_hidden_share_o70"] == 0.8
    assert d["decode_prefetch_vs_doorbell_o70"] == 0.9
    assert d["decode_prefetch_vs_gpu_o70"] == round(pf.vs_gpu, 3)
    assert d["decode_doorbell_vs_gpu_o70"] == round(db.vs_gpu, 3)
    assert d["decode_b64_h90_prefetch_prefetch_wasted"] == 500
    assert d["decode_b64_h90_doorbell_vs_gpu"] == round(db.vs_gpu, 3)
    text = table(rs, opts)
    assert "80.0 % of the misses fetched off the critical path (2400 of 3000; 500 prefetched" in text
    assert "x doorbell 0.900" in text
    assert d["decode_prefetch_config_o70"] == "b64_h90_k2048"
    # Without a prefetch row: no headline prefetch keys; without batch 64 at 90 %: the first.
    assert not [k for k in summary(derive(fake_results(), 61, 656), opts) if "prefetch" in k]
    pf16 = Result("prefetch", 16, 80.0, run="graph", p50_us=900.0, p99_us=950.0, misses=1, prefetch_hits=3)
    d = summary(derive(fake_results() + [pf16], 61, 656), opts)
    assert d["decode_prefetch_config_o70"] == "b16_h80_k2048" and d["decode_prefetch_hidden_share_o70"] == 0.75


def test_run_sides_reads_the_prefetch_counters(cpu_torch):
    torch = cpu_torch
    opts, lay, _ = tiny()
    wl = generate(3, 0.9, steps=opts.warmup + opts.steps, layers=3, context=256, top_k=64, block_size=16)
    st = dm._Static(torch, lay, opts.blocks)
    counter = iter([(0, 0, 0, 0, 0), (95, 5, 40, 50, 7)])
    out: list = []
    dm._run_sides(torch, [dm._Side("prefetch", lambda: None, st, counts=lambda: next(counter))], lay, {90.0: wl},
                  opts, out, capture=False)
    r = out[0]
    assert (r.misses, r.prefetch_hits, r.prefetched, r.prefetch_wasted) == (5, 40, 50, 7)
    assert r.hit_rate == 0.95 and r.hidden_share == pytest.approx(40 / 45)


def test_the_prefetch_mode_gets_a_region_above_top_k_for_every_offloaded_mode(capsys):
    """A prefetch never evicts a row of the region's latest resolve: with the prefetch mode
    the region defaults to top-k + top-k / 4 (for every offloaded mode: one layout), and a
    region of top-k is refused; without it the region stays top-k."""
    from sparsekv.cli.main import main

    assert Options(**SMALL).validate().region == 256
    opts = Options(modes=("gpu", "inproc", "doorbell", "prefetch"), **SMALL).validate()
    assert opts.region == 320 and dw.make_layout(4, opts).region_stride == 320
    assert Options(modes=("doorbell", "prefetch"), region_rows=512, **SMALL).validate().region == 512
    assert main(["bench", "decode", "--modes", "doorbell,prefetch", "--region-rows", "2048"]) == 2
    assert "needs rows above top-k 2048" in capsys.readouterr().err
    assert main(["bench", "decode", "--region-rows", "100"]) == 2
    assert "--region-rows must be >= top-k" in capsys.readouterr().err


def test_prefetch_needs_the_doorbell_mode(capsys):
    from sparsekv.cli.main import main

    assert main(["bench", "decode", "--modes", "gpu,prefetch"]) == 2
    err = capsys.readouterr().err
    assert "--modes prefetch" in err and "doorbell" in err


def test_the_prefetch_rank_joins_before_the_doorbell_rank_leaves_and_runs_alone(monkeypatch):
    """run_doorbell with prefetch: after the doorbell rank's run, a rank of its own attaches
    to the same engine with prefetch on (the pool kept: the doorbell rank is still
    attached), then the doorbell rank detaches and the prefetch rank runs, then leaves;
    with zmq the zmq rank, attached first, runs last."""
    events = []
    refuse_prefetch = False

    class FakeDaemon:
        def __init__(self, **kw):
            self.run_dir = "/nowhere"

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    class FakeClient:
        def __init__(self, run_dir, rank, **kw):
            self.rank = rank

        def connect(self):
            return self

        def close(self):
            pass

        def attach(self, lay, engine, transport="zmq", prefetch=False, fence=False):
            if prefetch and refuse_prefetch:
                raise RuntimeError("prefetch refused")
            events.append(("attach", self.rank, transport, prefetch))

        def detach(self):
            events.append(("detach", self.rank))

        def stats(self):
            return {}

    def fake_rank(torch, c, lay, workloads, opts, out, fill_s, paired_with=None, huge_pct=None, mode="doorbell"):
        events.append(("run", mode, c.rank))

    monkeypatch.setattr(dm, "PrivateDaemon", FakeDaemon)
    monkeypatch.setattr(dm, "Client", FakeClient)
    monkeypatch.setattr(dm, "fill_through_staging", lambda *a, **k: 0.5)
    monkeypatch.setattr(dm, "_run_doorbell_rank", fake_rank)
    monkeypatch.setattr(dm, "_run_zmq_rank", lambda *a, **k: events.append(("run", "zmq", 1)))
    monkeypatch.setattr(dm, "HostSwapIn", lambda c: None)
    opts = Options(modes=("doorbell", "prefetch"), **SMALL).validate()
    lay = dw.make_layout(4, opts)
    dm.run_doorbell(None, lay, {90.0: None}, opts, [])
    assert events == [("attach", 0, "doorbell", False), ("run", "doorbell", 0), ("attach", 1, "doorbell", True),
                      ("detach", 0), ("run", "prefetch", 1), ("detach", 1)]
    events.clear()
    opts = Options(modes=("doorbell", "prefetch", "zmq"), **SMALL).validate()
    dm.run_doorbell(None, lay, {90.0: None}, opts, [])
    assert events == [("attach", 1, "zmq", False), ("attach", 0, "doorbell", False), ("run", "doorbell", 0),
                      ("attach", 2, "doorbell", True), ("detach", 0), ("run", "prefetch", 2), ("detach", 2),
                      ("run", "zmq", 1)]
    # A prefetch rank refused: error rows for the prefetch only; the doorbell rank still
    # leaves before the zmq rank runs.
    events.clear()
    refuse_prefetch = True
    out: list = []
    dm.run_doorbell(None, lay, {90.0: None}, opts, out)
    assert events == [("attach", 1, "zmq", False), ("attach", 0, "doorbell", False), ("run", "doorbell", 0),
                      ("detach", 0), ("run", "zmq", 1)]
    assert [(r.mode, r.error) for r in out] == [("prefetch", "RuntimeError: prefetch refused")]
