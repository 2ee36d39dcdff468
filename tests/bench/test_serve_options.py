"""``sparsekv bench serve``'s options are checked before anything is built, without torch:
each bad one refused (exit 2) with a message naming it."""

import pytest

from sparsekv.bench import serve
from sparsekv.bench.serve_capacity import PRESETS, Deployment, Shapes, capacity_text
from sparsekv.cli.main import main


def test_serve_refuses_more_than_one_hit_rate(capsys):
    assert main(["bench", "serve", "--hits", "80,90"]) == 2
    assert "--hits" in capsys.readouterr().err


@pytest.mark.parametrize("args, words", [
    (["--contexts", "0"], "--contexts must be positive"),
    (["--batches", "-1"], "--batches must be positive"),
    (["--batches", "100000"], "--batches: at most 65536"),
    (["--preset", "foo"], "--preset must be one of"),
    (["--steps", "0"], "--steps must be a positive number, got 0"),
    (["--activations-gb", "-1"], "--activations-gb must be a number >= 0"),
    (["--activations-gb", "nan"], "--activations-gb must be a number >= 0"),
    (["--hbm-gb", "inf"], "--hbm-gb must be a positive number, got inf"),
    (["--host-gib", "inf"], "--host-gib must be a positive number"),
    (["--host-pool-gib", "inf"], "--host-pool-gib must be a positive number"),
    (["--host-pool-gib", "1e30"], "--host-pool-gib 1e+30: this machine has"),
    (["--gather-blocks", "0"], "--gather-blocks must be >= 1, got 0"),
    (["--region-rows", "100000000"], "--region-rows must be <= 32768"),
])
def test_bad_options_are_refused_before_torch_is_needed(capsys, args, words):
    """Found by a review: without torch every option was taken (the torch check came
    first), --steps 0 became 30, an infinite or negative size was taken (a traceback later,
    or more HBM), a gather of no blocks went to the daemon."""
    assert main(["bench", "serve", *args]) == 2
    err = capsys.readouterr().err
    assert words in err and "needs torch" not in err, err


def test_the_prefetch_mode_needs_hot_region_rows_above_top_k():
    top_k = PRESETS["v32"].top_k
    assert serve.Options().region(top_k) == top_k + top_k // 4
    with pytest.raises(ValueError, match="--region-rows 2048: the prefetch mode needs rows above top-k"):
        serve.Options(region_rows=top_k).validate(PRESETS)
    serve.Options(region_rows=top_k, modes=("gpu", "daemon"), host_pool_gib=1.0).validate(PRESETS)  # no prefetch: top_k will do
    with pytest.raises(ValueError, match="--region-rows must be >= top-k 2048, got 2000"):
        serve.Options(region_rows=2000, modes=("daemon",)).validate(PRESETS)
    with pytest.raises(ValueError, match="--overlaps must lie in"):
        serve.Options(overlaps=(1.5,)).validate(PRESETS)


def test_an_hbm_the_weights_fill_runs_the_equal_batch_configs_and_says_so():
    """--hbm-gb below the weights (1 GB: the batch-1 probes use it) is taken: no mode has a
    largest batch, and the capacity lines say why."""
    serve.Options(hbm_gb=1.0, host_pool_gib=1.0).validate(PRESETS)
    text = capacity_text(Shapes(), [32768], Deployment(hbm_bytes=1e9))
    assert "no HBM is left for KV rows" in text and "batch 0" in text
    assert "no HBM is left" not in capacity_text(Shapes(), [32768], Deployment())
