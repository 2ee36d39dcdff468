"""The run of ``sparsekv bench serve`` (imports torch): the model, the offloaded handles
once, then each config (context, batch, modes): its top-k sequence, its rows, each mode's
step captured and timed in turn, then each mode's step captured once more with CUDA
events at its parts and replayed for them; figures written after each config."""

from __future__ import annotations

import gc
import sys
import time

import numpy as np
import torch

from .decode_modes import DEVICE, capture_step
from .decode_report import write_json
from .decode_workload import gather_blocks, generate
from .serve_capacity import Deployment, capacity, capacity_text
from .serve_model import PRESETS, BatchState, Model, Ops
from .serve_modes import (COUNTERS, PART_REPLAYS, HbmRows, Offload, Static, SwappedRows, TILE_ROWS, block_table,
                          offload_layout, parts, row_tile, say, timed)
from .serve_report import MODES, OFFLOADED, Result, headline, plot, set_parts, summary, table

__all__ = ["PRESETS", "main"]
# the mode each mode's paired difference is taken against (the first of these that ran; else the first mode)
PAIRED_WITH = {"daemon": ("inproc",), "prefetch": ("daemon",)}
# Left free on this GPU besides the all-on-GPU rows (its graph's activations and workspaces,
# under 1 GB at the largest batches); a fill that runs out anyway skips the mode, not the config.
HBM_MARGIN_BYTES = 3 << 30


def configs(opts, caps: dict) -> list[tuple[int, int, float, tuple[str, ...]]]:
    """(context, batch, layer overlap, modes): the equal-batch configs at the first
    context, then each mode at its largest batch per context, at ``--layer-overlap``; the
    first context's largest equal batch also at each of ``--overlaps`` (right after it at
    ``--layer-overlap``, its offloaded modes only: the all-on-GPU step reads the same rows
    from HBM whatever the overlap, so its run at ``--layer-overlap`` is the baseline of
    every overlap); one config per (context, batch, overlap)."""
    off = tuple(m for m in opts.modes if m in OFFLOADED)
    o = opts.layer_overlap
    want: dict[tuple[int, int, float], set] = {}
    for b in opts.batches:
        want.setdefault((opts.contexts[0], b, o), set()).update(opts.modes)
    for c, cap in caps.items():
        if "gpu" in opts.modes and cap["gpu"] > 0:
            want.setdefault((c, cap["gpu"], o), set()).add("gpu")
        if off and cap["offload"] > 0:
            want.setdefault((c, cap["offload"], o), set()).update(off)
    # The more overlaps right after the same batch at --layer-overlap (offloaded modes only).
    first = (opts.contexts[0], max(opts.batches), o)
    more = [((c, b, x), set(off)) for c, b, x in sorted({first[:2] + (x,) for x in opts.overlaps if x != o})] \
        if off else []
    order = {m: i for i, m in enumerate(MODES)}
    plan = []
    for key, ms in sorted(want.items()):
        plan += [(key, ms)] + (more if key == first else [])
    return [(c, b, x, tuple(sorted(ms, key=order.get))) for (c, b, x), ms in plan]


