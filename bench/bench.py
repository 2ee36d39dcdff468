"""``sparsekv bench``: speed figures as ratios against a baseline measured in the same run.

* ``resolve``: time to resolve one top-k batch (residency only, no bytes moved).
* ``gather``: rows per second of the plan gather against a bulk copy of the same bytes.
* ``transport``, ``cuda_transport``: a decode step through a daemon against the same step
  in process (bench/transport.py).
* ``prefix``: the block store's lookup of a cached 128K-token prefix through a daemon, and
  a restarted engine's time to it; on a GPU also its indexer keys loaded into engine
  memory against a bulk H2D copy (bench/prefix.py; not in the default set).
* ``tp``: the daemon's time per step of a TP group's ranks against the same ranks each
  resolving its own (cpu; bench/tp.py; not in the default set).
* alone, with options of their own: ``decode`` (a whole decode step offloaded against
  on the GPU, bench/decode.py), ``serve`` (decode throughput of a DeepSeek-V3.2-shaped
  model at long context, offloaded against all on the GPU, bench/serve.py), ``kernels`` (gather, resolve and pool start against the
  link, bench/kernels.py) and ``latest`` (docs/perf/latest.json's figures, bench/latest.py).
"""

from __future__ import annotations

import functools
import json
import os
import stat
import sys
import time

import numpy as np

from sparsekv.daemon.residency.base import Plan
from sparsekv.daemon.residency.cpu import CpuMover, CpuResidency
from sparsekv.proto import Layout

from . import decode, kernels, latest, serve
from .prefix import bench_prefix
from .tp import bench_tp
from .transport import bench_cuda_transport, bench_transport

CPU_BENCHES = ("resolve", "gather", "transport")  # the default set
MORE_CPU_BENCHES = ("prefix", "tp")  # cpu, named to run
GPU_BENCHES = ("cuda_transport", "kernels", "latest")  # need CuPy and a GPU (decode checks for torch itself)
ALONE = {"decode": decode.run_args, "serve": serve.run_args, "kernels": kernels.run_args, "latest": latest.run_args}
FILE_OPTIONS = {"decode": ("--json", "--plot", "--daemon-log"), "serve": ("--json", "--plot", "--daemon-log"),
                "kernels": ("--json",), "latest": ("--json", "--merge")}
# The benches that read each option group (its file options aside: FILE_OPTIONS); an option
# of a group given to another bench is refused, never ignored. Filled by add_arguments.
READERS = {"decode": ("decode",), "serve": ("serve",), "kernels": ("kernels",), "latest": ("latest",)}
SERVE_READS = {"batches", "modes", "steps", "hits", "quick", "block_size", "layer_overlap", "gather_blocks", "seed"}
DECODE_READS = {"region_rows"}  # serve's options decode reads too
_GROUP_ACTIONS: dict[str, list] = {}


