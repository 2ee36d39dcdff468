"""The figures of ``sparsekv bench decode``: one :class:`Result` per (mode, batch, hits),
merged over rounds, compared with inproc, printed as a table, written as flat JSON and
plotted."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from .decode_workload import CONTROL, Options, gather_blocks, hkey, say

ORDER = ("gpu", "inproc", CONTROL, "doorbell", "prefetch", "zmq")  # the table's and the plot's
COMPARED = (CONTROL, "doorbell", "prefetch", "zmq")  # the modes measured against the same config's inproc
OFFLOADED = ("inproc", CONTROL, "doorbell", "prefetch", "zmq")  # each also against the same config's gpu
REFERENCE = (64, 90.0)  # (batch, hits %) of the headline JSON figures


def hidden_share(prefetch_hits: int | None, misses: int | None) -> float | None:
    """Prefetch: the miss rows fetched off the critical path (its hits) over every miss row
    (those plus the misses the resolves fetched); None without both counts."""
    if prefetch_hits is None or misses is None:
        return None
    return prefetch_hits / max(1, prefetch_hits + misses)


@dataclass
class Result:
    """One (mode, batch, hits) figure. Times in microseconds per decode step."""

    mode: str
    batch: int
    hits: float  # the config's target, percent
    run: str = ""  # "graph" or "eager"
    p50_us: float | None = None
    p99_us: float | None = None
    hit_rate: float | None = None  # measured (or the target when ``hit_measured`` is False)
    hit_measured: bool = False
    misses_per_step: float | None = None  # top-k columns gathered per step, all layers
    misses: int | None = None  # over the timed steps (the daemon's counters)
    # prefetch, over the timed steps: rows the prefetch fetched that a resolve then hit
    # (misses taken off the critical path), rows it fetched, rows it fetched lost unread
    prefetch_hits: int | None = None
    prefetched: int | None = None
    prefetch_wasted: int | None = None
    fill_s: float | None = None  # seconds to fill this mode's pool (first config of a batch)
    huge_pct: int | None = None  # its pool's share in transparent huge pages (likewise)
    error: str | None = None
    skipped: str | None = None
    round: int = 0  # which of --rounds (combine_rounds() merges them)
    round_p50s: tuple[float, ...] = ()  # merged: each round's p50
    # --paired: the median over steps of (this step - inproc's same step) / layers, us
    paired_us_per_layer: float | None = None
    round_paired: tuple[float, ...] = ()  # merged: each round's
    # derived by derive()
    gbps: float | None = None
    overhead_us_per_layer: float | None = None
    vs_inproc: float | None = None
    vs_gpu: float | None = None  # this mode's p50 / gpu's (any offloaded mode)
    vs_doorbell: float | None = None  # prefetch: its p50 / the doorbell rank's (the prefetch's gain or cost)
    round_overheads: tuple[float, ...] = ()  # each round's overhead against that round's inproc

    @property
    def ok(self) -> bool:
        return self.error is None and self.skipped is None and self.p50_us is not None

    @property
    def hidden_share(self) -> float | None:
        return hidden_share(self.prefetch_hits, self.misses)

    @property
    def inproc_vs_gpu(self) -> float | None:
        """The in-process step over all on the GPU's (the table's and JSON's own column)."""
        return self.vs_gpu if self.mode == "inproc" else None


