"""``sparsekv bench decode``: a whole decode step (every layer: swap-in, then a tiny
attention over the selected rows) with the KV cache offloaded, against the same step with
every row already on the GPU, over one generated top-k sequence.

Modes (each over the same top-k sequence of a (batch, hits) config), in this order:

* ``gpu``: no offload: every layer's rows in one GPU tensor, positions mapped to rows
  through the block table with torch ops.
* ``inproc``: ``InprocSwapIn`` (the daemon's kernels inline on this stream, its own pool).
* ``doorbell``: a private cuda ``sparsekvd``, the rank attached with
  ``transport="doorbell"``, ``Client.doorbell_handle()``, the same engine code as inproc.
* ``prefetch`` (only when ``--modes`` names it, with doorbell): the doorbell rank again,
  attached with cross-layer prefetch (DESIGN.md §4), on the same daemon and pool after the
  doorbell rank; its figures: the share of misses fetched off the critical path, and its
  step against the doorbell's and the all-on-GPU step at equal batch. A prefetch never
  evicts a row of a region's latest resolve, so with this mode every offloaded mode's
  region has rows above top-k (``--region-rows``, default top-k + top-k / 4; without it
  top-k). Between two layers
  this bench computes only a tiny attention, so little of the prefetch's copies can hide
  behind compute (``bench serve`` has the model's real layers).
* ``zmq`` (only when ``--modes`` names it): ``HostSwapIn`` with fence events and device
  wait (``Client(device_wait=True)``); eager.

The step of gpu, inproc and doorbell is captured once per (mode, batch) as a CUDA graph
and replayed each step (the time: ``replay()`` plus a synchronize); when the capture
fails the step runs eagerly and the table's ``run`` column says so.

What a phase holds is big (batch 128, 61 layers, context 8192: 42 GB of KV rows), so
the run goes by batch, and within a batch by mode, each mode over every hit rate: one
allocation and one pool fill per (mode, batch), freed before the next. The daemon's
engine stays attached over the hit rates of a batch; every state row is reset at the
first step of each config, which empties its hot region as a new attach would.

The other modules: ``decode_workload`` (options, the top-k sequence, the pool fill),
``decode_modes`` (each mode's step and timed run) and ``decode_report`` (results, table,
JSON, plot).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

from sparsekv.proto import Layout

from .decode_modes import DEVICE, error_rows, guarded, run_doorbell, run_gpu, run_inproc, run_paired
from .decode_report import Result, combine_rounds, derive, plot, summary, table, write_json
from .decode_workload import (CONTROL, DEFAULT_BATCHES, DEFAULT_HITS, DEFAULT_MODES, DEFAULT_STEPS, MODES, Options,
                              generate, make_layout, say)

QUICK_BATCHES = (16, 64)
QUICK_HITS = (90.0, 100.0)  # 100: nothing to gather, the doorbell's hand-off alone
QUICK_STEPS = 20
OVER_BUDGET = "over --budget-s"  # how a config --budget-s kept from running is marked skipped


def _free(torch) -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    cp = sys.modules.get("cupy")
    if cp is not None:
        cp.get_default_memory_pool().free_all_blocks()
        cp.get_default_pinned_memory_pool().free_all_blocks()


def run(opts: Options, torch=None, on_batch=None) -> list[Result]:
    """Every (batch, mode, hits) of ``opts``; results with derived figures. ``on_batch``:
    called with the results so far (derived) after each batch size, e.g. to write them.
    Past ``opts.budget_s`` no batch size or round starts: its configs are marked skipped."""
    if torch is None:
        import torch  # noqa: PLC0415
    torch.cuda.set_device(DEVICE)
    start = time.monotonic()
    results: list[Result] = []

    def over_budget(batch: int, rnd: int) -> bool:
        if opts.budget_s is None or time.monotonic() - start < opts.budget_s:
            return False
        why = f"{OVER_BUDGET} {opts.budget_s:g}" + (f" before round {rnd + 1}" if rnd else "")
        say(f"batch {batch}: {why}: not run")
        if rnd == 0:  # a later round's configs have rows of the first already
            modes = [m for m in MODES if m in opts.modes] + ([CONTROL] if opts.control else [])
            results.extend(Result(m, batch, h, skipped=why) for m in modes for h in opts.hits)
        return True

    for batch in opts.batches:
        if over_budget(batch, 0):
            continue
        lay = make_layout(batch, opts).validate()
        t0 = time.perf_counter()
        workloads = {h: generate(batch, h / 100, steps=opts.warmup + opts.steps, layers=opts.layers,
                                 context=opts.context, top_k=opts.top_k, block_size=opts.block_size,
                                 layer_overlap=opts.layer_overlap, seed=opts.seed) for h in opts.hits}
        say(f"batch {batch}: top-k sequences of {len(workloads)} hit rate(s) generated in "
             f"{time.perf_counter() - t0:.1f} s (host_rows {lay.host_rows}, pool {lay.pool_bytes / 1e9:.1f} GB)")
        for rnd in range(opts.rounds):
            if rnd and over_budget(batch, rnd):
                break
            here: list[Result] = []
            # its own baseline once; with --paired rounds 2, 4, ... make the daemon's pool first
            _run_batch_modes(torch, batch, lay, workloads, opts, here, gpu=rnd == 0, daemon_first=rnd % 2 == 1)
            for r in here:
                r.round = rnd
            results.extend(here)
        if on_batch is not None:
            on_batch(derive(combine_rounds(results, opts.layers), opts.layers, opts.row_bytes))
    return derive(combine_rounds(results, opts.layers), opts.layers, opts.row_bytes)


def _run_batch_modes(torch, batch: int, lay: Layout, workloads: dict, opts: Options, results: list,
                     gpu: bool = True, daemon_first: bool = False) -> None:
    """Every mode of ``opts`` once for one batch size (one round), in MODES order; the
    all-on-GPU mode only with ``gpu`` (it involves no offload: one round of it is enough)."""
    if gpu and "gpu" in opts.modes:
        guarded(results, "gpu", batch, workloads, lambda: run_gpu(torch, lay, workloads, opts, results))
        _free(torch)
    if opts.paired:
        modes = [m for m in ("inproc", "doorbell", "prefetch", "zmq") if m in opts.modes] + (
            [CONTROL] if opts.control else [])
        guarded(results, modes, batch, workloads, label="paired",
                fn=lambda: run_paired(torch, lay, workloads, opts, results, daemon_first=daemon_first))
        error_rows(results, modes, batch, workloads,
                   "not timed: the paired run with the doorbell failed first (see its row)")
        _free(torch)
        return
    if "inproc" in opts.modes:
        guarded(results, "inproc", batch, workloads, lambda: run_inproc(torch, lay, workloads, opts, results))
        _free(torch)
    if "doorbell" in opts.modes or "zmq" in opts.modes:
        daemon_modes = [m for m in ("doorbell", "prefetch", "zmq") if m in opts.modes]
        guarded(results, daemon_modes, batch, workloads, label="daemon",
                fn=lambda: run_doorbell(torch, lay, workloads, opts, results))
        _free(torch)


# -- command line --------------------------------------------------------------------------
def _csv(kind, what: str):
    def parse(text: str):
        try:
            vals = tuple(kind(x) for x in text.replace(" ", ",").split(",") if x)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}: a comma list, got {text!r}") from None
        if not vals:
            raise argparse.ArgumentTypeError(f"{what}: empty list")
        return vals
    return parse


def _percent(text: str) -> float:
    v = float(text)
    return v * 100 if 0 < v < 1 else v  # 0.9 means 90 %


def add_arguments(p) -> None:
    """The options of ``sparsekv bench decode`` (on a parser or an argument group)."""
    p.add_argument("--batches", type=_csv(int, "--batches"), default=None, metavar="LIST",
                   help="batch sizes, comma list (default: 16,64,128; --quick: 16,64)")
    p.add_argument("--hits", type=_csv(_percent, "--hits"), default=None, metavar="LIST",
                   help="hit rates in percent: each request keeps this share of its previous top-k "
                        "(default: 80,90,95; --quick: 90,100)")
    p.add_argument("--layers", type=int, default=61, metavar="N", help="layers (one index group each)")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help=f"timed decode steps per config (default: {DEFAULT_STEPS}; --quick: {QUICK_STEPS})")
    p.add_argument("--warmup", type=int, default=8, metavar="N", help="untimed steps before them (the first is cold)")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="run every mode of a batch N times, alternating, each daemon mode with a daemon of its "
                        "own; figures are the rounds' medians, the spread of the hand-off is reported")
    p.add_argument("--paired", action="store_true",
                   help="time inproc and doorbell step by step in turn, both set up at once (two pools), so that "
                        "drift of the machine cancels out of the hand-off; adds the median per-step difference. "
                        "Odd rounds make the in-process pools first, even ones the daemon's")
    p.add_argument("--control", action="store_true",
                   help=f"with --paired: time a second in-process handle ({CONTROL}, a pool of its own) in turn too; "
                        "its difference to inproc is what two pools alone differ by (a third pool in host memory)")
    p.add_argument("--context", type=int, default=8192, metavar="N", help="positions per request")
    p.add_argument("--block-size", type=int, default=64, metavar="N", help="positions per block of the block table")
    p.add_argument("--top-k", type=int, default=2048, metavar="N", help="columns per top-k row (= hot slots)")
    p.add_argument("--row-bytes", type=int, default=656, metavar="N", help="bytes per KV row")
    p.add_argument("--modes", type=_csv(str, "--modes"), default=None, metavar="LIST",
                   help="of gpu, inproc, doorbell, prefetch (needs doorbell), zmq; they run in that order "
                        "(default: gpu,inproc,doorbell)")
    p.add_argument("--layer-overlap", type=float, default=0.85, metavar="F",
                   help="share of columns adjacent layers have in common within a step")
    p.add_argument("--gather-blocks", type=int, default=None, metavar="N",
                   help="blocks of the gather, inproc and daemon alike (default: the daemon's default)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="random seed of the top-k sequences")
    p.add_argument("--quick", action="store_true", help="a short run: batch 16 and 64, 90 and 100 %% hits, 20 steps")
    p.add_argument("--budget-s", type=float, default=None, metavar="S",
                   help="start no batch size (or round) after S seconds; the rest is marked skipped "
                        "(default: no limit). The JSON is written after each batch size either way")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                   help="write the figures as one flat JSON dict (default: none)")
    p.add_argument("--plot", dest="plot_path", default=None, metavar="PATH.png",
                   help="plot step time against batch, one panel per hit rate (needs matplotlib; default: none)")
    p.add_argument("--daemon-log", default=None, metavar="FILE", help="log of the private daemon (default: discarded)")


def options_from_args(a) -> Options:
    """Options from parsed arguments (``--quick`` fills what was not given); validated."""
    quick = a.quick
    return Options(
        batches=a.batches or (QUICK_BATCHES if quick else DEFAULT_BATCHES),
        hits=a.hits or (QUICK_HITS if quick else DEFAULT_HITS),
        layers=a.layers, top_k=a.top_k, row_bytes=a.row_bytes, context=a.context, block_size=a.block_size,
        steps=a.steps if a.steps is not None else (QUICK_STEPS if quick else DEFAULT_STEPS), warmup=a.warmup,
        rounds=a.rounds, paired=a.paired, control=a.control,
        modes=tuple(dict.fromkeys(a.modes)) if a.modes else DEFAULT_MODES,
        layer_overlap=a.layer_overlap, gather_blocks=a.gather_blocks, seed=a.seed, region_rows=a.region_rows,
        budget_s=a.budget_s, json_path=a.json_path, plot_path=a.plot_path, daemon_log=a.daemon_log,
    ).validate()


def run_args(a) -> int:
    """Run from parsed arguments (``sparsekv bench decode``); exit code:
    0, 1 when a mode failed, 2 for bad options or no GPU."""
    try:
        opts = options_from_args(a)
    except ValueError as e:
        print(f"sparsekv bench decode: {e}", file=sys.stderr)
        return 2
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        print("sparsekv bench decode: needs torch with CUDA and CuPy (pip install 'sparsekv[cuda]')", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("sparsekv bench decode: torch sees no CUDA device", file=sys.stderr)
        return 2

    def write(results, complete: bool) -> None:
        if opts.json_path:
            # Written after each batch size too: a run cut short still leaves what it measured.
            cut = any(r.skipped is not None and r.skipped.startswith(OVER_BUDGET) for r in results)
            write_json(opts.json_path, {**summary(results, opts), "decode_complete": complete and not cut})

    results = run(opts, torch, on_batch=lambda rs: write(rs, False))
    write(results, True)
    if opts.json_path:
        say(f"wrote {opts.json_path}")
    if opts.plot_path and plot(results, opts.plot_path):
        say(f"wrote {opts.plot_path}")
    sys.stdout.write(table(results, opts))
    return 1 if any(r.error is not None for r in results) else 0

