"""``sparsekv bench kernels``: the daemon's kernels on one GPU against the link's own speed
(docs/PERF.md records what it printed).

* **Pool ready**: a host pool of ``--pool-gib`` pre-faulted and page-locked, registered
  chunk by chunk while faulting (the daemon's start) and after the fault. GiB/s.
* **Gather** of a decode step's misses (batch 64, top-k 2048, 656 B rows, ~10 % misses, each
  request's rows in its own 64-row blocks scattered over one layer) on several grid sizes,
  against a bulk ``cudaMemcpyAsync`` of the same bytes and of 4 GiB from the same pinned
  pool; then the scattered workloads of :mod:`.kernels_scattered` (the pool as one layer,
  each request's rows in its own window: ``gather_vs_bulk_scattered``), each as a CUDA
  graph; every gather also by each variant of :data:`GATHER_VARIANTS`; then a TP group's
  plan striped over its GPUs (:mod:`.kernels_striped`: ``striped_gather_vs_per_rank_*``).
* **Resolve** of batch 64, top-k 2048, region 4096, 90 % of each row kept, at the
  daemon's thread count (and of batch 1: one block alone, ``resolve_us_b1``), then at
  other thread counts and workspace options; then the
  **prefetch** of the next step's rows after each resolve (``prefetch_us_b64``).

Every figure is the median of CUDA-event timings over distinct inputs (nothing served
from L2). ``--json``: the flat figures (``gather_vs_bulk``, ``resolve_us_b64``, ...).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time

import numpy as np

from sparsekv.daemon.kernels import get_cache
from sparsekv.daemon.pinned import PinnedRegion, PoolPinner
from sparsekv.daemon.pool import HostPool, anon_huge_bytes, vmstat, vmstat_delta
from sparsekv.daemon.residency.cuda import CudaResidency, allocate_device_buffers, make_desc
from sparsekv.proto import Layout

from .decode_report import write_json
from .kernels_scattered import (BATCH, DEFAULT_BLOCKS, GATHER_VARIANTS, MISS_RATE, PLANS, ROW_BYTES, STRIDE, TOP_K,
                                SCATTERED_SHAPES, device_plans, request_gather, scattered_section, variant_key)
from .kernels_striped import striped_section

GIB = 1 << 30
BLOCK_ROWS = 64


def _say(msg: str) -> None:
    print(f"bench kernels: {msg}", file=sys.stderr, flush=True)


class EventTimer:
    """CUDA-event timings of work enqueued on one stream."""

    def __init__(self, cp, stream):
        self.cp, self.stream = cp, stream

    def median_us(self, fn, n: int, rounds: int = 5, warmup: int = 1) -> tuple[float, float]:
        """Median and min over ``rounds`` of the mean time of ``fn(i)`` for i in range(n)."""
        def run_round():
            for i in range(n):
                fn(i)

        return self._rounds(run_round, n, rounds, warmup)

    def graph_us(self, fn, n: int, rounds: int = 5, warmup: int = 2) -> tuple[float, float]:
        """As :meth:`median_us`, the calls captured once into a CUDA graph and replayed:
        the device's time, without the host's launch cost between calls."""
        cp, s = self.cp, self.stream
        s.synchronize()
        s.begin_capture(cp.cuda.runtime.streamCaptureModeRelaxed)
        try:
            for i in range(n):
                fn(i)
        finally:
            graph = s.end_capture()
        graph.upload(s)
        return self._rounds(lambda: graph.launch(s), n, rounds, warmup)

    def _rounds(self, run_round, n: int, rounds: int, warmup: int) -> tuple[float, float]:
        """Median and min (us) of ``rounds`` timed rounds divided by ``n``, after ``warmup``."""
        cp, s = self.cp, self.stream
        for _ in range(warmup):
            run_round()
        s.synchronize()
        times = []
        for _ in range(rounds):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(s)
            run_round()
            b.record(s)
            b.synchronize()
            times.append(cp.cuda.get_elapsed_time(a, b) * 1e3 / n)
        return float(np.median(times)), float(np.min(times))


# -- pool ready --------------------------------------------------------------------------------
def pool_ready(nbytes: int, threads: int, pipelined: bool, max_chunk_bytes: int) -> tuple:
    """(HostPool, PinnedRegion, seconds, note): a pool of ``nbytes`` faulted by ``threads``
    and page-locked in chunks of ``max_chunk_bytes``: during the fault (``pipelined``, the
    daemon's start) or after it."""

    before = vmstat()
    t0 = time.perf_counter()
    if pipelined:
        pinner = PoolPinner(nbytes, max_chunk_bytes, while_faulting=True)
        pool = HostPool(nbytes, threads, on_faulted=pinner)
        region = pinner.finish()
        secs = time.perf_counter() - t0
        note = (f"every page faulted at {pool.faulted_s:.2f} s, {region.register_s:.2f} s in cudaHostRegister; "
                "registered while faulting")
    else:
        pool = HostPool(nbytes, threads)
        t1 = time.perf_counter()
        region = PinnedRegion(pool.address, nbytes, 16, max_chunk_bytes)
        secs = time.perf_counter() - t0
        note = f"fault {nbytes / GIB / (t1 - t0):.1f} GiB/s, then register {nbytes / GIB / (t0 + secs - t1):.1f} GiB/s"
    # What the kernel did meanwhile: huge pages given or refused, compaction, reclaim.
    moved = {k: v for k, v in vmstat_delta(before, vmstat()).items() if v}
    if moved:
        note += "; vmstat " + " ".join(f"{k}={v}" for k, v in moved.items())
    return pool, region, secs, note


# -- a realistic step's plan -------------------------------------------------------------------
def step_plans(rng, host_rows: int, n: int, batch: int = BATCH, top_k: int = TOP_K, miss_rate: float = MISS_RATE):
    """``n`` plans of one layer: per request ~``miss_rate * top_k`` rows, each request's
    rows inside its own blocks of BLOCK_ROWS rows (its context: an equal share of the
    layer's rows, blocks scattered over the layer by a random block table), each plan
    sorted by host row as skv_resolve leaves it. Returns (rows [n, batch, top_k] int32,
    slots same shape, misses [n, batch] int32)."""
    blocks = host_rows // BLOCK_ROWS
    per_req = blocks // batch
    table = rng.permutation(blocks)[: per_req * batch].reshape(batch, per_req)
    misses = np.full((n, batch), int(round(miss_rate * top_k)), np.int32)
    rows = np.full((n, batch, top_k), -1, np.int32)
    slots = np.full((n, batch, top_k), -1, np.int32)
    ctx = per_req * BLOCK_ROWS
    for i in range(n):
        for b in range(batch):
            m = misses[i, b]
            pos = rng.choice(ctx, m, replace=False)
            r = np.sort(table[b, pos // BLOCK_ROWS].astype(np.int64) * BLOCK_ROWS + pos % BLOCK_ROWS)
            rows[i, b, :m] = r
            slots[i, b, :m] = b * STRIDE + rng.choice(STRIDE, m, replace=False)
    return rows, slots, misses


# -- the benchmark -----------------------------------------------------------------------------
def run(pool_gib: float = 64.0, layers: int = 61, threads: int | None = None, chunk_gib: float = 4.0,
        blocks=(16, 32, 64, 132), both_pool_modes: bool = True, resolve_variants: bool | str = True,
        gather_variants=GATHER_VARIANTS, scattered_shapes=SCATTERED_SHAPES, seed: int = 0,
        resolve_only: bool = False, json_path: str | None = None) -> dict:
    """Every figure into the returned dict (``_rows``: the table's rows). ``resolve_variants``:
    True every variant, ``"quick"`` the thread counts, False none. ``json_path``: the
    figures so far are written there after every row (a run cut short keeps them)."""
    import cupy as cp  # noqa: PLC0415

    threads = threads or min(16, os.cpu_count() or 1)
    nbytes = int(pool_gib * GIB) // (1 << 21) * (1 << 21)
    chunk = int(chunk_gib * GIB)
    out: dict = {"kernels_pool_GiB": round(nbytes / GIB, 2), "kernels_prefault_threads": threads,
                 "kernels_register_chunk_GiB": chunk_gib}
    rows_out: list[tuple[str, str, str]] = []

    def row(what, value, note=""):
        rows_out.append((what, value, note))
        _say(f"{what}: {value} {note}")
        if json_path:
            write_json(json_path, out)

    kc = get_cache()
    s = cp.cuda.Stream(non_blocking=True)
    timer = EventTimer(cp, s)
    if resolve_only:  # no pool, no gather: the resolve and its variants alone
        _resolve_section(out, row, cp, kc, s, timer, np.random.default_rng(seed), resolve_variants)
        out["_rows"] = rows_out
        return out
    with contextlib.ExitStack() as stack:
        # The daemon's way first: the first large pool of a run finds the host's memory as
        # it is (a later one may find huge pages ready).
        pool, region, secs, note = pool_ready(nbytes, threads, pipelined=True, max_chunk_bytes=chunk)
        huge = anon_huge_bytes(pool.address, pool.size_bytes) / nbytes
        out["pool_ready_GiBps"] = round(nbytes / GIB / secs, 2)
        out["pool_ready_s"] = round(secs, 2)
        out["pool_faulted_s"] = round(pool.faulted_s, 2)
        out["pool_register_s"] = round(region.register_s, 2)
        out["pool_backing"] = pool.backing
        out["pool_huge_page_share"] = round(huge, 3)
        row(f"pool ready, {nbytes / GIB:.0f} GiB, {pool.backing}, registered while faulting ({threads} threads; "
            "the daemon's way), the run's first pool", f"{nbytes / GIB / secs:.1f} GiB/s",
            f"{secs:.2f} s, {huge:.0%} in huge pages; {note}")
        # The same way again (memory the host has backed before), then the other way
        # (SPARSEKV_PIN_POOL_AT_START=after).
        for pipelined, key, label in ((True, "again", "registered while faulting, the second pool"),
                                      (False, "after_fault", "fault then register (=after; the third pool)")):
            if not both_pool_modes:
                break
            region.close()
            pool.close()
            pool, region, secs, note = pool_ready(nbytes, threads, pipelined=pipelined, max_chunk_bytes=chunk)
            out[f"pool_ready_{key}_GiBps"] = round(nbytes / GIB / secs, 2)
            row(f"pool ready, {nbytes / GIB:.0f} GiB, {pool.backing}, {label}", f"{nbytes / GIB / secs:.1f} GiB/s",
                note)
        stack.callback(pool.close)
        stack.callback(region.close)

        host_rows = nbytes // (layers * ROW_BYTES)
        lay = Layout(num_layers=layers, row_bytes=ROW_BYTES, top_k=TOP_K, region_stride=STRIDE, max_reqs=BATCH,
                     host_rows=host_rows, max_batch=BATCH).validate()
        layer = layers // 2
        rng = np.random.default_rng(seed)
        t0 = time.perf_counter()
        prow, pslot, pmiss = step_plans(rng, host_rows, PLANS)
        _say(f"{PLANS} step plans in {time.perf_counter() - t0:.1f} s ({int(pmiss[0].sum())} misses each, "
             f"{host_rows} rows a layer)")
        plans = device_plans(cp, s, prow, pslot, pmiss, layer)
        bufs = allocate_device_buffers(lay)
        step_bytes = int(pmiss[0].sum()) * ROW_BYTES

        # The link: bulk copies from the pinned pool (one DMA copy stays inside one registration).
        big = min(4 * GIB, region.chunks[0].nbytes)
        bulk = cp.empty(big, dtype=cp.uint8)
        src = region.device_address(0, big)

        def copy(n, off=0):
            cp.cuda.runtime.memcpyAsync(bulk.data.ptr, src + off, n, 1, s.ptr)  # host to device

        t_big, _ = timer.median_us(lambda i: copy(big), 1, rounds=3)
        bulk_GBps = big / t_big / 1e3
        spread = max(0, big - step_bytes) // PLANS
        t_same, _ = timer.median_us(lambda i: copy(step_bytes, (i * spread) // 4096 * 4096), PLANS)
        same_GBps = step_bytes / t_same / 1e3
        out.update(bulk_h2d_GBps=round(bulk_GBps, 2), bulk_h2d_GiB=round(big / GIB, 2), bulk_h2d_step_bytes_GBps=round(same_GBps, 2),
                   kernels_step_bytes=step_bytes)
        row(f"bulk pinned H2D, {big / GIB:.2f} GiB (cudaMemcpyAsync)", f"{bulk_GBps:.1f} GB/s",
            f"{t_big / 1e3:.1f} ms")
        row(f"bulk pinned H2D, {step_bytes / 1e6:.1f} MB (the step's bytes)", f"{same_GBps:.1f} GB/s",
            f"{t_same:.0f} us")
        bulk = None
        cp.get_default_memory_pool().free_all_blocks()

        best = 0.0
        for nb in blocks:
            gbps, t, tmin = request_gather(lay, region, bufs, kc, s, timer, plans, step_bytes, nb)
            best = max(best, gbps)
            out[f"gather_request_order_{nb}blocks_GBps"] = round(gbps, 2)
            row(f"gather of the step's misses, {nb} blocks x 256 threads", f"{gbps:.1f} GB/s",
                f"{t:.0f} us (min {tmin:.0f})")
        # The gather's variants (their own grid, else the daemon's).
        for key, label, kw in gather_variants:
            kw = dict(kw)
            nb = kw.pop("blocks", DEFAULT_BLOCKS)
            try:
                gbps, t, _ = request_gather(lay, region, bufs, kc, s, timer, plans, step_bytes, nb, **kw)
            except Exception as e:  # noqa: BLE001 - a variant failing must not lose the rest
                row(f"gather variant {label}", "FAILED", f"{type(e).__name__}: {e}")
                continue
            out[f"gather_request_order_{variant_key(key)}_GBps"] = round(gbps, 2)
            row(f"gather, {nb} blocks, variant: {label}", f"{gbps:.1f} GB/s", f"{t:.0f} us")
        # The same kernel on adjacent rows (each request's misses one run of consecutive
        # rows): the ceiling of any gather by the SMs (the bulk figure is the copy engine's).
        crow = prow.copy()
        for i in range(PLANS):
            for b in range(BATCH):
                m = int(pmiss[i, b])
                crow[i, b, :m] = np.arange(m, dtype=np.int32) + (i * BATCH + b) * m
        if int(crow.max()) < lay.host_rows:
            gbps, t, _ = request_gather(lay, region, bufs, kc, s, timer,
                                        device_plans(cp, s, crow, pslot, pmiss, layer), step_bytes, 32)
            out["gather_adjacent_rows_GBps"] = round(gbps, 2)
            out["gather_vs_adjacent_rows"] = round(best / gbps, 3)
            row("gather, 32 blocks, each request's misses adjacent rows (the SMs' ceiling)",
                f"{gbps:.1f} GB/s", f"{t:.0f} us; the scattered gather reaches "
                f"{out['gather_vs_adjacent_rows']:.2f} of it")
        # The scattered workloads: the pool as one layer, each request's rows in its own window.
        scattered_section(out, row, cp, kc, s, timer, region, nbytes, bulk_GBps, np.random.default_rng(seed + 1),
                          shapes=scattered_shapes, blocks=blocks, variants=gather_variants)
        # A TP group's plan striped over its ranks' GPUs (or two slabs on one GPU); a failure
        # is a row, the rest of the run goes on (it needs peers and more device memory).
        try:
            striped_section(out, row, cp, kc, region, nbytes, np.random.default_rng(seed + 2))
        except Exception as e:  # noqa: BLE001 - report and continue
            row("striped gather", "FAILED", f"{type(e).__name__}: {e}")
        # The same gather from the engine's range registered in one piece (as an attach does).
        region.close()
        whole = PinnedRegion(pool.address, -(-lay.pool_bytes // 4096) * 4096, ROW_BYTES,
                             max_chunk_bytes=1 << 40)
        stack.callback(whole.close)
        for nb in (32, 64):
            gbps, t, _ = request_gather(lay, whole, bufs, kc, s, timer, plans, step_bytes, nb)
            out[f"gather_request_order_{nb}blocks_one_registration_GBps"] = round(gbps, 2)
            row(f"gather, {nb} blocks, the engine's range registered in one piece",
                f"{gbps:.1f} GB/s", f"{t:.0f} us")
        out["gather_request_order_GBps"] = round(best, 2)
        out["gather_vs_bulk"] = round(best / bulk_GBps, 3)  # the headline
        out["gather_vs_bulk_same_bytes"] = round(best / same_GBps, 3)

        _resolve_section(out, row, cp, kc, s, timer, rng, resolve_variants)
    out["_rows"] = rows_out
    return out


def resolve_sequence(rng, steps: int = PLANS, batch: int = BATCH, top_k: int = TOP_K, kept: float = 0.9,
                     span: int = 65536) -> list[np.ndarray]:
    """``steps`` top-k batches (int32 [batch, top_k]) that form a cycle (each keeps ``kept``
    of its predecessor's ids, the first of the last's): row b's ids a window sliding over
    a ring of distinct ids of its own range (b * span ...), in random column order."""
    fresh = top_k - int(kept * top_k)
    ring = steps * fresh
    if ring < top_k + fresh or ring > span:
        raise ValueError(f"{steps} steps of {fresh} fresh ids do not make a ring of {top_k}-id windows")
    rings = np.stack([b * span + rng.choice(span, ring, replace=False) for b in range(batch)])
    out = []
    for i in range(steps):
        cols = (i * fresh + np.arange(top_k)) % ring
        out.append(np.stack([rng.permutation(rings[b, cols]) for b in range(batch)]).astype(np.int32))
    return out


def variant_options(res, quick: bool = False) -> list[tuple[str, dict]]:
    """(label, CudaResidency options) of the resolve variants timed against ``res`` (the
    default): other thread counts, then (unless ``quick``) the workspace's options."""
    variants = [(f"{n} threads", {"threads": n}) for n in (256, 512, 768, 1024) if n != res.threads]
    if quick:
        return variants
    other_scale = 2 if res.hash_scale == 4 else 4
    return variants + [
        (f"new lru {'scattered to global memory' if res.lru_smem else 'in the workspace'}",
         {"lru_smem": not res.lru_smem}),
        (f"owners read {'from global memory' if res.owner_smem else 'into the workspace'}",
         {"owner_smem": not res.owner_smem}),
        ("owners and the new lru in the workspace", {"lru_smem": True, "owner_smem": True}),
        ("table x2, rows in global memory", {"hash_scale": 2, "lru_smem": False, "owner_smem": False}),
        (f"hash table x{other_scale}", {"hash_scale": other_scale})]


def _resolve_section(out, row, cp, kc, s, timer, rng, variants: bool | str) -> None:
    """Resolve at the daemon's settings replayed as a CUDA graph (the device's time), and
    launched one by one from Python with the descriptor's upload (the host's floor); then
    the variants (:func:`variant_options`; ``variants`` as :func:`run`'s)."""
    rlay = Layout(num_layers=1, row_bytes=16, top_k=TOP_K, region_stride=STRIDE, max_reqs=BATCH,
                  host_rows=BATCH * 65536, max_batch=BATCH).validate()
    with s:
        d_seq = [cp.asarray(x) for x in resolve_sequence(rng)]
        sr = cp.asarray(np.arange(BATCH, dtype=np.int32))
    s.synchronize()

    def graph_time(res, batch: int = BATCH) -> float:
        ro = res.new_output(batch)
        seq, rows = [x[:batch] for x in d_seq], sr[:batch]
        for x in seq:  # the steady state (and the kernel compiled) before the capture
            res.resolve_async(0, rows, x, ro, stream=s)
        ro.desc.set(make_desc(batch, TOP_K, 0), stream=s)

        def go(i):
            res.launch_resolve(ro.desc, rows, seq[i], ro.slots, ro.misses, ro.plan_rows, ro.plan_slots,
                               ro.counters, 0, ro.err, ro.workspace, batch, s)

        t, _ = timer.graph_us(go, len(seq))
        return t

    res = CudaResidency(rlay, kernels=kc, stream=s)
    t = graph_time(res)
    out["resolve_us_b64"] = round(t, 1)
    out["resolve_hash_scale"] = res.hash_scale
    out["resolve_lru_smem"], out["resolve_owner_smem"] = int(res.lru_smem), int(res.owner_smem)
    row(f"resolve, batch 64, top-k 2048, region 4096, 90 % kept, {res.threads} threads (table x{res.hash_scale}, "
        f"lru {'in' if res.lru_smem else 'out of'} the workspace, owners {'in' if res.owner_smem else 'out of'} it; "
        "graph)", f"{t:.1f} us")
    # Batch 1: one block resolves the row alone, its phases one after another (the step's
    # critical path at batch 1, where the resolve is not hidden behind other rows').
    r1 = CudaResidency(dataclasses.replace(rlay, max_reqs=1, max_batch=1), kernels=kc, stream=s)
    t1 = graph_time(r1, 1)
    out["resolve_us_b1"] = round(t1, 1)
    row("resolve, batch 1, the same (graph)", f"{t1:.1f} us", "one block: the row's latency")
    ro = res.new_output(BATCH)
    te, _ = timer.median_us(lambda i: res.resolve_async(0, sr, d_seq[i], ro, stream=s), len(d_seq))
    out["resolve_us_b64_eager"] = round(te, 1)
    row("resolve, the same, each launched from Python after its descriptor's upload", f"{te:.1f} us",
        "the host's floor when it is above the kernel")
    # Each variant starts from the default's steady state (owners and lru after the cycle).
    for label, kw in variant_options(res, quick=variants == "quick") if variants else []:
        try:
            rv = CudaResidency(rlay, kernels=kc, stream=s, **kw)
            with s:
                rv.owner[...] = res.owner
                rv.lru[...] = res.lru
            tv = graph_time(rv)
        except Exception as e:  # noqa: BLE001 - a variant failing must not lose the rest
            row(f"resolve variant {label}", "FAILED", f"{type(e).__name__}: {e}")
            continue
        out[f"resolve_us_b64_{label.replace(' ', '_')}"] = round(tv, 1)
        row(f"resolve variant: {label}", f"{tv:.1f} us")
    try:
        _prefetch_rows(out, row, kc, s, timer, d_seq, sr)
    except Exception as e:  # noqa: BLE001 - the figures above stand without it
        row("prefetch", "FAILED", f"{type(e).__name__}: {e}")


def _prefetch_rows(out, row, kc, s, timer, d_seq, sr) -> None:
    """``skv_prefetch`` at the resolve's shape: per step, group 1 resolves step i's rows
    and then takes the next step's rows by prefetch (about 10 % of each row not held), as
    one CUDA graph, against the same resolves alone (the difference is the prefetch)."""
    lay = Layout(num_layers=2, row_bytes=16, top_k=TOP_K, region_stride=STRIDE, max_reqs=BATCH,
                 host_rows=BATCH * 65536, index_groups=((0,), (1,)), max_batch=BATCH).validate()
    res = CudaResidency(lay, kernels=kc, stream=s, prefetch=True)
    ro, po = res.new_output(BATCH), res.new_output(BATCH)
    n = len(d_seq)
    for x in d_seq:
        res.resolve_async(1, sr, x, ro, stream=s)
    ro.desc.set(make_desc(BATCH, TOP_K, 1), stream=s)
    po.desc.set(make_desc(BATCH, TOP_K, 1), stream=s)

    def step(i: int, prefetch: bool) -> None:
        res.launch_resolve(ro.desc, sr, d_seq[i], ro.slots, ro.misses, ro.plan_rows, ro.plan_slots, ro.counters,
                           0, ro.err, ro.workspace, BATCH, s)
        if prefetch:
            res.launch_prefetch(po.desc, sr, d_seq[(i + 1) % n], po.plan_rows, po.plan_slots, po.misses, po.err,
                                BATCH, s)

    alone, _ = timer.graph_us(lambda i: step(i, False), n)
    both, _ = timer.graph_us(lambda i: step(i, True), n)
    taken = res.prefetched
    out["prefetch_us_b64"] = round(both - alone, 1)
    row("prefetch of the next step's rows after each resolve, batch 64, top-k 2048, region 4096 (graph)",
        f"{both - alone:.1f} us", f"resolve + prefetch {both:.1f} us against the resolve alone {alone:.1f}; "
        f"{taken} rows taken in all, prefetch workspace {res.prefetch_smem} B")


def table(result: dict) -> str:
    lines = ["| what | value | note |", "| --- | --- | --- |"]
    lines += [f"| {w} | {v} | {n} |" for w, v, n in result.get("_rows", [])]
    keys = ("gather_vs_bulk", "gather_vs_bulk_same_bytes", "gather_vs_bulk_scattered", "resolve_us_b64",
            "pool_ready_GiBps")
    lines += ["", "  ".join(f"{k} {result[k]}" for k in keys if k in result)]
    return "\n".join(lines) + "\n"


def add_arguments(p) -> None:
    p.add_argument("--pool-gib", type=float, default=64.0,
                   help="kernels: the host pool the gather reads and the pool start times (GiB)")
    p.add_argument("--kernels-quick", action="store_true",
                   help="kernels: gathers on 32 and 64 blocks only (every workload and gather variant "
                        "still), the resolve's thread counts only")
    p.add_argument("--resolve-only", action="store_true",
                   help="kernels: the resolve and its variants only (no pool, no gather)")


def run_args(a) -> int:
    """``sparsekv bench kernels [--pool-gib N] [--kernels-quick] [--json PATH]``."""
    quick = a.kernels_quick
    r = run(pool_gib=a.pool_gib, blocks=(32, 64) if quick else (16, 32, 64, 132),
            resolve_variants="quick" if quick else True, resolve_only=a.resolve_only, json_path=a.json_path)
    sys.stdout.write(table(r))
    if a.json_path:
        write_json(a.json_path, r)
    return 0