def _free() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def run_config(model, off, tile, opts, context: int, batch: int, modes, host_rows: int, mirror,
               device=None, overlap: float | None = None) -> list[Result]:
    """One config's results: its modes (``off``: the offloaded handles) timed in turn over
    one top-k sequence (layer overlap ``overlap``, default ``opts.layer_overlap``), then
    each one's parts, timed inside its step captured again (the timed graphs freed first)."""
    sh = model.sh
    L, K, d = sh.layers, sh.top_k, device or torch.device("cuda", DEVICE)
    overlap = opts.layer_overlap if overlap is None else overlap
    t0 = time.perf_counter()
    wl = generate(batch, opts.hits / 100, steps=opts.warmup + opts.steps + PART_REPLAYS, layers=L, context=context,
                  top_k=K, block_size=opts.block_size, layer_overlap=overlap, seed=opts.seed)
    st = Static(model, batch, block_table(batch, context, opts.block_size, host_rows, opts.seed), wl, d)
    state = BatchState(sh, batch, context, d)
    key_bytes = state.keys.numel() + 4 * state.kscale.numel()
    say(f"context {context} batch {batch} overlap {overlap:g}: top-k sequence and {key_bytes / 1e9:.1f} GB of indexer keys ready in "
        f"{time.perf_counter() - t0:.1f} s")
    out, sides = [], []
    if "gpu" in modes:
        need = L * (batch * context + batch) * sh.row_bytes
        free = torch.cuda.mem_get_info()[0]
        why = f"{need / 1e9:.1f} GB of rows do not fit this GPU ({free / 1e9:.1f} GB free)"
        if need + HBM_MARGIN_BYTES <= free:
            try:
                sides.append(("gpu", HbmRows.filled(tile, st, L, opts.block_size)))
                why = None
            except torch.OutOfMemoryError:  # the offloaded modes of the config still run
                _free()
                why = f"{need / 1e9:.1f} GB of rows ran out of memory ({free / 1e9:.1f} GB were free)"
        if why:
            out.append(Result("gpu", context, batch, overlap, skipped=why))
    sides += [(m, SwappedRows(off.handles[m], st, opts.block_size, mirror)) for m in modes if m in OFFLOADED]
    if not sides:
        return out
    st.load(0)
    runs = [capture_step(torch, lambda src=src: model.step(st.x, state, src), f"{m} context {context} batch {batch}")
            for m, src in sides]
    counts = [off.counts.get(m) if off else None for m, _ in sides]
    times, deltas = timed([r[0] for r in runs], st, opts.warmup, opts.steps, counts)
    kinds = [r[1] for r in runs]
    del runs
    _free()  # the timed graphs' memory back before the parts' graphs are captured
    names = [m for m, _ in sides]
    for i, (m, src) in enumerate(sides):
        r = Result(m, context, batch, overlap, run=kinds[i], p50_us=float(np.median(times[i])),
                   p99_us=float(np.percentile(times[i], 99)))
        ref = next((names.index(x) for x in PAIRED_WITH.get(m, ()) if x in names), 0)
        if i != ref:
            r.paired_diff_us = float(np.median(times[i] - times[ref]))
        if m in OFFLOADED:
            c = dict(zip(COUNTERS, deltas[i])) if deltas[i] else None
            if c and c["hits"] + c["misses"]:
                r.hit_rate = c["hits"] / (c["hits"] + c["misses"])
                r.misses, r.misses_per_layer = c["misses"], c["misses"] / opts.steps / L
                if m == "prefetch":
                    r.prefetched, r.prefetch_hits, r.prefetch_wasted = (
                        c[k] for k in ("prefetched", "prefetch_hits", "prefetch_wasted"))
            else:
                r.hit_rate = wl.target_hit_rate
                r.misses_per_layer = (1 - wl.target_hit_rate) * batch * K
        label = f"{m} context {context} batch {batch}"
        try:
            set_parts(r, sh, *parts(model, st, state, src, opts.warmup + opts.steps, label))
        except torch.OutOfMemoryError:  # the parts' extra capture: the timed figures stay, without parts
            _free()
            set_parts(r, sh, {}, "failed (out of GPU memory)")
        if m in OFFLOADED:
            try:
                off.handles[m].check()
            except Exception as e:  # noqa: BLE001 - a refused row makes the figure suspect: report it
                r.error = f"{type(e).__name__}: {e}"
        out.append(r)
        say(f"context {context} batch {batch} overlap {overlap:g} {m}: TPOT p50 {r.p50_us / 1e3:.2f} ms, {r.tok_s:.0f} tok/s ({r.run})"
            + (f", parts sum {r.parts_step_us / 1e3:.2f} ms ({r.parts_run})" if r.parts_step_us is not None
               else f", parts {r.parts_run}")
            + (f", flagged {','.join(r.flagged)}" if r.flagged else "") + (f"; {r.error}" if r.error else ""))
    del sides
    return out


