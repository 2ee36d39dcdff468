"""``sparsekv bench serve``: the parts of its step at the tiny preset on torch's CPU device
(rows, sparse MLA, the grouped MoE, the indexer), its headline keys, its configs, the per-part times' replays; on a GPU (``cuda``) the FP8 / Triton paths
against the torch ones. The step and its rows: test_bench_serve_step.py."""

import math
import time

import numpy as np
import pytest

from sparsekv.bench.decode_workload import generate
from sparsekv.bench.serve_report import PARTS, Result, summary

torch = pytest.importorskip("torch")

from sparsekv.bench import serve_model as sm  # noqa: E402
from sparsekv.bench import serve_modes  # noqa: E402

TINY = sm.PRESETS["tiny"]


@pytest.fixture
def cpu_ops():
    return sm.Ops("cpu", torch.float32, fast=False)


def test_fp8_ds_mla_rows_are_656_bytes_and_unpack_to_what_was_packed():
    assert sm.PRESETS["v32"].row_bytes == 656
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(5, 7, TINY.kv_lora + TINY.rope, generator=gen)
    rows = sm.pack_rows(kv, TINY)
    assert rows.dtype == torch.uint8 and rows.shape == (5, 7, TINY.row_bytes)
    back = sm.unpack_rows(rows, TINY, torch.float32)
    lat_err = (back[..., :TINY.kv_lora] - kv[..., :TINY.kv_lora]).abs().max() / kv[..., :TINY.kv_lora].abs().max()
    assert lat_err < 0.07  # e4m3: 3 mantissa bits
    assert torch.allclose(back[..., TINY.kv_lora:], kv[..., TINY.kv_lora:], rtol=1e-2, atol=1e-2)  # bf16


def test_sparse_mla_over_dequantised_rows_equals_dense_attention_restricted_to_the_top_k():
    gen = torch.Generator().manual_seed(1)
    B, C, H, K = 3, 40, TINY.heads, TINY.top_k
    rows = sm.pack_rows(torch.randn(B, C, TINY.kv_lora + TINY.rope, generator=gen), TINY)
    q = torch.randn(B, H, TINY.kv_lora + TINY.rope, generator=gen)
    topk = torch.stack([torch.randperm(C, generator=gen)[:K] for _ in range(B)])
    topk[0, -3:] = -1  # masked columns
    picked = torch.stack([rows[b, topk[b].clamp(min=0)] for b in range(B)])
    got = sm.sparse_mla(q, picked, topk >= 0, TINY, torch.float32)
    # dense reference in float64 over every position, those outside the top-k masked
    kv = sm.unpack_rows(rows, TINY, torch.float64)
    s = torch.einsum("bhd,bcd->bhc", q.double(), kv) / math.sqrt(TINY.nope + TINY.rope)
    keep = torch.zeros(B, C, dtype=torch.bool)
    for b in range(B):
        keep[b, topk[b][topk[b] >= 0]] = True
    p = torch.softmax(s.masked_fill(~keep[:, None, :], float("-inf")), -1)
    want = torch.einsum("bhc,bcd->bhd", p, kv[..., :TINY.kv_lora])
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-5)


