"""The GPU side of ``sparsekv bench decode``: each mode's decode step, captured as a CUDA
graph where it can be, and the timed runs of one batch size over its hit rates, alone or
several modes in turn (``--paired``). torch comes in as an argument."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sparsekv.client.client import Client
from sparsekv.client.swap_in import HostSwapIn
from sparsekv.embedded.inproc_cuda import InprocSwapIn
from sparsekv.proto import Layout

from .decode_report import Result
from .decode_workload import (CONTROL, PATTERN_ROWS, Options, Workload, fill_pattern, fill_through_staging,
                              gather_blocks, hkey, pattern_tile, say)
from .private_daemon import PrivateDaemon

DEVICE = 0  # the GPU this process and the private daemon use
DAEMON_POOL_SLACK_BYTES = 64 << 20
CLIENT_TIMEOUT_S = 600.0  # attach registers GBs of pool; a write of 256 MiB takes a while
DAEMON_START_TIMEOUT_S = 600.0  # the daemon pre-faults its pool before it listens
GIB = 1 << 30


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


def capture_step(torch, step, label: str):
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
        say(f"{label}: CUDA graph capture failed ({type(e).__name__}: {' '.join(str(e).split())[:300]}); "
             "running the step eagerly")
        torch.cuda.synchronize()
        return step, "eager", None
    return graph.replay, "graph", graph


def _timed(torch, runs, inputs: _Inputs, sts, opts: Options, counts):
    """Step times (us) ``[len(runs), steps]``, and per run the growth of its counters (hits,
    misses[, prefetch hits, prefetched, wasted]) over them, or None.
    With several sides, step ``t`` of every side runs before step ``t + 1`` of any, the
    order rotated by ``t``, each timed alone between two synchronisations."""
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
            deltas[i] = tuple(a - b for a, b in zip(after, before[i]))
    return times, deltas


@dataclass
class _Side:
    """One mode's step in a timed run (:func:`_run_sides`)."""

    mode: str
    step: object  # () -> None: one decode step, enqueued on the current stream
    st: _Static
    counts: object = None  # () -> (hits, misses[, PREFETCH_COUNTERS]) or None
    check: object = None  # () -> None, raises what went wrong
    fill_s: float | None = None
    handle: object = None  # what the owner closes after the run (inproc: the InprocSwapIn)
    huge_pct: int | None = None  # share of its host pool in transparent huge pages


