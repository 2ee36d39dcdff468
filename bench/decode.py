"""``sparsekv bench decode``: a whole decode step (every layer: swap-in, then a tiny
attention over the selected rows) with the KV cache offloaded, against the same step with
every row already on the GPU, over one generated top-k sequence.

Modes (each over the same top-k sequence of a (batch, hits) config):

* ``gpu``: no offload. Every layer's rows sit in one GPU tensor ``[layers, host_rows,
  row_bytes]``; per layer, positions map to rows through the block table with torch ops,
  then the tiny attention reads the rows.
* ``inproc``: ``InprocSwapIn`` (the daemon's kernels inline on this stream, its own pinned
  pool): ``begin_step`` once, ``swap_in`` per layer, the same tiny attention over
  ``kv(layer)``.
* ``doorbell``: a private cuda ``sparsekvd``, the rank attached with
  ``transport="doorbell"``, ``Client.doorbell_handle()``, the same engine code as inproc.
* ``zmq`` (only when ``--modes`` names it): ``HostSwapIn`` over a rank attached with the
  default transport and fence events, with device wait (``Client(device_wait=True)``):
  per layer the positions are mapped on the GPU and copied into the rank's step block on
  the stream, one TOPK message goes, the stream waits on the GPU for the entry's done
  word; the host waits for nothing. Eager (host code on the path).

The step of gpu, inproc and doorbell is captured once per (mode, batch) as a
``torch.cuda.CUDAGraph`` over static input tensors and replayed each step after the
step's inputs were copied in (not timed); the time is ``replay()`` plus
``torch.cuda.synchronize()``. When the capture fails the step runs eagerly and the table
says so (``run`` column).

The top-k sequence (:func:`generate`): each request's top-k over its ``context``
positions keeps exactly ``hits`` of its columns from the previous step (with a hot region
of ``top_k`` slots, that is the hit rate), and each layer's top-k is a fixed bijection of
the step's base top-k, chosen so that adjacent layers share ~``layer_overlap`` of their
columns (published: 70-100 %; DESIGN §3) while each layer keeps the exact step-to-step
overlap.

What a phase holds is big (batch 128, 61 layers, context 8192: 42 GB of KV rows, on the
GPU for ``gpu``, pinned on the host for ``inproc`` and the daemon), so the run goes by
batch, and within a batch by mode (gpu, inproc, doorbell, zmq), each mode over every hit
rate: one allocation and one pool fill per (mode, batch), freed before the next. The
daemon's engine stays attached over the hit rates of a batch (a detach releases its pool
range, and a new engine would need its pool written again); every state row is reset at
the first step of each config, which empties its hot region as a new attach would.

CPU-only parts (generation, fill pattern, table, JSON) import neither torch nor CuPy.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from sparsekv.proto import LIMITS, Layout

MODES = ("gpu", "inproc", "doorbell", "zmq")  # also the order they run in
# --control: a second in-process handle with a pool of its own, timed in turn with inproc
# and the doorbell: what two pools alone differ by in the same run (the noise floor of the
# hand-off figure: on these VMs one pool's gather can run a few % faster than another's).
CONTROL = "inproc2"
ORDER = ("gpu", "inproc", CONTROL, "doorbell", "zmq")  # the table's and the plot's
COMPARED = (CONTROL, "doorbell", "zmq")  # the modes measured against the same config's inproc
DEFAULT_MODES = ("gpu", "inproc", "doorbell")
DEFAULT_BATCHES = (16, 64, 128)
DEFAULT_HITS = (80.0, 90.0, 95.0)  # percent
DEFAULT_STEPS = 40
QUICK_BATCHES = (16, 64)
QUICK_HITS = (90.0, 100.0)  # 100: nothing to gather, the doorbell's hand-off alone
QUICK_STEPS = 20
REFERENCE = (64, 90.0)  # (batch, hits %) of the headline JSON figures
OVER_BUDGET = "over --budget-s"  # how a config --budget-s kept from running is marked skipped
DEVICE = 0  # the GPU this process and the private daemon use
DAEMON_POOL_SLACK_BYTES = 64 << 20
CLIENT_TIMEOUT_S = 600.0  # attach registers GBs of pool; a write of 256 MiB takes a while
DAEMON_START_TIMEOUT_S = 600.0  # the daemon pre-faults its pool before it listens
GIB = 1 << 30


def _say(msg: str) -> None:
    print(f"bench decode: {msg}", file=sys.stderr, flush=True)


# -- options -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Options:
    """One run. ``hits`` in percent; ``gather_blocks`` None: the daemon's default."""

    batches: tuple[int, ...] = DEFAULT_BATCHES
    hits: tuple[float, ...] = DEFAULT_HITS
    layers: int = 61
    top_k: int = 2048
    row_bytes: int = 656
    context: int = 8192
    block_size: int = 64
    steps: int = DEFAULT_STEPS
    warmup: int = 8
    rounds: int = 1  # every mode of a batch this many times over, alternating (run-to-run spread)
    paired: bool = False  # inproc and doorbell timed step by step in turn (drift cancels out)
    control: bool = False  # with paired: a second inproc handle (CONTROL) timed in turn too
    modes: tuple[str, ...] = DEFAULT_MODES
    layer_overlap: float = 0.85
    gather_blocks: int | None = None
    seed: int = 0
    # Start no batch size (or round of one) after this many seconds: the rest is marked
    # skipped, and what ran is written (a device call has a hard limit). None: no limit.
    budget_s: float | None = None
    json_path: str | None = None
    plot_path: str | None = None
    daemon_log: str | None = None

    def validate(self) -> "Options":
        """Raise ValueError naming the first bad option; return self."""
        if not self.batches or any(b <= 0 for b in self.batches):
            raise ValueError(f"--batches must be positive integers, got {list(self.batches)}")
        if not self.hits or any(not 0 <= h <= 100 for h in self.hits):
            raise ValueError(f"--hits must be percentages in [0, 100], got {list(self.hits)}")
        for name in ("layers", "top_k", "row_bytes", "context", "block_size", "steps", "warmup", "rounds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.row_bytes % 16:
            raise ValueError(f"--row-bytes {self.row_bytes} must be a multiple of 16 (the cuda backend moves "
                             "rows with 16-byte loads)")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
        if self.paired and not {"inproc", "doorbell"} <= set(self.modes):
            raise ValueError(f"--paired times inproc and doorbell in turn: --modes must have both, got "
                             f"{','.join(self.modes)}")
        if self.control and not self.paired:
            raise ValueError("--control times a second in-process pool in turn with the others: it needs --paired")
        if not 0 <= self.layer_overlap <= 1:
            raise ValueError(f"--layer-overlap must lie in [0, 1], got {self.layer_overlap}")
        if self.gather_blocks is not None and self.gather_blocks < 1:
            raise ValueError(f"--gather-blocks must be >= 1, got {self.gather_blocks}")
        if self.budget_s is not None and not self.budget_s > 0:
            raise ValueError(f"--budget-s must be a positive number of seconds, got {self.budget_s}")
        for h in self.hits:
            need = self.top_k + (self.top_k - _keep(self.top_k, h / 100))
            if self.context < need:
                raise ValueError(f"--context {self.context} is too short for top-k {self.top_k} at {h:g} % hits: "
                                 f"each step draws {self.top_k - _keep(self.top_k, h / 100)} new positions outside "
                                 f"the previous top-k, so the context needs >= {need} positions")
        for b in self.batches:
            make_layout(b, self).validate()
        return self

    @property
    def blocks(self) -> int:
        """Blocks of one request's block table."""
        return -(-self.context // self.block_size)

    def host_rows(self, batch: int) -> int:
        return batch * self.blocks * self.block_size


def make_layout(batch: int, opts: Options) -> Layout:
    """One index group per layer, one token per request (region_stride = top_k)."""
    return Layout(num_layers=opts.layers, row_bytes=opts.row_bytes, top_k=opts.top_k, region_stride=opts.top_k,
                  max_reqs=batch, host_rows=opts.host_rows(batch),
                  index_groups=tuple((layer,) for layer in range(opts.layers)), max_batch=batch,
                  staging_rows=min(FILL_STAGING_ROWS, opts.host_rows(batch)))


def _keep(top_k: int, hit_rate: float) -> int:
    """Columns each request keeps from its previous step's top-k."""
    return int(round(hit_rate * top_k))


def hkey(hits: float) -> str:
    """90.0 -> "90", 92.5 -> "92p5" (for names and JSON keys)."""
    return f"{hits:g}".replace(".", "p")


# -- the top-k sequence --------------------------------------------------------------------
@dataclass
class Workload:
    """One config's decode steps (warm-up included).

    ``base`` int32 [steps, batch, top_k]: each request's positions of the step (layer 0);
    layer ``l``'s top-k is ``perms[l][base[t]]`` (:meth:`topk`). ``block_table`` int32
    [batch, blocks]: host block of each logical block of each request (a permutation of
    every host block). ``reset`` bool [steps, batch]: True at step 0 only.
    """

    base: np.ndarray
    perms: np.ndarray
    block_table: np.ndarray
    reset: np.ndarray
    block_size: int
    target_hit_rate: float

    @property
    def steps(self) -> int:
        return self.base.shape[0]

    @property
    def batch(self) -> int:
        return self.base.shape[1]

    @property
    def top_k(self) -> int:
        return self.base.shape[2]

    @property
    def layers(self) -> int:
        return self.perms.shape[0]

    @property
    def context(self) -> int:
        return self.perms.shape[1]

    def topk(self, t: int) -> np.ndarray:
        """int32 [layers, batch, top_k]: every layer's top-k positions of step ``t``."""
        return self.perms[:, self.base[t]]

    def host_rows_of(self, t: int) -> np.ndarray:
        """int64 [layers, batch, top_k]: the host rows ``topk(t)`` names (for checks)."""
        pos = self.topk(t).astype(np.int64)
        bs = self.block_size
        blk = self.block_table[np.arange(self.batch)[None, :, None], pos // bs]
        return blk.astype(np.int64) * bs + pos % bs


def generate(batch: int, hit_rate: float, *, steps: int, layers: int, context: int, top_k: int = 2048,
             block_size: int = 64, layer_overlap: float = 0.85, seed: int = 0) -> Workload:
    """A decode sequence of ``steps`` steps whose top-k keeps exactly ``round(hit_rate *
    top_k)`` columns of each request's previous step, in every layer, and whose adjacent
    layers share about ``layer_overlap`` of their columns.

    How: a base top-k per step and request (kept columns: a random subset of the previous
    base; new columns: random positions outside it); layer ``l`` applies a fixed bijection
    ``perms[l]`` of the positions to the base. A bijection keeps each layer's step-to-step
    overlap exact. ``perms[l] = perms[l-1] o sigma_l`` where ``sigma_l`` shuffles a random
    fraction ``m`` of the positions among themselves, so adjacent layers share ``(1 - m)
    + m * top_k / context`` of their columns in expectation; ``m`` is chosen for
    ``layer_overlap``. Positions lie in [0, context), unique within each row."""
    if not 0 <= hit_rate <= 1:
        raise ValueError(f"hit_rate must lie in [0, 1], got {hit_rate}")
    keep = _keep(top_k, hit_rate)
    fresh = top_k - keep
    if context < top_k + fresh:
        raise ValueError(f"context {context} < top_k {top_k} + {fresh} new positions per step")
    # The block table depends on (seed, batch) only: every hit rate of a batch reads the
    # same host rows for the same positions.
    table_rng = np.random.default_rng([seed, batch])
    blocks = -(-context // block_size)
    block_table = table_rng.permutation(batch * blocks).astype(np.int32).reshape(batch, blocks)
    rng = np.random.default_rng([seed, batch, int(round(hit_rate * 1e6))])

    base = np.empty((steps, batch, top_k), np.int32)
    base[0] = _smallest_keys(rng.random((batch, context), dtype=np.float32), top_k)
    for t in range(1, steps):
        base[t] = _next_base(rng, base[t - 1], context, keep)

    moved = 0.0
    if context > top_k:
        moved = min(1.0, (1.0 - layer_overlap) / (1.0 - top_k / context))
    n_moved = int(round(moved * context))
    perms = np.empty((layers, context), np.int32)
    perms[0] = np.arange(context, dtype=np.int32)
    for layer in range(1, layers):
        sigma = np.arange(context)
        chosen = rng.choice(context, size=n_moved, replace=False)
        sigma[chosen] = rng.permutation(chosen)
        perms[layer] = perms[layer - 1][sigma]

    reset = np.zeros((steps, batch), bool)
    reset[0] = True
    return Workload(base=base, perms=perms, block_table=block_table, reset=reset, block_size=block_size,
                    target_hit_rate=keep / top_k)


def _smallest_keys(keys: np.ndarray, n: int) -> np.ndarray:
    """Per row, the column numbers of the ``n`` smallest keys (any order)."""
    if n == 0:
        return np.empty((keys.shape[0], 0), np.int64)
    return np.argpartition(keys, n - 1, axis=1)[:, :n]


def _next_base(rng, prev: np.ndarray, context: int, keep: int) -> np.ndarray:
    """Next step's positions: ``keep`` random columns of ``prev`` (per row), the rest
    random positions not in ``prev``; columns shuffled."""
    batch, top_k = prev.shape
    in_prev = np.zeros((batch, context), bool)
    np.put_along_axis(in_prev, prev.astype(np.int64), True, axis=1)
    keys = rng.random((batch, context), dtype=np.float32)  # in [0, 1): 2.0 never wins
    kept = _smallest_keys(np.where(in_prev, keys, 2.0), keep)
    new = _smallest_keys(np.where(in_prev, 2.0, keys), top_k - keep)
    row = np.concatenate([kept, new], axis=1)
    order = np.argsort(rng.random((batch, top_k), dtype=np.float32), axis=1)
    return np.take_along_axis(row, order, axis=1).astype(np.int32)


# -- fill patterns -------------------------------------------------------------------------
PATTERN_ROWS = 4096  # the pattern repeats every this many rows


def pattern_tile(rows: int, row_bytes: int) -> np.ndarray:
    """uint8 [rows, row_bytes]: byte j of row r is (7 r + j) mod 256."""
    r = np.arange(rows, dtype=np.int64)[:, None]
    j = np.arange(row_bytes, dtype=np.int64)[None, :]
    return ((7 * r + j) & 0xFF).astype(np.uint8)


def fill_pattern(pool: np.ndarray, threads: int | None = None) -> None:
    """Fill ``pool`` uint8 [layers, rows, row_bytes] cheaply: layer 0 from a repeating
    tile (row r holds the tile's row r mod PATTERN_ROWS), copied to the other layers on
    several threads (NumPy copies release the GIL). The bytes do not matter for timing;
    this only makes every row hold something."""
    layers, rows, row_bytes = pool.shape
    tile = pattern_tile(min(rows, PATTERN_ROWS), row_bytes)
    first = pool[0]
    for start in range(0, rows, tile.shape[0]):
        n = min(tile.shape[0], rows - start)
        first[start:start + n] = tile[:n]
    if layers > 1:
        workers = threads or min(16, os.cpu_count() or 1)
        with ThreadPoolExecutor(workers) as ex:
            list(ex.map(lambda layer: np.copyto(pool[layer], first), range(1, layers)))


FILL_STAGING_ROWS = 4096  # rows per layer of the staging buffer the pool is filled through


def fill_through_staging(client, lay: Layout, torch) -> float:
    """Fill every host row of every layer from the rank's staging buffer: the pattern
    block is put there once, and each ``WRITE_STAGED`` copies it to the next
    ``staging_rows`` host rows (the daemon's write mirror, device to host). A last plain
    ``write`` of one row waits for them: a WRITE quiesces the engine's copies first.
    Returns the seconds it took."""
    att = client.attachment
    n = lay.staging_rows
    block = np.empty((lay.num_layers, n, lay.row_bytes), np.uint8)
    fill_pattern(block)
    t0 = time.perf_counter()
    att.staging.copy_(torch.from_numpy(block))
    torch.cuda.synchronize()
    for start in range(0, lay.host_rows, n):
        client.write_staged(np.arange(start, min(start + n, lay.host_rows), dtype=np.int32))
    last = lay.host_rows - 1
    client.write(np.array([last], np.int32), block[:, (last % n):(last % n) + 1])
    return time.perf_counter() - t0


def fill_through_client(client, lay: Layout) -> float:
    """Write every host row of every layer through ``client.write`` (all layers per
    request, as many rows as one frame carries); return the seconds it took."""
    per_row = lay.num_layers * lay.row_bytes
    chunk = max(1, min(LIMITS.max_frame_bytes // per_row, LIMITS.max_write_rows, lay.host_rows))
    block = np.empty((lay.num_layers, chunk, lay.row_bytes), np.uint8)
    fill_pattern(block)
    t0 = time.perf_counter()
    for start in range(0, lay.host_rows, chunk):
        n = min(chunk, lay.host_rows - start)
        client.write(np.arange(start, start + n, dtype=np.int32), block if n == chunk else block[:, :n])
    return time.perf_counter() - t0


# -- results -------------------------------------------------------------------------------
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
    inproc_vs_gpu: float | None = None
    round_overheads: tuple[float, ...] = ()  # each round's overhead against that round's inproc

    @property
    def ok(self) -> bool:
        return self.error is None and self.skipped is None and self.p50_us is not None


def combine_rounds(results: list[Result], layers: int) -> list[Result]:
    """One result per (batch, hits, mode) from the rounds of ``--rounds``: p50 and p99 the
    median of the rounds' (the rounds' p50s kept), the hit rate and misses of the first,
    and for a daemon mode each round's overhead against the same round's inproc
    (``round_overheads``, microseconds a layer). A config whose every round failed keeps
    its first failure; a failed round is left out of the others."""
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
                        misses_per_step=first.misses_per_step, fill_s=first.fill_s, huge_pct=first.huge_pct,
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
        if r.mode == "inproc" and gpu is not None and gpu.ok:
            r.inproc_vs_gpu = r.p50_us / gpu.p50_us
    return results


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def table(results: list[Result], opts: Options) -> str:
    """The compact table printed last (call :func:`derive` first)."""
    gb = _gather_blocks(opts)
    lines = [f"sparsekv bench decode: {opts.layers} layers, top-k {opts.top_k}, {opts.row_bytes} B rows, context "
             f"{opts.context} (block {opts.block_size}), {opts.steps} steps after {opts.warmup} warm-up, "
             f"gather_blocks {gb}",
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
    from sparsekv.daemon.cuda.doorbell import signal_mode as daemon_signal  # noqa: PLC0415

    from sparsekv.client.doorbell import signal_mode as engine_signal  # noqa: PLC0415

    out: dict = {"decode_layers": opts.layers, "decode_top_k": opts.top_k, "decode_row_bytes": opts.row_bytes,
                 "decode_context": opts.context, "decode_block_size": opts.block_size, "decode_steps": opts.steps,
                 "decode_warmup": opts.warmup, "decode_gather_blocks": _gather_blocks(opts),
                 "decode_layer_overlap": opts.layer_overlap, "decode_paired": opts.paired,
                 "decode_control": opts.control,
                 # how bells and ready words were signalled (client/doorbell.py, daemon/cuda/doorbell.py)
                 "decode_engine_signal": engine_signal(),
                 "decode_daemon_signal": daemon_signal()}
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
        # the two sides differ by the signalling only (docs/PERF.md, session 17).
        out["doorbell_handoff_us_per_layer"] = _per_layer(_compared(results, "doorbell", ref.batch, 100.0))
        # --control: the second in-process pool against the first at the reference config.
        ctl = _compared(results, CONTROL, ref.batch, ref.hits)
        if ctl is not None:
            out["decode_pool_control_us_per_layer"] = _per_layer(ctl)
    else:
        out["doorbell_handoff_us_per_layer"] = None
    return out


def _compared(results: list[Result], mode: str, batch: int, hits: float) -> Result | None:
    """The row of ``mode`` at (batch, hits) that ran and was compared with inproc, or None."""
    return next((r for r in results if r.mode == mode and r.ok and r.batch == batch and r.hits == hits
                 and r.vs_inproc is not None), None)


def _per_layer(r: Result | None):
    """``r``'s microseconds a layer over inproc: the paired median when --paired ran
    (both sides timed in turn, the machine's drift left out), else the difference of the
    p50s (the other figure stays under its config's keys); None without a row."""
    if r is None:
        return None
    return _round(r.paired_us_per_layer if r.paired_us_per_layer is not None else r.overhead_us_per_layer, 2)


def _reference(results: list[Result]) -> Result | None:
    """The doorbell figure at batch 64, 90 % hits when run, else the first config run
    with both doorbell and inproc."""
    rows = [r for r in results if r.mode == "doorbell" and r.ok and r.vs_inproc is not None]
    for r in rows:
        if (r.batch, r.hits) == REFERENCE:
            return r
    return rows[0] if rows else None


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
        _say(f"matplotlib is not installed: --plot {path} skipped (pip install matplotlib)")
        return False
    ok = [r for r in results if r.ok]
    if not ok:
        _say(f"nothing to plot: --plot {path} skipped")
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


# -- the GPU side --------------------------------------------------------------------------
def _gather_blocks(opts: Options) -> int:
    if opts.gather_blocks is not None:
        return opts.gather_blocks
    from sparsekv.daemon.config import Config  # noqa: PLC0415 - the daemon's own default

    return int(Config.gather_blocks)


def _device(torch):
    return torch.device("cuda", DEVICE)


class _Static:
    """The step's static device tensors: captured once, refilled before each replay."""

    def __init__(self, torch, lay: Layout, blocks: int):
        d = _device(torch)
        B, K, L = lay.max_batch, lay.top_k, lay.num_layers
        self.state = torch.arange(B, dtype=torch.int32, device=d)  # state rows = request ids
        self.req = torch.arange(B, dtype=torch.int32, device=d)
        self.reset = torch.zeros(B, dtype=torch.bool, device=d)
        self.table = torch.zeros((B, blocks), dtype=torch.int32, device=d)
        self.topk = torch.zeros((L, B, K), dtype=torch.int32, device=d)  # topk[l]: contiguous
        self.idx = torch.zeros((L, B, K), dtype=torch.int32, device=d)
        self.out = torch.zeros((L, B), dtype=torch.int64, device=d)


class _Inputs:
    """One config's sequence on the GPU; ``load(st, t)`` copies step ``t`` into ``st``."""

    def __init__(self, torch, wl: Workload):
        d = _device(torch)
        self.base = torch.from_numpy(wl.base.reshape(wl.steps, -1)).to(device=d, dtype=torch.int64)
        self.perms = torch.from_numpy(wl.perms).to(d)
        self.reset = torch.from_numpy(wl.reset).to(d)
        self.table = torch.from_numpy(wl.block_table).to(d)

    def load(self, st: _Static, t: int) -> None:
        st.reset.copy_(self.reset[t])
        L = st.topk.shape[0]
        st.topk.view(L, -1).copy_(self.perms.index_select(1, self.base[t]))


def _attend(torch, kv32, idx, out) -> None:
    """The tiny attention: read every selected row (``kv32`` [rows, row_bytes / 4] int32,
    ``idx`` [tokens, k], -1 = masked) and reduce it to one number per token in ``out``."""
    valid = idx >= 0
    rows = kv32.index_select(0, idx.clamp(min=0).reshape(-1).long())
    sums = rows.sum(dim=1) * valid.reshape(-1)
    torch.sum(sums.view(idx.shape), dim=1, out=out)


def _capture(torch, step, label: str):
    """(run, "graph" | "eager", graph): one eager warm-up step on a side stream (lazy
    kernel loads, allocator), then the capture; on failure the eager step itself."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    except Exception as e:  # noqa: BLE001 - any failure: say it, run eagerly
        _say(f"{label}: CUDA graph capture failed ({type(e).__name__}: {' '.join(str(e).split())[:300]}); "
             "running the step eagerly")
        torch.cuda.synchronize()
        return step, "eager", None
    return graph.replay, "graph", graph


def _timed(torch, runs, inputs: _Inputs, sts, opts: Options, counts):
    """Step times (us) ``[len(runs), steps]`` of the timed steps, and per run (hits,
    misses) over them or None. ``runs`` / ``sts`` / ``counts``: one per side; with several,
    step ``t`` of every side runs before step ``t + 1`` of any, the order rotated by ``t``
    (each side first as often), each timed alone between two synchronisations."""
    n = len(runs)
    times = np.zeros((n, opts.steps))
    before: list = [None] * n
    for t in range(opts.warmup + opts.steps):
        for st in sts:
            inputs.load(st, t)
        torch.cuda.synchronize()
        if t == opts.warmup:
            before = [c() if c is not None else None for c in counts]
        for j in range(n):
            i = (t + j) % n
            t0 = time.perf_counter()
            runs[i]()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if t >= opts.warmup:
                times[i, t - opts.warmup] = dt * 1e6
    deltas: list = [None] * n
    for i, c in enumerate(counts):
        if c is None:
            continue
        after = c()
        if before[i] is not None and after is not None:
            deltas[i] = (after[0] - before[i][0], after[1] - before[i][1])
    return times, deltas


@dataclass
class _Side:
    """One mode's step in a timed run (:func:`_run_sides`)."""

    mode: str
    step: object  # () -> None: one decode step, enqueued on the current stream
    st: _Static
    counts: object = None  # () -> (hits, misses) or None
    check: object = None  # () -> None, raises what went wrong
    fill_s: float | None = None
    handle: object = None  # what the owner closes after the run (inproc: the InprocSwapIn)
    huge_pct: int | None = None  # share of its host pool in transparent huge pages


def _run_configs(torch, mode: str, step, st: _Static, lay: Layout, workloads: dict, opts: Options, out: list,
                 counts=None, check=None, capture: bool = True, fill_s: float | None = None) -> None:
    """Every hit rate of one (mode, batch): capture once, then time each config."""
    _run_sides(torch, [_Side(mode, step, st, counts, check, fill_s)], lay, workloads, opts, out, capture=capture)


def _run_sides(torch, sides: list, lay: Layout, workloads: dict, opts: Options, out: list,
               capture: bool = True) -> None:
    """Every hit rate of one batch for one or several modes (``sides``): each side's step
    captured once, then every config timed. Several sides are timed step by step in turn
    (:func:`_timed`), so that drift of the machine lands on each alike; every side after
    the first gets the median of its per-step differences to the first
    (``paired_us_per_layer``; the first is inproc)."""
    batch = lay.max_batch
    runs = [(s.step, "eager", None) for s in sides]
    first = True
    for hits, wl in workloads.items():
        inputs = _Inputs(torch, wl)
        for s in sides:
            s.st.table.copy_(inputs.table)
        if first and capture:
            for i, s in enumerate(sides):
                inputs.load(s.st, 0)
                runs[i] = _capture(torch, s.step, f"{s.mode} batch {batch}")
        times, deltas = _timed(torch, [r[0] for r in runs], inputs, [s.st for s in sides], opts,
                               [s.counts for s in sides])
        for i, s in enumerate(sides):
            r = Result(s.mode, batch, hits, run=runs[i][1], p50_us=float(np.median(times[i])),
                       p99_us=float(np.percentile(times[i], 99)), fill_s=s.fill_s if first else None,
                       huge_pct=s.huge_pct if first else None)
            if i > 0:
                r.paired_us_per_layer = float(np.median(times[i] - times[0])) / lay.num_layers
            if s.mode != "gpu":
                delta = deltas[i]
                if delta is not None and sum(delta) > 0:
                    r.hit_rate, r.hit_measured = delta[0] / sum(delta), True
                    r.misses_per_step = delta[1] / opts.steps
                else:
                    r.hit_rate = wl.target_hit_rate
                    r.misses_per_step = (1 - wl.target_hit_rate) * batch * opts.top_k * opts.layers
            if s.check is not None:
                try:
                    s.check()
                except Exception as e:  # noqa: BLE001 - a refused row makes the figure suspect: report it
                    r.error = f"{type(e).__name__}: {e}"
            out.append(r)
            _say(f"batch {batch} hits {hkey(hits)}% {s.mode}: p50 {r.p50_us:.1f} us, p99 {r.p99_us:.1f} us "
                 f"({runs[i][1]})" + (f"; {r.error}" if r.error else "")
                 + (f"; paired with {sides[0].mode}: {r.paired_us_per_layer:+.2f} us/layer"
                    if r.paired_us_per_layer is not None else ""))
        first = False
        del inputs
    torch.cuda.synchronize()
    del runs


def _gpu_step(torch, kv32, st: _Static, lay: Layout, block_size: int):
    """The no-offload step: per layer, positions -> rows through the block table, then
    the tiny attention straight from ``kv32`` [layers, host_rows, row_bytes / 4]."""
    bs = block_size

    def step():
        table = st.table.index_select(0, st.req.long())  # each token's request's row
        for layer in range(lay.num_layers):
            pos = st.topk[layer]
            host_block = table.gather(1, torch.div(pos, bs, rounding_mode="floor").long())
            idx = host_block * bs + torch.remainder(pos, bs)
            _attend(torch, kv32[layer], idx, st.out[layer])

    return step


def run_gpu(torch, lay: Layout, workloads: dict, opts: Options, out: list, capture: bool = True) -> None:
    """No offload: every row of every layer in one GPU tensor."""
    d = _device(torch)
    L, R, RB = lay.num_layers, lay.host_rows, lay.row_bytes
    t0 = time.perf_counter()
    kv = torch.empty((L, R, RB), dtype=torch.uint8, device=d)
    tile = torch.from_numpy(pattern_tile(min(R, PATTERN_ROWS), RB)).to(d)
    for start in range(0, R, tile.shape[0]):
        n = min(tile.shape[0], R - start)
        kv[0, start:start + n].copy_(tile[:n])
    if L > 1:
        kv[1:].copy_(kv[0].expand(L - 1, R, RB))
    torch.cuda.synchronize()
    fill_s = time.perf_counter() - t0
    _say(f"batch {lay.max_batch} gpu: {kv.numel() / 1e9:.1f} GB of rows on the GPU, filled in {fill_s:.1f} s")
    kv32 = kv.view(torch.int32)  # [L, R, RB / 4]
    st = _Static(torch, lay, opts.blocks)
    try:
        _run_configs(torch, "gpu", _gpu_step(torch, kv32, st, lay, opts.block_size), st, lay, workloads, opts, out,
                     capture=capture, fill_s=fill_s)
    finally:
        del kv, kv32, tile, st


def _handle_step(torch, h, st: _Static, lay: Layout, block_size: int):
    """The engine's step over a device handle (inproc or doorbell)."""
    kv32 = [h.kv(layer).view(torch.int32) for layer in range(lay.num_layers)]

    def step():
        h.begin_step(st.state, st.reset, None)
        for layer in range(lay.num_layers):
            idx = h.swap_in(st.req, st.table, st.topk[layer], layer=layer, block_size=block_size,
                            attention_indices_out=st.idx[layer])
            _attend(torch, kv32[layer], idx, st.out[layer])

    return step


def _open_inproc(torch, lay: Layout, opts: Options, mode: str = "inproc"):
    """``InprocSwapIn`` with its pool filled, and its side of a timed run (named ``mode``);
    the caller closes the handle (``side.handle``) once the GPU is done with it."""
    from sparsekv.embedded.inproc_cuda import InprocSwapIn  # noqa: PLC0415

    t0 = time.perf_counter()
    h = InprocSwapIn(lay, device=DEVICE, gather_blocks=_gather_blocks(opts))
    try:
        t1 = time.perf_counter()
        fill_pattern(h.pool)
        fill_s = time.perf_counter() - t1
        huge = _pct(h.pool_huge_bytes, lay.pool_bytes)
        _say(f"batch {lay.max_batch} {mode}: {lay.pool_bytes / 1e9:.1f} GB pinned pool registered in "
             f"{t1 - t0:.1f} s ({huge} % in huge pages), filled in {fill_s:.1f} s")
        st = _Static(torch, lay, opts.blocks)

        def counts():
            c = h.counters()
            return c["hits"], c["misses"]

        return _Side(mode, _handle_step(torch, h, st, lay, opts.block_size), st, counts=counts, check=h.check,
                     fill_s=fill_s, handle=h, huge_pct=huge)
    except BaseException:
        h.close()
        raise


def run_inproc(torch, lay: Layout, workloads: dict, opts: Options, out: list) -> None:
    """``InprocSwapIn``: the daemon's kernels inline, its own pinned pool."""
    side = _open_inproc(torch, lay, opts)
    try:
        _run_sides(torch, [side], lay, workloads, opts, out)
    finally:
        torch.cuda.synchronize()
        side.handle.close()


def run_paired(torch, lay: Layout, workloads: dict, opts: Options, out: list, daemon_first: bool = False) -> None:
    """``--paired``: the inproc handle and the doorbell rank side by side (each its own
    pool), timed step by step in turn (with ``--control`` a second inproc handle too);
    then zmq, when asked, as without it. The in-process pools are made before the daemon
    starts, or with ``daemon_first`` once its pool is made and filled (host memory a VM
    hands out later can be slower to gather from: rounds alternate, see :func:`run`)."""
    sides: list[_Side] = []

    def open_sides() -> list[_Side]:
        sides.append(_open_inproc(torch, lay, opts))
        if opts.control:
            sides.append(_open_inproc(torch, lay, opts, CONTROL))
        return sides

    try:
        run_doorbell(torch, lay, workloads, opts, out, paired_with=open_sides if daemon_first else open_sides())
    finally:
        torch.cuda.synchronize()
        for side in sides:
            side.handle.close()


def _arena_bytes(lay: Layout, ranks: int) -> int:
    """A device arena for ``ranks`` ranks: each a slab plus its per-group step buffers
    (slots, misses, plan: a few [groups, max_batch, top_k] int32 arrays), 1 GiB spare,
    whole GiB."""
    per_rank = lay.slab_bytes + lay.staging_bytes + 8 * lay.num_groups * lay.max_batch * lay.top_k * 4
    return -(-(ranks * per_rank + GIB) // GIB) * GIB


def _pct(part: int, whole: int) -> int:
    return int(part) * 100 // max(1, int(whole))


def _daemon_counts(client):
    s = client.stats()
    if "hits" in s and "misses" in s:
        return int(s["hits"]), int(s["misses"])
    return None


def _host_swap_in():
    """(HostSwapIn, None), or (None, why) when the portable handle is not there."""
    try:
        from sparsekv.client.swap_in import HostSwapIn  # noqa: PLC0415
    except ImportError as e:
        return None, f"sparsekv.client.swap_in.HostSwapIn does not import ({e})"
    return HostSwapIn, None


def run_doorbell(torch, lay: Layout, workloads: dict, opts: Options, out: list,
                 paired_with: list[_Side] | Callable[[], list[_Side]] | None = None) -> None:
    """A private cuda daemon for this batch: the doorbell rank (and the zmq rank, when
    asked: a second rank of the same engine, so the pool is written once). ``paired_with``:
    the in-process sides (inproc first), or what opens them once the daemon's pool is
    filled, timed step by step in turn with the doorbell rank (their results too)."""
    from sparsekv.client.client import Client  # noqa: PLC0415
    from .private_daemon import PrivateDaemon  # noqa: PLC0415

    batch = lay.max_batch
    want_db = "doorbell" in opts.modes
    want_zmq = "zmq" in opts.modes
    host_swap_in = None
    if want_zmq:
        host_swap_in, why = _host_swap_in()
        if host_swap_in is None:
            _say(f"zmq mode unavailable: {why}")
            out.extend(Result("zmq", batch, h, skipped=f"unavailable: {why}") for h in workloads)
            want_zmq = False
    if not (want_db or want_zmq):
        return
    arena = _arena_bytes(lay, int(want_db) + int(want_zmq))
    size = f"{arena // GIB}GiB"
    extra = ["--device-arena-size", size, "--max-slab-bytes", size, "--gather-blocks", str(_gather_blocks(opts)),
             "--devices", str(DEVICE)]
    engine = f"bench-decode-b{batch}"
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        d = stack.enter_context(PrivateDaemon(pool_bytes=lay.pool_bytes + DAEMON_POOL_SLACK_BYTES, backend="cuda",
                                              extra_args=extra, log_path=opts.daemon_log,
                                              start_timeout_s=DAEMON_START_TIMEOUT_S))
        _say(f"batch {batch}: private cuda daemon up in {time.perf_counter() - t0:.1f} s "
             f"(pool {lay.pool_bytes / 1e9:.1f} GB, arena {size})")
        # The zmq rank (if any) first and the pool filled through it; the doorbell rank
        # attaches after the fill and detaches before the zmq run: while a doorbell rank
        # waits on its engine's bells, other work of the daemon on that GPU may wait
        # behind its parked stream (docs/PERF.md, "Doorbell"), so the two never overlap.
        c = cz = None
        if want_zmq:
            # The portable path at its best: fence events (the top-k goes from the GPU into
            # the step block, no wait on the host) and device wait (no reply waited for).
            cz = Client(d.run_dir, rank=1 if want_db else 0, device=f"cuda:{DEVICE}", name="bench-decode-zmq",
                        timeout_s=CLIENT_TIMEOUT_S, device_wait=True).connect()
            stack.callback(cz.close)
            cz.attach(lay, engine=engine, fence=True)
        if want_db:
            c = Client(d.run_dir, rank=0, device=f"cuda:{DEVICE}", name="bench-decode-doorbell",
                       timeout_s=CLIENT_TIMEOUT_S).connect()
            stack.callback(c.close)
            if cz is None:
                c.attach(lay, engine=engine, transport="doorbell")
        filler = cz or c
        if lay.staging_rows and filler.attachment.staging is not None:
            fill_s, how = fill_through_staging(filler, lay, torch), "WRITE_STAGED"
        else:
            fill_s, how = fill_through_client(filler, lay), "client.write"
        snap = filler.stats()
        huge = _pct(snap.get("pool_huge_bytes", 0), snap.get("pool_bytes", 0))
        _say(f"batch {batch}: wrote {lay.pool_bytes / 1e9:.1f} GB into the daemon's pool ({huge} % in huge pages) "
             f"through {how} in {fill_s:.1f} s ({lay.pool_bytes / 1e9 / max(fill_s, 1e-9):.2f} GB/s)")
        if want_db:
            if callable(paired_with):  # the in-process pools after the daemon's (a failure: every mode's)
                paired_with = paired_with()
            if cz is not None:
                c.attach(lay, engine=engine, transport="doorbell")  # joins: the pool is already written
            _guarded(out, "doorbell", batch, workloads,
                     lambda: _run_doorbell_rank(torch, c, lay, workloads, opts, out, fill_s, paired_with, huge))
            if cz is not None:
                c.detach()
        if want_zmq:
            _guarded(out, "zmq", batch, workloads,
                     lambda: _run_zmq_rank(torch, host_swap_in(cz), cz, lay, workloads, opts, out, fill_s))


def _run_doorbell_rank(torch, c, lay, workloads, opts, out, fill_s, paired_with=None, huge_pct=None) -> None:
    h = c.doorbell_handle()
    try:
        st = _Static(torch, lay, opts.blocks)
        side = _Side("doorbell", _handle_step(torch, h, st, lay, opts.block_size), st,
                     counts=lambda: _daemon_counts(c), check=h.check, fill_s=fill_s, huge_pct=huge_pct)
        _run_sides(torch, [*(paired_with or ()), side], lay, workloads, opts, out)
    finally:
        torch.cuda.synchronize()  # the stream must not wait on a ready word when the watcher stops
        h.close()


def _run_zmq_rank(torch, hz, cz, lay, workloads, opts, out, fill_s) -> None:
    """The portable handle: every swap_in converts the device tensors to host arrays,
    sends one top-k batch, waits for its slots. Eager (host code on the path)."""
    try:
        st = _Static(torch, lay, opts.blocks)
        state = np.arange(lay.max_batch, dtype=np.int32)
        kv32 = [hz.kv(layer).view(torch.int32) for layer in range(lay.num_layers)]

        def step():
            hz.begin_step(state, st.reset, None)
            for layer in range(lay.num_layers):
                idx = hz.swap_in(st.req, st.table, st.topk[layer], layer=layer, block_size=opts.block_size,
                                 attention_indices_out=st.idx[layer])
                _attend(torch, kv32[layer], idx, st.out[layer])

        _run_configs(torch, "zmq", step, st, lay, workloads, opts, out, counts=lambda: _daemon_counts(cz),
                     check=hz.check, capture=False, fill_s=fill_s)
    finally:
        torch.cuda.synchronize()
        hz.close()


def _guarded(out: list, mode: str, batch: int, workloads: dict, fn) -> None:
    """Run one (mode, batch); a failure becomes an error row for each config it left out."""
    try:
        fn()
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - one mode failing must not lose the others' figures
        why = f"{type(e).__name__}: {' '.join(str(e).split())}"
        _say(f"batch {batch} {mode} failed: {why}")
        done = {r.hits for r in out if r.mode == mode and r.batch == batch}
        out.extend(Result(mode, batch, h, error=why) for h in workloads if h not in done)


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
        _say(f"batch {batch}: {why}: not run")
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
        _say(f"batch {batch}: top-k sequences of {len(workloads)} hit rate(s) generated in "
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
        _guarded(results, "gpu", batch, workloads, lambda: run_gpu(torch, lay, workloads, opts, results))
        _free(torch)
    if opts.paired:
        modes = [m for m in ("inproc", "doorbell", "zmq") if m in opts.modes] + ([CONTROL] if opts.control else [])
        why = "not timed: the paired run with the doorbell failed first (see its row)"
        try:
            run_paired(torch, lay, workloads, opts, results, daemon_first=daemon_first)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - inproc or the daemon did not start, attach or fill
            why = f"{type(e).__name__}: {' '.join(str(e).split())}"
            _say(f"batch {batch} paired: {why}")
        done = {(r.mode, r.hits) for r in results if r.batch == batch}
        results.extend(Result(m, batch, h, error=why) for m in modes for h in workloads if (m, h) not in done)
        _free(torch)
        return
    if "inproc" in opts.modes:
        _guarded(results, "inproc", batch, workloads, lambda: run_inproc(torch, lay, workloads, opts, results))
        _free(torch)
    if "doorbell" in opts.modes or "zmq" in opts.modes:
        daemon_modes = [m for m in ("doorbell", "zmq") if m in opts.modes]
        try:
            run_doorbell(torch, lay, workloads, opts, results)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - the daemon did not start, attach or fill
            why = f"{type(e).__name__}: {' '.join(str(e).split())}"
            _say(f"batch {batch} daemon: {why}")
            done = {(r.mode, r.hits) for r in results if r.batch == batch}
            results.extend(Result(m, batch, h, error=why) for m in daemon_modes for h in workloads
                           if (m, h) not in done)
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
                   help="of gpu, inproc, doorbell, zmq; they run in that order (default: gpu,inproc,doorbell)")
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
    quick = bool(getattr(a, "quick", False))
    return Options(
        batches=a.batches or (QUICK_BATCHES if quick else DEFAULT_BATCHES),
        hits=a.hits or (QUICK_HITS if quick else DEFAULT_HITS),
        layers=a.layers, top_k=a.top_k, row_bytes=a.row_bytes, context=a.context, block_size=a.block_size,
        steps=a.steps if a.steps is not None else (QUICK_STEPS if quick else DEFAULT_STEPS), warmup=a.warmup,
        rounds=a.rounds, paired=bool(getattr(a, "paired", False)), control=bool(getattr(a, "control", False)),
        modes=tuple(dict.fromkeys(a.modes)) if a.modes else DEFAULT_MODES,
        layer_overlap=a.layer_overlap, gather_blocks=a.gather_blocks, seed=a.seed,
        budget_s=getattr(a, "budget_s", None), json_path=a.json_path, plot_path=a.plot_path, daemon_log=a.daemon_log,
    ).validate()


def run_args(a) -> int:
    """Run from parsed arguments (``sparsekv bench decode`` and :func:`main`); exit code:
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
            out = {**summary(results, opts), "decode_complete": complete and not cut}
            tmp = opts.json_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(out, f, indent=1)
                f.write("\n")
            os.replace(tmp, opts.json_path)

    results = run(opts, torch, on_batch=lambda rs: write(rs, False))
    write(results, True)
    if opts.json_path:
        _say(f"wrote {opts.json_path}")
    if opts.plot_path and plot(results, opts.plot_path):
        _say(f"wrote {opts.plot_path}")
    sys.stdout.write(table(results, opts))
    return 1 if any(r.error is not None for r in results) else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="sparsekv bench decode", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
