"""The attention function transformers calls for DSA layers when ``attn_implementation``
is ``"sparsekv"`` (registered through ``AttentionInterface``), and the mask it is given
(transformers' eager mask, registered through ``AttentionMaskInterface``: the indexer
then scores exactly as on the eager path).

transformers passes the indexer's top-k as ``indices`` [batch, q, k]; this reads only
those rows (``SparseKVCache.rows``: the device's prompt rows in prefill, ``swap_in``'s hot
rows in decode), expands their latents through the module's own ``kv_b_proj`` into
per-head keys and values, and attends over them. A selected position the mask forbids
(padding, a future position) is not read, as the eager path masks it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

from .errors import UnsupportedGeneration, UnsupportedModel

NAME = "sparsekv"


def sparse_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                     scaling: float, dropout: float = 0.0, indices: torch.Tensor | None = None, **kwargs):
    """``query`` [batch, heads, q, nope + rope]; returns ``(out [batch, q, heads, v], None)``."""
    runtime = getattr(module, "sparsekv_runtime", None)
    if runtime is None or indices is None:
        raise UnsupportedModel(f"attn_implementation {NAME!r} serves the DSA layers of a model passed to "
                               "sparsekv.hf.enable(); this module was not")
    cache = runtime.active
    if cache is None or cache.released:
        raise UnsupportedGeneration("no sparsekv cache is running this forward: generate through the enabled "
                                    "model's generate(), or pass runtime.new_cache(...) as past_key_values")
    if module.training and dropout:
        raise UnsupportedGeneration("sparsekv attention is for inference: put the model in eval()")
    pos = indices.long()  # [batch, q, k]
    mask = attention_mask[:, 0]  # [batch, q, positions]
    allowed = mask.gather(-1, pos)
    valid = allowed if mask.dtype == torch.bool else allowed == 0
    rows, ok = cache.rows(module.layer_idx, pos, valid)  # [batch, q, k, row_dim], [batch, q, k]
    geo = runtime.geometry
    latent, rope = rows.split([geo.kv_lora_rank, geo.rope_dim], dim=-1)
    b, q, k, _ = rows.shape
    kv = F.linear(latent.to(query.dtype), module.kv_b_proj.weight).view(b, q, k, geo.num_heads, -1)
    k_nope, v = kv.split([geo.nope_dim, geo.v_dim], dim=-1)
    keys = torch.cat([k_nope, rope.to(query.dtype)[:, :, :, None, :].expand(-1, -1, -1, geo.num_heads, -1)], -1)
    scores = torch.einsum("bhqd,bqkhd->bhqk", query, keys) * scaling
    scores = scores.masked_fill(~ok[:, None], torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.einsum("bhqk,bqkhv->bqhv", probs, v)
    return out.contiguous(), None


def register() -> None:
    """Make ``"sparsekv"`` an attention implementation (idempotent)."""
    AttentionInterface.register(NAME, sparse_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, eager_mask)