def _run_sides(torch, sides: list, lay: Layout, workloads: dict, opts: Options, out: list,
               capture: bool = True) -> None:
    """Every hit rate of one batch for one or several modes (``sides``): each side's step
    captured once, then every config timed, several sides step by step in turn
    (:func:`_timed`); every side after the first gets the median of its per-step
    differences to the first (``paired_us_per_layer``)."""
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
                runs[i] = capture_step(torch, s.step, f"{s.mode} batch {batch}")
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
                if delta is not None and delta[0] + delta[1] > 0:
                    r.hit_rate, r.hit_measured = delta[0] / (delta[0] + delta[1]), True
                    r.misses_per_step = delta[1] / opts.steps
                    r.misses = delta[1]
                    if len(delta) > 2:
                        r.prefetch_hits, r.prefetched, r.prefetch_wasted = delta[2:5]
                else:
                    r.hit_rate = wl.target_hit_rate
                    r.misses_per_step = (1 - wl.target_hit_rate) * batch * opts.top_k * opts.layers
            if s.check is not None:
                try:
                    s.check()
                except Exception as e:  # noqa: BLE001 - a refused row makes the figure suspect: report it
                    r.error = f"{type(e).__name__}: {e}"
            out.append(r)
            say(f"batch {batch} hits {hkey(hits)}% {s.mode}: p50 {r.p50_us:.1f} us, p99 {r.p99_us:.1f} us "
                 f"({runs[i][1]})" + (f"; {r.error}" if r.error else "")
                 + (f"; paired with {sides[0].mode}: {r.paired_us_per_layer:+.2f} us/layer"
                    if r.paired_us_per_layer is not None else "")
                 + (f"; {100 * r.hidden_share:.0f} % of misses prefetched off the critical path"
                    if r.hidden_share is not None else ""))
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
    say(f"batch {lay.max_batch} gpu: {kv.numel() / 1e9:.1f} GB of rows on the GPU, filled in {fill_s:.1f} s")
    kv32 = kv.view(torch.int32)  # [L, R, RB / 4]
    st = _Static(torch, lay, opts.blocks)
    try:
        side = _Side("gpu", _gpu_step(torch, kv32, st, lay, opts.block_size), st, fill_s=fill_s)
        _run_sides(torch, [side], lay, workloads, opts, out, capture=capture)
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
    """``InprocSwapIn`` with its pool filled, as a side named ``mode``; the caller closes
    ``side.handle`` once the GPU is done with it."""
    t0 = time.perf_counter()
    h = InprocSwapIn(lay, device=DEVICE, gather_blocks=gather_blocks(opts))
    try:
        t1 = time.perf_counter()
        fill_pattern(h.pool)
        fill_s = time.perf_counter() - t1
        huge = _pct(h.pool_huge_bytes, lay.pool_bytes)
        say(f"batch {lay.max_batch} {mode}: {lay.pool_bytes / 1e9:.1f} GB pinned pool registered in "
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
    """``--paired``: the inproc handle (with ``--control`` a second one) and the doorbell
    rank, each with its own pool, timed step by step in turn; then zmq, when asked. The
    in-process pools are made before the daemon starts, or with ``daemon_first`` once its
    pool is filled (memory handed out later can be slower to gather from)."""
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


def arena_bytes(lay: Layout, ranks: int) -> int:
    """A device arena for ``ranks`` ranks (each a slab and its step buffers), 1 GiB spare,
    in whole GiB."""
    per_rank = lay.slab_bytes + lay.staging_bytes + 8 * lay.num_groups * lay.max_batch * lay.top_k * 4
    return -(-(ranks * per_rank + GIB) // GIB) * GIB


def _pct(part: int, whole: int) -> int:
    return int(part) * 100 // max(1, int(whole))


PREFETCH_COUNTERS = ("prefetch_hits", "prefetched", "prefetch_wasted")


def _daemon_counts(client, prefetch: bool = False):
    """The daemon's (hits, misses), with ``prefetch`` then :data:`PREFETCH_COUNTERS`; None
    when its stats lack one."""
    s = client.stats()
    keys = ("hits", "misses") + (PREFETCH_COUNTERS if prefetch else ())
    if all(k in s for k in keys):
        return tuple(int(s[k]) for k in keys)
    return None


def run_doorbell(torch, lay: Layout, workloads: dict, opts: Options, out: list,
                 paired_with: list[_Side] | Callable[[], list[_Side]] | None = None) -> None:
    """A private cuda daemon for this batch: the doorbell rank (and the zmq rank, when
    asked: a second rank of the same engine). ``paired_with``: the in-process sides, or
    what opens them once the daemon's pool is filled, timed in turn with the doorbell."""
    batch = lay.max_batch
    want_db = "doorbell" in opts.modes
    want_pf = want_db and "prefetch" in opts.modes
    want_zmq = "zmq" in opts.modes
    if not (want_db or want_zmq):
        return
    arena = arena_bytes(lay, int(want_db) + int(want_pf) + int(want_zmq))
    size = f"{arena // GIB}GiB"
    extra = ["--device-arena-size", size, "--max-slab-bytes", size, "--gather-blocks", str(gather_blocks(opts)),
             "--devices", str(DEVICE)]
    engine = f"bench-decode-b{batch}"
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        d = stack.enter_context(PrivateDaemon(pool_bytes=lay.pool_bytes + DAEMON_POOL_SLACK_BYTES, backend="cuda",
                                              extra_args=extra, log_path=opts.daemon_log,
                                              start_timeout_s=DAEMON_START_TIMEOUT_S))
        say(f"batch {batch}: private cuda daemon up in {time.perf_counter() - t0:.1f} s "
             f"(pool {lay.pool_bytes / 1e9:.1f} GB, arena {size})")
        # The zmq rank (if any) first and the pool filled through it; the doorbell rank
        # attaches after the fill and detaches before the zmq run: while a doorbell rank
        # waits on its engine's bells, other work of the daemon on that GPU may wait
        # behind its parked stream (docs/PERF.md, "Doorbell"), so the two never overlap.
        c = cz = None
        if want_zmq:  # the portable path at its best: fence events and device wait
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
        fill_s = fill_through_staging(filler, lay, torch)
        snap = filler.stats()
        huge = _pct(snap.get("pool_huge_bytes", 0), snap.get("pool_bytes", 0))
        say(f"batch {batch}: wrote {lay.pool_bytes / 1e9:.1f} GB into the daemon's pool ({huge} % in huge pages) "
             f"through WRITE_STAGED in {fill_s:.1f} s ({lay.pool_bytes / 1e9 / max(fill_s, 1e-9):.2f} GB/s)")
        if want_db:
            if callable(paired_with):  # the in-process pools after the daemon's (a failure: every mode's)
                paired_with = paired_with()
            if cz is not None:
                c.attach(lay, engine=engine, transport="doorbell")  # joins: the pool is already written
            guarded(out, "doorbell", batch, workloads,
                     lambda: _run_doorbell_rank(torch, c, lay, workloads, opts, out, fill_s, paired_with, huge))
            left: list = []  # the doorbell rank, once detached
            if want_pf:  # its failure (the attach's too) is the prefetch rows', never zmq's
                guarded(out, "prefetch", batch, workloads,
                         lambda: _run_prefetch_rank(torch, d.run_dir, stack, c, left, engine, lay, workloads, opts, out,
                                                    rank=2 if want_zmq else 1))
            if cz is not None and not left:
                c.detach()
        if want_zmq:
            guarded(out, "zmq", batch, workloads,
                     lambda: _run_zmq_rank(torch, HostSwapIn(cz), cz, lay, workloads, opts, out, fill_s))


def _run_prefetch_rank(torch, run_dir, stack, c, left: list, engine, lay, workloads, opts, out, rank: int) -> None:
    """A rank of its own with prefetch: it joins the engine while the doorbell rank ``c`` is
    still attached (the engine's pool stays written), then ``c`` detaches (``left`` says
    so), and it runs alone (after the doorbell rank, not in turn with it), then leaves."""
    cp = Client(run_dir, rank=rank, device=f"cuda:{DEVICE}", name="bench-decode-prefetch",
                timeout_s=CLIENT_TIMEOUT_S).connect()
    stack.callback(cp.close)
    cp.attach(lay, engine=engine, transport="doorbell", prefetch=True)
    c.detach()
    left.append(c)
    try:
        _run_doorbell_rank(torch, cp, lay, workloads, opts, out, None, mode="prefetch")
    finally:
        cp.detach()


def _run_doorbell_rank(torch, c, lay, workloads, opts, out, fill_s, paired_with=None, huge_pct=None,
                       mode: str = "doorbell") -> None:
    h = c.doorbell_handle()
    try:
        st = _Static(torch, lay, opts.blocks)
        side = _Side(mode, _handle_step(torch, h, st, lay, opts.block_size), st,
                     counts=lambda: _daemon_counts(c, prefetch=mode == "prefetch"), check=h.check, fill_s=fill_s,
                     huge_pct=huge_pct)
        _run_sides(torch, [*(paired_with or ()), side], lay, workloads, opts, out)
    finally:
        torch.cuda.synchronize()  # the stream must not wait on a ready word when the watcher stops
        h.close()


def _run_zmq_rank(torch, hz, cz, lay, workloads, opts, out, fill_s) -> None:
    """The portable handle (HostSwapIn), eager."""
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

        side = _Side("zmq", step, st, counts=lambda: _daemon_counts(cz), check=hz.check, fill_s=fill_s)
        _run_sides(torch, [side], lay, workloads, opts, out, capture=False)
    finally:
        torch.cuda.synchronize()
        hz.close()


def guarded(out: list, modes, batch: int, workloads: dict, fn, label: str = "") -> None:
    """Run ``fn`` for one batch; a failure becomes an error row for each config of
    ``modes`` (a mode or a list) it left out; ``label`` in the message (default: the mode)."""
    modes = [modes] if isinstance(modes, str) else modes
    try:
        fn()
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - one mode failing must not lose the others' figures
        why = f"{type(e).__name__}: {' '.join(str(e).split())}"
        say(f"batch {batch} {label or modes[0] + ' failed'}: {why}")
        error_rows(out, modes, batch, workloads, why)


def error_rows(out: list, modes, batch: int, workloads: dict, why: str) -> None:
    """An error row ``why`` for each (mode of ``modes``, hits) of ``batch`` not in ``out``."""
    done = {(r.mode, r.hits) for r in out if r.batch == batch}
    out.extend(Result(m, batch, h, error=why) for m in modes for h in workloads if (m, h) not in done)
