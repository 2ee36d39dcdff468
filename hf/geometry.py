"""What the pool holds for a DSA model: one row per token and layer, the compressed
latent (``kv_lora_rank``, after ``kv_a_layernorm``) then the rotated rope key
(``qk_rope_head_dim``), in the model's dtype. Derived from the model's config, checked
against a layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.proto import Layout

from .errors import UnsupportedModel

MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")


@dataclass(frozen=True)
class Geometry:
    num_layers: int
    kv_lora_rank: int
    rope_dim: int
    nope_dim: int
    v_dim: int
    num_heads: int
    index_topk: int
    dtype: torch.dtype
    groups: tuple[tuple[int, ...], ...]  # index groups: a full-indexer layer, then its shared layers

    @property
    def row_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def row_bytes(self) -> int:
        return self.row_dim * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def of(cls, model) -> "Geometry":
        cfg = getattr(model, "config", None)
        kind = getattr(cfg, "model_type", None)
        if kind not in MODEL_TYPES:
            raise UnsupportedModel(f"sparsekv serves transformers' {' and '.join(MODEL_TYPES)} models, not "
                                   f"{type(model).__name__} (model_type {kind!r})")
        if not hasattr(model, "generate"):
            raise UnsupportedModel(f"{type(model).__name__} has no generate(): pass the ...ForCausalLM model")
        types = list(getattr(cfg, "indexer_types", None) or ["full"] * cfg.num_hidden_layers)
        if types[0] != "full" or set(types) - {"full", "shared"}:
            raise UnsupportedModel(f"indexer_types must start with 'full' and hold only 'full' / 'shared', got {types}")
        groups, cur = [], []
        for layer, t in enumerate(types):
            if t == "full" and cur:
                groups.append(tuple(cur))
                cur = []
            cur.append(layer)
        groups.append(tuple(cur))
        return cls(num_layers=cfg.num_hidden_layers, kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim,
                   nope_dim=cfg.qk_nope_head_dim, v_dim=cfg.v_head_dim, num_heads=cfg.num_attention_heads,
                   index_topk=cfg.index_topk, dtype=model.dtype, groups=tuple(groups))

    def layout(self, max_batch: int, host_rows: int, region_stride: int | None = None) -> Layout:
        """The sparsekv layout for this model: ``max_batch`` request state rows, ``host_rows``
        token rows per layer, hot regions of ``region_stride`` rows (default: twice the
        top-k, room for rows to stay hot across steps)."""
        stride = region_stride or min(2 * self.index_topk, 32768)
        return Layout(num_layers=self.num_layers, row_bytes=self.row_bytes, top_k=self.index_topk,
                      region_stride=stride, max_reqs=max_batch, host_rows=host_rows,
                      index_groups=self.groups).validate()

    def check(self, layout: Layout) -> None:
        """Raise UnsupportedModel unless ``layout`` (of an attached client) fits this model."""
        want = {"num_layers": self.num_layers, "row_bytes": self.row_bytes, "groups": self.groups}
        got = {"num_layers": layout.num_layers, "row_bytes": layout.row_bytes, "groups": layout.groups}
        bad = [f"{k} {got[k]} (model: {want[k]})" for k in want if got[k] != want[k]]
        if layout.top_k < self.index_topk:
            bad.append(f"top_k {layout.top_k} (model's index_topk: {self.index_topk})")
        if bad:
            raise UnsupportedModel("the client's layout does not fit the model: " + ", ".join(bad))
