"""``model.generate`` through sparsekv gives transformers' own eager outputs: greedy token
ids identical and every step's logits within 1e-4 (float32; the two sum the same terms in
a different order), both DSA models, batch 4 of mixed prompt lengths, in process and
through a daemon; sampling with one seed; rows given back; what is refused."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import HOST_ROWS, KINDS, NEW_TOKENS, check_same, generate, one_torch_thread, prompts, tiny  # noqa: E402,F401

from sparsekv import hf  # noqa: E402
from sparsekv.client import Client  # noqa: E402
from sparsekv.embedded.inproc import InprocClient  # noqa: E402

@pytest.fixture(scope="module", params=KINDS)
def reference(request):
    """(kind, eager greedy sequences, their logits) from transformers' DynamicCache."""
    model = tiny(request.param)
    return (request.param, *generate(model, do_sample=False))


def test_greedy_in_process_matches_eager_and_gives_rows_back(reference):
    kind, seq, logits = reference
    model = tiny(kind)
    with InprocClient() as c:
        rt = hf.enable(model, c, max_batch=4, host_rows=HOST_ROWS, block_size=16)
        check_same((seq, logits), generate(model, do_sample=False))
        assert rt.free_rows == HOST_ROWS  # the generation's rows came back
        counts = rt.handle.counts
        steps = NEW_TOKENS - 1  # decode forwards; the first token comes from the prefill
        assert counts["batches"] == steps * len(rt.geometry.groups)  # one request per index group and step
        assert counts["hits"] > 0 and counts["misses"] > 0
        check_same((seq, logits), generate(model, do_sample=False))  # again, on the reused rows
        hf.disable(model)
    assert model.config._attn_implementation == "eager"
    check_same((seq, logits), generate(model, do_sample=False))


def test_greedy_through_a_daemon_matches_eager(reference, daemon):
    kind, seq, logits = reference
    model = tiny(kind)
    with Client(daemon.run_dir, name="hf-test") as c:
        hf.enable(model, c, max_batch=4, host_rows=HOST_ROWS, block_size=16)
        check_same((seq, logits), generate(model, do_sample=False))


@pytest.mark.parametrize("kind", KINDS[:1])
def test_sampling_with_one_seed_matches_eager(kind):
    model = tiny(kind)
    torch.manual_seed(7)
    ref = generate(model, do_sample=True, top_k=0, temperature=1.0)
    with InprocClient() as c:
        hf.enable(model, c, max_batch=4, host_rows=HOST_ROWS, block_size=16)
        torch.manual_seed(7)
        check_same(ref, generate(model, do_sample=True, top_k=0, temperature=1.0))


@pytest.mark.parametrize("kind", KINDS[:1])
def test_chunked_prefill_matches_eager_chunked(kind):
    """A prompt prefilled in chunks (``prefill_chunk_size``): later chunks read the earlier
    ones' rows from the device, then decode reads them from the pool."""
    model = tiny(kind)
    ref = generate(model, do_sample=False, prefill_chunk_size=6)
    with InprocClient() as c:
        hf.enable(model, c, max_batch=4, host_rows=HOST_ROWS, block_size=16)
        check_same(ref, generate(model, do_sample=False, prefill_chunk_size=6))


def _outputs(model, **kw):
    """(sequences, logits) of greedy ``generate`` on the prompts, with ``kw`` as given."""
    ids, mask = prompts()
    out = model.generate(ids, attention_mask=mask, output_logits=True, return_dict_in_generate=True,
                         do_sample=False, **kw)
    return out.sequences, torch.stack(out.logits)