def combine_rounds(results: list[Result], layers: int) -> list[Result]:
    """One result per (batch, hits, mode) from the rounds of ``--rounds``: p50 and p99 the
    median of the rounds' (their p50s kept), the hit rate and misses of the first, and for
    a daemon mode each round's overhead against that round's inproc (``round_overheads``,
    us a layer). A failed round is left out; a config whose every round failed keeps its first."""
    groups: dict[tuple, list[Result]] = {}
    for r in results:
        groups.setdefault((r.batch, r.hits, r.mode), []).append(r)
    inproc = {(r.batch, r.hits, r.round): r for r in results if r.mode == "inproc" and r.ok}
    out = []
    for (batch, hits, mode), rs in groups.items():
        ok = [r for r in rs if r.ok]
        if not ok:
            out.append(rs[0])
            continue
        first = ok[0]
        p99s = [r.p99_us for r in ok if r.p99_us is not None]
        merged = Result(mode, batch, hits, run=first.run,
                        p50_us=float(np.median([r.p50_us for r in ok])),
                        p99_us=float(np.median(p99s)) if p99s else None,
                        hit_rate=first.hit_rate, hit_measured=first.hit_measured,
                        misses_per_step=first.misses_per_step, misses=first.misses,
                        prefetch_hits=first.prefetch_hits, prefetched=first.prefetched,
                        prefetch_wasted=first.prefetch_wasted, fill_s=first.fill_s, huge_pct=first.huge_pct,
                        round_p50s=tuple(r.p50_us for r in ok))
        paired = [r.paired_us_per_layer for r in ok if r.paired_us_per_layer is not None]
        if paired:
            merged.paired_us_per_layer = float(np.median(paired))
            merged.round_paired = tuple(paired)
        if mode in COMPARED:
            merged.round_overheads = tuple((r.p50_us - inproc[(batch, hits, r.round)].p50_us) / layers
                                           for r in ok if (batch, hits, r.round) in inproc)
        out.append(merged)
    return out


def derive(results: list[Result], layers: int, row_bytes: int) -> list[Result]:
    """Fill the derived figures in place: GB/s moved (misses x row_bytes / p50), and
    against the same config's inproc (and gpu) p50: per-layer hand-off overhead and
    ratios."""
    by = {(r.batch, r.hits, r.mode): r for r in results}
    for r in results:
        if not r.ok:
            continue
        if r.misses_per_step is not None and r.p50_us:
            r.gbps = r.misses_per_step * row_bytes / (r.p50_us * 1e-6) / 1e9
        base = by.get((r.batch, r.hits, "inproc"))
        if r.mode in COMPARED and base is not None and base.ok:
            r.overhead_us_per_layer = (r.p50_us - base.p50_us) / layers
            r.vs_inproc = r.p50_us / base.p50_us
        gpu = by.get((r.batch, r.hits, "gpu"))
        if r.mode in OFFLOADED and gpu is not None and gpu.ok:
            r.vs_gpu = r.p50_us / gpu.p50_us
        db = by.get((r.batch, r.hits, "doorbell"))
        if r.mode == "prefetch" and db is not None and db.ok:
            r.vs_doorbell = r.p50_us / db.p50_us
    return results


