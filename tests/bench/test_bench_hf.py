"""``python -m sparsekv.bench.hf_long`` runs end to end (``--device cpu --dims tiny``:
a cpu daemon, the zmq handle) and writes the figures it promises: both paths per config,
the ratios, the daemon's hits and misses per step, equal greedy tokens."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from sparsekv.bench import hf_long  # noqa: E402


def test_the_long_context_bench_runs_on_the_cpu_and_writes_its_figures(tmp_path, capsys):
    out = tmp_path / "hf.json"
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert hf_long.main(["--device", "cpu", "--dims", "tiny", "--contexts", "40", "--batches", "2",
                             "--new-tokens", "5", "--layers", "2", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(before)
    got = json.loads(out.read_text())
    (row,) = got["configs"]
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