def main(opts, device=None) -> int:
    """The whole run; exit 0, 1 when a config failed, 2 when the host pool cannot hold
    one request of the longest context. ``device``: default the GPU (FP8 and Triton
    paths where they pass their checks); torch's CPU device runs the all-on-GPU mode in
    float32 (the tests)."""
    t_start = time.perf_counter()
    sh = PRESETS[opts.preset]
    row_set = sh.layers * sh.row_bytes
    host_rows = int(opts.host_pool_gib * 2**30 // row_set) // TILE_ROWS * TILE_ROWS
    if set(opts.modes) & set(OFFLOADED) and host_rows < max(opts.contexts):
        print(f"sparsekv bench serve: --host-pool-gib {opts.host_pool_gib:g} holds {host_rows} rows a layer, fewer "
              f"than one request of context {max(opts.contexts)}: give it >= "
              f"{max(opts.contexts) * row_set / 2**30 + 1:.0f}", file=sys.stderr)
        return 2
    dep = Deployment(hbm_bytes=opts.hbm_gb * 1e9, host_bytes=opts.host_gib * 2**30,
                     activation_bytes=opts.activations_gb * 1e9)
    region = opts.region(sh.top_k)
    caps = {c: capacity(sh, c, dep, region) for c in opts.contexts}
    say(capacity_text(sh, opts.contexts, dep, region))
    plan = configs(opts, caps)
    say("configs: " + "; ".join(f"context {c} batch {b} overlap {o:g} {','.join(m)}" for c, b, o, m in plan))
    say(f"the expert-parallel all-to-all is left out of every mode (one GPU); the indexer's own top-k is computed "
        f"and dropped: the rows read follow the bench's sequence ({opts.hits:g} % step-to-step hits, "
        f"{opts.layer_overlap:g} layer-to-layer overlap), each layer's copied right after that top-k into the "
        f"buffer its rows read, as an engine's top-k kernel leaves its indices; the offloaded modes' hot regions "
        f"hold {region} rows a layer")
    d = torch.device(device or f"cuda:{DEVICE}")
    cuda = d.type == "cuda"
    if cuda:
        torch.cuda.set_device(d)
    t0 = time.perf_counter()
    ops = Ops(d, torch.bfloat16 if cuda else torch.float32, fast=cuda)
    model = Model.build(sh, ops, opts.seed)
    say(f"weights of one layer and the head built in {time.perf_counter() - t0:.1f} s; " + "; ".join(
        f"{k}: {v}" for k, v in ops.impl.items()))
    tile = row_tile(model, opts.seed)
    off_batches = [b for _, b, _, m in plan if set(m) & set(OFFLOADED)]
    off = mirror = None
    results: list[Result] = []
    figures: dict = {}
    failed: dict[str, str] = {}  # offloaded mode -> why it could not start
    try:
        if off_batches:
            lay = offload_layout(sh, max(off_batches), host_rows, region)
            say(f"host pools: {host_rows} rows a layer ({lay.pool_bytes / 1e9:.1f} GB each); requests beyond "
                f"{host_rows // max(opts.contexts)} of the longest context share host blocks (this machine's memory; "
                "the bytes a miss moves are the same)")
            try:
                off = Offload(lay, tile, opts.modes, gather_blocks(opts), opts.daemon_log)
            except Exception as e:  # noqa: BLE001 - the all-on-GPU figures still come
                failed = dict.fromkeys(OFFLOADED, f"{type(e).__name__}: {' '.join(str(e).split())[:400]}")
                say(f"the offloaded modes did not start: {failed['inproc']}")
            mirror = torch.empty((sh.layers, max(off_batches), sh.row_bytes), dtype=torch.uint8, pin_memory=True)
        for context, batch, overlap, modes in plan:
            results += [Result(m, context, batch, overlap, error=failed[m]) for m in modes if m in failed]
            modes = tuple(m for m in modes if m not in failed)
            try:
                results += run_config(model, off, tile, opts, context, batch, modes, host_rows, mirror, d, overlap)
            except Exception as e:  # noqa: BLE001 - one config failing must not lose the others' figures
                why = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
                say(f"context {context} batch {batch} overlap {overlap:g} failed: {why}")
                results += [Result(m, context, batch, overlap, error=why) for m in modes]
            _free()
            figures = summary(results, caps, opts.contexts[0], ops.impl, opts.layer_overlap)
            if opts.json_path:
                write_json(opts.json_path, figures)
    finally:
        if off is not None:
            off.close()
    over = sorted({f"{b} > {caps[c]['gpu']}" for c, b, _, m in plan
                   if "gpu" in m and c == opts.contexts[0] and b > caps[c]["gpu"]})
    print(table(results, sh) + headline(figures), end="")
    if over:
        print(f"note: equal-batch configs past the all-on-GPU capacity at context {opts.contexts[0]} ({', '.join(over)}) "
              "fit this GPU only because one layer's weights serve every layer here")
    say(f"done in {time.perf_counter() - t_start:.0f} s")
    if opts.json_path:
        say(f"wrote {opts.json_path}")
    if opts.plot_path:
        why = plot(results, opts.plot_path, opts.layer_overlap)
        say(why or f"wrote {opts.plot_path}")
    return 1 if any(r.error for r in results) else 0
