"""The Triton kernels of ``sparsekv bench serve``. The indexer's logits: per request and
block of keys, the FP8 dot products of every indexer head with the keys, ReLU, the head
weights and the head sum, times each key's scale; read once, the keys are what it costs.
Sparse MLA: gather, dequantisation and attention of a token's top-k fp8_ds_mla rows in
one pass (:class:`MlaConfig`: its tiling, measured on the H200; docs/DESIGN.md §8 has
the tilings and variants that measured slower). Triton is optional: without it :data:`AVAILABLE` is False and ``serve_model.Ops`` runs
the torch path (``bench/serve_model.py``: the kernel is checked against it first)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU machines: torch only
    triton = None

AVAILABLE = triton is not None


@dataclass(frozen=True)
class IndexerConfig:
    """How :func:`indexer_logits` tiles the keys: keys per block, blocks per program (the
    query held in registers across them, their loads pipelined over ``stages``), warps."""

    keys: int = 128
    blocks: int = 8  # at most: fewer (powers of two) while the grid would have under ``programs``
    warps: int = 4
    stages: int = 3
    programs: int = 1056  # 8 per SM of an H200


INDEXER = IndexerConfig()

if AVAILABLE:
    @triton.jit
    def _logits(q_ptr, w_ptr, k_ptr, ks_ptr, out_ptr, T, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                NB: tl.constexpr, STAGES: tl.constexpr):
        b = tl.program_id(1)
        h = tl.arange(0, H)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + b * H * D + h[:, None] * D + d[None, :])  # [H, D] fp8, once for NB blocks
        w = tl.load(w_ptr + b * H + h)
        for i in tl.range(0, NB, num_stages=STAGES):
            t = (tl.program_id(0) * NB + i) * BT + tl.arange(0, BT)
            live = t < T
            row = b.to(tl.int64) * T + t  # int64: layers x batch x context x D passes 2^31
            k = tl.load(k_ptr + row[None, :] * D + d[:, None], mask=live[None, :], other=0.0)  # [D, BT] fp8
            s = tl.dot(q, k)  # [H, BT] fp32
            logit = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
            ks = tl.load(ks_ptr + row, mask=live, other=0.0)
            tl.store(out_ptr + row, logit * ks, mask=live)


def indexer_logits(q, w, keys, kscale, out=None, cfg: IndexerConfig = INDEXER):
    """``q`` fp8 [B, H, D], ``w`` float32 [B, H], ``keys`` fp8 [B, T, D], ``kscale`` float32
    [B, T], all contiguous on one GPU -> float32 [B, T] (``out`` when given)."""
    if not AVAILABLE:
        raise RuntimeError("Triton is not installed")
    B, H, D = q.shape
    T = keys.shape[1]
    if out is None:
        out = torch.empty((B, T), dtype=torch.float32, device=q.device)
    nb = cfg.blocks
    while nb > 1 and triton.cdiv(T, cfg.keys * nb) * B < cfg.programs:
        nb //= 2
    _logits[(triton.cdiv(T, cfg.keys * nb), B)](q, w, keys, kscale, out, T, H=H, D=D, BT=cfg.keys, NB=nb,
                                                STAGES=cfg.stages, num_warps=cfg.warps)
    return out


if AVAILABLE:
    @triton.jit
    def _sparse_mla(q_ptr, lat_ptr, sc_ptr, rope_ptr, idx_ptr, o_ptr, lse_ptr, K, SPLITS, sm_scale, H: tl.constexpr,
                    BH: tl.constexpr, LAT: tl.constexpr, ROPE: tl.constexpr, TILE: tl.constexpr, RB: tl.constexpr,
                    BN: tl.constexpr, STAGES: tl.constexpr):
        # one program: a token's block of BH heads over a share of its K rows (SPLITS at run time: one
        # compiled kernel for every batch)
        pid = tl.program_id(0)
        b = tl.program_id(1)
        NHB: tl.constexpr = H // BH
        hb = pid % NHB  # a token's head blocks run side by side: its rows come from HBM once
        s = pid // NHB
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
        for start in tl.range(s * per, (s + 1) * per, BN, num_stages=STAGES):
            n = start + tl.arange(0, BN)
            ids = tl.load(idx_ptr + b.to(tl.int64) * K + n)
            row = tl.maximum(ids, 0).to(tl.int64)
            # one row: LAT fp8 | LAT / TILE fp32 scales | ROPE bf16 (three views of the same bytes); each
            # value's scale read where it is used (a row's LAT / TILE scales are one cached line)
            k = (tl.load(lat_ptr + row[:, None] * RB + dl[None, :]).to(tl.float32)
                 * tl.load(sc_ptr + row[:, None] * (RB // 4) + LAT // 4 + dl[None, :] // TILE)).to(tl.bfloat16)
            rope = tl.load(rope_ptr + row[:, None] * (RB // 2) + (LAT + 4 * (LAT // TILE)) // 2 + dr[None, :])
            sco = tl.dot(q_lat, tl.trans(k)) + tl.dot(q_rope, tl.trans(rope))  # [BH, BN] fp32
            sco = tl.where((ids >= 0)[None, :], sco * sm_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(sco, 1))
            p = tl.exp(sco - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), k)
            m = m_new
        out = ((b * SPLITS + s) * H + h).to(tl.int64)
        tl.store(o_ptr + out[:, None] * LAT + dl[None, :], acc / tl.maximum(l, 1e-30)[:, None])
        tl.store(lse_ptr + out, m + tl.log(l))  # l = 0 (every row masked): -inf, no weight below


@dataclass(frozen=True)
class MlaConfig:
    """How :func:`sparse_mla` tiles the work: heads per program, rows per tile, warps,
    pipeline stages, and the programs it aims for (the rows split among programs until
    there are as many)."""

    heads: int = 64
    rows: int = 64
    warps: int = 8
    stages: int = 1
    programs: int = 264  # 2 per SM of an H200


MLA = MlaConfig()


def mla_supported(heads: int, kv_lora: int, rope: int, top_k: int, tile: int, cfg: MlaConfig = MLA) -> bool:
    pow2 = all(v & (v - 1) == 0 for v in (kv_lora, rope, tile))
    return AVAILABLE and heads % cfg.heads == 0 and kv_lora % tile == 0 and pow2 and rope >= 16 \
        and top_k % cfg.rows == 0


def sparse_mla(q, kv, idx, kv_lora: int, tile: int, sm_scale: float, cfg: MlaConfig = MLA):
    """Absorbed MLA over fp8_ds_mla rows, fused: ``q`` bf16 [B, H, kv_lora + rope], ``kv``
    uint8 [rows, row_bytes] (contiguous), ``idx`` int32 [B, K] rows of ``kv`` (-1: masked)
    -> bf16 [B, H, kv_lora]. Each program one token's block of heads over a share of its
    K rows (split so that the GPU is full), the shares combined by their log-sum-exp."""
    B, H, D = q.shape
    K, RB = idx.shape[1], kv.shape[1]
    per_split = H // cfg.heads
    splits = 1
    while B * per_split * splits < cfg.programs and K % (2 * splits * cfg.rows) == 0:
        splits *= 2
    o = torch.empty((B, splits, H, kv_lora), dtype=torch.float32, device=q.device)
    lse = torch.empty((B, splits, H), dtype=torch.float32, device=q.device)
    _sparse_mla[(per_split * splits, B)](
        q, kv.view(torch.float8_e4m3fn), kv.view(torch.float32), kv.view(torch.bfloat16), idx, o, lse, K, splits,
        sm_scale, H=H, BH=cfg.heads, LAT=kv_lora, ROPE=D - kv_lora, TILE=tile, RB=RB, BN=cfg.rows,
        STAGES=cfg.stages, num_warps=cfg.warps)
    if splits == 1:
        return o[:, 0].to(torch.bfloat16)
    return (o * torch.softmax(lse, 1).unsqueeze(-1)).sum(1).to(torch.bfloat16)


# -- the new token's writes: its KV row and its indexer key, one kernel each ------------------
if AVAILABLE:
    @triton.jit
    def _pack_row(x_ptr, x_stride, q_ptr, s_ptr, r_ptr, RB: tl.constexpr, LAT: tl.constexpr, ROPE: tl.constexpr,
                  TILE: tl.constexpr):
        b = tl.program_id(0)
        x = x_ptr + b * x_stride
        t = tl.arange(0, TILE)
        ss = 0.0
        for i in tl.static_range(LAT // TILE):
            v = tl.load(x + i * TILE + t).to(tl.float32)
            ss += tl.sum(v * v, 0)
        r = tl.rsqrt(ss / LAT + 1e-6).to(tl.bfloat16).to(tl.float32)  # as serve_model.rms: the factor in bf16
        row = b.to(tl.int64) * RB
        for i in tl.static_range(LAT // TILE):
            v = (tl.load(x + i * TILE + t).to(tl.float32) * r).to(tl.bfloat16).to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(v), 0), 1e-12) / 448.0
            tl.store(q_ptr + row + i * TILE + t, (v / scale).to(tl.float8e4nv))
            tl.store(s_ptr + (row + LAT) // 4 + i, scale)
        e = tl.arange(0, ROPE)
        tl.store(r_ptr + (row + LAT + 4 * (LAT // TILE)) // 2 + e, tl.load(x + LAT + e))

    @triton.jit
    def _quant_key(k_ptr, k_stride, o_ptr, o_stride, s_ptr, s_stride, D: tl.constexpr):
        b = tl.program_id(0)
        d = tl.arange(0, D)
        k = tl.load(k_ptr + b * k_stride + d).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(k), 0), 1e-12) / 448.0
        tl.store(o_ptr + b.to(tl.int64) * o_stride + d, (k / scale).to(tl.float8e4nv))
        tl.store(s_ptr + b.to(tl.int64) * s_stride, scale)


def pack_rows_supported(kv_lora: int, rope: int, tile: int, row_bytes: int) -> bool:
    pow2 = all(v & (v - 1) == 0 for v in (rope, tile))
    return AVAILABLE and pow2 and kv_lora % tile == 0 and kv_lora % 4 == 0 and row_bytes % 4 == 0


def pack_rows(kv, out, kv_lora: int, tile: int) -> None:
    """The new token's fp8_ds_mla rows in one kernel: ``kv`` bf16 [B, kv_lora + rope] (rows
    may be strided, the values contiguous), the latent RMS-normed (``serve_model.rms``) and
    quantised per ``tile`` values, the rope part as it is -> ``out`` uint8 [B, row_bytes],
    contiguous (``serve_model.pack_rows`` of the same)."""
    B, D = kv.shape
    _pack_row[(B,)](kv, kv.stride(0), out.view(torch.float8_e4m3fn), out.view(torch.float32), out.view(torch.bfloat16),
                    RB=out.shape[1], LAT=kv_lora, ROPE=D - kv_lora, TILE=tile, num_warps=1)


def quant_keys(k, out, scale) -> None:
    """The new token's indexer keys in one kernel: ``k`` [B, D] (rows may be strided) -> fp8
    ``out`` [B, D] and fp32 ``scale`` [B] (each row strided as given: a request's last
    position in the layer's keys), amax / 448 a key (``serve_model.quant_keys``)."""
    B, D = k.shape
    _quant_key[(B,)](k, k.stride(0), out, out.stride(0), scale, scale.stride(0), D=D, num_warps=1)
