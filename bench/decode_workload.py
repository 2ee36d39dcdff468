"""The inputs of ``sparsekv bench decode``: its options, the top-k sequence of each
(batch, hits) config (:func:`generate`) and the fill of a pool. Imports neither torch nor
CuPy."""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from sparsekv.daemon.config import Config
from sparsekv.proto import Layout

MODES = ("gpu", "inproc", "doorbell", "prefetch", "zmq")  # also the order they run in
# --control: a second in-process handle with a pool of its own, timed in turn with inproc
# and the doorbell: what two pools alone differ by (the noise floor of the hand-off figure).
CONTROL = "inproc2"
DEFAULT_MODES = ("gpu", "inproc", "doorbell")
DEFAULT_BATCHES = (16, 64, 128)
DEFAULT_HITS = (80.0, 90.0, 95.0)  # percent
DEFAULT_STEPS = 40


def say(msg: str) -> None:
    print(f"bench decode: {msg}", file=sys.stderr, flush=True)


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
    region_rows: int | None = None  # hot-region rows a layer (None: top_k; with prefetch top_k + top_k / 4)
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
        if self.region_rows is not None and self.region_rows < self.top_k:
            raise ValueError(f"--region-rows must be >= top-k {self.top_k}, got {self.region_rows}")
        if "prefetch" in self.modes and self.region == self.top_k:
            raise ValueError(f"--region-rows {self.region}: the prefetch mode needs rows above top-k {self.top_k} (a "
                             "prefetch never evicts a row of the region's latest resolve)")
        if "prefetch" in self.modes and "doorbell" not in self.modes:
            raise ValueError("--modes prefetch (the doorbell rank with cross-layer prefetch) is measured against the "
                             f"doorbell rank of the same daemon: --modes must have doorbell too, got {','.join(self.modes)}")
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
    def region(self) -> int:
        """Hot-region rows a layer of every offloaded mode (one layout for all of them)."""
        if self.region_rows is not None:
            return self.region_rows
        return self.top_k + self.top_k // 4 if "prefetch" in self.modes else self.top_k

    @property
    def blocks(self) -> int:
        """Blocks of one request's block table."""
        return -(-self.context // self.block_size)

    def host_rows(self, batch: int) -> int:
        return batch * self.blocks * self.block_size


def make_layout(batch: int, opts: Options) -> Layout:
    """One index group per layer, one token per request (region_stride: ``opts.region``)."""
    return Layout(num_layers=opts.layers, row_bytes=opts.row_bytes, top_k=opts.top_k, region_stride=opts.region,
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
    """One config's decode steps (warm-up included). ``base`` int32 [steps, batch, top_k]:
    each request's positions (layer 0; layer ``l``'s are ``perms[l][base[t]]``).
    ``block_table`` int32 [batch, blocks]: host block of each request's logical block.
    ``reset`` bool [steps, batch]: True at step 0 only."""

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
    def layers(self) -> int:
        return self.perms.shape[0]

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

    Layer ``l`` applies a fixed bijection ``perms[l]`` of the positions to a base top-k
    (which keeps each layer's step-to-step overlap exact); ``perms[l] = perms[l-1] o
    sigma_l``, ``sigma_l`` shuffling a fraction ``m`` of the positions, so adjacent layers
    share ``(1 - m) + m * top_k / context`` of their columns in expectation."""
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


def fill_pattern(pool: np.ndarray, threads: int | None = None, tile: np.ndarray | None = None) -> None:
    """Fill ``pool`` uint8 [layers, rows, row_bytes] cheaply: layer 0 from a repeating
    tile (row r holds the tile's row r mod its rows; default :func:`pattern_tile`), copied
    to the other layers on several threads (NumPy copies release the GIL)."""
    layers, rows, row_bytes = pool.shape
    tile = pattern_tile(min(rows, PATTERN_ROWS), row_bytes) if tile is None else tile
    first = pool[0]
    for start in range(0, rows, tile.shape[0]):
        n = min(tile.shape[0], rows - start)
        first[start:start + n] = tile[:n]
    if layers > 1:
        workers = threads or min(16, os.cpu_count() or 1)
        with ThreadPoolExecutor(workers) as ex:
            list(ex.map(lambda layer: np.copyto(pool[layer], first), range(1, layers)))


FILL_STAGING_ROWS = 4096  # rows per layer of the staging buffer the pool is filled through


def fill_through_staging(client, lay: Layout, torch, tile: np.ndarray | None = None) -> float:
    """Fill every host row of every layer from the rank's staging buffer (the pattern put
    there once, each ``WRITE_STAGED`` copying it to the next ``staging_rows`` host rows;
    ``tile``: as :func:`fill_pattern`'s, with ``staging_rows`` a multiple of its rows);
    a last plain ``write`` waits for them (a WRITE quiesces the engine's copies first).
    Returns the seconds it took."""
    att = client.attachment
    n = lay.staging_rows
    block = np.empty((lay.num_layers, n, lay.row_bytes), np.uint8)
    fill_pattern(block, tile=tile)
    t0 = time.perf_counter()
    att.staging.copy_(torch.from_numpy(block))
    torch.cuda.synchronize()
    for start in range(0, lay.host_rows, n):
        client.write_staged(np.arange(start, min(start + n, lay.host_rows), dtype=np.int32))
    last = lay.host_rows - 1
    client.write(np.array([last], np.int32), block[:, (last % n):(last % n) + 1])
    return time.perf_counter() - t0


def gather_blocks(opts: Options) -> int:
    """The gather's blocks of the run: ``--gather-blocks``, else the daemon's default."""
    return opts.gather_blocks if opts.gather_blocks is not None else int(Config.gather_blocks)
