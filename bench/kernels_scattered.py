"""``sparsekv bench kernels``' gathers: the step plans on the device, a gather of them timed
(the daemon's ``skv_gather`` or a variant of it), and the scattered workloads.

* **Scattered workloads** (:data:`SCATTERED_SHAPES`): the pool seen as one flat layer of
  656-byte rows; each request's rows random within its own window of the pool (the windows
  side by side from row 0, or spread evenly over the whole pool), in runs of adjacent rows
  (1: single rows); ~10 % of top-k new a step (a binomial count per request), each
  request's plan sorted by host row as skv_resolve leaves it. ``w128k`` is the decode step
  of a 128K context: batch 64, top-k 2048, 131,072-row windows (``gather_vs_bulk_scattered``);
  also its first request alone (``gather_us_b1``: a batch-1 layer's gather, its latency).
* **Variants** (:data:`GATHER_VARIANTS`): the gather with other threads, loads in flight,
  loads, grid or work split (csrc/copy.cu's defines), timed on every workload beside the
  default; the losers are deleted once measured (docs/DESIGN.md §8).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

from sparsekv.daemon.config import Config
from sparsekv.daemon.residency.cuda import CudaMover, allocate_device_buffers
from sparsekv.proto import Layout
from sparsekv.proto.step_block import D_BATCH, D_GROUP, D_K, DESC_INTS

ROW_BYTES = 656
BATCH, TOP_K, STRIDE = 64, 2048, 4096
MISS_RATE = 0.10
PLANS = 16  # distinct plans per timing round
DEFAULT_BLOCKS = Config.gather_blocks  # the daemon's gather grid


class Shape(NamedTuple):
    """A scattered workload: each request's rows in its own ``window`` of rows, in runs of
    ``run`` adjacent rows; the windows side by side (``spread`` False) or spread evenly
    over the whole pool."""

    name: str
    window: int
    run: int
    spread: bool
    label: str


# The first is the headline: gather_vs_bulk_scattered.
SCATTERED_SHAPES = (
    Shape("w128k", 131072, 1, False, "rows random in each request's 131,072-row window, the windows side by side"),
    Shape("w128k_spread", 131072, 1, True, "the same, the windows spread over the whole pool"),
    Shape("w128k_r8", 131072, 8, False, "runs of 8 adjacent rows in 131,072-row windows"),
    Shape("w128k_r16", 131072, 16, False, "runs of 16 adjacent rows in 131,072-row windows"),
    Shape("w128k_r64", 131072, 64, False, "runs of 64 adjacent rows in 131,072-row windows"),
    Shape("w32k", 32768, 1, False, "rows random in 32,768-row windows, side by side"),
)

# (key, label, options): CudaMover options (threads), the grid (blocks, default
# DEFAULT_BLOCKS) and csrc/copy.cu defines (the build of a variant).
GATHER_VARIANTS = (
    ("t512", "512 threads", {"threads": 512}),
    ("t128", "128 threads", {"threads": 128}),
    ("unroll2", "2 loads in flight a thread", {"defines": {"SKV_COPY_UNROLL": 2}}),
    ("unroll8", "8 loads in flight a thread", {"defines": {"SKV_COPY_UNROLL": 8}}),
)


def scattered_plans(rng, pool_rows: int, n: int, window: int, run: int = 1, spread: bool = False,
                    batch: int = BATCH, top_k: int = TOP_K, miss_rate: float = MISS_RATE, stride: int = STRIDE):
    """``n`` plans of a scattered decode step over a pool of ``pool_rows`` rows: request b's
    misses (a Binomial(top_k, miss_rate) count) distinct rows of its own
    window of ``window`` rows, in runs of ``run`` adjacent rows aligned to ``run`` (the last
    run cut to the count), sorted by host row; their slots distinct in the request's region
    of ``stride`` slots. Windows: request b's starts at b * window, or (``spread``) at
    b * ((pool_rows - window) // (batch - 1)). Returns (rows [n, batch, top_k] int32,
    -1 past the misses; slots, same; misses [n, batch] int32)."""
    if window < 1 or run < 1 or window % run:
        raise ValueError(f"window {window} must be a positive multiple of the run {run}")
    if batch * window > pool_rows:
        raise ValueError(f"{batch} windows of {window} rows need {batch * window} rows; the pool has {pool_rows}")
    if top_k > stride or top_k > window:
        raise ValueError(f"top-k {top_k} must fit the region ({stride} slots) and the window ({window} rows)")
    gap = (pool_rows - window) // max(1, batch - 1) if spread else window
    misses = rng.binomial(top_k, miss_rate, size=(n, batch)).astype(np.int32)
    rows = np.full((n, batch, top_k), -1, np.int32)
    slots = np.full((n, batch, top_k), -1, np.int32)
    within = np.arange(run, dtype=np.int64)
    for i in range(n):
        for b in range(batch):
            m = int(misses[i, b])
            starts = np.sort(rng.choice(window // run, -(-m // run), replace=False)).astype(np.int64) * run
            rows[i, b, :m] = (b * gap + starts[:, None] + within).reshape(-1)[:m]
            slots[i, b, :m] = b * stride + rng.choice(stride, m, replace=False)
    return rows, slots, misses


def device_plans(cp, s, prow, pslot, pmiss, group: int) -> tuple:
    """The plans on the device, and a descriptor of their batch and top-k naming index
    group ``group``: (desc, rows, slots, misses), lists of one array a plan."""
    n, batch, top_k = prow.shape
    with s:
        d_rows = [cp.asarray(prow[i]) for i in range(n)]
        d_slots = [cp.asarray(pslot[i]) for i in range(n)]
        d_miss = [cp.asarray(pmiss[i]) for i in range(n)]
        desc = np.zeros(DESC_INTS, np.int32)
        desc[D_BATCH], desc[D_K], desc[D_GROUP] = batch, top_k, group
        d_desc = cp.asarray(desc)
    s.synchronize()
    return d_desc, d_rows, d_slots, d_miss


class VariantKernels:
    """A kernel cache that builds every module with ``defines`` added: CudaMover then
    launches a variant of its kernels, built from the same sources."""

    def __init__(self, kernels, defines: dict):
        self.kernels, self.defines = kernels, dict(defines)

    def function(self, source: str, name: str, defines=None, smem_bytes: int = 0):
        return self.kernels.function(source, name, {**(defines or {}), **self.defines}, smem_bytes)


def request_gather(lay, region, bufs, kc, s, timer, plans, step_bytes: float, blocks: int, graph: bool = False,
                   defines: dict | None = None, **kw) -> tuple[float, float, float]:
    """(GB/s, us, min us) of the request-order gather of the plans from ``region`` (the
    daemon's path: skv_gather of each batch row's sorted plan) with ``blocks`` blocks,
    launched one by one or (``graph``) replayed as one CUDA graph; ``defines``: a variant's
    csrc/copy.cu constants; ``kw``: more CudaMover options. ``step_bytes``: a plan's mean."""
    d_desc, d_rows, d_slots, d_miss = plans
    kernels = VariantKernels(kc, defines) if defines else kc
    mv = CudaMover(lay, region, buffers=bufs, kernels=kernels, stream=s, blocks=blocks, **kw)
    n = len(d_rows)
    batch = int(d_rows[0].shape[0])

    def go(i):
        mv.launch_gather(d_desc, d_rows[i], d_slots[i], d_miss[i], batch, s)

    if graph:
        go(0)  # a launch outside the capture first: the function loaded (CUDA loads lazily)
        t, tmin = timer.graph_us(go, n)
    else:
        t, tmin = timer.median_us(go, n)
    return step_bytes / t / 1e3, t, tmin


