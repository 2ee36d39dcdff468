"""The indexer's logits as one Triton kernel (``sparsekv bench serve``): per request and
block of keys, the FP8 dot products of every indexer head with the keys, ReLU, the head
weights and the head sum, times each key's scale; read once, the keys are what it costs.
Triton is optional: without it :data:`AVAILABLE` is False and ``serve_model.Ops`` runs
the torch path (``bench/serve_model.py``: the kernel is checked against it first)."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU machines: torch only
    triton = None

AVAILABLE = triton is not None
BLOCK_T = 128  # keys per program

if AVAILABLE:
    @triton.jit
    def _logits(q_ptr, w_ptr, k_ptr, ks_ptr, out_ptr, T, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr):
        b = tl.program_id(1)
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        h = tl.arange(0, H)
        d = tl.arange(0, D)
        live = t < T
        q = tl.load(q_ptr + b * H * D + h[:, None] * D + d[None, :])  # [H, D] fp8
        row = b.to(tl.int64) * T + t  # int64: layers x batch x context x D passes 2^31
        k = tl.load(k_ptr + row[None, :] * D + d[:, None], mask=live[None, :], other=0.0)  # [D, BT] fp8
        s = tl.dot(q, k)  # [H, BT] fp32
        w = tl.load(w_ptr + b * H + h)
        logit = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
        ks = tl.load(ks_ptr + row, mask=live, other=0.0)
        tl.store(out_ptr + row, logit * ks, mask=live)


def indexer_logits(q, w, keys, kscale, out=None):
    """``q`` fp8 [B, H, D], ``w`` float32 [B, H], ``keys`` fp8 [B, T, D], ``kscale`` float32
    [B, T], all contiguous on one GPU -> float32 [B, T] (``out`` when given)."""
    if not AVAILABLE:
        raise RuntimeError("Triton is not installed")
    B, H, D = q.shape
    T = keys.shape[1]
    if out is None:
        out = torch.empty((B, T), dtype=torch.float32, device=q.device)
    _logits[(triton.cdiv(T, BLOCK_T), B)](q, w, keys, kscale, out, T, H=H, D=D, BT=BLOCK_T)
    return out


if AVAILABLE:
    @triton.jit
    def _sparse_mla(q_ptr, lat_ptr, sc_ptr, rope_ptr, idx_ptr, o_ptr, lse_ptr, K, SPLITS, sm_scale, H: tl.constexpr,
                    BH: tl.constexpr, LAT: tl.constexpr, ROPE: tl.constexpr, TILE: tl.constexpr, RB: tl.constexpr,
                    BN: tl.constexpr):
        # SPLITS at run time: one compiled kernel for every batch (the start-up check's too)
        pid = tl.program_id(0)
        b = tl.program_id(1)
        hb = pid % (H // BH)  # the head blocks of a token run side by side: its rows read from HBM once
        s = pid // (H // BH)
        h = hb * BH + tl.arange(0, BH)
        dl = tl.arange(0, LAT)
        dr = tl.arange(0, ROPE)
        qrow = (b * H + h).to(tl.int64) * (LAT + ROPE)
        q_lat = tl.load(q_ptr + qrow[:, None] + dl[None, :])  # [BH, LAT] bf16
        q_rope = tl.load(q_ptr + qrow[:, None] + LAT + dr[None, :])
        m = tl.full([BH], -1e30, tl.float32)  # finite: a tile of masked rows keeps alpha = 1
        l = tl.zeros([BH], tl.float32)
        acc = tl.zeros([BH, LAT], tl.float32)
        per = K // SPLITS
        for start in range(s * per, (s + 1) * per, BN):
            n = start + tl.arange(0, BN)
            ids = tl.load(idx_ptr + b.to(tl.int64) * K + n)
            row = tl.maximum(ids, 0).to(tl.int64)
            # one row: LAT fp8 | LAT / TILE fp32 scales | ROPE bf16 (three views of the same bytes)
            lat = tl.load(lat_ptr + row[:, None] * RB + dl[None, :]).to(tl.float32)
            sc = tl.load(sc_ptr + row[:, None] * (RB // 4) + LAT // 4 + tl.arange(0, LAT // TILE)[None, :])
            lat = tl.reshape(tl.reshape(lat, (BN, LAT // TILE, TILE)) * sc[:, :, None], (BN, LAT)).to(tl.bfloat16)
            rope = tl.load(rope_ptr + row[:, None] * (RB // 2) + (LAT + 4 * (LAT // TILE)) // 2 + dr[None, :])
            sco = tl.dot(q_lat, tl.trans(lat)) + tl.dot(q_rope, tl.trans(rope))  # [BH, BN] fp32
            sco = tl.where((ids >= 0)[None, :], sco * sm_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(sco, 1))
            p = tl.exp(sco - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), lat)
            m = m_new
        out = ((b * SPLITS + s) * H + h).to(tl.int64)
        tl.store(o_ptr + out[:, None] * LAT + dl[None, :], acc / tl.maximum(l, 1e-30)[:, None])
        tl.store(lse_ptr + out, m + tl.log(l))  # l = 0 (every row masked): -inf, no weight below


MLA_HEADS = 32  # heads per program
MLA_ROWS = 32  # rows per tile
MLA_PROGRAMS = 264  # at least this many programs (2 per SM of an H200) where splits allow


def mla_supported(heads: int, kv_lora: int, rope: int, top_k: int, tile: int) -> bool:
    pow2 = all(v & (v - 1) == 0 for v in (kv_lora, rope, kv_lora // tile))
    return AVAILABLE and heads % MLA_HEADS == 0 and kv_lora % tile == 0 and pow2 and rope >= 16 \
        and top_k % MLA_ROWS == 0


def sparse_mla(q, kv, idx, kv_lora: int, tile: int, sm_scale: float):
    """Absorbed MLA over fp8_ds_mla rows, fused: ``q`` bf16 [B, H, kv_lora + rope], ``kv``
    uint8 [rows, row_bytes] (contiguous), ``idx`` int32 [B, K] rows of ``kv`` (-1: masked)
    -> bf16 [B, H, kv_lora]. Each program one token's block of heads over a share of its
    K rows (split so that the GPU is full), the shares combined by their log-sum-exp."""
    B, H, D = q.shape
    K, RB = idx.shape[1], kv.shape[1]
    splits = 1
    while B * (H // MLA_HEADS) * splits < MLA_PROGRAMS and K % (2 * splits * MLA_ROWS) == 0 and splits < 16:
        splits *= 2
    o = torch.empty((B, splits, H, kv_lora), dtype=torch.float32, device=q.device)
    lse = torch.empty((B, splits, H), dtype=torch.float32, device=q.device)
    _sparse_mla[((H // MLA_HEADS) * splits, B)](
        q, kv.view(torch.float8_e4m3fn), kv.view(torch.float32), kv.view(torch.bfloat16), idx, o, lse, K, splits,
        sm_scale, H=H, BH=MLA_HEADS, LAT=kv_lora, ROPE=D - kv_lora, TILE=tile, RB=RB, BN=MLA_ROWS, num_warps=8)
    return (o * torch.softmax(lse, 1).unsqueeze(-1)).sum(1).to(torch.bfloat16)
