"""``python -m sparsekv.bench.hf_long`` runs end to end (``--device cpu --dims tiny``:
a cpu daemon, the zmq handle) and writes the figures it promises: both paths per config,
the ratios, the daemon's hits and misses per step, equal greedy tokens; with a real
prefill and with the synthetic one, whose two caches hold the same keys."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from sparsekv import hf  # noqa: E402
from sparsekv.bench import hf_long  # noqa: E402
from sparsekv.embedded.inproc import InprocClient  # noqa: E402


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_long_context_bench_runs_on_the_cpu_and_writes_its_figures(tmp_path, capsys, one_thread):
    out = tmp_path / "hf.json"
    assert hf_long.main(["--device", "cpu", "--dims", "tiny", "--contexts", "40", "--batches", "2",
                         "--new-tokens", "5", "--layers", "2", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["prefill"] == "real"
    (row,) = got["configs"]
    assert row["prefill_chunk"] == 40 and "fill_s" not in row["sparsekv"]
    assert (row["context"], row["batch"]) == (40, 2)
    skv, eager = row["sparsekv"], row["eager"]
    assert skv["tokens_per_s"] > 0 and eager["tokens_per_s"] > 0
    assert 0 < skv["kv_hbm_bytes"] and 0 < eager["kv_hbm_bytes"]
    assert row["kv_hbm_ratio"] == round(skv["kv_hbm_bytes"] / eager["kv_hbm_bytes"], 4)
    assert skv["hits_per_step"] + skv["misses_per_step"] > 0
    assert row["same_tokens"] == 1.0 and row["diverged"] == []  # float32 on the CPU: the two paths agree
    assert row["max_logit_diff"] < 1e-3
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["bench"] == "hf_dsv32"


def test_divergence_names_the_first_parted_step_and_both_margins():
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    ref = torch.tensor([[1, 2, 3, 4], [5, 6, 9, 8]])  # sequence 1 parts at step 2
    scores = torch.zeros(2, 4, 10)
    ref_scores = torch.zeros(2, 4, 10)
    scores[1, 2, 7], scores[1, 2, 9] = 3.0, 2.5  # mine picks 7 by 0.5
    ref_scores[1, 2, 9], ref_scores[1, 2, 7] = 3.0, 2.99  # the reference picks 9 by 0.01
    scores[0, 1, 0] = 0.25  # a logit difference before the parting step: counted
    scores[0, 3, 0] = 9.0  # after it: not
    parted, diff = hf_long.divergence(tokens, ref, scores, ref_scores)
    assert parted == [{"seq": 1, "step": 2, "margin": 0.5, "ref_margin": 0.01}]
    assert diff == 0.25
    assert hf_long.divergence(tokens, tokens, scores, scores) == ([], 0.0)


def test_the_synthetic_prefill_gives_both_paths_the_same_tokens(tmp_path, one_thread, monkeypatch):
    monkeypatch.setattr(hf_long, "FILL_BYTES", 3 * 2 * 2 * 48 * 4)  # spans of 3 positions at batch 2: many fills
    out = tmp_path / "hf.json"
    assert hf_long.main(["--device", "cpu", "--dims", "tiny", "--contexts", "70", "--batches", "2",
                         "--new-tokens", "8", "--layers", "2", "--prefill", "synthetic", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["prefill"] == "synthetic"
    (row,) = got["configs"]
    assert row["fill_spans"] == 24 and "prefill_chunk" not in row
    skv, eager = row["sparsekv"], row["eager"]
    assert skv["fill_s"] >= 0 and eager["fill_s"] >= 0
    # Every forward reads each layer's top-k (16) of each sequence from the pool, less at most its own new row.
    assert skv["hits_per_step"] + skv["misses_per_step"] >= 2 * 2 * (16 - 1)
    assert row["same_tokens"] == 1.0 and row["diverged"] == [] and row["max_logit_diff"] < 1e-3
    assert "hf_dsv32_kv_hbm_ratio_32k" not in got  # the tracked figures come from a real prefill only


def test_the_synthetic_prefill_puts_the_same_keys_in_both_caches(one_thread):
    """sparsekv's pool rows, expanded through the layer's kv_b_proj, are the per-head keys
    and values of transformers' DynamicCache; the indexer keys are equal."""
    model = hf_long.build_model(hf_long.TINY, 2, 64, torch.device("cpu"), torch.float32)
    geo = hf_long.Geometry.of(model)
    batch, context = 2, 50
    spans = [(0, 7), (7, 30), (30, 50)]
    eager = hf_long.fill_eager(model, batch, spans, seed=3)
    assert eager.get_seq_length() == context
    with InprocClient() as c:
        rt = hf.enable(model, c, max_batch=batch, host_rows=2 * 64, block_size=16)
        cache = hf.SparseKVCache(rt, batch, context, context + 4)
        hf_long.fill_sparsekv(model, cache, spans, seed=3)
        assert cache.get_seq_length() == context
        pool = c._space.pool  # uint8 [layers, host_rows, row_bytes]
        layer = 1
        cols = torch.arange(context)
        host = torch.from_numpy(cache._table_host)[:, cols // 16] * 16 + cols % 16  # [batch, context]
        rows = torch.from_numpy(pool[layer][host.numpy()].copy()).view(torch.float32)  # [batch, context, row_dim]
        attn = model.model.layers[layer].self_attn
        lat, rope = rows.split([geo.kv_lora_rank, geo.rope_dim], dim=-1)
        k, v = attn.expand_kv(lat[:, None], rope[:, None])
        lay = eager.layers[layer]
        assert torch.equal(lay.keys, k) and torch.equal(lay.values, v)
        assert torch.equal(cache.layers[layer].index_keys[:, :context], lay.indexer_keys)
        assert not torch.equal(eager.layers[0].keys, lay.keys)  # the layers differ
        cache.release()
        hf.disable(model)
