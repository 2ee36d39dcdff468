"""The arithmetic of ``sparsekv bench serve``, without torch: the model's shapes
(:class:`Shapes`), how many requests each mode fits on one GPU of the deployment
(:func:`capacity`), each part's lower bound (:func:`bounds`: bytes at the HBM rate, FLOPs
at the H200's peaks), and a prefill's (:func:`prefill_bound`: what recomputing a prefix
costs at least, against which ``bench prefix`` sets serving it from the block store)."""

from __future__ import annotations

from dataclasses import dataclass

from sparsekv.daemon.residency.base import STATE_BYTES_PER_SLOT

from .decode_workload import FILL_STAGING_ROWS

HBM_BPS = 4.8e12  # H200 HBM3e
BF16_FLOPS = 989e12  # H200 dense peaks
FP8_FLOPS = 1979e12
LINK_BPS = 55e9  # pinned host -> GPU, the bulk copy's rate measured on the H200 VM (docs/PERF.md)
GB = 1e9


LATENT_TILE = 128  # latent values per fp32 scale of an fp8_ds_mla row


@dataclass(frozen=True)
class Shapes:
    """One GPU's shapes. Default: DeepSeek-V3.2, attention DP, MoE EP over ``ep`` GPUs."""

    hidden: int = 7168
    q_lora: int = 1536
    kv_lora: int = 512
    rope: int = 64
    nope: int = 128
    v_dim: int = 128
    heads: int = 128
    idx_heads: int = 64
    idx_dim: int = 128
    top_k: int = 2048
    experts: int = 32  # routed experts on this GPU
    ep: int = 8  # GPUs the routed experts are spread over
    top_experts: int = 8
    expert_inter: int = 2048
    dense_inter: int = 18432
    layers: int = 61
    dense_layers: int = 3
    vocab: int = 129280

    @property
    def row_bytes(self) -> int:
        """An fp8_ds_mla row: fp8 latent, one fp32 scale per LATENT_TILE, bf16 rope."""
        return self.kv_lora + 4 * (self.kv_lora // LATENT_TILE) + 2 * self.rope

    @property
    def idx_key_bytes(self) -> int:
        return self.idx_dim + 4  # fp8 key + fp32 scale

    @property
    def a_out(self) -> int:
        return self.q_lora + self.kv_lora + self.rope + self.idx_dim + self.idx_heads

    @property
    def q_dim(self) -> int:
        return self.heads * (self.nope + self.rope)

    def moe_rows(self, batch: int) -> int:
        """Token-expert pairs this GPU's experts take a step: each of the ``ep`` GPUs'
        ``batch`` tokens picks ``top_experts`` of ``experts * ep``, balanced."""
        return batch * self.top_experts

    def expert_counts(self, batch: int) -> list[int]:
        """Rows per active local expert at balanced routing (experts with none left out)."""
        m = self.moe_rows(batch)
        n = min(self.experts, m)
        return [m // n + (e < m % n) for e in range(n)]


PRESETS = {
    "v32": Shapes(),
    # tests: row_bytes 560 (a multiple of 16, as the cuda backend moves rows), every FP8
    # matmul's dimensions multiples of 16 (torch._scaled_mm), the indexer's Triton shapes
    "tiny": Shapes(hidden=256, q_lora=64, kv_lora=512, rope=16, nope=32, v_dim=32, heads=4, idx_heads=16, idx_dim=32,
                   top_k=16, experts=4, ep=2, top_experts=2, expert_inter=64, dense_inter=128, layers=4,
                   dense_layers=1, vocab=512),
}


@dataclass(frozen=True)
class Deployment:
    """One GPU of the deployment: its HBM, its share of the node's host memory, and what
    activations, CUDA graphs and workspaces keep besides weights and KV."""

    hbm_bytes: float = 141e9
    host_bytes: float = 2 * 2**40 / 8  # 2 TiB a node, 8 GPUs
    activation_bytes: float = 5e9


def weight_bytes(sh) -> dict[str, float]:
    """Per-GPU weights of the whole model: matmul weights in FP8, W_UK / W_UV, the router,
    embedding and LM head in bf16 (W_UK / W_UV as an engine keeps them for the absorbed MLA
    after load, dequantised from the checkpoint's FP8 ``wkv_b``); every GPU its own
    attention (data-parallel), 1/ep of the routed experts. The MTP layer is not counted
    (loaded only for speculative decoding, which the bench does not run)."""
    moe_layers = sh.layers - sh.dense_layers
    attn = (sh.a_out * sh.hidden + (sh.q_dim + sh.idx_heads * sh.idx_dim) * sh.q_lora + sh.hidden * sh.heads * sh.v_dim
            + 2 * sh.heads * sh.kv_lora * (sh.nope + sh.v_dim))
    expert = 3 * sh.hidden * sh.expert_inter
    return {"attention": sh.layers * attn, "dense_ffn": sh.dense_layers * 3 * sh.hidden * sh.dense_inter,
            "routed_experts": moe_layers * sh.experts * expert,
            "shared_expert_and_router": moe_layers * (expert + 2 * sh.hidden * sh.experts * sh.ep),
            "embedding_and_head": 2 * 2 * sh.vocab * sh.hidden}


def per_request(sh, context: int, region_rows: int | None = None) -> dict[str, float]:
    """Bytes one request of ``context`` tokens holds: all on the GPU (MLA rows and indexer
    keys in HBM), offloaded (in HBM its indexer keys, a hot region of ``region_rows`` rows
    a layer, default top_k, the residency's state of each slot and the step's slot of each
    top-k column, a layer each; the MLA rows in host memory)."""
    L, region = sh.layers, region_rows or sh.top_k
    return {"gpu_hbm": context * L * (sh.row_bytes + sh.idx_key_bytes),
            "offload_hbm": (context * L * sh.idx_key_bytes + L * region * (sh.row_bytes + STATE_BYTES_PER_SLOT)
                            + L * sh.top_k * 4),
            "offload_host": context * L * sh.row_bytes}


def offload_fixed_hbm(sh) -> int:
    """HBM the offloaded modes take once, whatever the batch: the rank's staging buffer
    (:data:`FILL_STAGING_ROWS` rows a layer, as the bench attaches)."""
    return FILL_STAGING_ROWS * sh.layers * sh.row_bytes


def capacity(sh, context: int, dep: Deployment = Deployment(), region_rows: int | None = None) -> dict:
    """The largest batch of each mode at ``context`` and the arithmetic behind it
    (``region_rows``: the offloaded modes' hot-region rows a layer, default top_k)."""
    w = sum(weight_bytes(sh).values())
    free = dep.hbm_bytes - w - dep.activation_bytes
    req = per_request(sh, context, region_rows)
    fixed = offload_fixed_hbm(sh)
    by_hbm = max(0, int((free - fixed) // req["offload_hbm"]))
    by_host = int(dep.host_bytes // req["offload_host"])
    return {"context": context, "weights_bytes": w, "free_hbm_bytes": free, "offload_fixed_hbm": fixed, **req,
            "gpu": max(0, int(free // req["gpu_hbm"])), "offload": min(by_hbm, by_host),
            "offload_limited_by": "HBM (indexer keys, hot regions)" if by_hbm <= by_host else "host memory"}


def capacity_text(sh, contexts, dep: Deployment = Deployment(), region_rows: int | None = None) -> str:
    """The capacity arithmetic, printed."""
    w = weight_bytes(sh)
    # GB = 1e9 bytes throughout, so that the lines below divide as printed (the host's
    # share is given in GiB: both shown).
    free = dep.hbm_bytes - sum(w.values()) - dep.activation_bytes
    lines = [f"capacity per GPU: HBM {dep.hbm_bytes / GB:.1f} GB - weights {sum(w.values()) / GB:.1f} GB ("
             + ", ".join(f"{k} {v / GB:.1f}" for k, v in w.items())
             + f") - activations {dep.activation_bytes / GB:.1f} GB = {free / GB:.1f} GB free; "
             f"host {dep.host_bytes / GB:.1f} GB ({dep.host_bytes / 2**30:g} GiB)"
             + ("; no HBM is left for KV rows: no mode has a largest batch, the equal-batch configs run alone"
                if free <= 0 else "")]
    for c in contexts:
        cap = capacity(sh, c, dep, region_rows)
        lines.append(f"  context {c}: all on GPU {cap['gpu_hbm'] / GB:.3f} GB a request -> batch {cap['gpu']}; "
                     f"offloaded {cap['offload_fixed_hbm'] / GB:.3f} GB HBM once (staging), then "
                     f"{cap['offload_hbm'] / GB:.3f} GB HBM + {cap['offload_host'] / GB:.3f} GB host a "
                     f"request -> batch {cap['offload']} (limited by {cap['offload_limited_by']})")
    return "\n".join(lines)


def bounds(sh, batch: int, context: int, misses_per_layer: float | None = None) -> dict[str, float | None]:
    """Each part's lower bound in microseconds a layer it runs in (``head``: a step), the
    larger of its bytes at HBM_BPS and its FLOPs at the peaks (FP8 matmuls at FP8_FLOPS,
    bf16 ones at BF16_FLOPS), FP8 byte counts whatever dtype ran; ``query``: c_q -> q and
    W_UK, the projections beside the rows (``proj``: the others); ``swap_in``: the missed
    rows over the link (None without misses: all on the GPU); ``write``: the new token's
    latent, rope key and indexer key read in bf16, its row and key written."""
    B, H, K = batch, sh.heads, min(sh.top_k, context)
    fp8_proj = sh.a_out * sh.hidden + sh.idx_heads * sh.idx_dim * sh.q_lora + sh.hidden * H * sh.v_dim
    bf16_proj = H * sh.kv_lora * sh.v_dim  # W_UV
    fp8_query, bf16_query = sh.q_dim * sh.q_lora, H * sh.kv_lora * sh.nope  # c_q -> q, W_UK
    expert = 3 * sh.hidden * sh.expert_inter
    active = len(sh.expert_counts(B))
    router = sh.hidden * sh.experts * sh.ep

    def bound(nbytes, fp8_flops=0.0, bf16_flops=0.0) -> float:
        return 1e6 * max(nbytes / HBM_BPS, fp8_flops / FP8_FLOPS + bf16_flops / BF16_FLOPS)

    out = {
        "proj": bound(fp8_proj + 2 * bf16_proj, 2 * B * fp8_proj, 2 * B * bf16_proj),
        "query": bound(fp8_query + 2 * bf16_query, 2 * B * fp8_query, 2 * B * bf16_query),
        "write": bound(B * (2 * (sh.kv_lora + sh.rope + sh.idx_dim) + sh.row_bytes + sh.idx_key_bytes)),
        # keys and scales read once, the logits written; the top-k reads them
        "indexer": bound(B * context * (sh.idx_key_bytes + 4), 2 * B * context * sh.idx_heads * sh.idx_dim),
        "topk": bound(B * context * 4),
        "swap_in": None if misses_per_layer is None else 1e6 * misses_per_layer * sh.row_bytes / LINK_BPS,
        "attention": bound(B * K * sh.row_bytes, 0.0, 2 * B * H * K * (2 * sh.kv_lora + sh.rope)),
        "dense_ffn": bound(3 * sh.hidden * sh.dense_inter, 2 * B * 3 * sh.hidden * sh.dense_inter),
        "moe": bound((active + 1) * expert + 2 * router, 2 * (sh.moe_rows(B) + B) * expert, 2 * B * router),
        "head": bound(2 * sh.vocab * sh.hidden, 0.0, 2 * B * sh.vocab * sh.hidden),
    }
    return out


def prefill_bound(sh, tokens: int) -> dict[str, float]:
    """The FLOPs of prefilling one request of ``tokens`` positions on the deployment, and
    the least time they take on its GPUs at the H200's dense peaks (``bound_s``).

    What the prefill must make is every layer's cache of every position (the latent, its
    rope key, the indexer key). Per token, in each layer but the last: the attention's
    projections, the latent's up-projection to per-head keys and values (MLA as a prefill
    runs it, cheaper than the absorbed form), attention over ``min(position, top_k)``
    positions (bf16, heads x (nope + rope + v)), the indexer's logits over every earlier
    position, then the dense FFN or the MoE (the shared expert and the router on the
    request's GPU, its ``top_experts`` routed experts spread over the ``ep`` GPUs); in the
    last layer only the projection of what its cache keeps (its output feeds the LM head
    at one position). Every matmul FP8 (DeepSeek-V3.2's weights are, ``wkv_b`` too), the
    attention bf16. The request's attention and the shared parts run on its GPU (attention
    data-parallel, the named deployment: context parallelism would split them); its routed
    experts' FLOPs count 1 / ep there (balanced routing). Elementwise work, norms and the
    LM head are left out: a lower bound."""
    T, L, H = tokens, sh.layers, sh.heads
    inner = L - 1  # the layers whose outputs the next layer needs
    proj = 2 * (sh.a_out * sh.hidden + (sh.q_dim + sh.idx_heads * sh.idx_dim) * sh.q_lora + sh.hidden * H * sh.v_dim)
    cache_proj = 2 * (sh.kv_lora + sh.rope + sh.idx_dim) * sh.hidden  # the last layer's
    kv_up = 2 * sh.kv_lora * H * (sh.nope + sh.v_dim)
    k = min(sh.top_k, T)
    attended = k * (k + 1) // 2 + (T - k) * k  # sum over positions t = 1..T of min(t, top_k)
    attention = 2 * H * (sh.nope + sh.rope + sh.v_dim) * attended
    indexer = 2 * sh.idx_heads * sh.idx_dim * (T * (T - 1) // 2)
    expert = 2 * 3 * sh.hidden * sh.expert_inter
    moe_layers = inner - sh.dense_layers
    out = {
        "projections": inner * T * proj + T * cache_proj,
        "kv_up": inner * T * kv_up,
        "attention": inner * attention,
        "indexer": inner * indexer,
        "dense_ffn": sh.dense_layers * T * 2 * 3 * sh.hidden * sh.dense_inter,
        "shared_expert_and_router": moe_layers * T * (expert + 2 * sh.hidden * sh.experts * sh.ep),
        "routed_experts": moe_layers * T * sh.top_experts * expert,
    }
    fp8 = (out["projections"] + out["kv_up"] + out["indexer"] + out["dense_ffn"] + out["shared_expert_and_router"]
           + out["routed_experts"] / sh.ep)
    out["bound_s"] = fp8 / FP8_FLOPS + out["attention"] / BF16_FLOPS
    return out