def _vs_gpu_of(results: list[Result], r: Result, mode: str = "doorbell"):
    """``mode``'s p50 / gpu's at ``r``'s config, or None."""
    return next((x.vs_gpu for x in results if x.mode == mode and x.ok and (x.batch, x.hits) == (r.batch, r.hits)),
                None)


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def table(results: list[Result], opts: Options) -> str:
    """The compact table printed last (call :func:`derive` first)."""
    gb = gather_blocks(opts)
    lines = [f"sparsekv bench decode: {opts.layers} layers, top-k {opts.top_k}, {opts.row_bytes} B rows, context "
             f"{opts.context} (block {opts.block_size}), hot region {opts.region} rows, {opts.steps} steps after "
             f"{opts.warmup} warm-up, gather_blocks {gb}",
             f"{'batch':>5} {'hits':>5} {'mode':<8} {'run':<5} {'p50 us':>9} {'p99 us':>9} {'hit %':>6} "
             f"{'GB/s':>6} {'+us/layer':>9} {'x inproc':>8} {'inproc/gpu':>10}"]
    order = {m: i for i, m in enumerate(ORDER)}
    for r in sorted(results, key=lambda r: (r.batch, r.hits, order.get(r.mode, 99))):
        head = f"{r.batch:>5} {hkey(r.hits) + '%':>5} {r.mode:<8}"
        if r.skipped is not None or r.error is not None:
            what = f"skipped: {r.skipped}" if r.skipped is not None else f"error: {r.error}"
            lines.append(f"{head} {' '.join(what.split())[:100]}")
            continue
        hit = "-" if r.hit_rate is None else f"{100 * r.hit_rate:.1f}" + ("" if r.hit_measured else "~")
        lines.append(f"{head} {r.run:<5} {_fmt(r.p50_us, '9.1f'):>9} {_fmt(r.p99_us, '9.1f'):>9} {hit:>6} "
                     f"{_fmt(r.gbps, '6.1f'):>6} {_fmt(r.overhead_us_per_layer, '+9.2f'):>9} "
                     f"{_fmt(r.vs_inproc, '8.3f'):>8} {_fmt(r.inproc_vs_gpu, '10.3f'):>10}")
    notes = []
    if any(r.ok and r.hit_rate is not None and not r.hit_measured for r in results):
        notes.append("hit % with ~: the generator's target (the daemon's stats had no hits/misses)")
    if any(r.ok and r.run == "eager" and r.mode != "zmq" for r in results):
        notes.append("run eager: the CUDA graph capture failed, each step was launched from Python")
    notes.append("+us/layer = (mode p50 - inproc p50) / layers; x inproc = mode p50 / inproc p50")
    if any(r.mode == "zmq" and r.ok for r in results):
        notes.append("zmq: HostSwapIn over the socket, the rank with fence events and device wait (the top-k "
                     "mapped on the GPU, nothing waited for on the host within a step; eager)")
    for r in results:
        if r.ok and r.mode == "prefetch":
            notes.append(f"batch {r.batch} {hkey(r.hits)}% prefetch (layer overlap {opts.layer_overlap:g}): "
                         + (f"{100 * r.hidden_share:.1f} % of the misses fetched off the critical path "
                            f"({r.prefetch_hits} of {r.prefetch_hits + r.misses}; {r.prefetch_wasted} prefetched "
                            "rows lost unread)" if r.hidden_share is not None else "no prefetch counters")
                         + (f"; x doorbell {r.vs_doorbell:.3f}" if r.vs_doorbell is not None else "")
                         + (f"; x gpu {r.vs_gpu:.3f} (doorbell {_fmt(_vs_gpu_of(results, r), '.3f')})"
                            if r.vs_gpu is not None else ""))
    if any(r.ok and r.mode == "prefetch" for r in results):
        notes.append("prefetch: a rank of its own on the doorbell rank's daemon and pool, timed alone after it "
                     "(x doorbell: not in turn); hit % counts the prefetched rows a resolve found resident, GB/s "
                     "the misses left to the resolves; between two layers this bench computes a tiny attention "
                     "only, so its copies have little compute to hide behind")
    if any(r.mode == CONTROL for r in results):
        notes.append(f"{CONTROL} (--control): the in-process handle again with a pool of its own, timed in turn "
                     "with the others: its +us/layer is what two pools alone differ by")
    for r in results:
        if r.paired_us_per_layer is not None:
            per = f" (rounds {', '.join(f'{v:+.2f}' for v in r.round_paired)})" if len(r.round_paired) > 1 else ""
            notes.append(f"batch {r.batch} {hkey(r.hits)}% {r.mode}: timed step by step in turn with inproc "
                         f"(--paired); median of the per-step differences {r.paired_us_per_layer:+.2f} us/layer{per}")
        if len(r.round_overheads) > 1:
            notes.append(f"batch {r.batch} {hkey(r.hits)}% {r.mode}: {len(r.round_p50s)} rounds (medians above), "
                         f"+us/layer per round {', '.join(f'{v:+.2f}' for v in r.round_overheads)}")
    return "\n".join(lines + [f"note: {n}" for n in notes]) + "\n"


