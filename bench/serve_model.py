"""The compute of ``sparsekv bench serve``: one decoder layer shaped as DeepSeek-V3.2 at
one GPU's shapes of a deployment (attention data-parallel, routed experts
expert-parallel), random weights, run for every layer of a step.

Per layer: the projections (fused x -> [c_q | c_kv | k_rope | k_idx | w_idx], c_q -> q_idx),
the indexer over the whole context (FP8 keys, the new token's written first; logits with
ReLU, head weights and head sum, then top-k); then, on a second stream, the KV rows of
the layer's top-k from a source (HBM or ``swap_in``) while the step's stream does what
does not need them (c_q -> q, W_UK absorbed into the query, the new token's KV row packed
as fp8_ds_mla and written), as an engine schedules a layer's independent work; sparse MLA
over the rows dequantised once both are done, W_UV and o_proj, then the dense FFN (the
first ``dense_layers``) or the MoE (shared expert + the local routed experts, balanced
routing). Every mode runs this schedule (on the CPU the two streams are one). RoPE and the norms' weights are left out (elementwise, a few
us a step). The indexer's top-k is computed and dropped: random weights give meaningless
scores, so the rows read are the bench's top-k sequence, the layer's copied right after
that top-k into the one buffer the rows read (``src.topk``): an engine's top-k kernel hands
its consumers indices it has just written, not a tensor loaded before the step.

:class:`Ops` picks how matmuls and the indexer run on the device, each path checked once
against the plain torch one at a small size before use (a path that fails its check is
not used, and :attr:`Ops.impl` says so): FP8 ``torch._scaled_mm`` /
``torch._scaled_grouped_mm`` and the Triton indexer (``serve_triton``) on a GPU that has
them, else ``dtype`` (float32 on the CPU, for the tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import serve_triton
from .serve_capacity import LATENT_TILE, PRESETS, Shapes  # noqa: F401  (the shapes, without torch)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


# -- fp8_ds_mla rows and indexer keys -----------------------------------------------------
def pack_rows(kv, sh: Shapes):
    """``kv`` [..., kv_lora + rope] -> uint8 [..., row_bytes]: the latent in fp8 with one
    fp32 scale per LATENT_TILE values (amax / FP8_MAX), the rope part in bf16."""
    lat = kv[..., :sh.kv_lora].float().unflatten(-1, (-1, LATENT_TILE))
    scale = lat.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    q = (lat / scale.unsqueeze(-1)).to(FP8).flatten(-2)
    rope = kv[..., sh.kv_lora:].to(torch.bfloat16).contiguous()
    return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8), rope.view(torch.uint8)], -1)


def pack_new_rows(ckv, sh: Shapes):
    """The new token's rows from the projection's ``ckv`` [..., kv_lora + rope]: the latent
    RMS-normed, then :func:`pack_rows` (what ``serve_triton.pack_rows`` computes in one kernel)."""
    return pack_rows(torch.cat([rms(ckv[..., :sh.kv_lora]), ckv[..., sh.kv_lora:]], -1), sh)


def unpack_rows(rows, sh: Shapes, dtype):
    """uint8 [..., row_bytes] -> [..., kv_lora + rope] in ``dtype`` (views of the bytes, no copy
    before the conversion)."""
    tiles = sh.kv_lora // LATENT_TILE
    lat = rows[..., :sh.kv_lora].view(FP8).to(dtype).unflatten(-1, (tiles, LATENT_TILE))
    scale = rows[..., sh.kv_lora:sh.kv_lora + 4 * tiles].view(torch.float32).to(dtype)
    rope = rows[..., sh.kv_lora + 4 * tiles:].view(torch.bfloat16).to(dtype)
    return torch.cat([(lat * scale.unsqueeze(-1)).flatten(-2), rope], -1)


def quant_keys(k):
    """[..., idx_dim] -> (fp8 keys, fp32 scale per key)."""
    scale = k.float().abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    return (k.float() / scale.unsqueeze(-1)).to(FP8), scale


def indexer_reference(q, w, keys, kscale):
    """logits [B, T] = kscale * sum_h w[b, h] * relu(q[b, h] . keys[b, t]) in float32
    (``q`` [B, H, D], ``w`` [B, H], ``keys`` [B, T, D], ``kscale`` [B, T])."""
    s = torch.bmm(q.float(), keys.float().transpose(1, 2))
    return (s.relu() * w.float().unsqueeze(-1)).sum(1) * kscale


def sparse_mla(q, rows, valid, sh: Shapes, dtype):
    """Absorbed MLA over each token's rows: ``q`` [B, H, kv_lora + rope] (the nope part
    through W_UK), ``rows`` uint8 [B, K, row_bytes], ``valid`` bool [B, K]; the latent
    output [B, H, kv_lora]."""
    kv = unpack_rows(rows, sh, dtype)
    s = torch.bmm(q, kv.transpose(1, 2)).float() * (1.0 / math.sqrt(sh.nope + sh.rope))
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    return torch.bmm(torch.softmax(s, -1).to(dtype), kv[..., :sh.kv_lora])


def rms(x):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


# -- matmuls ------------------------------------------------------------------------------
@dataclass
class Lin:
    """A weight ``w`` [N, K] or [G, N, K] (fp8 or the compute dtype), drawn N(0, 1), and its
    scale 1 / sqrt(K); ``s`` / ``s_rows``: the scale as the FP8 kernels take it."""

    w: object
    scale: float
    s: object = None
    s_rows: object = None  # [G, N] for the grouped FP8 matmul

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()


def _close(got, want, tol: float = 3e-2) -> bool:
    got, want = got.float(), want.float()
    return bool(torch.isfinite(got).all()) and float((got - want).abs().max()) <= tol * float(want.abs().max())


class Ops:
    """The step's matmuls, indexer and attention on ``device``; ``impl``: part -> how it runs.

    ``fast``: try the FP8 paths (``torch._scaled_mm``, ``torch._scaled_grouped_mm``) and the
    Triton kernels (indexer, sparse MLA); each is checked against the plain torch path on
    small inputs first."""

    def __init__(self, device, dtype, fast: bool):
        self.device, self.dtype = torch.device(device), dtype
        self.impl: dict[str, str] = {}
        self.one = torch.ones((), dtype=torch.float32, device=self.device)
        gen = torch.Generator(self.device).manual_seed(1)
        self.fp8_mm = fast and self._check("mm", "fp8 torch._scaled_mm", self._try_mm, gen)
        if not self.fp8_mm:
            self.impl["mm"] = f"{dtype} torch.mm"
        self.grouped_kind = "loop"
        for kind, label in (("scaled", "fp8 torch._scaled_grouped_mm"), ("grouped", f"{dtype} torch._grouped_mm")):
            if (kind != "scaled" or self.fp8_mm) and self._check("experts", label, lambda g, k=kind: self._try_grouped(k, g), gen):
                self.grouped_kind = kind
                break
        else:
            self.impl["experts"] += f"; a loop over the experts ({self.impl['mm']})"
        self.triton_indexer = fast and self._check("indexer", "triton fp8 logits + relu + weights + head sum",
                                                  self._try_indexer, gen)
        if not self.triton_indexer:
            tried = self.impl.get("indexer")
            self.impl["indexer"] = (f"{tried}; " if tried else "") + f"{dtype} torch.bmm + relu + sum"
        self.triton_mla = fast and self._check("attention", "triton gather + dequant + sparse MLA (split, lse-combined)",
                                               self._try_mla, gen)
        if not self.triton_mla:
            tried = self.impl.get("attention")
            self.impl["attention"] = (f"{tried}; " if tried else "") + f"index_select + dequant + {dtype} torch.bmm"
        self.triton_write = fast and self._check("write", "triton rms + fp8_ds_mla row pack, indexer key quant "
                                                 "(one kernel each)", self._try_write, gen)
        if not self.triton_write:
            tried = self.impl.get("write")
            self.impl["write"] = (f"{tried}; " if tried else "") + "torch elementwise ops"

    def _check(self, part: str, label: str, fn, gen) -> bool:
        try:
            ok = fn(gen)
            why = "" if ok else "differs from the torch reference"
        except Exception as e:  # noqa: BLE001 - an unsupported path (dtype, arch, missing op): say why, fall back
            ok, why = False, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        self.impl[part] = label if ok else f"{label} not used ({why})"
        return ok

    # -- weights -----------------------------------------------------------------------
    def lin(self, shape, gen, fp8: bool | None = None) -> Lin:
        """A random weight; FP8 where the dense FP8 matmul passed its check (``fp8`` False:
        kept in the compute dtype)."""
        fp8 = self.fp8_mm if fp8 is None else fp8
        w = torch.randn(shape, generator=gen, device=self.device, dtype=torch.bfloat16 if fp8 else self.dtype)
        scale = 1.0 / math.sqrt(shape[-1])
        if not fp8:
            return Lin(w, scale)
        s = torch.full((), scale, dtype=torch.float32, device=self.device)
        rows = torch.full(shape[:-1], scale, dtype=torch.float32, device=self.device) if len(shape) == 3 else None
        return Lin(w.to(FP8), scale, s, rows)

    def experts(self, shape, gen) -> Lin:
        return self.lin(shape, gen, fp8=self.grouped_kind == "scaled" or (self.grouped_kind == "loop" and self.fp8_mm))

    # -- the ops -----------------------------------------------------------------------
    def mm(self, x, lin: Lin):
        """x [M, K] @ lin.w.T -> [M, N] in the compute dtype."""
        if lin.s is not None:
            return torch._scaled_mm(x.to(FP8), lin.w.t(), scale_a=self.one, scale_b=lin.s, out_dtype=self.dtype)
        return torch.mm(x.to(lin.w.dtype), lin.w.t()) * lin.scale

    def grouped(self, x, lin: Lin, offs, counts: list[int]):
        """Rows of ``x`` [M, K] in consecutive groups, ``counts[g]`` (``offs``: their ends,
        int32 on the device) through expert ``g`` of ``lin.w`` [G, N, K] -> [M, N]."""
        w = lin.w[:len(counts)]
        if self.grouped_kind == "scaled":
            a = x.to(FP8)
            sa = torch.ones(a.shape[0], dtype=torch.float32, device=a.device)
            return torch._scaled_grouped_mm(a, w.transpose(1, 2), sa, lin.s_rows[:len(counts)], offs=offs,
                                            out_dtype=self.dtype)
        if self.grouped_kind == "grouped":
            return torch._grouped_mm(x.to(w.dtype), w.transpose(1, 2), offs=offs) * lin.scale
        out, start = [], 0
        for g, n in enumerate(counts):
            out.append(self.mm(x[start:start + n], Lin(w[g], lin.scale, lin.s)))
            start += n
        return torch.cat(out)

    def indexer(self, q, w, keys, kscale, out=None):
        """Logits [B, T] float32 (:func:`indexer_reference`'s); ``q`` [B, H, D] in the compute
        dtype (cast to fp8 for the Triton kernel), ``keys`` fp8 [B, T, D]."""
        if self.triton_indexer:
            return serve_triton.indexer_logits(q.to(FP8).contiguous(), w.float().contiguous(), keys, kscale, out)
        s = torch.bmm(q.to(self.dtype), keys.to(self.dtype).transpose(1, 2))
        return (s.relu() * w.to(s.dtype).unsqueeze(-1)).sum(1, dtype=torch.float32) * kscale

    def attention(self, q, kv, idx, sh: Shapes):
        """Sparse MLA of ``q`` [B, H, kv_lora + rope] over rows ``idx`` [B, K] (-1: masked) of
        ``kv`` uint8 [rows, row_bytes] -> [B, H, kv_lora] (:func:`sparse_mla`'s)."""
        if self.triton_mla and serve_triton.mla_supported(sh.heads, sh.kv_lora, sh.rope, idx.shape[1], LATENT_TILE):
            return serve_triton.sparse_mla(q, kv, idx, sh.kv_lora, LATENT_TILE, 1.0 / math.sqrt(sh.nope + sh.rope))
        rows = kv.index_select(0, idx.reshape(-1).clamp(min=0).long()).view(*idx.shape, sh.row_bytes)
        return sparse_mla(q, rows, idx >= 0, sh, self.dtype)

    def write_row(self, ckv, out, sh: Shapes) -> None:
        """The new token's KV rows: ``ckv`` [B, kv_lora + rope], the latent RMS-normed, packed
        as fp8_ds_mla into ``out`` uint8 [B, row_bytes] (contiguous)."""
        if self.triton_write and serve_triton.pack_rows_supported(sh.kv_lora, sh.rope, LATENT_TILE, sh.row_bytes):
            serve_triton.pack_rows(ckv, out, sh.kv_lora, LATENT_TILE)
            return
        out.copy_(pack_new_rows(ckv, sh))

    def write_key(self, k, out, scale) -> None:
        """The new token's indexer keys ``k`` [B, idx_dim] -> fp8 ``out`` [B, idx_dim] and
        fp32 ``scale`` [B] (:func:`quant_keys`)."""
        if self.triton_write and k.shape[1] & (k.shape[1] - 1) == 0:
            serve_triton.quant_keys(k, out, scale)
            return
        k8, s = quant_keys(k)
        out.copy_(k8)
        scale.copy_(s)

    # -- the checks (small inputs against the plain torch path) -------------------------
    def _try_mm(self, gen) -> bool:
        w = torch.randn(48, 64, generator=gen, device=self.device).to(FP8)
        s = torch.full((), 0.125, device=self.device)
        ok = True
        for m in (1, 8):  # batch 1 too: a single row
            x = torch.randn(m, 64, generator=gen, device=self.device)
            got = torch._scaled_mm(x.to(FP8), w.t(), scale_a=self.one, scale_b=s, out_dtype=torch.bfloat16)
            ok = ok and _close(got, x.to(FP8).float() @ w.float().t() * 0.125)
        return ok

    def _try_grouped(self, kind: str, gen) -> bool:
        counts = [3, 5, 1]
        x = torch.randn(sum(counts), 64, generator=gen, device=self.device, dtype=self.dtype)
        saved = self.grouped_kind
        self.grouped_kind = kind
        try:
            lin = self.lin((3, 32, 64), gen, fp8=kind == "scaled")
            offs = torch.tensor(counts, device=self.device).cumsum(0).to(torch.int32)
            got = self.grouped(x, lin, offs, counts)
        finally:
            self.grouped_kind = saved
        xr = x.to(FP8).float() if kind == "scaled" else x.float()
        want = torch.cat([xr[s:s + n] @ lin.w[g].float().t() for g, (s, n) in
                          enumerate(zip([0, 3, 8], counts))]) * lin.scale
        return _close(got, want)

    def _try_indexer(self, gen) -> bool:
        T = 320  # a part tile at the end; a multiple of 16 as the contexts (Triton specialises on it)
        q = torch.randn(2, 64, 128, generator=gen, device=self.device).to(FP8)
        keys = torch.randn(2, T, 128, generator=gen, device=self.device).to(FP8)
        w = torch.rand(2, 64, generator=gen, device=self.device)
        ks = torch.rand(2, T, generator=gen, device=self.device)
        return _close(serve_triton.indexer_logits(q, w, keys, ks), indexer_reference(q, w, keys, ks))

    def _try_write(self, gen) -> bool:
        sh = PRESETS["v32"]
        a = torch.randn(3, sh.kv_lora + sh.rope + 40, generator=gen, device=self.device).to(torch.bfloat16)
        ckv = a[:, 8:8 + sh.kv_lora + sh.rope]  # rows strided, as the split projection's
        out = torch.empty(3, sh.row_bytes, dtype=torch.uint8, device=self.device)
        serve_triton.pack_rows(ckv, out, sh.kv_lora, LATENT_TILE)
        want = pack_new_rows(ckv, sh)
        keys = torch.zeros(3, 5, sh.idx_dim, dtype=FP8, device=self.device)
        scale = torch.zeros(3, 5, device=self.device)
        k = a[:, :sh.idx_dim]
        serve_triton.quant_keys(k, keys[:, -1], scale[:, -1])
        k8, s = quant_keys(k)
        return (_close(unpack_rows(out, sh, torch.float32), unpack_rows(want, sh, torch.float32))
                and _close(keys[:, -1].float() * scale[:, -1:], k8.float() * s.unsqueeze(-1))
                and not keys[:, :-1].float().any() and not scale[:, :-1].any())

    def _try_mla(self, gen) -> bool:
        sh = PRESETS["v32"]
        kv = pack_rows(torch.randn(512, sh.kv_lora + sh.rope, generator=gen, device=self.device), sh)
        q = torch.randn(3, sh.heads, sh.kv_lora + sh.rope, generator=gen, device=self.device).to(torch.bfloat16)
        idx = torch.randint(0, 512, (3, 256), generator=gen, device=self.device, dtype=torch.int32)
        idx[0, 100:] = -1
        got = serve_triton.sparse_mla(q, kv, idx, sh.kv_lora, LATENT_TILE, 1.0 / math.sqrt(sh.nope + sh.rope))
        rows = kv.index_select(0, idx.reshape(-1).clamp(min=0).long()).view(3, 256, sh.row_bytes)
        return _close(got, sparse_mla(q.float(), rows, idx >= 0, sh, torch.float32))


# -- the model ----------------------------------------------------------------------------
@dataclass
class Model:
    """One layer's weights (they serve every layer: the same bytes per layer) and the LM head."""

    sh: Shapes
    ops: Ops
    w: dict = field(default_factory=dict)
    _side: object = field(default=None, repr=False)

    @classmethod
    def build(cls, sh: Shapes, ops: Ops, seed: int = 0) -> "Model":
        gen = torch.Generator(ops.device).manual_seed(seed)
        H, E = sh.hidden, sh.experts
        m = cls(sh, ops)
        m.w = {"wa": ops.lin((sh.a_out, H), gen), "wb_idx": ops.lin((sh.idx_heads * sh.idx_dim, sh.q_lora), gen),
               "wb_q": ops.lin((sh.q_dim, sh.q_lora), gen),
               "wo": ops.lin((H, sh.heads * sh.v_dim), gen),
               "w_uk": torch.randn(sh.heads, sh.nope, sh.kv_lora, generator=gen, device=ops.device,
                                   dtype=ops.dtype) / math.sqrt(sh.nope),
               "w_uv": torch.randn(sh.heads, sh.kv_lora, sh.v_dim, generator=gen, device=ops.device,
                                   dtype=ops.dtype) / math.sqrt(sh.kv_lora),
               "dense_up": ops.lin((2 * sh.dense_inter, H), gen), "dense_down": ops.lin((H, sh.dense_inter), gen),
               "shared_up": ops.lin((2 * sh.expert_inter, H), gen), "shared_down": ops.lin((H, sh.expert_inter), gen),
               "experts_up": ops.experts((E, 2 * sh.expert_inter, H), gen),
               "experts_down": ops.experts((E, H, sh.expert_inter), gen),
               "router": ops.lin((E * sh.ep, H), gen, fp8=False), "head": ops.lin((sh.vocab, H), gen, fp8=False)}
        return m

    def mlp(self, h, up: str, down: str):
        g, u = self.ops.mm(h, self.w[up]).chunk(2, -1)
        return self.ops.mm(torch.nn.functional.silu(g) * u, self.w[down])

    def moe(self, h, offs, counts: list[int]):
        """Shared expert + routed experts. The router runs (its choice unused: routing is
        balanced); the pairs this GPU's experts would get through the all-to-all are its
        own tokens ``top_experts`` times over, grouped by expert, combined by mean."""
        sh, ops = self.sh, self.ops
        torch.topk(ops.mm(h, self.w["router"]), sh.top_experts, dim=-1)
        rows = h.repeat(sh.top_experts, 1)
        g, u = ops.grouped(rows, self.w["experts_up"], offs, counts).chunk(2, -1)
        y = ops.grouped(torch.nn.functional.silu(g) * u, self.w["experts_down"], offs, counts)
        return self.mlp(h, "shared_up", "shared_down") + y.view(sh.top_experts, -1, sh.hidden).mean(0)

    def layer(self, layer: int, x, state, src, mark):
        """One decoder layer over ``x`` [B, hidden]; ``state``: the batch's indexer keys and
        MoE groups (:class:`BatchState`), ``src``: where the layer's KV rows come from and
        its new row goes (``begin``, ``topk``, ``rows``, ``new_rows``; ``end`` after the last layer, ``finish`` after
        the head),
        ``mark(part)``: called as each part starts, on the step's stream (``swap_in``: the
        wait for the rows after the work beside them), and as the rows begin and end on
        theirs (``rows``, ``rows_end``). Returns the new ``x``."""
        sh, ops, w = self.sh, self.ops, self.w
        B, H, R = x.shape[0], sh.heads, sh.nope + sh.rope
        mark("proj")
        a = ops.mm(rms(x), w["wa"])
        cq, ckv, k_idx, w_idx = a.split([sh.q_lora, sh.kv_lora + sh.rope, sh.idx_dim, sh.idx_heads], -1)
        cq = rms(cq)
        q_idx = ops.mm(cq, w["wb_idx"])
        mark("write")
        ops.write_key(k_idx, state.keys[layer, :, -1], state.kscale[layer, :, -1])
        mark("indexer")
        logits = ops.indexer(q_idx.view(B, sh.idx_heads, sh.idx_dim), w_idx, state.keys[layer], state.kscale[layer])
        mark("topk")
        torch.topk(logits, min(sh.top_k, logits.shape[1]), dim=-1, sorted=False)
        topk = src.topk(layer)
        side = self._side_stream(x)
        if side is not None:  # the rows on the side stream, from here (after the top-k) on
            side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):  # (None: the step's own stream)
            mark("rows")
            kv, idx = src.rows(layer, topk)
            mark("rows_end")
        mark("query")
        q = ops.mm(cq, w["wb_q"]).view(B, H, R)
        q_lat = torch.bmm(q[..., :sh.nope].transpose(0, 1), w["w_uk"]).transpose(0, 1)
        q = torch.cat([q_lat, q[..., sh.nope:]], -1)
        mark("write")
        ops.write_row(ckv, src.new_rows(layer), sh)
        mark("swap_in")
        if side is not None:
            torch.cuda.current_stream(x.device).wait_stream(side)
        mark("attention")
        o = ops.attention(q, kv, idx, sh)
        mark("proj")
        o = torch.bmm(o.transpose(0, 1), w["w_uv"]).transpose(0, 1).reshape(B, H * sh.v_dim)
        x = x + ops.mm(o, w["wo"])
        mark("ffn")
        h = rms(x)
        if layer < sh.dense_layers:
            return x + self.mlp(h, "dense_up", "dense_down")
        return x + self.moe(h, state.offs, state.counts)

    def _side_stream(self, x):
        """The stream a layer's rows come in on (one per model and device; None on the CPU)."""
        if not x.is_cuda:
            return None
        if self._side is None or self._side.device != x.device:
            self._side = torch.cuda.Stream(device=x.device)
        return self._side

    def step(self, x, state, src, mark=lambda part: None):
        """A decode step over every layer, then the LM head: logits [B, vocab]."""
        mark("begin")
        src.begin()
        for layer in range(self.sh.layers):
            x = self.layer(layer, x, state, src, mark)
        src.end()
        mark("head")
        out = self.ops.mm(rms(x), self.w["head"])
        src.finish()
        mark(None)
        return out


class BatchState:
    """A batch's own device state: each layer's indexer keys over the context (fp8
    [layers, B, context, idx_dim] and fp32 scales), the new token's key written at the
    last position, and the MoE groups of the batch size (made before any capture)."""

    def __init__(self, sh: Shapes, batch: int, context: int, device, gen=None):
        self.keys = torch.empty((sh.layers, batch, context, sh.idx_dim), dtype=FP8, device=device)
        self.kscale = torch.empty((sh.layers, batch, context), dtype=torch.float32, device=device)
        k = torch.randn((batch, context, sh.idx_dim), generator=gen, device=device)
        k8, s = quant_keys(k)
        self.keys.copy_(k8.expand_as(self.keys))
        self.kscale.copy_(s.expand_as(self.kscale))
        self.counts = sh.expert_counts(batch)
        self.offs = torch.tensor(self.counts, device=device).cumsum(0).to(torch.int32)
