"""What the integration does not do is refused with a typed error naming it, before a
row is allocated: other models, beam search, other caches, several sequences per prompt,
a batch or a length the pool cannot hold, a fill past the prompt or short of it."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import one_torch_thread, prompts, tiny  # noqa: E402,F401

from sparsekv import hf  # noqa: E402
from sparsekv.embedded.inproc import InprocClient  # noqa: E402
from sparsekv.proto import Layout  # noqa: E402


@pytest.fixture
def enabled():
    model = tiny("deepseek_v32")
    with InprocClient() as c:
        rt = hf.enable(model, c, max_batch=4, host_rows=256, block_size=16)
        yield model, rt


@pytest.mark.parametrize("kw, what", [
    ({"num_beams": 2}, "beam search"),
    ({"num_return_sequences": 2, "do_sample": True}, "several sequences per prompt"),
    ({"cache_implementation": "static"}, "another cache"),
    ({"use_cache": False}, "use_cache=False"),
    ({"past_key_values": "not a cache"}, "must be a SparseKVCache"),
    ({"assistant_early_exit": 1}, "assistant_early_exit"),  # its nested generate left the model one layer short
    ({"output_attentions": True, "return_dict_in_generate": True}, "output_attentions"),
])
def test_generation_options_it_cannot_serve_are_refused(enabled, kw, what):
    model, rt = enabled
    ids, mask = prompts()
    with pytest.raises(hf.UnsupportedGeneration, match=what):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, **kw)
    assert rt.free_rows == 256 and not rt.in_use


def test_a_generation_the_pool_cannot_hold_is_refused_before_any_row_is_taken(enabled):
    model, rt = enabled
    ids, mask = prompts()
    with pytest.raises(hf.OutOfRows, match=r"need 384 host rows per layer; the pool has 256 free of 256"):
        model.generate(ids, attention_mask=mask, max_new_tokens=70)
    ids5, mask5 = prompts((3, 4, 5, 6, 7))
    with pytest.raises(hf.OutOfRows, match="batch 5 exceeds the layout's max_reqs 4"):
        model.generate(ids5, attention_mask=mask5, max_new_tokens=2)
    assert rt.free_rows == 256
    model.generate(ids, attention_mask=mask, max_new_tokens=4)  # and it still generates


def test_only_dsa_models_and_fitting_layouts_are_taken():
    with InprocClient() as c, pytest.raises(hf.UnsupportedModel, match="not Linear"):
        hf.enable(torch.nn.Linear(2, 2), c, max_batch=1, host_rows=64)
    model = tiny("glm_moe_dsa")
    with InprocClient() as c:
        c.attach(Layout(num_layers=4, row_bytes=192, top_k=8, region_stride=16, max_reqs=2, host_rows=64))
        with pytest.raises(hf.UnsupportedModel, match=r"groups \(\(0,\), \(1,\), \(2,\), \(3,\)\) "
                                                      r"\(model: \(\(0, 1\), \(2, 3\)\)\)"):
            hf.enable(model, c)
        with pytest.raises(hf.UnsupportedModel, match="transport='doorbell' is the device handle"):
            hf.enable(model, c, transport="doorbell")
    assert getattr(model, "sparsekv", None) is None


def test_a_fill_must_cover_the_prompt_and_nothing_more(enabled):
    model, rt = enabled
    geo = rt.geometry
    cache = hf.SparseKVCache(rt, 2, 10, 14)
    rows, keys = torch.randn(geo.num_layers, 2, 6, geo.row_dim), torch.randn(geo.num_layers, 2, 6, 32)
    with pytest.raises(hf.UnsupportedGeneration, match=r"rows must be \[layers 2, batch 2, n, row_dim 48\]"):
        cache.fill(rows[:, :1], keys[:, :1])
    cache.fill(rows, keys)
    with pytest.raises(hf.UnsupportedGeneration, match="6 at 6 pass the prompt's 10"):
        cache.fill(rows, keys)
    ids = torch.ones(2, 11, dtype=torch.long)
    with pytest.raises(hf.UnsupportedGeneration, match="filled to 6 of the prompt's 10 positions"):
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=2)
    cache.release()


def test_a_second_model_on_one_client_is_refused_until_the_first_is_disabled():
    """Found by an adversarial review: two models enabled on one client each kept their own
    free host rows over the same pool and state rows; the second overwrote the first's."""
    a, b = tiny("deepseek_v32"), tiny("deepseek_v32", seed=5)
    with InprocClient() as c:
        hf.enable(a, c, max_batch=4, host_rows=256, block_size=16)
        with pytest.raises(hf.UnsupportedModel, match="serves another enabled model"):
            hf.enable(b, c)
        assert getattr(b, "sparsekv", None) is None
        hf.disable(a)
        hf.enable(b, c)  # one after the other: allowed


def test_a_forward_without_the_live_cache_is_refused(enabled):
    """Found by an adversarial review: a plain forward while a caller's SparseKVCache was
    live read that generation's rows and returned wrong logits."""
    model, rt = enabled
    ids, mask = prompts()
    cache = hf.SparseKVCache(rt, 4, ids.shape[1], ids.shape[1] + 8)
    model.generate(ids, attention_mask=mask, max_new_tokens=4, past_key_values=cache)
    with pytest.raises(hf.UnsupportedGeneration, match="no sparsekv cache is running this forward"):
        model(ids[:, :5], use_cache=False)
    cache.release()
    assert rt.free_rows == 256


def test_a_cast_after_enable_is_refused(enabled):
    """Found by an adversarial review: a model cast to another dtype of the same size after
    enable() read its hot rows in the old dtype (wrong logits), to another size failed
    with an untyped error."""
    model, rt = enabled
    ids, mask = prompts()
    model.to(torch.float64)
    with pytest.raises(hf.UnsupportedModel, match="runs in torch.float64, but sparsekv was enabled on it in "
                                                  "torch.float32"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4)
    assert rt.free_rows == 256 and not rt.in_use


def test_a_kv_b_proj_with_a_bias_is_refused():
    model = tiny("deepseek_v32")
    proj = model.model.layers[1].self_attn.kv_b_proj
    biased = torch.nn.Linear(proj.in_features, proj.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(proj.weight)
        biased.bias.fill_(0.5)
    model.model.layers[1].self_attn.kv_b_proj = biased
    with InprocClient() as c, pytest.raises(hf.UnsupportedModel, match="layer 1's kv_b_proj"):
        hf.enable(model, c, max_batch=1, host_rows=64)
