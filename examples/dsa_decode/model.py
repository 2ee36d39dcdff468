"""A tiny decode-only model shaped like DeepSeek-V3.2's sparse attention (DSA).

Each layer's small *indexer* (a few heads, ReLU, head weights) scores every past position
of the token's request and keeps the top-k; the layer attends over those positions' KV
rows plus the token's own. A KV row is 656 bytes like ``fp8_ds_mla``: here 328 bfloat16
values, a 256-value latent, a 64-value rope part and 8 unused. Attention is MLA-shaped
with the projections absorbed: a row's score is ``q_latent . latent + q_rope . rope``, its
value the latent. With ``layers_per_indexer > 1`` consecutive layers form an index group
(GLM-5 style): the group's first layer runs the indexer, the others reuse its top-k.

The model reads KV rows only through a *handle*, so it runs unchanged on any of them:

* ``swap_in(req_id_per_token, block_table, positions, layer=, block_size=)`` -> int32
  ``idx [tokens, k]``: where each selected row is in ``kv(layer)``, -1 for none;
* ``kv(layer)`` -> uint8 ``[rows, 656]`` (NumPy or torch);
* ``begin_step(...)``, called by the engine loop (``run.py``), not by the model.

:class:`LocalKV` keeps every KV row in the engine; ``sparsekv.client.swap_in.HostSwapIn``
(or the device handle) reads sparsekv's host pool and hot slab. The indexer's own keys
stay with the engine in both: ``index_keys [layers, host_rows, index_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROW_BYTES = 656
ROW_VALUES = ROW_BYTES // 2  # bfloat16 values of one KV row
LATENT, ROPE = 256, 64  # the row: [latent | rope | 8 unused]


@dataclass(frozen=True)
class Config:
    num_layers: int = 4
    hidden: int = 64
    vocab: int = 512
    top_k: int = 32  # positions the indexer keeps per token
    index_heads: int = 4
    index_dim: int = 16
    layers_per_indexer: int = 1  # 1: every layer has its indexer (DeepSeek-V3.2)
    seed: int = 0
    device: str = "cpu"

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Index groups, leader first (what the sparsekv Layout's ``index_groups`` gets)."""
        n = self.layers_per_indexer
        return tuple(tuple(range(i, min(i + n, self.num_layers))) for i in range(0, self.num_layers, n))


@dataclass
class Batch:
    """One decode step's tokens, as an engine hands them to its attention layers."""

    tokens: torch.Tensor  # int64 [T] input token of each query token
    req_ids: torch.Tensor  # int64 [T] request state row of each token, -1 = padding token
    positions: torch.Tensor  # int64 [T] position of the token = its request's past length
    block_table: torch.Tensor  # int64 [max_reqs, max_blocks] host block of each logical block, -1 = none
    block_size: int


@dataclass
class StepOut:
    logits: torch.Tensor  # float32 [T, vocab]
    kv_rows: torch.Tensor  # uint8 [layers, T, ROW_BYTES]: each token's new KV row per layer
    index_keys: torch.Tensor  # float32 [layers, T, index_dim]: its new indexer keys