def summary(results: list[Result], opts: Options) -> dict:
    """The flat dict ``--json`` writes (call :func:`derive` first)."""
    out: dict = {"decode_layers": opts.layers, "decode_top_k": opts.top_k, "decode_row_bytes": opts.row_bytes,
                 "decode_context": opts.context, "decode_block_size": opts.block_size, "decode_steps": opts.steps,
                 "decode_warmup": opts.warmup, "decode_gather_blocks": gather_blocks(opts),
                 "decode_layer_overlap": opts.layer_overlap, "decode_region_rows": opts.region,
                 "decode_paired": opts.paired,
                 "decode_control": opts.control}
    for r in results:
        k = f"decode_b{r.batch}_h{hkey(r.hits)}_{r.mode}"
        if r.skipped is not None:
            out[f"{k}_skipped"] = r.skipped
            continue
        if r.error is not None:
            out[f"{k}_error"] = r.error
            continue
        if r.fill_s is not None:
            out[f"decode_b{r.batch}_{r.mode}_fill_s"] = round(r.fill_s, 2)
        if r.huge_pct is not None:
            out[f"decode_b{r.batch}_{r.mode}_pool_huge_pct"] = r.huge_pct
        out[f"{k}_p50_us"] = _round(r.p50_us, 1)
        out[f"{k}_p99_us"] = _round(r.p99_us, 1)
        out[f"{k}_graph"] = r.run == "graph"
        if r.hit_rate is not None:
            out[f"{k}_hit_rate"] = _round(r.hit_rate, 4)
            out[f"{k}_hit_rate_measured"] = r.hit_measured
        if r.gbps is not None:
            out[f"{k}_GBps"] = _round(r.gbps, 2)
        if r.overhead_us_per_layer is not None:
            out[f"{k}_overhead_us_per_layer"] = _round(r.overhead_us_per_layer, 2)
            out[f"{k}_vs_inproc"] = _round(r.vs_inproc, 3)
        if r.paired_us_per_layer is not None:
            out[f"{k}_paired_overhead_us_per_layer"] = _round(r.paired_us_per_layer, 2)
        if len(r.round_p50s) > 1:
            out[f"{k}_rounds"] = len(r.round_p50s)
        if len(r.round_overheads) > 1:
            out[f"{k}_overhead_us_per_layer_min"] = _round(min(r.round_overheads), 2)
            out[f"{k}_overhead_us_per_layer_max"] = _round(max(r.round_overheads), 2)
        if r.inproc_vs_gpu is not None:
            out[f"decode_b{r.batch}_h{hkey(r.hits)}_inproc_vs_gpu"] = _round(r.inproc_vs_gpu, 3)
        elif r.vs_gpu is not None:
            out[f"{k}_vs_gpu"] = _round(r.vs_gpu, 3)
        if r.hidden_share is not None:
            out[f"{k}_hidden_share"] = _round(r.hidden_share, 4)
            out[f"{k}_prefetch_hits"] = r.prefetch_hits
            out[f"{k}_prefetched"] = r.prefetched
            out[f"{k}_prefetch_wasted"] = r.prefetch_wasted
        if r.vs_doorbell is not None:
            out[f"{k}_vs_doorbell"] = _round(r.vs_doorbell, 4)
    ref = _reference(results)
    if ref is not None and (ref.batch, ref.hits) != REFERENCE and REFERENCE[0] in opts.batches \
            and REFERENCE[1] in opts.hits:
        ref = None  # the reference config was asked for but did not run (a budget, an error)
    out["decode_reference_config"] = None if ref is None else f"b{ref.batch}_h{hkey(ref.hits)}_k{opts.top_k}"
    # The headline per-layer overhead (_per_layer: paired when --paired ran).
    out["doorbell_overhead_us_per_layer"] = _per_layer(ref)
    out["doorbell_overhead_paired"] = ref is not None and ref.paired_us_per_layer is not None
    out["decode_daemon_vs_inproc"] = None if ref is None else _round(ref.vs_inproc, 3)
    if ref is not None:
        # The hand-off alone: the same batch with nothing to gather (100 % hits), where
        # the two sides differ by the signalling only.
        out["doorbell_handoff_us_per_layer"] = _per_layer(_compared(results, "doorbell", ref.batch, 100.0))
        # --control: the second in-process pool against the first at the reference config.
        ctl = _compared(results, CONTROL, ref.batch, ref.hits)
        if ctl is not None:
            out["decode_pool_control_us_per_layer"] = _per_layer(ctl)
    else:
        out["doorbell_handoff_us_per_layer"] = None
    # The prefetch at batch 64, 90 % when run (else its first config), named by the layer
    # overlap: the runs of a sweep merge.
    pfs = [r for r in results if r.mode == "prefetch" and r.ok]
    pf = next((r for r in pfs if (r.batch, r.hits) == REFERENCE), pfs[0] if pfs else None)
    if pf is not None:
        o = f"o{round(opts.layer_overlap * 100):d}"
        out[f"decode_prefetch_config_{o}"] = f"b{pf.batch}_h{hkey(pf.hits)}_k{opts.top_k}"
        out[f"decode_prefetch_hidden_share_{o}"] = _round(pf.hidden_share, 4)
        out[f"decode_prefetch_vs_doorbell_{o}"] = _round(pf.vs_doorbell, 4)
        out[f"decode_prefetch_vs_gpu_{o}"] = _round(pf.vs_gpu, 3)
        out[f"decode_doorbell_vs_gpu_{o}"] = _round(_vs_gpu_of(results, pf), 3)
    return out