def variant_key(key: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", key.lower()).strip("_")


def scattered_section(out, row, cp, kc, s, timer, region, pool_bytes: int, bulk_GBps: float, rng,
                      shapes=SCATTERED_SHAPES, blocks=(DEFAULT_BLOCKS,), variants=GATHER_VARIANTS) -> None:
    """Each shape's gather from ``region`` (the pool as one layer of ``pool_bytes``), as a
    CUDA graph of PLANS plans: the daemon's (DEFAULT_BLOCKS blocks; the first shape, the
    headline, also on each of ``blocks``), then each variant. A shape the pool cannot hold
    is skipped (a row says why). Keys: ``gather_<shape>_GBps``, ``gather_<shape>_<n>blocks_GBps``,
    ``gather_<shape>_<variant>_GBps``, ``gather_vs_bulk_scattered`` (the headline's
    against ``bulk_GBps``)."""
    pool_rows = pool_bytes // ROW_BYTES
    lay = Layout(num_layers=1, row_bytes=ROW_BYTES, top_k=TOP_K, region_stride=STRIDE, max_reqs=BATCH,
                 host_rows=pool_rows, max_batch=BATCH).validate()
    bufs = allocate_device_buffers(lay)
    for i, shape in enumerate(shapes):
        first = i == 0
        try:
            prow, pslot, pmiss = scattered_plans(rng, pool_rows, PLANS, shape.window, shape.run, shape.spread)
        except ValueError as e:
            row(f"gather, {shape.name}", "skipped", str(e))
            continue
        plans = device_plans(cp, s, prow, pslot, pmiss, 0)
        step_bytes = float(pmiss.sum(axis=1).mean()) * ROW_BYTES
        out[f"gather_{shape.name}_step_bytes"] = int(step_bytes)
        grids = sorted({DEFAULT_BLOCKS, *blocks}) if first else [DEFAULT_BLOCKS]
        for nb in grids:
            gbps, t, tmin = request_gather(lay, region, bufs, kc, s, timer, plans, step_bytes, nb, graph=True)
            key = f"gather_{shape.name}_GBps" if nb == DEFAULT_BLOCKS else f"gather_{shape.name}_{nb}blocks_GBps"
            out[key] = round(gbps, 2)
            row(f"gather, {shape.name} ({shape.label}), {nb} blocks (graph)", f"{gbps:.1f} GB/s",
                f"{t:.0f} us (min {tmin:.0f}) for {step_bytes / 1e6:.2f} MB; {gbps / bulk_GBps:.3f} of bulk")
            if nb == DEFAULT_BLOCKS and first:
                out["gather_vs_bulk_scattered"] = round(gbps / bulk_GBps, 3)
        if first:  # batch 1: one request's ~205 misses, the step's latency at batch 1 (not bytes)
            try:
                one = device_plans(cp, s, prow[:, :1], pslot[:, :1], pmiss[:, :1], 0)
                _, t1, tmin1 = request_gather(lay, region, bufs, kc, s, timer, one,
                                              float(pmiss[:, 0].mean()) * ROW_BYTES, DEFAULT_BLOCKS, graph=True)
            except Exception as e:  # noqa: BLE001 - the figures above stand without it
                row(f"gather, {shape.name}, batch 1", "FAILED", f"{type(e).__name__}: {e}")
            else:
                out["gather_us_b1"] = round(t1, 1)
                row(f"gather, {shape.name}, batch 1 ({pmiss[:, 0].mean():.0f} rows), {DEFAULT_BLOCKS} blocks "
                    "(graph)", f"{t1:.1f} us", f"min {tmin1:.1f} us: with resolve_us_b1, a batch-1 layer's "
                    "swap-in on the device")
        for key, label, opts in variants:
            opts = dict(opts)
            nb = opts.pop("blocks", DEFAULT_BLOCKS)
            try:
                gbps, t, _ = request_gather(lay, region, bufs, kc, s, timer, plans, step_bytes, nb, graph=True,
                                            **opts)
            except Exception as e:  # noqa: BLE001 - a variant failing must not lose the rest
                row(f"gather, {shape.name}, variant {label}", "FAILED", f"{type(e).__name__}: {e}")
                continue
            out[f"gather_{shape.name}_{variant_key(key)}_GBps"] = round(gbps, 2)
            row(f"gather, {shape.name}, variant: {label}", f"{gbps:.1f} GB/s",
                f"{t:.0f} us; {gbps / bulk_GBps:.3f} of bulk")