def test_grouped_experts_equal_a_loop_over_the_experts(cpu_ops):
    gen = torch.Generator().manual_seed(2)
    lin = cpu_ops.lin((4, 24, 32), gen)
    counts = [5, 1, 3]  # the fourth expert gets none
    x = torch.randn(sum(counts), 32, generator=gen)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    got = cpu_ops.grouped(x, lin, offs, counts)
    starts = [0, 5, 6]
    want = torch.cat([x[s:s + n] @ lin.w[g].t() for g, (s, n) in enumerate(zip(starts, counts))]) * lin.scale
    assert cpu_ops.grouped_kind == "grouped"
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_moe_is_the_shared_expert_plus_the_mean_of_each_tokens_routed_experts(cpu_ops):
    m = sm.Model.build(TINY, cpu_ops)
    B = 3
    state = sm.BatchState(TINY, B, 32, "cpu")
    assert state.counts == TINY.expert_counts(B) == [2, 2, 1, 1]  # 6 pairs over 4 experts, balanced
    h = torch.randn(B, TINY.hidden, generator=torch.Generator().manual_seed(3))
    got = m.moe(h, state.offs, state.counts)

    def ffn(x, up, down):  # one expert, as a plain matmul chain
        g, u = (x @ up.t() / math.sqrt(up.shape[1])).chunk(2, -1)
        return (torch.nn.functional.silu(g) * u) @ down.t() / math.sqrt(down.shape[1])

    expert_of = np.repeat(np.arange(4), state.counts)  # pair r = (replica r // B, token r % B)
    want = ffn(h, m.w["shared_up"].w, m.w["shared_down"].w)
    for b in range(B):
        routed = [ffn(h[b:b + 1], m.w["experts_up"].w[e], m.w["experts_down"].w[e])
                  for e in expert_of[b::B]]
        want[b] += torch.cat(routed).mean(0)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def test_the_indexer_is_relu_of_each_heads_dot_product_weighted_summed_and_scaled(cpu_ops):
    gen = torch.Generator().manual_seed(4)
    B, T, Hi, D = 2, 50, TINY.idx_heads, TINY.idx_dim
    q, w = torch.randn(B, Hi, D, generator=gen), torch.rand(B, Hi, generator=gen)
    keys, ks = sm.quant_keys(torch.randn(B, T, D, generator=gen))
    got = cpu_ops.indexer(q, w, keys, ks)
    want = torch.zeros(B, T)
    for b in range(B):
        for t in range(T):
            want[b, t] = ks[b, t] * sum(w[b, h] * max(0.0, float(q[b, h] @ keys[b, t].float())) for h in range(Hi))
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    assert torch.allclose(sm.indexer_reference(q, w, keys, ks), want, rtol=1e-4, atol=1e-4)


def test_headline_keys_are_the_ratios_of_the_right_configs():
    caps = {32768: {"gpu": 21, "offload": 96}, 131072: {"gpu": 5, "offload": 29}}

    def r(mode, ctx, batch, p50):
        return Result(mode, ctx, batch, p50_us=p50, p50_at_bound_us=p50 / 2)

    results = [r("gpu", 32768, 1, 20000.0), r("inproc", 32768, 1, 20500.0), r("daemon", 32768, 1, 21000.0),
               r("gpu", 32768, 64, 30000.0), r("inproc", 32768, 64, 40000.0), r("daemon", 32768, 64, 40400.0),
               r("gpu", 131072, 5, 22000.0), r("daemon", 131072, 29, 29000.0), r("inproc", 131072, 29, 28000.0)]
    f = summary(results, caps, 32768, {})
    assert f["serve_offload_vs_gpu_tpot_b1"] == f["serve_offload_vs_gpu_tpot_b1_32k"] == 1.05  # the daemon's
    assert f["serve_offload_vs_gpu_tpot_b64_32k"] == round(40400 / 30000, 4)
    assert f["serve_daemon_vs_inproc"] == 1.01
    assert f["serve_throughput_gain_128k"] == round((29 / 29000) / (5 / 22000), 3)
    assert "serve_throughput_gain_32k" not in f  # neither ran at its largest batch
    assert f["serve_max_batch_offload_128k"] == 29