def host_rows_of(block_table: torch.Tensor, req_ids: torch.Tensor, positions: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """Host row of ``positions [T, k]`` of requests ``req_ids [T]``: ``block * block_size +
    offset``; -1 for a padding token, a negative position, one past the table or on a -1
    block. (The engine's own rule; sparsekv applies the same one on its side.)"""
    max_blocks = block_table.shape[1]
    blk = torch.div(positions, block_size, rounding_mode="floor")
    ok = (positions >= 0) & (blk < max_blocks) & (req_ids[:, None] >= 0)
    table = block_table[req_ids.clamp(min=0)]  # [T, max_blocks]
    hb = torch.gather(table, 1, torch.where(ok, blk, 0))
    ok &= hb >= 0
    return torch.where(ok, hb * block_size + positions % block_size, -1)


class LocalKV:
    """The handle of an engine that keeps all KV rows itself: ``kv(layer)`` is the whole
    pool ``[host_rows, 656]`` and ``swap_in`` returns host rows."""

    def __init__(self, num_layers: int, host_rows: int, device: str = "cpu"):
        self.pool = torch.zeros((num_layers, host_rows, ROW_BYTES), dtype=torch.uint8, device=device)

    def write(self, rows: torch.Tensor, data: torch.Tensor) -> None:
        """``data`` uint8 [layers, n, 656] into host ``rows`` [n] of every layer."""
        self.pool[:, rows] = data

    def begin_step(self, state_rows, reset=None, invalidate=None) -> None:
        pass  # every row is always here: nothing to forget

    def swap_in(self, req_id_per_token, block_table, logical_topk_indices, *, layer, block_size):
        return host_rows_of(block_table, req_id_per_token, logical_topk_indices, block_size).to(torch.int32)

    def kv(self, layer: int) -> torch.Tensor:
        return self.pool[layer]


class DsaModel:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)  # weights drawn on the CPU: the same on any device

        def w(*shape):
            return (torch.randn(*shape, generator=g) / shape[0] ** 0.5).to(cfg.device)

        c, L = cfg, cfg.num_layers
        self.embed = torch.randn(c.vocab, c.hidden, generator=g).to(c.device)
        self.w_q_latent = [w(c.hidden, LATENT) for _ in range(L)]
        self.w_q_rope = [w(c.hidden, ROPE) for _ in range(L)]
        self.w_kv = [w(c.hidden, LATENT + ROPE) for _ in range(L)]
        self.w_out = [w(LATENT, c.hidden) for _ in range(L)]
        self.w_iq = [w(c.hidden, c.index_heads * c.index_dim) for _ in range(L)]  # indexer queries
        self.w_ik = [w(c.hidden, c.index_dim) for _ in range(L)]  # indexer key
        self.w_iw = [w(c.hidden, c.index_heads) for _ in range(L)]  # indexer head weights
        self.head = w(c.hidden, c.vocab)
        self.leaders = {grp[0] for grp in cfg.groups}

    # -- what a prefill would write ----------------------------------------------------
    def prompt_rows(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A stand-in prefill: the KV rows uint8 [layers, n, 656] and indexer keys [layers,
        n, index_dim] of prompt ``tokens``, each from its token's embedding alone."""
        x = torch.nn.functional.rms_norm(self.embed[tokens], (self.cfg.hidden,))
        rows = torch.stack([self._kv_row(x, layer) for layer in range(self.cfg.num_layers)])
        return rows.view(torch.uint8), self.prompt_index_keys(tokens)

    def prompt_index_keys(self, tokens: torch.Tensor) -> torch.Tensor:
        """The indexer keys [layers, n, index_dim] of prompt ``tokens`` alone (what
        :meth:`prompt_rows` gives with the KV rows)."""
        x = torch.nn.functional.rms_norm(self.embed[tokens], (self.cfg.hidden,))
        return torch.stack([x @ self.w_ik[layer] for layer in range(self.cfg.num_layers)])

    # -- one decode step ---------------------------------------------------------------
    @torch.no_grad()
    def decode_step(self, batch: Batch, kv, index_keys: torch.Tensor) -> StepOut:
        """One token per entry of ``batch``; reads past KV rows through the handle ``kv``
        and past indexer keys from ``index_keys`` [layers, host_rows, index_dim]."""
        x = self.embed[batch.tokens]
        new_rows, new_keys = [], []
        topk = None
        for layer in range(self.cfg.num_layers):
            h = torch.nn.functional.rms_norm(x, (self.cfg.hidden,))
            self_row = self._kv_row(h, layer)  # [T, 328] bf16: this token's own KV row
            new_rows.append(self_row)
            new_keys.append(h @ self.w_ik[layer])
            if layer in self.leaders:  # followers reuse their leader's top-k
                topk = self.indexer(layer, h, batch, index_keys[layer])

            # --- the sparse attention layer's read, whatever the handle -------------
            idx = kv.swap_in(batch.req_ids, batch.block_table, topk, layer=layer, block_size=batch.block_size)
            idx = torch.as_tensor(idx).long()
            valid = idx >= 0
            slab = torch.as_tensor(kv.kv(layer))  # [rows, 656] uint8 (NumPy views are shared, not copied)
            rows = slab[idx.clamp(min=0)].view(torch.bfloat16)  # [T, k, 328]
            rows = torch.where(valid[..., None], rows, torch.zeros((), dtype=torch.bfloat16))
            # --------------------------------------------------------------------------

            x = x + self.attend(layer, h, rows, valid, self_row)
        logits = torch.nn.functional.rms_norm(x, (self.cfg.hidden,)) @ self.head
        return StepOut(logits, torch.stack(new_rows).view(torch.uint8), torch.stack(new_keys))

    def indexer(self, layer: int, h: torch.Tensor, batch: Batch, keys: torch.Tensor) -> torch.Tensor:
        """Top-k past positions of each token's request, int64 [T, top_k], -1 padded: the
        score of position s is sum over heads of w_h * relu(q_h . key_s)."""
        c = self.cfg
        T = h.shape[0]
        q = (h @ self.w_iq[layer]).view(T, c.index_heads, c.index_dim)
        w = h @ self.w_iw[layer]
        out = torch.full((T, c.top_k), -1, dtype=torch.long, device=h.device)
        for t in range(T):
            n = int(batch.positions[t])
            if batch.req_ids[t] < 0 or n == 0:
                continue
            past = torch.arange(n, device=h.device)
            rows = host_rows_of(batch.block_table, batch.req_ids[t:t + 1], past[None], batch.block_size)[0]
            score = (torch.relu(q[t] @ keys[rows].T) * w[t][:, None]).sum(0)  # [n]
            # torch.topk does not say which of equal scores it keeps (ReLU makes ties
            # common); a stable sort keeps the lower position: the same choice every run.
            best = torch.sort(score, descending=True, stable=True).indices[: c.top_k]
            out[t, : best.numel()] = past[best]
        return out

    def attend(self, layer: int, h, rows, valid, self_row) -> torch.Tensor:
        """Attention of each token over its selected rows and its own row (MLA, absorbed)."""
        keys = torch.cat([rows, self_row[:, None]], dim=1).float()  # [T, k + 1, 328]
        mask = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=1)
        q_lat, q_rope = h @ self.w_q_latent[layer], h @ self.w_q_rope[layer]
        score = (keys[..., :LATENT] @ q_lat[:, :, None] + keys[..., LATENT:LATENT + ROPE] @ q_rope[:, :, None])[..., 0]
        score = score.masked_fill(~mask, float("-inf")) / (LATENT + ROPE) ** 0.5
        p = torch.softmax(score, dim=1)
        return (p[:, None, :] @ keys[..., :LATENT])[:, 0] @ self.w_out[layer]

    def _kv_row(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        """The KV row of hidden states ``h`` [n, hidden]: bf16 [n, 328], last 8 zero."""
        row = torch.zeros((h.shape[0], ROW_VALUES), dtype=torch.bfloat16, device=h.device)
        row[:, : LATENT + ROPE] = (h @ self.w_kv[layer]).to(torch.bfloat16)
        return row