def _compared(results: list[Result], mode: str, batch: int, hits: float) -> Result | None:
    """The row of ``mode`` at (batch, hits) that ran and was compared with inproc, or None."""
    return next((r for r in results if r.mode == mode and r.ok and r.batch == batch and r.hits == hits
                 and r.vs_inproc is not None), None)


def _per_layer(r: Result | None):
    """``r``'s microseconds a layer over inproc: the paired median when --paired ran, else
    the difference of the p50s (the other figure stays under its config's keys)."""
    if r is None:
        return None
    return _round(r.paired_us_per_layer if r.paired_us_per_layer is not None else r.overhead_us_per_layer, 2)


def _reference(results: list[Result]) -> Result | None:
    """The doorbell figure at batch 64, 90 % hits when run, else the first config run
    with both doorbell and inproc."""
    rows = [r for r in results if r.mode == "doorbell" and r.ok and r.vs_inproc is not None]
    return next((r for r in rows if (r.batch, r.hits) == REFERENCE), rows[0] if rows else None)


def _round(v, nd: int):
    return None if v is None else round(float(v), nd)


def plot(results: list[Result], path: str) -> bool:
    """Step time (p50, ms) against batch, one line per mode, one panel per hit rate.
    Returns False (and says why) when matplotlib is missing or nothing ran."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        say(f"matplotlib is not installed: --plot {path} skipped (pip install matplotlib)")
        return False
    ok = [r for r in results if r.ok]
    if not ok:
        say(f"nothing to plot: --plot {path} skipped")
        return False
    hits = sorted({r.hits for r in ok})
    fig, axes = plt.subplots(1, len(hits), figsize=(4.5 * len(hits), 3.8), squeeze=False, sharey=True)
    for ax, h in zip(axes[0], hits):
        for mode in ORDER:
            pts = sorted((r.batch, r.p50_us / 1e3) for r in ok if r.hits == h and r.mode == mode)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.set_title(f"{h:g} % hits")
        ax.set_xlabel("batch")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("decode step p50 (ms)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_json(path: str, figures: dict) -> None:
    """``figures`` but for the ``_``-prefixed entries, as JSON at ``path``, replaced whole
    (a reader never sees half a file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({k: v for k, v in figures.items() if not k.startswith("_")}, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