def _median_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def bench_resolve(batch=16, top_k=2048, region_stride=4096, overlap=0.8, reps=20, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    host_rows = batch * 65536
    lay = Layout(num_layers=1, row_bytes=16, top_k=top_k, region_stride=region_stride, max_reqs=batch, host_rows=host_rows)
    eng = CpuResidency(lay)
    state_rows = np.arange(batch, dtype=np.int32)
    base = (np.arange(batch) * 65536)[:, None]
    cur = (base + rng.choice(65536, top_k, replace=False)[None, :]).astype(np.int32)

    def next_topk():
        nonlocal cur
        keep = rng.random(cur.shape) < overlap
        fresh = base + rng.integers(0, 65536, cur.shape)
        new = np.where(keep, cur, fresh)
        # unique per row: replace collisions with -1 (rare)
        for b in range(batch):
            _, first = np.unique(new[b], return_index=True)
            dup = np.ones(top_k, bool)
            dup[first] = False
            new[b][dup] = -1
        cur = new.astype(np.int32)
        return cur

    batches = [next_topk() for _ in range(reps + 1)]
    it = iter(batches)
    per = _median_s(lambda: eng.resolve(0, state_rows, next(it)), reps)
    return {"bench": "resolve", "batch": batch, "top_k": top_k, "region_stride": region_stride,
            "overlap": overlap, "median_ms": round(per * 1e3, 3),
            "columns_per_s": round(batch * top_k / per)}


def bench_gather(rows=65536, row_bytes=656, host_rows=1 << 20, reps=5, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    lay = Layout(num_layers=1, row_bytes=row_bytes, top_k=1, region_stride=rows, max_reqs=1, host_rows=host_rows)
    pool = rng.integers(0, 255, (1, host_rows, row_bytes), dtype=np.uint8)
    slab = np.zeros((1, 1, rows, row_bytes), np.uint8)
    mover = CpuMover(lay, pool, slab, None)
    ids = np.sort(rng.choice(host_rows, rows, replace=False)).astype(np.int32)
    plan = Plan(rows=ids, slots=np.arange(rows, dtype=np.int32))
    t_gather = _median_s(lambda: mover.gather(plan, (0,)), reps)
    src = pool.reshape(-1)[: rows * row_bytes]
    dst = np.empty_like(src)
    t_bulk = _median_s(lambda: np.copyto(dst, src), reps)
    nbytes = rows * row_bytes
    return {"bench": "gather", "rows": rows, "row_bytes": row_bytes,
            "gather_GBps": round(nbytes / t_gather / 1e9, 2), "bulk_copy_GBps": round(nbytes / t_bulk / 1e9, 2),
            "ratio_vs_bulk": round(t_bulk / t_gather, 3)}


IO_PLACEMENTS = ("both", "installed", "warm")


def run_bench(which: list[str], io: str = "both", tp_ranks: int = 2) -> list[dict]:
    """Each benchmark's result; ``cuda_transport`` once per I/O placement of ``io``
    (``both``: installed, then warm where 4 CPUs or more can be used); ``tp`` with
    ``tp_ranks`` ranks."""
    if io not in IO_PLACEMENTS:
        raise ValueError(f"io must be one of {', '.join(IO_PLACEMENTS)}, got {io!r}")
    cpu_benches = {"resolve": bench_resolve, "gather": bench_gather, "transport": bench_transport,
                   "prefix": bench_prefix, "tp": functools.partial(bench_tp, ranks=tp_ranks)}
    out = []
    for w in which:
        if w != "cuda_transport":
            out.append(cpu_benches[w]())  # KeyError for a name that is none
            continue
        if io in ("both", "installed"):
            out.append(bench_cuda_transport())
        if io == "warm" or (io == "both" and len(os.sched_getaffinity(0)) >= 3):
            out.append(bench_cuda_transport(warm_io=True))
    return out


def format_results(results: list[dict]) -> str:
    return "\n".join(json.dumps(r) for r in results) + "\n"


def cuda_unavailable() -> str | None:
    """Why the GPU benchmarks cannot run here (no CuPy, no CUDA device), or None."""
    try:
        import cupy as cp  # noqa: PLC0415
    except ImportError:
        return "needs CuPy and an NVIDIA GPU (pip install 'sparsekv[cuda]')"
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError as e:
        return f"CuPy finds no CUDA device ({e})"
    return None if count else "CuPy finds no CUDA device"


def add_arguments(p) -> None:
    """The options of ``sparsekv bench`` (decode's, kernels' and latest's in groups)."""
    p.add_argument("which", nargs="*", metavar="NAME",
                   help="resolve, gather, transport (cpu; the default set), prefix (cpu: the block store's lookup of "
                        "a cached 128K-token prefix, and a restarted engine's time to it; on a GPU also its indexer "
                        "keys loaded into engine memory against a bulk H2D copy), tp (cpu: a TP group's daemon "
                        "time per step against its ranks resolving their own), cuda_transport (needs a "
                        "GPU), or alone: "
                        "decode (a whole decode step, offloaded against on the GPU), serve (decode throughput of a "
                        "DeepSeek-V3.2-shaped model, offloaded against on the GPU), kernels (gather, resolve "
                        "and pool start against the link) or latest (docs/perf/latest.json's figures); all four "
                        "need a GPU; options below")
    p.add_argument("--io", choices=IO_PLACEMENTS, default="both",
                   help="cuda_transport: the daemon's loop thread as installed (not placed), on a warm CPU (the "
                        "last this process may use, kept warm by the daemon; deploy/README.md \"Warm CPUs\"), or "
                        "both, one run each (warm only with 3 CPUs or more)")
    p.add_argument("--tp-ranks", type=int, default=2, metavar="N",
                   help="tp: the ranks of the group, 2 to 64 (default 2)")
    groups = {"decode": (decode, "decode options (sparsekv bench decode ...)"),
              "serve": (serve, "serve options (sparsekv bench serve ...; it also reads --batches, --modes, --steps, "
                               "--hits, --quick, --block-size, --layer-overlap, --gather-blocks, --seed, --json, "
                               "--plot, --daemon-log above, with its own defaults)"),
              "kernels": (kernels, "kernels options (sparsekv bench kernels ...)"),
              "latest": (latest, "latest options (sparsekv bench latest ...)")}
    files = {f for flags in FILE_OPTIONS.values() for f in flags}
    for name, (module, title) in groups.items():
        g = p.add_argument_group(title)
        module.add_arguments(g)
        _GROUP_ACTIONS[name] = [act for act in g._group_actions if not files & set(act.option_strings)]


def _foreign_option(a, which: list[str]) -> str | None:
    """The first option given (not at its default) that none of ``which`` reads, and who
    reads it; None when there is none."""
    for group, actions in _GROUP_ACTIONS.items():
        for act in actions:
            readers = READERS[group] + (("serve",) if group == "decode" and act.dest in SERVE_READS else ()) + (
                ("decode",) if group == "serve" and act.dest in DECODE_READS else ())
            if not set(which) & set(readers) and getattr(a, act.dest, act.default) != act.default:
                return f"{act.option_strings[-1]} is an option of sparsekv bench {' or '.join(readers)}"
    return None


def run_args(a) -> int:
    """``sparsekv bench [NAME ...] [options]``: exit 0, 1 when a run failed, 2 for bad
    arguments or a machine that cannot run them (one line on stderr, before any work)."""
    which = a.which or list(CPU_BENCHES)
    what = f"sparsekv bench {' '.join(which)}"
    alone = [w for w in which if w in ALONE]
    unknown = sorted(set(which) - set(CPU_BENCHES) - set(MORE_CPU_BENCHES) - set(GPU_BENCHES) - set(ALONE))
    if unknown:
        return _refuse("sparsekv bench", f"unknown benchmark(s) {', '.join(unknown)}; choose from "
                       f"{', '.join(CPU_BENCHES + MORE_CPU_BENCHES + GPU_BENCHES + ('decode', 'serve'))}")
    if alone and len(which) != 1:
        return _refuse("sparsekv bench", f"{alone[0]} runs alone (sparsekv bench {alone[0]} [options])")
    twice = sorted({w for w in which if which.count(w) > 1})
    if twice:  # (it would run again, its figures under the same keys)
        return _refuse("sparsekv bench", f"{', '.join(twice)} named twice; name each benchmark once")
    why = _foreign_option(a, which)
    if why:
        return _refuse(what, why)
    if a.io != "both" and "cuda_transport" not in which:
        return _refuse("sparsekv bench", "--io is an option of cuda_transport")
    if a.tp_ranks != 2 and "tp" not in which:
        return _refuse("sparsekv bench", "--tp-ranks is an option of tp")
    if not 2 <= a.tp_ranks <= 64:
        return _refuse(what, f"--tp-ranks must lie in [2, 64], got {a.tp_ranks}")
    for flag, path in (("--json", a.json_path), ("--plot", a.plot_path), ("--daemon-log", a.daemon_log),
                       ("--merge", a.merge)):
        if path and not (alone and flag in FILE_OPTIONS[alone[0]]):
            return _refuse(what, f"{flag} is an option of {' or '.join(n for n, o in FILE_OPTIONS.items() if flag in o)}")
    for flag, path in (("--json", a.json_path), ("--plot", a.plot_path), ("--daemon-log", a.daemon_log)):
        why = output_problem(path, flag, replaced=flag == "--json") if path else None
        if why:
            return _refuse(what, why)
    why = cuda_unavailable() if set(which) & set(GPU_BENCHES) else None
    if why:
        return _refuse(what, why)
    if alone:
        return ALONE[alone[0]](a)
    sys.stdout.write(format_results(run_bench(which, io=a.io, tp_ranks=a.tp_ranks)))
    return 0


# An output is written beside its path under a temporary name this much longer
# (".tmp-" and a process id), then renamed over it.
TEMP_SUFFIX_BYTES = 12


def output_problem(path: str, what: str = "--out", replaced: bool = True) -> str | None:
    """Why an output path cannot be written, found before any work; None when it can. It
    must name a file (not empty, not a directory) in a directory that exists and is
    writable. One ``replaced`` whole (written under a temporary name, then renamed over
    it: a trace, a result, JSON) must have a name that fits the file system with the
    temporary suffix, and what is there must be a regular file (a symlink, a device or a
    FIFO would be replaced by the rename, not written through); a log (appended) or a
    plot may be any file but a FIFO or a socket (its open would wait for a reader)."""
    if not path:
        return f"{what} is empty; name a file"
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{what} {path} is a directory; name a file"
    if path.endswith(os.sep):  # (abspath drops it: the file would be made, then not found at the end)
        return f"{what} {path} ends with {os.sep}; name a file"
    if not os.path.isdir(folder):
        return f"{what} {path}: " + (f"{folder} is not a directory" if os.path.exists(folder)
                                      else f"directory {folder} does not exist")
    try:
        name_max = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    name, suffix = len(os.fsencode(os.path.basename(path))), TEMP_SUFFIX_BYTES if replaced else 0
    if name + suffix > name_max:
        why = f" (it is written under a name {suffix} bytes longer first)" if suffix else ""
        return f"{what} {path}: its file name is {name} bytes; at most {name_max - suffix} here{why}"
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        return f"{what} {path}: {e.strerror}"
    if replaced and mode is not None and not stat.S_ISREG(mode):
        kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
        return f"{what} {path} is {kind}, which the output would replace; name a regular file or a new one"
    if mode is not None and (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):  # an open of it would wait for a reader
        return f"{what} {path} is a {'FIFO' if stat.S_ISFIFO(mode) else 'socket'}; name a file"
    if not os.access(folder, os.W_OK | os.X_OK) or (mode is not None and not os.access(path, os.W_OK)):
        return f"{what} {path}: not writable by this user"
    return None


def _refuse(what: str, why: str) -> int:
    print(f"{what}: {why}", file=sys.stderr)
    return 2
