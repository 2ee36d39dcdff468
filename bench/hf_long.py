"""DeepSeek-V3.2 under Hugging Face transformers at long context: ``model.generate`` with
its rows in sparsekv (``sparsekv.hf``, the doorbell transport) against transformers' own
eager path with its ``DynamicCache``, in one run.

    python -m sparsekv.bench.hf_long --quick --json hf.json       # 32K, batch 1 (~2 min)
    python -m sparsekv.bench.hf_long --json hf.json               # 32K and 128K, batch 1, 2, 4, 8
    python -m sparsekv.bench.hf_long --prefill synthetic --json hf.json   # the same, no prefill compute

The model has DeepSeek-V3.2's attention dims (kv_lora 512, rope 64, 128 heads, indexer
64 x 128, top-k 2048), ``--layers`` layers, a small dense MLP and vocabulary (they are not
what is measured) and random bf16 weights. Each config (context, batch) runs both paths
on the same random prompt, then ``--new-tokens`` greedy steps. How the caches get the
prompt (``--prefill``, named in the JSON):

- ``real`` (the default; the tracked figures): a chunked prefill of ``context`` tokens
  (``prefill_chunk_size``, sized to keep the indexer's and eager attention's score tensors
  under ``--chunk-gib``). Eager attention is dense over the whole cache per chunk: a 128K
  config takes minutes on an H200.
- ``synthetic``: no prefill compute. Both caches are filled directly with the same content
  for ``context`` positions: per layer and position a random latent through the layer's
  own ``kv_a_layernorm``, a random rope key, and random indexer keys through the
  indexer's ``k_norm`` (``content``, seeded per layer and span, so both paths get equal
  values). sparsekv's ``SparseKVCache.fill`` writes every layer's rows of a span (~256 MiB)
  to the pool through the write path and keeps the indexer keys on the GPU; transformers'
  ``DynamicCache`` gets what its eager path caches: per-head keys and values from the same
  latents and rope keys through the module's own ``expand_kv`` (its ``kv_b_proj``), and
  the indexer keys through ``Cache.update_indexer``. ``generate`` then runs on a prompt of
  ``context + 1`` tokens: the caches hold all but the last, so each of the
  ``--new-tokens`` forwards is a decode step over the same keys on both paths. Per path,
  ``fill_s``: the time the filling took (not in tokens/s). The tracked figures are not
  set from it.

Per path: decode tokens/s (batch x steps / time between the first and last step, each
step synchronised), the HBM the cache holds for KV at the end (eager: the DynamicCache's
expanded keys, values and indexer keys; sparsekv: the indexer keys it keeps on the GPU
plus the hot slab's bytes in the daemon's arena), peak HBM allocated by torch during the
prefill (or fill) and the generation, and for sparsekv the daemon's hits and misses per
step. Per config: ``same_tokens``, ``max_logit_diff`` (sparsekv's logits
against eager's over the steps before any sequence parts) and ``diverged`` (for each
sequence that parts: the step, and both paths' margins between their two best logits
there: a near tie tipped by a last-bit difference, or not). A path that runs out of
memory says so (``oom``; ``"predicted"`` where eager's cache would not fit in what is
free, so it is not tried). The figures the docs track are ``hf_dsv32_kv_hbm_ratio_32k``
(sparsekv's KV HBM / eager's, 32K, batch 1) and ``hf_dsv32_tokens_per_s_ratio_32k``
(sparsekv's tokens/s / eager's, 32K, batch 1), from a real prefill.

``--device cpu --dims tiny`` runs the same on the CPU through a cpu daemon (zmq): a smoke
test of the bench itself, not a figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

try:
    import torch
    from transformers import (DeepseekV32Config, DeepseekV32ForCausalLM, DynamicCache, LogitsProcessor,
                              LogitsProcessorList)
except ImportError:  # one line, not a traceback
    sys.exit("sparsekv.bench.hf_long needs torch and transformers: pip install 'sparsekv[transformers]'")

from sparsekv import hf
from sparsekv.hf.geometry import Geometry
from sparsekv.client import Client

from .bench import output_problem
from .private_daemon import PrivateDaemon

REAL = dict(hidden_size=7168, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
            v_head_dim=128, num_attention_heads=128, num_key_value_heads=128, index_n_heads=64, index_head_dim=128,
            index_topk=2048, intermediate_size=2048, vocab_size=1024)
TINY = dict(hidden_size=64, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
            num_attention_heads=4, num_key_value_heads=4, index_n_heads=2, index_head_dim=32, index_topk=16,
            intermediate_size=64, vocab_size=128)
BLOCK_SIZE = 64
GIB = 1 << 30
FILL_BYTES = 256 << 20  # pool rows per fill() call (every layer's): large writes


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class StepClock(LogitsProcessor):
    """The time after each forward of a generation (the stream synchronised first)."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def __call__(self, input_ids, scores):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        return scores

    def tokens_per_s(self, batch: int) -> float:
        steps = len(self.times) - 1  # the decode steps after the prefill's token
        return batch * steps / (self.times[-1] - self.times[0]) if steps > 0 else 0.0


