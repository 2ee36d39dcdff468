"""The attention function transformers calls for DSA layers when ``attn_implementation``
is ``"sparsekv"`` (registered through ``AttentionInterface``), and the mask it is given
(transformers' eager mask, registered through ``AttentionMaskInterface``: the indexer
then scores exactly as on the eager path).

transformers passes the indexer's top-k as ``indices`` [batch, q, k]. A decode step reads
only those rows (``SparseKVCache.decode_rows``: ``swap_in``'s hot rows, and the token's
own new row), expands their latents through the module's own ``kv_b_proj`` into per-head
keys and values, and attends over them. A prefill forward (many queries of a sequence,
each with its own top-k) reads the selected rows of the prompt's rows on the device and
applies ``kv_b_proj`` to the queries and outputs instead (MLA's absorbed form). A
selected position the mask forbids (padding, a future position) is not read, as the eager
path masks it; the softmax is the eager path's (float32, then the model's dtype).
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
                                    "model's generate(), or pass a SparseKVCache as past_key_values")
    if module.training and dropout:
        raise UnsupportedGeneration("sparsekv attention is for inference: put the model in eval()")
    pos = indices.long()  # [batch, q, k]
    mask = attention_mask[:, 0]  # [batch, q, positions]: the causal and padding mask
    allowed = mask if mask.dtype == torch.bool else mask == 0
    layer = module.layer_idx
    if cache.in_prefill(layer):
        rows = cache.prompt_rows(layer, pos)  # [batch, q, k, row_dim]
        return _absorbed(module, runtime.geometry, query, rows, allowed.gather(-1, pos), scaling)
    # One query per sequence: only the selected rows, from the hot slab (and its own row).
    rows, ok = cache.decode_rows(layer, pos[:, 0], allowed.gather(-1, pos)[:, 0])  # [batch, k, row_dim], [batch, k]
    keys, values = _expand(module, runtime.geometry, rows, query.dtype)
    scores = torch.einsum("bhd,bkhd->bhk", query[:, :, 0], keys)[:, :, None]
    return _attend(scores * scaling, ok[:, None], values, "bhqk,bkhv->bqhv", query.dtype)


def check_projections(model, geo) -> None:
    """UnsupportedModel unless every DSA layer's ``kv_b_proj`` is linear without a bias
    (its output for a zero latent is zero): the absorbed prefill takes its matrix, the
    decode applies the module itself (a wrapped or quantized one included)."""
    for i, layer in enumerate(model.model.layers):
        proj = layer.self_attn.kv_b_proj
        weight = next(proj.parameters(), None)
        if weight is None:
            raise UnsupportedModel(f"layer {i}'s kv_b_proj has no parameters")
        with torch.no_grad():
            zero = proj(torch.zeros(1, geo.kv_lora_rank, dtype=geo.dtype, device=weight.device))
        if zero.shape[-1] != geo.num_heads * (geo.nope_dim + geo.v_dim) or bool(zero.any()):
            raise UnsupportedModel(f"layer {i}'s kv_b_proj ({type(proj).__name__}) must map the latent linearly, "
                                   "without a bias, to heads x (nope + v) values")


def _kv_b_matrix(proj, geo, dtype, device) -> torch.Tensor:
    """``kv_b_proj``'s matrix [out, rank]: a plain Linear's weight; another module's (an
    adapter such as LoRA, a quantized or hooked layer) from its output for each unit
    latent, so that what it adds is applied as the eager path applies it."""
    if type(proj) is torch.nn.Linear and not (proj._forward_hooks or proj._forward_pre_hooks):
        return proj.weight
    with torch.no_grad():
        return proj(torch.eye(geo.kv_lora_rank, dtype=dtype, device=device)).T


def _absorbed(module, geo, query, rows, ok, scaling: float):
    """Prefill: many queries of a sequence, each with its own top-k. Expanding every
    query's selected latents would take k x heads x (nope + v) values per query, so the
    module's ``kv_b_proj`` is applied to the queries and outputs instead (MLA's absorbed
    form: the same products, grouped the other way)."""
    w = _kv_b_matrix(module.kv_b_proj, geo, query.dtype, query.device)
    w = w.reshape(geo.num_heads, geo.nope_dim + geo.v_dim, geo.kv_lora_rank)
    w_k, w_v = w.split([geo.nope_dim, geo.v_dim], dim=1)  # [heads, nope, rank], [heads, v, rank]
    q_nope, q_rope = query.split([geo.nope_dim, geo.rope_dim], dim=-1)  # [batch, heads, q, .]
    q_lat = torch.einsum("bhqn,hnr->bhqr", q_nope, w_k)
    latent, rope = rows.to(query.dtype).split([geo.kv_lora_rank, geo.rope_dim], dim=-1)  # [batch, q, k, .]
    scores = torch.einsum("bhqr,bqkr->bhqk", q_lat, latent) + torch.einsum("bhqd,bqkd->bhqk", q_rope, rope)
    out_lat, _ = _attend(scores * scaling, ok, latent, "bhqk,bqkr->bqhr", query.dtype)
    return torch.einsum("bqhr,hvr->bqhv", out_lat, w_v).contiguous(), None


def _expand(module, geo, rows: torch.Tensor, dtype):
    """Per-head keys [..., heads, nope + rope] and values [..., heads, v] of latent rows
    [..., row_dim], through the module's own ``kv_b_proj`` (its forward: an adapter on it applies)."""
    latent, rope = rows.split([geo.kv_lora_rank, geo.rope_dim], dim=-1)
    kv = module.kv_b_proj(latent.to(dtype)).unflatten(-1, (geo.num_heads, -1))
    k_nope, values = kv.split([geo.nope_dim, geo.v_dim], dim=-1)
    rope = rope.to(dtype).unsqueeze(-2).expand(*k_nope.shape[:-1], -1)
    return torch.cat([k_nope, rope], dim=-1), values


def _attend(scores, ok, values, spec: str, dtype):
    """Softmax over the allowed keys (as the eager path: float32, the rest at the
    dtype's min), then the values."""
    scores = scores.masked_fill(~ok[:, None], torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    return torch.einsum(spec, probs, values).contiguous(), None


def register() -> None:
    """Make ``"sparsekv"`` an attention implementation (idempotent)."""
    AttentionInterface.register(NAME, sparse_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, eager_mask)