def test_the_generation_length_is_the_one_transformers_runs():
    """Found by an adversarial review: ``generate(ids)`` without a length raised a
    TypeError (transformers 5.17 leaves ``max_length`` None until its own resolution);
    a GenerationConfig passed with ``max_length`` sized the cache by it while transformers
    ran the model's ``max_new_tokens``, refused mid-run."""
    from transformers import GenerationConfig

    model = tiny(KINDS[0])
    plain = _outputs(model)  # transformers' default: 20 new tokens
    model.generation_config.max_new_tokens = 30
    merged = _outputs(model, generation_config=GenerationConfig(max_length=25))  # the model's 30 new tokens win
    assert plain[0].shape[1] == 20 + 20 and merged[0].shape[1] == 20 + 30
    with InprocClient() as c:
        rt = hf.enable(model, c, max_batch=4, host_rows=HOST_ROWS, block_size=16)
        model.generation_config.max_new_tokens = None
        check_same(plain, _outputs(model))
        model.generation_config.max_new_tokens = 30
        check_same(merged, _outputs(model, generation_config=GenerationConfig(max_length=25)))
        assert rt.free_rows == HOST_ROWS


class Adapter(torch.nn.Module):
    """A low-rank update on a Linear, applied in its forward (as LoRA's adapters are)."""

    def __init__(self, base: torch.nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base
        self.a = torch.nn.Parameter(torch.randn(rank, base.in_features) * 0.3)
        self.b = torch.nn.Parameter(torch.randn(base.out_features, rank) * 0.3)

    def forward(self, x):
        return self.base(x) + (x @ self.a.T) @ self.b.T


def test_an_adapter_on_kv_b_proj_is_applied_as_on_the_eager_path():
    """Found by an adversarial review: a LoRA adapter on ``kv_b_proj`` was ignored (its
    weight read directly): the tokens differed from the second one on."""
    model = tiny(KINDS[0])
    torch.manual_seed(3)
    for layer in model.model.layers:
        layer.self_attn.kv_b_proj = Adapter(layer.self_attn.kv_b_proj)
    ref = _outputs(model, max_new_tokens=16)
    with InprocClient() as c:
        hf.enable(model, c, max_batch=4, host_rows=HOST_ROWS, block_size=16)
        check_same(ref, _outputs(model, max_new_tokens=16))


def test_two_models_on_one_daemon_keep_their_own_rows(daemon):
    """Found by an adversarial review: two processes each enabling a model on one daemon
    attached to the same default engine ("transformers") and shared its host rows: each
    overwrote the other's, tokens differed. The default engine name is each enable()'s own."""
    from transformers import DynamicCache

    a, b = tiny(KINDS[0]), tiny(KINDS[0], seed=5)
    ids, mask = prompts()
    ref_b = _outputs(b, max_new_tokens=6)
    past = DynamicCache(config=a.config)
    first = a.generate(ids, attention_mask=mask, max_new_tokens=6, past_key_values=past, do_sample=False)
    mask2 = torch.cat([mask, torch.ones(ids.shape[0], 6, dtype=mask.dtype)], 1)
    ref_a = a.generate(first, attention_mask=mask2, max_new_tokens=6, past_key_values=past, do_sample=False)
    with Client(daemon.run_dir, name="model-a") as ca, Client(daemon.run_dir, name="model-b") as cb:
        hf.enable(a, ca, max_batch=4, host_rows=HOST_ROWS, block_size=16)
        hf.enable(b, cb, max_batch=4, host_rows=HOST_ROWS, block_size=16)
        cache = hf.SparseKVCache(a.sparsekv, ids.shape[0], ids.shape[1], ids.shape[1] + 12)
        got_first = a.generate(ids, attention_mask=mask, max_new_tokens=6, past_key_values=cache, do_sample=False)
        check_same(ref_b, _outputs(b, max_new_tokens=6))  # model b's generation between a's two calls
        got_a = a.generate(got_first, attention_mask=mask2, max_new_tokens=6, past_key_values=cache, do_sample=False)
        cache.release()
        assert torch.equal(got_first, first) and torch.equal(got_a, ref_a)
        assert ca.attachment.engine != cb.attachment.engine
