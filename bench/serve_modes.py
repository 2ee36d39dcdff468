"""The GPU side of ``sparsekv bench serve``: where each mode's KV rows come from (:class:`HbmRows`:
every row in HBM; :class:`SwappedRows`: ``swap_in`` of an in-process handle or a private
daemon's doorbell handle), the host pools, the steps captured as CUDA graphs, timed in
turn, and each part's time from CUDA events recorded inside a second capture of the step.

Rows' content: host row ``r`` holds row ``r mod TILE_ROWS`` of one tile of valid
fp8_ds_mla rows in every layer; the all-on-GPU rows of (request, position) hold what the
host row of the same position holds, so every mode reads the same rows. The host pool is
smaller than the requests' rows when their contexts do not fit this machine's memory:
block tables then share host blocks between requests (each request's blocks distinct),
which moves as many bytes per miss.
"""

from __future__ import annotations

import contextlib
import sys
import time

import numpy as np
import torch

from sparsekv.client.client import Client
from sparsekv.embedded.inproc_cuda import InprocSwapIn
from sparsekv.proto import Layout

from .decode_modes import (CLIENT_TIMEOUT_S, DAEMON_POOL_SLACK_BYTES, DAEMON_START_TIMEOUT_S, DEVICE, GIB, arena_bytes,
                           capture_step)
from .decode_workload import FILL_STAGING_ROWS, fill_pattern, fill_through_staging
from .private_daemon import PrivateDaemon
from .serve_model import Model, pack_rows
from .serve_report import intervals_of, median_parts, step_totals

TILE_ROWS = 4096  # the rows' content repeats every this many host rows (a multiple of staging rows)
PART_REPLAYS = 5  # replays of the step captured with marks; each part's time is its median over them


def say(msg: str) -> None:
    print(f"bench serve: {msg}", file=sys.stderr, flush=True)


def row_tile(model: Model, seed: int = 0) -> np.ndarray:
    """uint8 [TILE_ROWS, row_bytes]: valid fp8_ds_mla rows of random latents."""
    sh = model.sh
    gen = torch.Generator(model.ops.device).manual_seed(seed)
    kv = torch.randn((TILE_ROWS, sh.kv_lora + sh.rope), generator=gen, device=model.ops.device)
    return pack_rows(kv, sh).cpu().numpy()