def build_model(dims: dict, layers: int, max_positions: int, device: torch.device, dtype: torch.dtype):
    cfg = DeepseekV32Config(**dims, num_hidden_layers=layers, first_k_dense_replace=layers,
                            mlp_layer_types=["dense"] * layers, max_position_embeddings=max_positions,
                            pad_token_id=None, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = DeepseekV32ForCausalLM(cfg)
    return model.to(dtype).eval()


def chunk_for(context: int, batch: int, dims: dict, budget_bytes: int) -> int:
    """A prefill chunk whose score tensors (eager attention's [batch, heads, chunk,
    context] in bf16 and fp32, the indexer's [batch, chunk, index_heads, context] fp32)
    stay under ``budget_bytes``."""
    per_token = batch * context * (dims["num_attention_heads"] * 8 + dims["index_n_heads"] * 4)
    return max(16, min(context, budget_bytes // per_token))


def run_path(model, ids, new_tokens: int, chunk, kv_bytes, counts=None, make_cache=None, filled=False) -> dict:
    """One generation; ``kv_bytes(result)``: the KV bytes held at its end; ``counts()``:
    the daemon's (hits, misses) so far; ``make_cache()``: the ``past_key_values`` to
    start from (None: generate makes its own); ``filled``: it holds all of ``ids`` but the
    last token (a synthetic prefill, timed as ``fill_s``), so every forward is a decode
    step. ``chunk``: ``prefill_chunk_size`` (None: no chunked prefill)."""
    dev = ids.device
    clock = StepClock(dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    before = counts() if counts else None
    out = {}
    try:
        t0 = time.perf_counter()
        kw = {} if make_cache is None else {"past_key_values": make_cache()}
        if filled:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            out["fill_s"] = round(time.perf_counter() - t0, 2)
        with torch.no_grad():
            res = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                                 prefill_chunk_size=chunk, logits_processor=LogitsProcessorList([clock]),
                                 return_dict_in_generate=True, output_scores=True, **kw)
        out["tokens_per_s"] = round(clock.tokens_per_s(ids.shape[0]), 2)
        out["kv_hbm_bytes"] = int(kv_bytes(res))
        out["tokens"] = res.sequences[:, ids.shape[1]:].cpu()
        out["scores"] = torch.stack(res.scores, 1).float().cpu()  # [batch, steps, vocab]
        del res
    except torch.OutOfMemoryError as e:
        out["oom"] = True
        out["error"] = " ".join(str(e).split())[:200]
    if dev.type == "cuda":
        out["peak_hbm_bytes"] = int(torch.cuda.max_memory_allocated(dev))
    if counts and "oom" not in out:
        after = counts()
        steps = new_tokens if filled else max(1, new_tokens - 1)  # a real prefill reads nothing from the pool
        out["hits_per_step"] = round((after[0] - before[0]) / steps, 1)
        out["misses_per_step"] = round((after[1] - before[1]) / steps, 1)
    return out


def content(model, layer: int, batch: int, start: int, stop: int, seed: int):
    """The synthetic prefill of positions ``start .. stop - 1`` of ``layer``, the same on
    every call: the pool rows [batch, n, kv_lora_rank + rope] (a random latent through the
    layer's own ``kv_a_layernorm``, then a random rope key) and the indexer keys [batch,
    n, index_dim] (random, through the indexer's own ``k_norm``)."""
    cfg, attn, dev = model.config, model.model.layers[layer].self_attn, model.device
    g = torch.Generator(dev).manual_seed(((seed * 256 + layer) << 32) + start)
    raw = torch.randn(batch, stop - start, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=g, device=dev,
                      dtype=model.dtype)
    latent = attn.kv_a_layernorm.forward(raw[..., :cfg.kv_lora_rank])  # forward(): not sparsekv's hook
    keys = torch.randn(batch, stop - start, cfg.index_head_dim, generator=g, device=dev, dtype=model.dtype)
    return torch.cat([latent, raw[..., cfg.kv_lora_rank:]], dim=-1), attn.indexer.k_norm(keys)


def fill_spans(context: int, batch: int, geo: Geometry) -> list[tuple[int, int]]:
    """The position spans both paths fill in (the same, so that ``content`` matches)."""
    step = max(1, FILL_BYTES // (geo.num_layers * batch * geo.row_bytes))
    return [(s, min(context, s + step)) for s in range(0, context, step)]


def fill_sparsekv(model, cache, spans, seed: int):
    """sparsekv's cache filled with the synthetic prefill: every layer's rows of a span in
    one ``fill`` (through the write path into the pool), the indexer keys on the device."""
    layers = model.config.num_hidden_layers
    for start, stop in spans:
        parts = [content(model, layer, cache.batch, start, stop, seed) for layer in range(layers)]
        cache.fill(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
        del parts
    return cache


def fill_eager(model, batch: int, spans, seed: int) -> DynamicCache:
    """transformers' DynamicCache filled with the same synthetic prefill, in its format:
    per layer the per-head keys and values the eager path caches (each span's latents
    and rope keys through the attention module's own ``expand_kv``, its ``kv_b_proj``)
    and the indexer keys (``Cache.update_indexer``)."""
    cfg = model.config
    cache = DynamicCache(config=cfg)
    context = spans[-1][1]
    heads, nope, rope = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    for layer_idx, layer in enumerate(cache.layers):
        attn = model.model.layers[layer_idx].self_attn
        keys = torch.empty(batch, heads, context, nope + rope, device=model.device, dtype=model.dtype)
        values = torch.empty(batch, heads, context, cfg.v_head_dim, device=model.device, dtype=model.dtype)
        index_keys = torch.empty(batch, context, cfg.index_head_dim, device=model.device, dtype=model.dtype)
        for start, stop in spans:
            rows, index_keys[:, start:stop] = content(model, layer_idx, batch, start, stop, seed)
            k, v = attn.expand_kv(rows[:, None, :, :cfg.kv_lora_rank], rows[:, None, :, cfg.kv_lora_rank:])
            keys[:, :, start:stop], values[:, :, start:stop] = k, v
            del rows, k, v
        layer.lazy_initialization(keys[:, :, :0], values[:, :, :0])
        layer.keys, layer.values = keys, values  # its update() would concatenate: a second copy of the layer
        cache.update_indexer(index_keys, layer_idx)
        del keys, values, index_keys
    return cache


def divergence(tokens, ref_tokens, scores, ref_scores) -> tuple[list[dict], float]:
    """Where two greedy generations part: for each sequence whose tokens differ, the first
    step that differs and there each path's margin between its two best logits (a margin
    near 0 is a near tie that a last-bit difference of the attention tips); and the largest
    logit difference over the steps before any sequence parts (``scores`` [batch, steps,
    vocab], the reference's ``ref_``)."""
    parted = []
    first = tokens.shape[1]
    for b in range(tokens.shape[0]):
        diff = torch.nonzero(tokens[b] != ref_tokens[b]).flatten()
        if not diff.numel():
            continue
        j = int(diff[0])
        first = min(first, j)
        mine, ref = scores[b, j].topk(2).values, ref_scores[b, j].topk(2).values
        parted.append({"seq": b, "step": j, "margin": round(float(mine[0] - mine[1]), 5),
                       "ref_margin": round(float(ref[0] - ref[1]), 5)})
    same = (scores[:, :first] - ref_scores[:, :first]).abs()
    return parted, round(float(same.max()) if same.numel() else 0.0, 5)


def eager_kv_need(dims: dict, layers: int, batch: int, positions: int) -> int:
    """Bytes of transformers' DynamicCache (bf16) at ``positions``: expanded keys and
    values per head, and the indexer keys."""
    heads = dims["num_attention_heads"]
    per = heads * (dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"] + dims["v_head_dim"]) + dims["index_head_dim"]
    return 2 * per * positions * batch * layers


def eager_kv_bytes(res) -> int:
    total = 0
    for layer in res.past_key_values.layers:
        for t in (layer.keys, layer.values, getattr(layer, "indexer_keys", None)):
            total += t.numel() * t.element_size() if t is not None else 0
    return total


def run(a) -> dict:
    dev = torch.device(a.device)
    dims = TINY if a.dims == "tiny" else REAL
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    contexts, batches = a.contexts, a.batches
    max_len = max(contexts) + a.new_tokens + (a.prefill == "synthetic")
    model = build_model(dims, a.layers, max_len, dev, dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    say(f"model: {a.layers} layers, {weights / GIB:.1f} GiB of weights on {dev}")
    blocks_per_seq = -(-max_len // BLOCK_SIZE)
    host_rows = max(batches) * blocks_per_seq * BLOCK_SIZE
    geo = Geometry.of(model)
    layout = geo.layout(max(batches), host_rows)
    rows: list[dict] = []
    summary: dict = {"bench": "hf_dsv32", "device": str(dev), "layers": a.layers, "dims": a.dims,
                     "prefill": a.prefill, "new_tokens": a.new_tokens, "weights_bytes": weights, "configs": rows}
    cuda = dev.type == "cuda"
    extra = ["--device-arena-size", f"{-(-(2 * layout.slab_bytes + GIB) // GIB)}GiB", "--devices",
             str(dev.index or 0)] if cuda else []
    with contextlib.ExitStack() as stack:
        d = stack.enter_context(PrivateDaemon(pool_bytes=layout.pool_bytes + (64 << 20),
                                              backend="cuda" if cuda else "cpu", extra_args=extra,
                                              start_timeout_s=600))
        c = stack.enter_context(Client(d.run_dir, name="bench-hf", device=str(dev) if cuda else "cpu",
                                       timeout_s=600))

        def counts():
            s = c.stats()
            return int(s.get("hits", 0)), int(s.get("misses", 0))

        for context in contexts:
            for batch in batches:
                synthetic = a.prefill == "synthetic"  # the caches hold `context` positions; one more token
                ids = torch.randint(0, dims["vocab_size"], (batch, context + synthetic), device=dev,
                                    generator=torch.Generator(dev).manual_seed(context + batch))
                seed = context + batch
                spans = fill_spans(context, batch, geo) if synthetic else None
                chunk = None if synthetic else chunk_for(context, batch, dims, int(a.chunk_gib * GIB))
                row = {"context": context, "batch": batch}
                row.update({"fill_spans": len(spans)} if synthetic else {"prefill_chunk": chunk})
                say(f"context {context} batch {batch}: sparsekv ...")
                transport = "doorbell" if cuda else "zmq"
                if c.attachment is None:
                    hf.enable(model, c, max_batch=max(batches), host_rows=host_rows, block_size=BLOCK_SIZE,
                              transport=transport)
                else:
                    hf.enable(model, c, block_size=BLOCK_SIZE, transport=transport)
                cache = hf.SparseKVCache(model.sparsekv, batch, context, context + a.new_tokens)
                try:
                    row["sparsekv"] = run_path(model, ids, a.new_tokens, chunk,
                                               lambda res: cache.kv_bytes() + layout.slab_bytes, counts,
                                               lambda: fill_sparsekv(model, cache, spans, seed) if synthetic
                                               else cache, filled=synthetic)
                finally:
                    cache.release()
                    hf.disable(model)
                model.set_attn_implementation("eager")
                need = eager_kv_need(dims, a.layers, batch, context + a.new_tokens)
                if cuda:  # what the sparsekv run left in torch's cache is free for eager
                    torch.cuda.empty_cache()
                free = torch.cuda.mem_get_info(dev)[0] if cuda else None
                if free is not None and need > free:  # minutes of prefill to learn what the sizes say
                    say(f"context {context} batch {batch}: eager skipped: its cache needs {need / GIB:.1f} GiB, "
                        f"{free / GIB:.1f} GiB free")
                    row["eager"] = {"oom": "predicted", "kv_hbm_bytes_needed": need, "hbm_free_bytes": int(free)}
                else:
                    say(f"context {context} batch {batch}: eager (DynamicCache) ...")
                    row["eager"] = run_path(model, ids, a.new_tokens, chunk, eager_kv_bytes,
                                            make_cache=(lambda: fill_eager(model, batch, spans, seed)) if synthetic
                                            else None, filled=synthetic)
                s, e = row["sparsekv"], row["eager"]
                if "tokens" in s and "tokens" in e:
                    row["diverged"], row["max_logit_diff"] = divergence(s["tokens"], e["tokens"], s["scores"],
                                                                        e["scores"])
                    row["same_tokens"] = round(float((s["tokens"] == e["tokens"]).float().mean()), 3)
                for path in (s, e):
                    path.pop("tokens", None)
                    path.pop("scores", None)
                if "oom" not in s and "oom" not in e:
                    row["kv_hbm_ratio"] = round(s["kv_hbm_bytes"] / e["kv_hbm_bytes"], 4)
                    row["tokens_per_s_ratio"] = round(s["tokens_per_s"] / e["tokens_per_s"], 3)
                say(json.dumps(row))
                rows.append(row)
                if context == 32768 and batch == 1 and "kv_hbm_ratio" in row and a.prefill == "real":
                    summary["hf_dsv32_kv_hbm_ratio_32k"] = row["kv_hbm_ratio"]
                    summary["hf_dsv32_tokens_per_s_ratio_32k"] = row["tokens_per_s_ratio"]
                if a.json_path:  # after each config: a run cut short keeps what it measured
                    with open(a.json_path, "w") as f:
                        json.dump(summary, f, indent=1)
    return summary


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparsekv.bench.hf_long", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="32K context, batch 1, 16 new tokens (the tracked figures)")
    p.add_argument("--contexts", type=_ints, default=None, help="comma list (default 32768,131072)")
    p.add_argument("--batches", type=_ints, default=None, help="comma list (default 1,2,4,8)")
    p.add_argument("--new-tokens", type=int, default=None, help="decode steps per generation (default 32)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--chunk-gib", type=float, default=12.0,
                   help="prefill chunks sized so that eager attention's and the indexer's score tensors "
                        "take about this (GiB)")
    p.add_argument("--prefill", choices=["real", "synthetic"], default="real",
                   help="real: both paths prefill the prompt (chunked); synthetic: both caches are filled with the "
                        "same random rows, no prefill compute (see the docstring)")
    p.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for a smoke test (with --dims tiny)")
    p.add_argument("--dims", choices=["real", "tiny"], default="real")
    p.add_argument("--json", dest="json_path", help="write the figures here (JSON), after each config")
    a = p.parse_args(argv)
    a.contexts = a.contexts or ([32768] if a.quick else [32768, 131072])
    a.batches = a.batches or ([1] if a.quick else [1, 2, 4, 8])
    a.new_tokens = a.new_tokens or (16 if a.quick else 32)
    why = output_problem(a.json_path, "--json") if a.json_path else None
    if why:
        p.error(why)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("torch sees no CUDA device (use --device cpu --dims tiny for a smoke test)")
    summary = run(a)
    print(json.dumps({k: v for k, v in summary.items() if k != "configs"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
