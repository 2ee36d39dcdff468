"""Tiny random DeepSeek-V3.2 and GLM-5 (DSA) models built with transformers' own config
classes, and a batch of left-padded prompts of mixed lengths, for the integration's tests.
The top-k (8) is far below the positions a sequence reaches (up to ~84), so the indexer's
selection decides what each step reads."""

import torch
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

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