def block_table(batch: int, context: int, block_size: int, host_rows: int, seed: int = 0) -> np.ndarray:
    """int32 [batch, blocks]: request ``b``'s logical block ``j`` -> host block ``(b * blocks
    + perm[j]) mod host_blocks`` (``perm`` a fixed shuffle): distinct within a request,
    shared between requests once they outgrow the pool."""
    blocks = -(-context // block_size)
    host_blocks = host_rows // block_size
    if blocks > host_blocks:
        raise ValueError(f"a request of context {context} needs {blocks * block_size} host rows, the pool has "
                         f"{host_rows}: give --host-pool-gib more")
    perm = np.random.default_rng([seed, context]).permutation(blocks)
    return ((np.arange(batch)[:, None] * blocks + perm[None, :]) % host_blocks).astype(np.int32)


def offload_layout(sh, max_batch: int, host_rows: int, region_rows: int | None = None) -> Layout:
    """One index group a layer, one token a request (a hot region of ``region_rows`` rows,
    default top_k; the prefetch fills those above top_k)."""
    return Layout(num_layers=sh.layers, row_bytes=sh.row_bytes, top_k=sh.top_k, region_stride=region_rows or sh.top_k,
                  max_reqs=max_batch, host_rows=host_rows, index_groups=tuple((i,) for i in range(sh.layers)),
                  max_batch=max_batch, staging_rows=min(FILL_STAGING_ROWS, host_rows)).validate()


class Static:
    """One config's device inputs, shared by its modes: the step's input, each layer's
    top-k positions (loaded before each step), state rows, reset, block table."""

    def __init__(self, model: Model, batch: int, table: np.ndarray, workload, device):
        sh = model.sh
        self.batch, self.context = batch, workload.perms.shape[1]
        self.x = torch.randn((batch, sh.hidden), device=device, dtype=model.ops.dtype)
        self.req = torch.arange(batch, dtype=torch.int32, device=device)
        self.state = self.req.clone()
        self.reset = torch.zeros(batch, dtype=torch.bool, device=device)
        self.table = torch.from_numpy(table).to(device)
        self.topk = torch.zeros((sh.layers, batch, workload.base.shape[2]), dtype=torch.int32, device=device)
        self.fresh = torch.zeros_like(self.topk[0])  # the top-k a layer's rows read (handed_topk)
        self.idx = torch.zeros_like(self.topk)
        self._base = torch.from_numpy(workload.base.reshape(workload.steps, -1)).to(device=device, dtype=torch.int64)
        self._perms = torch.from_numpy(workload.perms).to(device)
        self._reset = torch.from_numpy(workload.reset).to(device)

    def load(self, t: int) -> None:
        """Step ``t``'s top-k and reset (step 0 resets every request: empty hot regions)."""
        self.reset.copy_(self._reset[t])
        self.topk.view(self.topk.shape[0], -1).copy_(self._perms.index_select(1, self._base[t]))

    def handed_topk(self, layer: int):
        """The layer's top-k as an engine's top-k kernel leaves it: copied from the loaded
        sequence (in HBM since before the step) into :attr:`fresh` on the step's stream,
        called right after the indexer's own top-k; every mode's rows read it there, warm.
        (Read straight from the sequence, the offloaded modes' first kernel waited on HBM
        beside the query's matmuls, which an engine's fresh indices do not.) One buffer
        serves every layer: a layer's rows are done before the next layer's top-k."""
        self.fresh.copy_(self.topk[layer])
        return self.fresh


class HbmRows:
    """All on the GPU: ``kv`` uint8 [layers, batch * context + batch, row_bytes], request
    ``b``'s position ``p`` at row ``b * context + p``, its new row at ``batch * context + b``."""

    def __init__(self, kv, st: Static):
        self.kv, self.st = kv, st
        B, C = st.batch, st.context
        self.base = (torch.arange(B, dtype=torch.int32, device=kv.device) * C).unsqueeze(1)
        self.new = slice(B * C, B * C + B)  # the new rows

    @classmethod
    def filled(cls, tile, st: Static, layers: int, block_size: int) -> "HbmRows":
        """Rows holding what the host rows of the same positions hold (through ``st.table``)."""
        B, C = st.batch, st.context
        kv = torch.empty((layers, B * C + B, tile.shape[1]), dtype=torch.uint8, device=st.table.device)
        pos = torch.arange(C, device=kv.device)
        host = st.table[:, pos // block_size].long() * block_size + pos % block_size
        torch.index_select(torch.from_numpy(tile).to(kv.device), 0, (host % tile.shape[0]).reshape(-1),
                           out=kv[0, :B * C])
        kv[1:].copy_(kv[0].expand(layers - 1, -1, -1))
        return cls(kv, st)

    def begin(self) -> None:
        pass

    def topk(self, layer: int):
        return self.st.handed_topk(layer)

    def rows(self, layer: int, topk):
        """The layer's rows and the indices of ``topk`` (positions [batch, k]) among them."""
        return self.kv[layer], topk + self.base

    def new_rows(self, layer: int):
        """Where the layer's new rows go: rows ``batch * context`` on (contiguous)."""
        return self.kv[layer, self.new]

    def end(self) -> None:
        pass

    def finish(self) -> None:
        pass


class SwappedRows:
    """Offloaded: the rows through ``h.swap_in`` (positions through the block table); each
    layer's new rows kept on the GPU (``staged``), as an engine keeps them to hand to
    ``write_staged`` after the step, and copied to pinned host memory (``mirror``
    [layers, max_batch, row_bytes]) in one copy once the last layer has made its rows.
    Nothing in the step reads the mirror, so that copy runs on a stream of its own, forked
    after the last layer (``end``) and joined after the head (``finish``): it overlaps the
    head, off the layers' critical path. (A copy to the host per layer, each forked and
    joined, cost the batch-1 step ~10 us a layer on the H200.)"""

    def __init__(self, h, st: Static, block_size: int, mirror):
        self.h, self.st, self.block_size = h, st, block_size
        self.side = torch.cuda.Stream(device=st.table.device)
        self.staged = torch.empty((mirror.shape[0], st.batch, mirror.shape[2]), dtype=torch.uint8,
                                  device=st.table.device)
        # The mirror's first bytes as one contiguous [layers, batch, row_bytes] (a strided
        # host destination would make torch copy through the host, synchronously).
        self.host = mirror.view(-1)[:self.staged.numel()].view(self.staged.shape)

    def begin(self) -> None:
        self.h.begin_step(self.st.state, self.st.reset, None)

    def topk(self, layer: int):
        return self.st.handed_topk(layer)

    def rows(self, layer: int, topk):
        """The layer's hot slab and the indices of ``topk`` (positions [batch, k]) in it."""
        st = self.st
        return self.h.kv(layer), self.h.swap_in(st.req, st.table, topk, layer=layer,
                                                block_size=self.block_size, attention_indices_out=st.idx[layer])

    def new_rows(self, layer: int):
        """Where the layer's new rows go: kept on the GPU (``staged``), mirrored at the step's end."""
        return self.staged[layer]

    def end(self) -> None:
        """Fork the mirror's copy of every layer's new rows (joined in :meth:`finish`)."""
        self.side.wait_stream(torch.cuda.current_stream(self.side.device))
        with torch.cuda.stream(self.side):
            self.host.copy_(self.staged, non_blocking=True)

    def finish(self) -> None:
        """The step's stream waits for the mirror's copy."""
        torch.cuda.current_stream(self.side.device).wait_stream(self.side)


# -- the offloaded handles -----------------------------------------------------------------
COUNTERS = ("hits", "misses", "prefetched", "prefetch_hits", "prefetch_wasted")  # what Offload.counts report


def huge_share(huge: int, total: int) -> str:
    """How much of a host pool is in transparent huge pages (the GPU reads its rows through
    the pages' translations), as a progress line says it."""
    return f"{100 * huge / max(1, total):.0f} % in huge pages"


class Offload:
    """The in-process handle and the private daemons' doorbell handles (``daemon``; with
    cross-layer prefetch: ``prefetch``, a daemon of its own), each over a pool of ``lay``
    filled with ``tile``; made once for the run (every batch up to ``max_batch``).
    ``counts[mode]()``: the handle's counters, :data:`COUNTERS` in that order."""

    def __init__(self, lay: Layout, tile: np.ndarray, modes, gather_blocks: int, daemon_log: str | None):
        self.lay, self.handles, self.counts = lay, {}, {}
        self._stack = contextlib.ExitStack()
        try:
            if "inproc" in modes:
                t0 = time.perf_counter()
                h = InprocSwapIn(lay, device=DEVICE, gather_blocks=gather_blocks)
                self._stack.callback(h.close)
                fill_pattern(h.pool, tile=tile)
                self.handles["inproc"] = h
                self.counts["inproc"] = lambda: tuple(h.counters()[k] for k in COUNTERS)
                say(f"inproc: {lay.pool_bytes / 1e9:.1f} GB pinned pool made and filled in "
                    f"{time.perf_counter() - t0:.1f} s, {huge_share(h.pool_huge_bytes, lay.pool_bytes)}")
            for mode in ("daemon", "prefetch"):
                if mode in modes:
                    log = daemon_log and (daemon_log if mode == "daemon" else f"{daemon_log}.{mode}")
                    self._open_daemon(mode, tile, gather_blocks, log)
        except BaseException:
            self.close()
            raise

    def _open_daemon(self, mode: str, tile, gather_blocks: int, daemon_log) -> None:
        lay = self.lay
        size = f"{arena_bytes(lay, 1) // GIB}GiB"
        t0 = time.perf_counter()
        d = self._stack.enter_context(PrivateDaemon(
            pool_bytes=lay.pool_bytes + DAEMON_POOL_SLACK_BYTES, backend="cuda", log_path=daemon_log,
            extra_args=["--device-arena-size", size, "--max-slab-bytes", size, "--gather-blocks", str(gather_blocks),
                        "--devices", str(DEVICE)], start_timeout_s=DAEMON_START_TIMEOUT_S))
        c = Client(d.run_dir, rank=0, device=f"cuda:{DEVICE}", name="bench-serve", timeout_s=CLIENT_TIMEOUT_S).connect()
        self._stack.callback(c.close)
        c.attach(lay, engine="bench-serve", transport="doorbell", prefetch=mode == "prefetch")
        fill_through_staging(c, lay, torch, tile=tile)
        h = c.doorbell_handle()
        self._stack.callback(h.close)
        self._stack.callback(torch.cuda.synchronize)  # no stream left waiting on a bell when the handle closes
        self.handles[mode] = h

        def counts():
            s = c.stats()
            return tuple(int(s[k]) for k in COUNTERS) if all(k in s for k in COUNTERS) else None

        self.counts[mode] = counts
        st = c.stats()
        say(f"{mode}: private sparsekvd up, {lay.pool_bytes / 1e9:.1f} GB pool written in "
            f"{time.perf_counter() - t0:.1f} s (arena {size}), {huge_share(st['pool_huge_bytes'], st['pool_bytes'])}")

    def close(self) -> None:
        self._stack.close()


# -- timing, parts (capture: decode_modes.capture_step) ----------------------------------------------------------------
def wall_us(run, side: int, t: int) -> float:
    """One replay of ``run``, timed (us) from its launch to the synchronisation after it."""
    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6


def timed(runs: list, st: Static, warmup: int, steps: int, counts: list, replay=wall_us):
    """Step times (us) [len(runs), steps], the sides in turn each step (the order rotated),
    each timed alone by ``replay(run, side, step)`` (default :func:`wall_us`); per side the
    growth of its counters (``counts``, e.g. :data:`COUNTERS`) over the timed steps, or None."""
    n = len(runs)
    times = np.zeros((n, steps))
    before = [None] * n
    for t in range(warmup + steps):
        st.load(t)
        torch.cuda.synchronize()
        if t == warmup:
            before = [c() if c else None for c in counts]
        for j in range(n):
            i = (t + j) % n
            dt = replay(runs[i], i, t)
            if t >= warmup:
                times[i, t - warmup] = dt
    after = [c() if c else None for c in counts]
    deltas = [tuple(x - y for x, y in zip(a, b)) if a and b else None for a, b in zip(after, before)]
    return times, deltas


class Marks:
    """``mark(part)`` records a CUDA event, external: inside a capture an event node of the
    graph, read after each replay. :meth:`rewind` before each run of the step: a capture
    records the events of the warm-up's run again (none is made while capturing)."""

    def __init__(self):
        self.events: list = []  # (part, event) in the order marked
        self.at = 0

    def rewind(self) -> None:
        self.at = 0

    def __call__(self, part) -> None:
        if self.at == len(self.events):
            self.events.append((part, torch.cuda.Event(enable_timing=True, external=True)))
        self.events[self.at][1].record()
        self.at += 1

    def points(self) -> list:
        """The last run's ``(part, us since the first mark)``, None where an event's time
        could not be read."""
        torch.cuda.synchronize()
        first = self.events[0][1] if self.events else None
        out = []
        for part, ev in self.events:
            try:
                out.append((part, first.elapsed_time(ev) * 1e3))
            except (RuntimeError, ValueError):  # an event not recorded: that part's time is unknown
                out.append((part, None))
        return out

    def intervals(self) -> list:
        return intervals_of(self.points())


def parts(model: Model, st: Static, state, src, first: int, label: str) -> tuple[dict[str, float], str]:
    """Each part's us over the step (``ffn`` split into ``dense_ffn`` and ``moe``): the step
    captured once more with a mark as each part starts (:func:`capture_step`; its warm-up
    runs step ``first - 1`` again), replayed over steps ``first`` to ``first +
    PART_REPLAYS - 1``, each part's median over the replays; and how it ran ("graph", or
    "eager" where the capture failed)."""
    marks = Marks()
    dense = model.sh.dense_layers
    layer = [0]

    def mark(part):
        if part == "ffn":
            part = "dense_ffn" if layer[0] < dense else "moe"
            layer[0] += 1
        marks(part)

    def step():
        marks.rewind()
        layer[0] = 0
        model.step(st.x, state, src, mark)

    st.load(first - 1)
    run, kind, _ = capture_step(torch, step, f"{label}, parts")
    runs = []
    for t in range(first, first + PART_REPLAYS):
        st.load(t)
        run()
        runs.append(step_totals(marks.intervals()))
    return median_parts(runs), kind