# -- on a GPU --------------------------------------------------------------------------------
@pytest.mark.cuda
def test_the_fp8_and_triton_paths_pass_their_checks_on_the_gpu():
    ops = sm.Ops("cuda", torch.bfloat16, fast=True)
    assert ops.fp8_mm and ops.grouped_kind == "scaled" and ops.triton_indexer and ops.triton_mla, ops.impl
    assert ops.triton_write, ops.impl
    gen = torch.Generator("cuda").manual_seed(5)
    q = torch.randn(3, 64, 128, generator=gen, device="cuda").to(sm.FP8)
    keys, ks = sm.quant_keys(torch.randn(3, 1000, 128, generator=gen, device="cuda"))
    w = torch.rand(3, 64, generator=gen, device="cuda")
    got = ops.indexer(q.to(torch.bfloat16), w, keys, ks)
    want = sm.indexer_reference(q, w, keys, ks)
    assert torch.allclose(got, want, rtol=2e-3, atol=2e-3 * float(want.abs().max()))



@pytest.mark.cuda
def test_the_new_rows_and_keys_kernels_write_what_the_torch_path_writes_and_nothing_else():
    """Batch 64 (several programs), rows strided as the split projection gives them, every
    byte of the destinations around them left as it was."""
    from sparsekv.bench import serve_triton

    sh, B = sm.PRESETS["v32"], 64
    gen = torch.Generator("cuda").manual_seed(6)
    a = (4 * torch.randn(B, sh.a_out, generator=gen, device="cuda")).to(torch.bfloat16)
    ckv = a[:, sh.q_lora:sh.q_lora + sh.kv_lora + sh.rope]
    kv = torch.full((2, B + 3, sh.row_bytes), 0x5A, dtype=torch.uint8, device="cuda")
    serve_triton.pack_rows(ckv, kv[1, 2:2 + B], sh.kv_lora, sm.LATENT_TILE)
    want = sm.pack_rows(torch.cat([sm.rms(ckv[:, :sh.kv_lora]), ckv[:, sh.kv_lora:]], -1), sh)
    got = kv[1, 2:2 + B]
    tiles = sh.kv_lora // sm.LATENT_TILE
    assert torch.equal(got[:, sh.kv_lora + 4 * tiles:], want[:, sh.kv_lora + 4 * tiles:])  # the rope, as it was
    sg, sw = (r[:, sh.kv_lora:sh.kv_lora + 4 * tiles].view(torch.float32) for r in (got, want))
    assert torch.allclose(sg, sw, rtol=1e-2)  # (the norm's factor in bf16: it may round the other way)
    # the fp8 latent: a value may round to the neighbouring code where the two paths' divisions differ
    diff = (sm.unpack_rows(got, sh, torch.float32) - sm.unpack_rows(want, sh, torch.float32)).abs()
    assert float(diff.max()) <= 0.07 * float(sm.unpack_rows(want, sh, torch.float32).abs().max())
    assert float((got[:, :sh.kv_lora] != want[:, :sh.kv_lora]).float().mean()) < 0.01
    assert bool((kv[0] == 0x5A).all()) and bool((kv[1, :2] == 0x5A).all()) and bool((kv[1, 2 + B:] == 0x5A).all())
    keys = torch.zeros((B, 7, sh.idx_dim), dtype=sm.FP8, device="cuda")
    scale = torch.zeros((B, 7), device="cuda")
    k = a[:, sh.q_lora + sh.kv_lora + sh.rope:][:, :sh.idx_dim]
    serve_triton.quant_keys(k, keys[:, -1], scale[:, -1])
    k8, s = sm.quant_keys(k)
    assert torch.equal(scale[:, -1], s)
    assert float((keys[:, -1].float() != k8.float()).float().mean()) < 0.01
    assert not keys[:, :-1].float().any() and not scale[:, :-1].any()


class _ClockMarks(serve_modes.Marks):
    """Marks on torch's CPU device: the host's clock instead of CUDA events."""

    def __call__(self, part) -> None:
        if self.at == len(self.events):
            self.events.append(None)
        self.events[self.at] = (part, time.perf_counter())
        self.at += 1

    def points(self) -> list:
        return [(part, (t - self.events[0][1]) * 1e6) for part, t in self.events]


