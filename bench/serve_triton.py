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
