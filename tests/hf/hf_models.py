"""Tiny random DeepSeek-V3.2 and GLM-5 (DSA) models built with transformers' own config
classes, and a batch of left-padded prompts of mixed lengths, for the integration's tests.
The top-k (8) is far below the positions a sequence reaches (up to ~84), so the indexer's
selection decides what each step reads."""

import pytest
import torch
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

NEW_TOKENS = 64
LOGITS_TOL = 1e-4  # float32: the integration and the eager path sum the same terms in another order
HOST_ROWS = 4 * 96  # 4 sequences of 20 + 64 positions, in blocks of 16 (96 rows each)
VOCAB = 128
PROMPT_LENGTHS = (20, 13, 7, 16)  # batch 4, left-padded to 20
COMMON = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_attention_heads=4,
              num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
              kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16,
              index_topk=8, index_head_dim=32, index_n_heads=2, max_position_embeddings=256, pad_token_id=0,
              eos_token_id=None, bos_token_id=None, initializer_range=0.2)  # decisive logits: few near-ties
KINDS = ("deepseek_v32", "glm_moe_dsa")


def tiny(kind: str, seed: int = 0):
    """A float32 model in eval mode with eager attention: 2 DeepSeek-V3.2 layers, or 4 GLM
    layers of which two reuse the previous full layer's top-k (two index groups)."""
    torch.manual_seed(seed)
    if kind == "deepseek_v32":
        model = DeepseekV32ForCausalLM(DeepseekV32Config(**COMMON, num_hidden_layers=2, first_k_dense_replace=1))
    else:
        cfg = GlmMoeDsaConfig(**COMMON, num_hidden_layers=4, indexer_types=["full", "shared", "full", "shared"])
        model = GlmMoeDsaForCausalLM(cfg)
    model.set_attn_implementation("eager")
    return model.eval()


def prompts(lengths=PROMPT_LENGTHS, seed: int = 1):
    """(input_ids, attention_mask) [len(lengths), max(lengths)], left-padded with 0."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), width), generator=g)
    mask = torch.ones_like(ids)
    for b, n in enumerate(lengths):
        ids[b, : width - n] = 0
        mask[b, : width - n] = 0
    return ids, mask


def generate(model, device="cpu", **kw):
    """Greedy or sampled ``NEW_TOKENS`` tokens of the prompts: (sequences, logits [steps,
    batch, vocab]) on the CPU."""
    ids, mask = prompts()
    out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=NEW_TOKENS,
                         output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences.cpu(), torch.stack(out.logits).cpu()


def check_same(ref, got):
    """Token ids identical, logits within LOGITS_TOL."""
    (seq, logits), (seq2, logits2) = ref, got
    assert torch.equal(seq, seq2), f"token ids differ at {(seq != seq2).nonzero()[:4].tolist()}"
    diff = float((logits - logits2).abs().max())
    assert diff <= LOGITS_TOL, f"logits differ by {diff}"


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The models are tiny: with pytest-xdist's workers on few cores, torch's thread pools
    would fight over them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