def _eager(monkeypatch):
    """Every capture of the bench (the timed steps', the parts') runs its step eagerly."""
    from sparsekv.bench import serve_run

    def eager(torch, step, label):
        step()  # the warm-up capture_step runs
        return step, "eager", None

    monkeypatch.setattr(serve_run, "capture_step", eager)
    monkeypatch.setattr(serve_modes, "capture_step", eager)
    monkeypatch.setattr(serve_modes, "Marks", _ClockMarks)


def test_the_parts_are_medians_over_replays_of_the_steps_after_the_timed_ones(cpu_ops, monkeypatch):
    _eager(monkeypatch)
    m = sm.Model.build(TINY, cpu_ops)
    B, C, bs, first = 2, 128, 16, 3
    wl = generate(B, 0.9, steps=first + serve_modes.PART_REPLAYS, layers=TINY.layers, context=C, top_k=TINY.top_k,
                  block_size=bs)
    st = serve_modes.Static(m, B, serve_modes.block_table(B, C, bs, 4096), wl, "cpu")
    src = serve_modes.HbmRows.filled(serve_modes.row_tile(m), st, TINY.layers, bs)
    loaded, seen = [], []
    load, totals_of = st.load, serve_modes.step_totals
    monkeypatch.setattr(st, "load", lambda t: (loaded.append(t), load(t)))
    monkeypatch.setattr(serve_modes, "step_totals", lambda iv: (seen.append(iv), totals_of(iv))[1])
    totals, kind = serve_modes.parts(m, st, sm.BatchState(TINY, B, C, "cpu"), src, first, "gpu")
    assert kind == "eager"
    # the warm-up repeats the last timed step; each replay is a step of its own after it
    assert loaded == [first - 1] + list(range(first, first + serve_modes.PART_REPLAYS))
    assert len(seen) == serve_modes.PART_REPLAYS
    for iv in seen:  # each run splits the FFN at the dense layers afresh (the warm-up's count does not carry over)
        ffn = [p for p, _ in iv if p in ("dense_ffn", "moe")]
        assert ffn == ["dense_ffn"] * TINY.dense_layers + ["moe"] * (TINY.layers - TINY.dense_layers)
    runs = [totals_of(iv) for iv in seen]
    assert set(totals) == {*PARTS, "rows"}  # rows: the side stream's, beside the step's
    for part in totals:
        assert totals[part] == pytest.approx(float(np.median([r[part] for r in runs])))


def test_a_config_of_the_all_on_gpu_mode_runs_on_the_cpu_and_reports_its_parts(cpu_ops, monkeypatch):
    from sparsekv.bench import serve, serve_run

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (1 << 40, 1 << 40))
    _eager(monkeypatch)
    m = sm.Model.build(TINY, cpu_ops)
    opts = serve.Options(preset="tiny", contexts=(256,), batches=(2,), modes=("gpu",), steps=3, warmup=1,
                         block_size=16).validate(sm.PRESETS)
    [r] = serve_run.run_config(m, None, serve_modes.row_tile(m), opts, 256, 2, ("gpu",), 4096, None, device="cpu")
    assert (r.mode, r.context, r.batch, r.run, r.error) == ("gpu", 256, 2, "eager", None)
    assert r.p50_us > 0 and r.tok_s == pytest.approx(2 / r.p50_us * 1e6)
    assert set(r.parts) == set(PARTS) and r.rows_us > 0
    assert r.parts_run == "eager" and r.parts_step_us > 0
    assert r.bounds["swap_in"] is None and r.bounds["attention"] > 0
    f = summary([r], {256: {"gpu": 2, "offload": 0}}, 256, cpu_ops.impl)
    assert f["serve_max_batch_gpu_256"] == 2 and f["serve_configs"][0]["tok_s"] == r.tok_s


