"""``sparsekv bench kernels``' striped gather: a TP group's shared plan split into N stripes
(csrc/copy.cu: ``skv_gather`` with a stripe, then ``skv_push`` of it into every peer's
slab, one ready word per slab counting N grids of arrivals) against every rank gathering
the whole plan, timed in one run on the same plans (the scattered ``w128k`` decode step:
batch 64, top-k 2048, ~10 % misses).

N ranks, a slab each: one rank per GPU when the machine has several (peer access between
every pair, the pushes over NVLink), else two slabs on one GPU (the pushes device to
device, both ranks' gathers over the one link). Each rank's steps are one CUDA graph on
its own stream (its gathers and pushes, step after step, no barrier between ranks); a
round launches every rank's graph and waits for all. Key
``striped_gather_vs_per_rank_<N>gpu`` (``..._1gpu_2slabs`` on one GPU): a step's time
striped over its time per rank (the issue's goal with 2 GPUs: <= 0.6).
"""

from __future__ import annotations

import time

import numpy as np

from sparsekv.daemon.residency.cuda import CudaMover
from sparsekv.proto import Layout

from .kernels_scattered import BATCH, DEFAULT_BLOCKS, PLANS, ROW_BYTES, STRIDE, TOP_K, device_plans, scattered_plans

WINDOW = 131072  # the w128k shape: each request's rows random in its own 131,072-row window


def _peer_access(cp, devices) -> str | None:
    """Enable peer access between every pair of ``devices``; why not, or None."""
    for a in devices:
        for b in devices:
            if a == b:
                continue
            if not cp.cuda.runtime.deviceCanAccessPeer(a, b):
                return f"GPU {a} cannot reach GPU {b}'s memory"
            with cp.cuda.Device(a):
                try:
                    cp.cuda.runtime.deviceEnablePeerAccess(b)
                except cp.cuda.runtime.CUDARuntimeError as e:
                    if "AlreadyEnabled" not in str(e) and "ALREADY_ENABLED" not in str(e):
                        raise
    return None


def striped_section(out, row, cp, kc, region, pool_bytes: int, rng, max_gpus: int = 8, rounds: int = 5,
                    window: int = WINDOW) -> None:
    """The striped gather against the per-rank gather (module docstring) from ``region``
    (the pool as one layer of ``pool_bytes``); ``max_gpus``: the most GPUs (ranks) used;
    ``window``: each request's rows (a smaller pool than the w128k step's needs less)."""
    gpus = min(cp.cuda.runtime.getDeviceCount(), max_gpus)
    devices = list(range(gpus)) if gpus > 1 else [0, 0]
    n = len(devices)
    key = f"striped_gather_vs_per_rank_{gpus}gpu" if gpus > 1 else "striped_gather_vs_per_rank_1gpu_2slabs"
    label = f"striped gather, {n} ranks on {gpus} GPU{'s' if gpus > 1 else ''}"
    why = _peer_access(cp, sorted(set(devices)))
    if why:
        row(label, "skipped", why)
        return
    pool_rows = pool_bytes // ROW_BYTES
    lay = Layout(num_layers=1, row_bytes=ROW_BYTES, top_k=TOP_K, region_stride=STRIDE, max_reqs=BATCH,
                 host_rows=pool_rows, max_batch=BATCH).validate()
    prow, pslot, pmiss = scattered_plans(rng, pool_rows, PLANS, window)
    step_bytes = float(pmiss.sum(axis=1).mean()) * ROW_BYTES
    ranks = []
    for d in devices:
        with cp.cuda.Device(d):
            s = cp.cuda.Stream(non_blocking=True)
            mv = CudaMover(lay, region, kernels=kc, stream=s, blocks=DEFAULT_BLOCKS)
            words = cp.zeros(2, cp.uint32)  # this slab's ready word and arrival counter
            ranks.append((d, s, mv, device_plans(cp, s, prow, pslot, pmiss, 0), words))
    targets = [[mv.slab_target(peer[2].slab) for peer in ranks] for _, _, mv, _, _ in ranks]
    expect = n * DEFAULT_BLOCKS

    def signal(q):
        ptr = ranks[q][4].data.ptr
        return {"ready": ptr, "arrivals": ptr + 4, "expect": expect}

    def step(r: int, i: int, striped: bool) -> None:
        _, s, mv, (desc, rows, slots, miss), _ = ranks[r]
        if not striped:
            mv.launch_gather(desc, rows[i], slots[i], miss[i], BATCH, s)
            return
        mv.launch_gather(desc, rows[i], slots[i], miss[i], BATCH, s, stripe=r, stripes=n, **signal(r))
        for q in range(n):
            if q != r:
                mv.launch_push(desc, rows[i], slots[i], miss[i], BATCH, s, targets[r][q], stripe=r, stripes=n,
                               **signal(q))

    def graphs(striped: bool) -> list:
        out_graphs = []
        for r, (d, s, _, _, _) in enumerate(ranks):
            with cp.cuda.Device(d):
                step(r, 0, striped)  # outside the capture first: CUDA loads the functions lazily
                s.synchronize()
                s.begin_capture(cp.cuda.runtime.streamCaptureModeRelaxed)
                try:
                    for i in range(PLANS):
                        step(r, i, striped)
                finally:
                    g = s.end_capture()
                g.upload(s)
                out_graphs.append(g)
        return out_graphs

    def step_us(striped: bool) -> tuple[float, float]:
        """Median and min (us) of a step, every rank's graph launched, all waited for."""
        gs = graphs(striped)
        times = []
        for k in range(rounds + 1):
            t0 = time.perf_counter()
            for (d, s, _, _, _), g in zip(ranks, gs):
                with cp.cuda.Device(d):
                    g.launch(s)
            for d, s, _, _, _ in ranks:
                with cp.cuda.Device(d):
                    s.synchronize()
            if k:  # the first round warms up
                times.append((time.perf_counter() - t0) * 1e6 / PLANS)
        return float(np.median(times)), float(np.min(times))

    per_rank, per_rank_min = step_us(False)
    striped, striped_min = step_us(True)
    out[key] = round(striped / per_rank, 3)
    out[f"{key}_step_us"] = round(striped, 1)
    row(f"{label}, each rank gathering the whole plan", f"{per_rank:.0f} us",
        f"min {per_rank_min:.0f}; {step_bytes / 1e6:.2f} MB a rank, {n * step_bytes / per_rank / 1e3:.1f} GB/s "
        "over the ranks")
    row(f"{label}, striped (stripe gathered, pushed to {n - 1} peer{'s' if n > 2 else ''})", f"{striped:.0f} us",
        f"min {striped_min:.0f}; {striped / per_rank:.3f} of per-rank ({key})")
