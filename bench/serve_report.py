"""The figures of ``sparsekv bench serve``, without torch: one :class:`Result` per (mode,
context, batch), each part's time beside its lower bound, the headline ratios under the
keys ``docs/perf/latest.json`` holds (:func:`summary`), the table and the plot."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from .decode_report import hidden_share
from .serve_capacity import bounds

# also the order they run in; "prefetch": the daemon (doorbell) attached with cross-layer prefetch
MODES = ("gpu", "inproc", "daemon", "prefetch")
OFFLOADED = ("prefetch", "daemon", "inproc")  # the first of these that ran is "offloaded" in the headline
PARTS = ("begin", "proj", "write", "indexer", "topk", "query", "swap_in", "attention", "dense_ffn", "moe", "head")
PARTS_NOTE = ("us a layer (begin, head: a step), from CUDA events recorded inside the step's CUDA graph (a second "
              "capture of the step, each part's median over its replays), not scaled: per step they sum to "
              "parts_step_us; parts_run 'eager': the capture failed and the events timed the step un-captured. "
              "After the top-k the rows come on a second stream (rows_us: their time there) while the step's "
              "stream runs query (c_q -> q, W_UK) and the new row's write; swap_in is the wait for them after that")
SLACK = 2.0  # a part slower than this many times its bound is flagged
PENALTY_BATCHES = (1, 4, 16, 64)
HEADLINE_OVERLAP = 0.85  # the layer overlap of the headline figures (issue 35's)


def ctx_key(context: int) -> str:
    """32768 -> "32k", 1048576 -> "1m", 1000 -> "1000"."""
    for unit, shift in (("m", 20), ("k", 10)):
        if context >= 1 << shift and context % (1 << shift) == 0:
            return f"{context >> shift}{unit}"
    return str(context)


@dataclass
class Result:
    """One (mode, context, batch). Times in microseconds; ``parts`` / ``bounds``: per layer
    a part runs in (``begin``, ``head``: per step), :data:`PARTS_NOTE`."""

    mode: str
    context: int
    batch: int
    overlap: float = HEADLINE_OVERLAP  # the top-k sequence's layer-to-layer overlap
    run: str = ""  # "graph" or "eager"
    p50_us: float | None = None
    p99_us: float | None = None
    hit_rate: float | None = None  # measured over the timed steps (offloaded modes)
    misses_per_layer: float | None = None
    misses: int | None = None  # over the timed steps, every layer (offloaded modes)
    # prefetch mode, over the timed steps: rows the prefetch fetched, those a resolve then
    # hit (misses taken off the critical path), those lost unread
    prefetched: int | None = None
    prefetch_hits: int | None = None
    prefetch_wasted: int | None = None
    parts: dict = field(default_factory=dict)  # us a layer, timed inside the step's graph (PARTS_NOTE)
    parts_run: str = ""  # how the parts' step ran: "graph" (events inside it), "eager", or "failed (why)"
    parts_step_us: float | None = None  # the parts' times summed over the step (begin to the head's end)
    rows_us: float | None = None  # us a layer the rows took on their own stream, beside query and write
    bounds: dict = field(default_factory=dict)
    flagged: list = field(default_factory=list)
    p50_at_bound_us: float | None = None  # p50 with each flagged part at its bound
    paired_diff_us: float | None = None  # median per-step difference, timed in turn: to gpu (the daemon: to inproc)
    error: str | None = None
    skipped: str | None = None

    @property
    def tok_s(self) -> float | None:
        return self.batch / self.p50_us * 1e6 if self.p50_us else None

    @property
    def tok_s_at_bound(self) -> float | None:
        return self.batch / self.p50_at_bound_us * 1e6 if self.p50_at_bound_us else None

    @property
    def hidden_share(self) -> float | None:
        return hidden_share(self.prefetch_hits, self.misses)


def layers_of(sh, part: str) -> int:
    """How many times a part runs a step."""
    per_step = {"dense_ffn": sh.dense_layers, "moe": sh.layers - sh.dense_layers, "begin": 1, "head": 1}
    return per_step.get(part, sh.layers)


def step_totals(intervals) -> dict[str, float | None]:
    """Per part, us over one run of the step from its marks' ``(part, us from this mark to
    the next, or None: an event not read)``; a part with an interval not read is None."""
    out: dict[str, float | None] = {}
    for part, us in intervals:
        prev = out.get(part, 0.0)
        out[part] = None if prev is None or us is None else prev + us
    return out


SIDE = ("rows", "rows_end")  # marks on the side stream: the layer's rows from their start to their end


def intervals_of(points) -> list:
    """``(part, us from its mark to the next)`` along the step's stream (the side marks
    skipped), then ``("rows", us from each "rows" mark to its "rows_end")``; None where
    either end is unknown."""
    def span(a, b):
        return None if a is None or b is None else b - a

    main = [(p, t) for p, t in points if p not in SIDE]
    out = [(p, span(a, b)) for (p, a), (_, b) in zip(main, main[1:])]
    start = None
    for p, t in points:
        if p == "rows":
            start = t
        elif p == "rows_end":
            out.append(("rows", span(start, t)))
    return out


def median_parts(runs: list[dict]) -> dict[str, float]:
    """Per part, the median of its step totals (:func:`step_totals`) over the runs where it
    was read; a part read in none is left out."""
    out = {}
    for part in dict.fromkeys(p for run in runs for p in run):
        got = [run[part] for run in runs if run.get(part) is not None]
        if got:
            out[part] = statistics.median(got)
    return out


def set_parts(r: Result, sh, totals_us: dict, run: str) -> None:
    """``r.parts`` (us a layer) from each part's us over the step (``totals_us``, timed
    inside the step's graph when ``run`` is "graph"), ``r.bounds``, the flags and
    ``p50_at_bound_us``."""
    r.parts_run = run
    r.parts = {p: totals_us[p] / layers_of(sh, p) for p in PARTS if p in totals_us and layers_of(sh, p)}
    r.parts_step_us = sum(t * layers_of(sh, p) for p, t in r.parts.items()) if r.parts else None
    r.rows_us = totals_us["rows"] / sh.layers if totals_us.get("rows") is not None else None
    r.bounds = bounds(sh, r.batch, r.context, r.misses_per_layer)
    r.flagged = [p for p, t in r.parts.items() if r.bounds.get(p) and t > SLACK * r.bounds[p]]
    if r.p50_us is not None:
        at = {p: r.bounds[p] if p in r.flagged else t for p, t in r.parts.items()}
        if "swap_in" in r.parts and r.rows_us is not None:
            # The wait is what the rows take beyond the query beside them: with the query at
            # its bound, the rows (at theirs, if flagged) hide behind less.
            rows = r.rows_us
            if r.bounds.get("swap_in") and rows > SLACK * r.bounds["swap_in"]:  # the rows over the link at its rate
                r.flagged.append("rows")
                rows = r.bounds["swap_in"]
            at["swap_in"] = max(rows - at.get("query", 0.0), 0.0)
        excess = sum((r.parts[p] - at[p]) * layers_of(sh, p) for p in r.parts)
        r.p50_at_bound_us = max(r.p50_us - excess, 1.0)


def okey(overlap: float) -> str:
    """0.85 -> "o85", 0.5 -> "o50", 0.955 -> "o95p5" (for JSON keys)."""
    return "o" + f"{overlap * 100:g}".replace(".", "p")


def _find(results, mode, context, batch, overlap: float = HEADLINE_OVERLAP) -> Result | None:
    for r in results:
        if (r.mode, r.context, r.batch, r.overlap) == (mode, context, batch, overlap) and r.p50_us:
            return r
    return None


def _offloaded(results, context, batch, overlap: float = HEADLINE_OVERLAP) -> Result | None:
    for m in OFFLOADED:
        r = _find(results, m, context, batch, overlap)
        if r is not None:
            return r
    return None


def _prefetch_figures(results: list[Result], penalty_context: int, overlap: float) -> dict:
    """Per (batch, overlap) of the first context where the prefetch mode ran: the share of
    miss rows it hid, its TPOT over the daemon's without it, and (other overlaps than the
    headline's) the offloaded TPOT over all on the GPU at the same batch (its step reads
    the same rows whatever the overlap: its run at the headline's overlap); then issue 35's
    keys."""
    out: dict = {}
    pk = ctx_key(penalty_context)
    for r in results:
        if r.mode != "prefetch" or r.context != penalty_context or not r.p50_us:
            continue
        tag = f"b{r.batch}_{pk}_{okey(r.overlap)}"
        if r.hidden_share is not None:
            out[f"serve_prefetch_hidden_share_{tag}"] = round(r.hidden_share, 4)
        d = _find(results, "daemon", r.context, r.batch, r.overlap)
        if d:
            out[f"serve_prefetch_vs_daemon_{tag}"] = round(r.p50_us / d.p50_us, 4)
        g = _find(results, "gpu", r.context, r.batch, overlap)  # (bench serve runs all on the GPU at that one)
        if g and r.overlap != overlap:
            out[f"serve_offload_vs_gpu_tpot_{tag}"] = round(r.p50_us / g.p50_us, 4)
    if pk == "32k":
        for key, src in (("prefetch_hidden_share", f"serve_prefetch_hidden_share_b64_32k_{okey(HEADLINE_OVERLAP)}"),
                         ("prefetch_cost_overlap50", "serve_prefetch_vs_daemon_b64_32k_o50")):
            if src in out:
                out[key] = out[src]
    return out


def summary(results: list[Result], caps: dict, penalty_context: int, impl: dict,
            overlap: float = HEADLINE_OVERLAP) -> dict:
    """Flat figures (the headline keys of docs/perf/latest.json among them), the configs
    as a list and the capacity arithmetic; ``caps``: context -> serve_capacity.capacity;
    ``overlap``: the layer overlap of the configs the headline ratios are taken from."""
    out: dict = {"serve_offloaded_mode": next((m for m in OFFLOADED if any(r.mode == m and r.p50_us
                                                                              for r in results)), None),
                 "serve_impl": impl, "serve_parts": PARTS_NOTE, "serve_configs": [{**asdict(r), "tok_s": r.tok_s} for r in results],
                 "serve_capacity": {ctx_key(c): cap for c, cap in caps.items()}}
    for c, cap in caps.items():
        k = ctx_key(c)
        out[f"serve_max_batch_gpu_{k}"], out[f"serve_max_batch_offload_{k}"] = cap["gpu"], cap["offload"]
        g, o = _find(results, "gpu", c, cap["gpu"], overlap), _offloaded(results, c, cap["offload"], overlap)
        if g and o:
            out[f"serve_throughput_gain_{k}"] = round(o.tok_s / g.tok_s, 3)
            out[f"serve_throughput_gain_{k}_at_bound"] = round(o.tok_s_at_bound / g.tok_s_at_bound, 3)
            out[f"serve_gpu_tok_s_{k}"], out[f"serve_offload_tok_s_{k}"] = round(g.tok_s, 1), round(o.tok_s, 1)
    pk = ctx_key(penalty_context)
    for b in PENALTY_BATCHES:
        g, o = _find(results, "gpu", penalty_context, b, overlap), _offloaded(results, penalty_context, b, overlap)
        if g and o:
            out[f"serve_offload_vs_gpu_tpot_b{b}_{pk}"] = round(o.p50_us / g.p50_us, 4)
            out[f"serve_offload_vs_gpu_tpot_b{b}_{pk}_at_bound"] = round(o.p50_at_bound_us / g.p50_at_bound_us, 4)
            d = _find(results, "daemon", penalty_context, b, overlap)
            if o.mode == "prefetch" and d:  # the same without prefetch
                out[f"serve_daemon_vs_gpu_tpot_b{b}_{pk}"] = round(d.p50_us / g.p50_us, 4)
    if f"serve_offload_vs_gpu_tpot_b1_{pk}" in out and pk == "32k":
        out["serve_offload_vs_gpu_tpot_b1"] = out["serve_offload_vs_gpu_tpot_b1_32k"]
    out.update(_prefetch_figures(results, penalty_context, overlap))
    d, i = (_find(results, m, penalty_context, 64, overlap) for m in ("daemon", "inproc"))
    if d and i and pk == "32k":
        out["serve_daemon_vs_inproc"] = round(d.p50_us / i.p50_us, 4)
        if d.paired_diff_us is not None:
            out["serve_daemon_vs_inproc_paired_us"] = round(d.paired_diff_us, 1)
    return out


def table(results: list[Result], sh) -> str:
    """Per config: TPOT, tokens/s, and each part against its bound (us a layer)."""
    lines = [f"{'mode':<8} {'context':>8} {'batch':>5} {'overlap':>7} {'run':<5} {'TPOT p50 ms':>11} {'p99 ms':>8} {'tok/s':>9} "
             f"{'hits':>5}  parts: us a layer (begin, head: a step), timed inside the step's graph, each the median of its "
             f"replays; their sum a step (bound; ! = over {SLACK:g}x)"]
    for r in results:
        head = f"{r.mode:<8} {r.context:>8} {r.batch:>5} {r.overlap:>7g} "
        if r.p50_us is None:
            lines.append(head + (r.error or r.skipped or "no figure"))
            continue
        parts = "  ".join(f"{p} {t:.1f}" + (f" ({r.bounds[p]:.1f}{'!' if p in r.flagged else ''})"
                                             if r.bounds.get(p) else "") for p, t in r.parts.items())
        hits = f"{r.hit_rate * 100:.0f}%" if r.hit_rate is not None else "-"
        if r.rows_us is not None:
            link = r.bounds.get("swap_in")
            parts += f"  [rows {r.rows_us:.1f} beside" + (f" ({link:.1f}{'!' if 'rows' in r.flagged else ''})"
                                                          if link else "") + "]"
        if r.parts_step_us is not None:
            parts += f"  [sum {r.parts_step_us / 1e3:.2f} ms" + ("" if r.parts_run == "graph" else f", {r.parts_run}") + "]"
        lines.append(head + f"{r.run:<5} {r.p50_us / 1e3:>11.2f} {r.p99_us / 1e3:>8.2f} {r.tok_s:>9.1f} {hits:>5}  "
                     + parts + (f"  [at bound: {r.p50_at_bound_us / 1e3:.2f} ms]" if r.flagged else "")
                     + (f"  [prefetch: {r.prefetched} rows, {r.prefetch_hits} hit, {r.prefetch_wasted} wasted; "
                        f"{r.hidden_share * 100:.0f} % of misses hidden]" if r.hidden_share is not None else "")
                     + (f"  ERROR {r.error}" if r.error else ""))
    return "\n".join(lines) + "\n"


def headline(figures: dict) -> str:
    keys = [k for k in sorted(figures) if k.startswith(("serve_throughput_gain", "serve_offload_vs_gpu",
                                                          "serve_daemon_vs_inproc", "serve_prefetch", "prefetch_"))]
    return "".join(f"{k}: {figures[k]}\n" for k in keys)


def plot(results: list[Result], path: str, overlap: float = HEADLINE_OVERLAP) -> str | None:
    """Tokens/s against batch, one panel per context, a line per mode, of the configs at
    layer overlap ``overlap`` (the run's ``--layer-overlap``); None when written, else why
    not (no matplotlib, no figures)."""
    try:
        import matplotlib  # noqa: PLC0415 - optional: only the plot needs it
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    ok = [r for r in results if r.p50_us]
    contexts = sorted({r.context for r in ok})
    if not contexts:
        return "no figures to plot"
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.5 * len(contexts), 3.8), squeeze=False)
    for ax, c in zip(axes[0], contexts):
        for mode in MODES:
            pts = sorted((r.batch, r.tok_s) for r in ok
                         if r.context == c and r.mode == mode and r.overlap == overlap)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.set_title(f"context {ctx_key(c)}")
        ax.set_xlabel("batch")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("decode tokens/s (one GPU)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