@pytest.mark.parametrize("short", ["by the free bytes", "by running out"])
def test_all_on_gpu_rows_that_do_not_fit_skip_that_mode_with_the_reason(cpu_ops, monkeypatch, short):
    """Too little free HBM, told before the fill or met during it: the all-on-GPU mode is
    skipped with the bytes it needed and what was free (the config's other modes still run)."""
    from sparsekv.bench import serve, serve_run

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    need = TINY.layers * (2 * 256 + 2) * TINY.row_bytes
    free = need if short == "by the free bytes" else need + serve_run.HBM_MARGIN_BYTES
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free, 1 << 40))
    if short == "by running out":
        def oom(*a, **k):
            raise torch.OutOfMemoryError("CUDA out of memory")
        monkeypatch.setattr(serve_modes.HbmRows, "filled", oom)
    m = sm.Model.build(TINY, cpu_ops)
    opts = serve.Options(preset="tiny", contexts=(256,), batches=(2,), modes=("gpu",), steps=2, warmup=1,
                         block_size=16).validate(sm.PRESETS)
    [r] = serve_run.run_config(m, None, serve_modes.row_tile(m), opts, 256, 2, ("gpu",), 4096, None, device="cpu")
    assert r.p50_us is None and r.error is None
    assert r.skipped.startswith(f"{need / 1e9:.1f} GB of rows ")
    assert ("ran out of memory" in r.skipped) == (short == "by running out")


def test_configs_are_the_equal_batches_at_the_first_context_and_each_modes_largest_batch():
    from sparsekv.bench import serve, serve_run

    opts = serve.Options(contexts=(32768, 131072), batches=(1, 64), modes=("daemon", "gpu", "inproc"))
    caps = {32768: {"gpu": 21, "offload": 96}, 131072: {"gpu": 5, "offload": 29}}
    assert serve_run.configs(opts, caps) == [
        (32768, 1, 0.85, ("gpu", "inproc", "daemon")), (32768, 21, 0.85, ("gpu",)),
        (32768, 64, 0.85, ("gpu", "inproc", "daemon")), (32768, 96, 0.85, ("inproc", "daemon")),
        (131072, 5, 0.85, ("gpu",)), (131072, 29, 0.85, ("inproc", "daemon"))]


def test_more_overlaps_run_the_first_contexts_largest_batch_with_every_offloaded_mode():
    from sparsekv.bench import serve, serve_run

    opts = serve.Options(contexts=(32768, 131072), batches=(1, 64), modes=("gpu", "daemon", "prefetch"),
                         overlaps=(0.5, 0.85, 0.95, 0.5))
    caps = {32768: {"gpu": 21, "offload": 96}, 131072: {"gpu": 5, "offload": 29}}
    plan = serve_run.configs(opts, caps)
    at = plan.index((32768, 64, 0.85, ("gpu", "daemon", "prefetch")))  # at --layer-overlap, then at the others
    off = ("daemon", "prefetch")  # (each once; all on the GPU only at --layer-overlap: its step is the same)
    assert plan[at + 1:at + 3] == [(32768, 64, 0.5, off), (32768, 64, 0.95, off)]
    assert len([c for c in plan if c[2] != 0.85]) == 2
    gpu_only = serve.Options(contexts=(32768,), batches=(64,), modes=("gpu",), overlaps=(0.5,))
    assert serve_run.configs(gpu_only, {32768: {"gpu": 21, "offload": 96}}) == [
        (32768, 21, 0.85, ("gpu",)), (32768, 64, 0.85, ("gpu",))]


