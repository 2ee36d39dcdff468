"""examples/hf_generate/run.py: plain generate through sparsekv prints equal tokens to
transformers' eager path and exits 0 (in process; GLM-5's index groups too)."""

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import one_torch_thread  # noqa: E402,F401

RUN = Path(__file__).resolve().parents[2] / "examples" / "hf_generate" / "run.py"


@pytest.mark.parametrize("model", ["deepseek_v32", "glm_moe_dsa"])
def test_the_example_generates_equal_tokens(model, capsys):
    spec = importlib.util.spec_from_file_location("hf_generate_run", RUN)
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    assert run.main(["--model", model, "--new-tokens", "16"]) == 0
    assert "tokens equal: transformers eager vs sparsekv, 16 new tokens" in capsys.readouterr().out