def test_the_prefetch_figures_are_its_hidden_share_and_its_cost_against_the_daemon_without_it():
    caps = {32768: {"gpu": 21, "offload": 96}}

    def r(mode, batch, p50, overlap=0.85, **kw):
        return Result(mode, 32768, batch, overlap, p50_us=p50, p50_at_bound_us=p50, **kw)

    results = [r("gpu", 64, 30000.0), r("daemon", 64, 36000.0), r("prefetch", 64, 32000.0, misses=300, prefetch_hits=700),
               r("daemon", 64, 36100.0, 0.5), r("prefetch", 64, 36500.0, 0.5, misses=600, prefetch_hits=200)]
    f = summary(results, caps, 32768, {})
    assert f["serve_offload_vs_gpu_tpot_b64_32k"] == round(32000 / 30000, 4)  # the prefetch mode: the product's
    assert f["serve_daemon_vs_gpu_tpot_b64_32k"] == round(36000 / 30000, 4)  # the same without prefetch
    assert f["prefetch_hidden_share"] == f["serve_prefetch_hidden_share_b64_32k_o85"] == 0.7
    assert f["serve_prefetch_hidden_share_b64_32k_o50"] == 0.25
    assert f["prefetch_cost_overlap50"] == f["serve_prefetch_vs_daemon_b64_32k_o50"] == round(36500 / 36100, 4)
    # all on the GPU runs at the headline's overlap only (its step reads the same rows whatever the overlap)
    assert f["serve_offload_vs_gpu_tpot_b64_32k_o50"] == round(36500 / 30000, 4)
    assert "serve_offload_vs_gpu_tpot_b64_32k_o85" not in f  # the headline's overlap: the key without a suffix


@pytest.mark.cuda
def test_the_fused_sparse_mla_kernel_equals_the_torch_path_with_masked_rows():
    from sparsekv.bench import serve_triton

    sh = sm.PRESETS["v32"]
    gen = torch.Generator("cuda").manual_seed(6)
    kv = sm.pack_rows(torch.randn(4096, sh.kv_lora + sh.rope, generator=gen, device="cuda"), sh)
    for B in (1, 7, 64):  # 16, 16 and 2 splits of the top-k
        q = torch.randn(B, sh.heads, sh.kv_lora + sh.rope, generator=gen, device="cuda").to(torch.bfloat16)
        idx = torch.randint(0, 4096, (B, sh.top_k), generator=gen, device="cuda", dtype=torch.int32)
        idx[0, 1000:] = -1
        got = serve_triton.sparse_mla(q, kv, idx, sh.kv_lora, sm.LATENT_TILE, 1 / math.sqrt(sh.nope + sh.rope))
        rows = kv.index_select(0, idx.reshape(-1).clamp(min=0).long()).view(B, sh.top_k, sh.row_bytes)
        want = sm.sparse_mla(q.float(), rows, idx >= 0, sh, torch.float32)
        assert torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max())), B


def test_the_whole_run_of_the_all_on_gpu_mode_on_the_cpu_writes_its_figures(cpu_ops, monkeypatch, tmp_path, capsys):
    import json

    from sparsekv.bench import serve, serve_run

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (1 << 40, 1 << 40))
    _eager(monkeypatch)
    # a deployment of 6 MB of HBM: the tiny model's weights (3.4 MB) leave room for 4 requests at 256
    opts = serve.Options(preset="tiny", contexts=(256, 512), batches=(1, 2), modes=("gpu",), steps=2, warmup=1,
                         block_size=16, hbm_gb=0.006, activations_gb=0.0, json_path=str(tmp_path / "s.json"),
                         plot_path=str(tmp_path / "s.png")).validate(sm.PRESETS)
    assert serve_run.main(opts, device="cpu") == 0
    out = capsys.readouterr()
    assert "context 256: all on GPU 0.001 GB a request -> batch 4" in out.err
    f = json.loads((tmp_path / "s.json").read_text())
    ran = {(c["context"], c["batch"]) for c in f["serve_configs"]}
    assert ran == {(256, 1), (256, 2), (256, 4), (512, 2)}  # equal batches at the first context, then each largest
    assert f["serve_max_batch_gpu_256"] == 4 and f["serve_max_batch_gpu_512"] == 2
    assert f["serve_impl"]["mm"] == "torch.float32 torch.mm"
    assert all(c["p50_us"] > 0 and c["run"] == "eager" for c in f["serve_configs"])
    assert "TPOT p50 ms" in out.out
