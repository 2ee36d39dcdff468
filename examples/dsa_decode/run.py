"""Decode loop of the DSA-shaped model (model.py) with its KV rows local or in sparsekv.

    python examples/dsa_decode/run.py                   # both modes side by side, in process
    python examples/dsa_decode/run.py --transport zmq   # sparsekv through a private daemon
    python examples/dsa_decode/run.py --kv sparsekv     # one mode: prints output digests

Requests of different lengths arrive and leave, each with a state row and host blocks
from a shuffled free list. Every step: admit (a stand-in prefill writes the prompt's
rows), ``begin_step``, the model's layers (each ``swap_in`` and ``kv(layer)``), then each
token's new KV rows are written before the next step reads them.

``--kv local``: every KV row in a torch tensor (model.LocalKV); ``--kv sparsekv``: rows
in sparsekv's host pool, read through ``swap_in`` from the hot slab; ``--kv both``: the
two on one schedule, their logits compared every step (they must be bit-identical).
``--slab engine``: sparsekv's hot region inside the engine's own KV-cache tensor, beside
the blocks the engine keeps itself (ResidentBlocks).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
from dataclasses import dataclass, field

import numpy as np

try:
    import torch
except ImportError:  # one line, not a traceback, for a newcomer without it
    sys.exit("examples/dsa_decode needs torch (pip install torch, or make install CUDA=1)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import Batch, Config, DsaModel, LocalKV  # noqa: E402

from sparsekv.client import Client, SparseKVError  # noqa: E402
from sparsekv.client.engine_slab import EngineSlab  # noqa: E402
from sparsekv.embedded.inproc import InprocClient  # noqa: E402
from sparsekv.bench.private_daemon import PrivateDaemon  # noqa: E402
from sparsekv.client.swap_in import HostSwapIn  # noqa: E402
from sparsekv.proto import Layout  # noqa: E402
from sparsekv.proto.layout import LayoutError  # noqa: E402
from sparsekv.proto.slab import SlabGeometry  # noqa: E402


@dataclass(frozen=True)
class RunConfig:
    steps: int = 40
    requests: int = 10
    max_reqs: int = 4  # request state rows = the fixed batch of one step (padded with -1)
    block_size: int = 16
    host_blocks: int = 40  # the host pool: host_blocks * block_size rows per layer
    prompt: tuple[int, int] = (8, 100)  # prompt length range
    new_tokens: tuple[int, int] = (4, 24)  # decoded tokens range
    seed: int = 1


# -- the schedule: the same for every KV mode ------------------------------------------
@dataclass
class Request:
    rid: int
    arrive: int
    prompt: torch.Tensor  # tokens; the last one is the first decode step's input
    new_tokens: int
    state_row: int = -1
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # positions with KV rows
    decoded: int = 0
    last_row: int = -1  # host row written for it since the last step (-1 none)


@dataclass
class Plan:
    """One step's batch as the engine hands it to sparsekv and the model: token b is the
    request in state row b, or padding (-1)."""

    req_ids: torch.Tensor  # int64 [max_reqs]
    positions: torch.Tensor  # int64 [max_reqs]
    block_table: torch.Tensor  # int64 [max_reqs, max_blocks]
    reset: torch.Tensor  # bool [max_reqs]: the state row starts a new request
    invalidate: torch.Tensor  # int64 [max_reqs, 1]: host row rewritten since the last step
    new_rows: torch.Tensor  # int64 [max_reqs]: host row of each token's own KV row, -1 padding
    admitted: list[Request]
    running: dict[int, Request]

    @classmethod
    def of(cls, running: dict, admitted: list, max_reqs: int, max_blocks: int, new_row) -> "Plan":
        """The step of the requests ``running`` (state row -> request), ``admitted`` this
        step (their regions reset), ``new_row(r)``: the host row of r's new token."""
        n = max_reqs
        p = cls(req_ids=torch.full((n,), -1), positions=torch.zeros(n, dtype=torch.long),
                block_table=torch.full((n, max_blocks), -1), reset=torch.zeros(n, dtype=torch.bool),
                invalidate=torch.full((n, 1), -1), new_rows=torch.full((n,), -1), admitted=admitted,
                running=dict(running))
        new = {r.rid for r in admitted}
        for s, r in running.items():
            p.req_ids[s], p.positions[s] = s, r.length
            p.block_table[s, : len(r.blocks)] = torch.tensor(r.blocks)
            p.reset[s] = r.rid in new
            p.invalidate[s, 0] = r.last_row
            p.new_rows[s] = new_row(r)
        return p


class Scheduler:
    """Arrivals, state rows and host blocks (allocated whole at admission, freed LIFO)."""

    def __init__(self, rc: RunConfig, vocab: int):
        self.rc = rc
        g = torch.Generator().manual_seed(rc.seed)

        def draw(lo, hi):
            return int(torch.randint(lo, hi + 1, (1,), generator=g))

        self.max_blocks = self.blocks_per_request(rc)
        self.waiting = []
        for i in range(rc.requests):
            arrive = draw(0, rc.steps * 2 // 3) if i else 0
            prompt = torch.randint(vocab, (draw(*rc.prompt) + 1,), generator=g)
            self.waiting.append(Request(i, arrive, prompt, draw(*rc.new_tokens)))
        self.waiting.sort(key=lambda r: r.arrive)
        self.free_rows = list(range(rc.max_reqs))
        self.free_blocks = torch.randperm(rc.host_blocks, generator=g).tolist()
        self.used_blocks: set[int] = set()  # every block handed out so far
        self.reused_blocks = 0  # blocks handed out again after a request left
        self.running: dict[int, Request] = {}

    @staticmethod
    def blocks_per_request(rc: RunConfig) -> int:
        """Columns of the block table: the blocks of the longest request."""
        return -(-(rc.prompt[1] + rc.new_tokens[1]) // rc.block_size)

    def plan(self, step: int) -> Plan:
        rc, admitted = self.rc, []
        while self.waiting and self.waiting[0].arrive <= step and self.free_rows:
            r = self.waiting[0]
            need = -(-(len(r.prompt) + r.new_tokens) // rc.block_size)
            if need > len(self.free_blocks):
                break
            self.waiting.pop(0)
            r.state_row = self.free_rows.pop(0)
            r.blocks = [self.free_blocks.pop() for _ in range(need)]
            self.reused_blocks += len(self.used_blocks.intersection(r.blocks))
            self.used_blocks.update(r.blocks)
            r.length = len(r.prompt) - 1  # the prefill writes all but the last prompt token
            self.running[r.state_row] = r
            admitted.append(r)
        return Plan.of(self.running, admitted, rc.max_reqs, self.max_blocks, lambda r: self.row_of(r, r.length))

    def row_of(self, r: Request, position: int) -> int:
        return r.blocks[position // self.rc.block_size] * self.rc.block_size + position % self.rc.block_size

    def prompt_rows(self, r: Request) -> torch.Tensor:
        return torch.tensor([self.row_of(r, pos) for pos in range(r.length)], dtype=torch.long)

    def finish(self, p: Plan) -> list[Request]:
        """After the step: one more position each; requests done leave (blocks and state
        row back to the free lists)."""
        left = []
        for s, r in list(self.running.items()):
            r.last_row = int(p.new_rows[s])
            r.length += 1
            r.decoded += 1
            if r.decoded == r.new_tokens:
                del self.running[s]
                self.free_blocks.extend(reversed(r.blocks))  # LIFO: the next request gets them
                self.free_rows.append(s)
                left.append(r)
        return left


# -- one KV mode -------------------------------------------------------------------------
class Engine:
    """The model, the handle its attention reads through, and where new rows go."""

    def __init__(self, name: str, model: DsaModel, handle, write, host_rows: int, resident=None, blocks=None):
        self.name, self.model, self.handle, self.write = name, model, handle, write
        self.blocks = blocks  # the engine's block store (client.blocks) when attached with a block size
        self.resident = resident  # ResidentBlocks: --slab engine keeps each request's newest block itself
        self.device = model.cfg.device
        self.index_keys = torch.zeros((model.cfg.num_layers, host_rows, model.cfg.index_dim), device=self.device)
        self.next_token: dict[int, int] = {}  # request -> its next input token

    def prefill(self, r: Request, rows: torch.Tensor) -> None:
        rows = rows.to(self.device)
        kv_rows, keys = self.model.prompt_rows(r.prompt[:-1].to(self.device))
        self.write(rows, kv_rows)
        if self.resident is not None:
            self.resident.admit(r.state_row, kv_rows)
        self.index_keys[:, rows] = keys
        self.next_token[r.rid] = int(r.prompt[-1])

    def step(self, p: Plan, block_size: int) -> torch.Tensor:
        """One decode step; returns the logits of the live tokens [n, vocab] (on the CPU)."""
        dev = self.device
        self.handle.begin_step(p.req_ids.to(dev), reset=p.reset.to(dev), invalidate=p.invalidate.to(dev))
        tokens = torch.tensor([self.next_token[p.running[s].rid] if s in p.running else 0
                               for s in range(len(p.req_ids))])
        batch = Batch(tokens.to(dev), p.req_ids.to(dev), p.positions.to(dev), p.block_table.to(dev), block_size)
        if self.resident is not None:
            self.resident.begin(p)
        out = self.model.decode_step(batch, self.handle, self.index_keys)
        live = (p.req_ids >= 0).to(dev)
        rows = p.new_rows.to(dev)[live]
        # New rows land before the next step reads them (this step read its own rows
        # directly: each token attends to the rows it just made).
        self.write(rows, out.kv_rows[:, live])
        if self.resident is not None:
            self.resident.append(p, out.kv_rows)
        self.index_keys[:, rows] = out.index_keys[:, live]
        logits = out.logits[live].cpu()
        for s, tok in zip(p.req_ids[p.req_ids >= 0].tolist(), logits.argmax(1).tolist()):
            self.next_token[p.running[s].rid] = tok  # greedy
        return logits


class DeviceHandle:
    """The doorbell handle takes contiguous int32 tensors on its GPU; the model's are
    int64: convert here (an engine would keep int32 tensors and skip this)."""

    def __init__(self, h):
        self.h = h

    def begin_step(self, state_rows, reset=None, invalidate=None) -> None:
        self.h.begin_step(state_rows.int().contiguous(), None if reset is None else reset.contiguous(),
                          None if invalidate is None else invalidate.int().contiguous())

    def swap_in(self, req_id_per_token, block_table, logical_topk_indices, *, layer, block_size,
                resident_block_table=None):
        res = None if resident_block_table is None else resident_block_table.int().contiguous()
        return self.h.swap_in(req_id_per_token.int().contiguous(), block_table.int().contiguous(),
                              logical_topk_indices.int().contiguous(), layer=layer, block_size=block_size,
                              resident_block_table=res)

    def __getattr__(self, name):  # kv, check
        return getattr(self.h, name)

    def close(self) -> None:
        torch.cuda.synchronize()  # nothing may wait on a ready word once the watcher stops
        self.h.close()


class ResidentBlocks:
    """``--slab engine``: the engine's own KV cache, one tensor with sparsekv's hot region
    inside. Per layer: ``max_reqs`` resident blocks (state row ``s``'s is block ``s``: the
    request's newest logical block, written by the engine itself), then the hot blocks
    the daemon gathers into; the model reads ``kv(layer)[idx]`` whichever holds the row.
    The resident block table names the logical block each request holds (not fetched);
    every row goes to the host pool too, read through the hot region once the request
    moves on to its next block."""

    def __init__(self, layout: Layout, rc: RunConfig, max_blocks: int, device):
        self.bs, self.R = rc.block_size, rc.max_reqs
        hot_rows = layout.max_reqs * layout.region_stride
        if hot_rows % self.bs:
            raise SystemExit(f"--slab engine: max_reqs * region_stride ({hot_rows}) must be whole blocks of "
                             f"{self.bs} rows")
        self.layer_rows = self.R * self.bs + hot_rows
        layer_bytes = self.layer_rows * layout.row_bytes
        self.nbytes = layout.num_layers * layer_bytes
        self.geometry = SlabGeometry.paged(layout, [layer * layer_bytes for layer in range(layout.num_layers)],
                                           first_block=self.R, block_size=self.bs, buffer_bytes=self.nbytes)
        self.hot_base = self.R * self.bs
        self.table = torch.full((rc.max_reqs, max_blocks), -1, dtype=torch.long, device=device)
        self.current = torch.full((rc.max_reqs,), -1, dtype=torch.long)  # logical block held, per state row
        self.storage = None  # [layers, layer_rows, 656] uint8, the engine's KV cache (set by attach)
        self.reads = 0  # indices swap_in returned into resident blocks

    def allocate(self, layout: Layout, device) -> EngineSlab:
        """The engine's KV cache (shared memory on the CPU, a torch tensor on the GPU),
        with the geometry of its hot blocks: what ``client.attach(..., slab=)`` takes."""
        if str(device).startswith("cuda"):
            buf = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
            slab = EngineSlab.from_tensor(buf)
        else:
            slab = EngineSlab.shared_memory(self.nbytes)
            buf = torch.from_numpy(slab.array)
        self.storage = buf.view(layout.num_layers, self.layer_rows, layout.row_bytes)
        return slab.with_geometry(self.geometry)

    def _hold(self, s: int, block: int) -> None:
        if int(self.current[s]) >= 0:
            self.table[s, int(self.current[s])] = -1
        self.current[s] = block
        if block >= 0:
            self.table[s, block] = s

    def admit(self, s: int, kv_rows: torch.Tensor) -> None:
        """A request starts in state row ``s`` with its prompt's rows ``[layers, n, 656]``:
        its last block's rows go to resident block ``s``."""
        self.table[s] = -1
        self.current[s] = -1
        n = kv_rows.shape[1]
        if n == 0:
            return
        last = (n - 1) // self.bs
        self._hold(s, last)
        self.storage[:, s * self.bs: s * self.bs + n - last * self.bs] = kv_rows[:, last * self.bs:]

    def begin(self, p: Plan) -> None:
        for s in range(self.R):
            if s not in p.running and int(self.current[s]) >= 0:
                self._hold(s, -1)  # the request left: nothing held

    def append(self, p: Plan, kv_rows: torch.Tensor) -> None:
        """After a step: each live token's new row (position ``p.positions[s]``) in its
        request's resident block; a row that starts a block moves the block there."""
        for s in p.running:
            pos = int(p.positions[s])
            block = pos // self.bs
            if block != int(self.current[s]):
                self._hold(s, block)
            self.storage[:, s * self.bs + pos % self.bs] = kv_rows[:, s]


class EngineKV:
    """The handle the model reads through with ``--slab engine``: sparsekv's ``swap_in``
    with the engine's resident block table added."""

    def __init__(self, h, resident: ResidentBlocks):
        self.h, self.resident = h, resident

    def __getattr__(self, name):  # begin_step, kv, check, close, counts
        return getattr(self.h, name)

    def swap_in(self, req_id_per_token, block_table, logical_topk_indices, *, layer, block_size):
        idx = self.h.swap_in(req_id_per_token, block_table, logical_topk_indices, layer=layer,
                             block_size=block_size, resident_block_table=self.resident.table)
        # Rows read in place, for the report (on a GPU this waits for the stream).
        i = torch.as_tensor(idx)
        self.resident.reads += int(((i >= 0) & (i < self.resident.hot_base)).sum())
        return idx


def _counts(handle) -> dict | None:
    """The hits and misses so far where the handle counts them (the portable handle's;
    the doorbell handle and the local KV keep none)."""
    while isinstance(handle, (DeviceHandle, EngineKV)):
        handle = handle.h
    return dict(handle.counts) if isinstance(handle, HostSwapIn) else None


def layout_for(cfg: Config, rc: RunConfig) -> Layout:
    return Layout(num_layers=cfg.num_layers, row_bytes=656, top_k=cfg.top_k, region_stride=2 * cfg.top_k,
                  max_reqs=rc.max_reqs, host_rows=rc.host_blocks * rc.block_size, index_groups=cfg.groups).validate()


def private_daemon(layout: Layout, on_gpu: bool, engines: int = 1) -> PrivateDaemon:
    """A private sparsekvd with room for ``engines`` engines of ``layout``: a cuda one for
    a model on the GPU (its hot rows on the model's GPU)."""
    extra = ["--device-arena-size", "1GiB"] if on_gpu else []
    return PrivateDaemon(pool_bytes=max(64 << 20, 2 * engines * layout.pool_bytes),
                         backend="cuda" if on_gpu else "cpu", extra_args=extra)


@contextlib.contextmanager
def sparsekv_engine(model: DsaModel, rc: RunConfig, transport: str, run_dir: str | None = None,
                    slab: str = "daemon", max_blocks: int = 0, engine: str | None = None, block_size: int = 0,
                    index_bytes: int = 0):
    """An Engine whose KV rows live in sparsekv: connect, attach (to ``engine``, default a
    name of this process's own: the ranks of one engine share its host rows, so two runs on
    one daemon must not share one; with a
    block store of blocks of ``block_size`` rows when > 0, whose blocks have an indexer
    keys plane of ``index_bytes`` a position and layer when > 0), wrap in a handle.
    ``slab="engine"``: the hot region inside the engine's own KV cache (ResidentBlocks)."""
    layout = layout_for(model.cfg, rc)
    engine = engine if engine is not None else f"dsa-example-{os.getpid()}"
    with contextlib.ExitStack() as stack:
        if slab == "engine" and transport == "inproc":
            raise SystemExit("--slab engine gives the engine's memory to a daemon: use --transport zmq or doorbell")
        on_gpu = str(model.cfg.device).startswith("cuda")
        if transport == "doorbell" and not on_gpu:
            raise SystemExit("--transport doorbell runs the model on the GPU: add --device cuda:0")
        if transport == "inproc":
            client = stack.enter_context(InprocClient(backend="cpu"))
        else:  # zmq (HostSwapIn) or doorbell (the device handle, on the model's own CUDA stream)
            if run_dir is None:
                run_dir = stack.enter_context(private_daemon(layout, on_gpu)).run_dir
            client = stack.enter_context(Client(run_dir, name="dsa-example",
                                                device=str(model.cfg.device) if on_gpu else "cpu"))
        resident = None
        if slab == "engine":
            resident = ResidentBlocks(layout, rc, max_blocks, model.cfg.device)
            engine_slab = resident.allocate(layout, model.cfg.device)
            stack.callback(engine_slab.close)
            client.attach(layout, engine=engine, transport="doorbell" if transport == "doorbell" else "zmq",
                          slab=engine_slab, block_size=block_size, index_bytes=index_bytes)
        elif transport == "doorbell":
            client.attach(layout, engine=engine, transport="doorbell", block_size=block_size, index_bytes=index_bytes)
        elif on_gpu:  # zmq with fence events: the top-k goes from the GPU, no wait on the host
            client.attach(layout, engine=engine, fence=True, block_size=block_size, index_bytes=index_bytes)
        else:
            client.attach(layout, engine=engine, block_size=block_size, index_bytes=index_bytes)
        hot_base = resident.hot_base if resident is not None else 0
        if transport == "doorbell":
            handle = DeviceHandle(client.doorbell_handle(hot_base=hot_base))
            stack.callback(handle.close)
        else:
            handle = stack.enter_context(HostSwapIn(client, hot_base=hot_base))
        if resident is not None:
            handle = EngineKV(handle, resident)

        def write(rows: torch.Tensor, data: torch.Tensor) -> None:
            client.write(rows.cpu().numpy().astype(np.int32), data.cpu().numpy())  # all layers

        yield Engine("sparsekv", model, handle, write, layout.host_rows, resident,
                     client.blocks if block_size else None)  # (no block size: no store, NotAttached)
        handle.check()


@dataclass
class Result:
    logits: dict[str, list[torch.Tensor]]  # mode -> per step [live tokens, vocab]
    equal: bool | None  # --kv both: every step bit-identical
    max_abs_diff: float | None
    reused_blocks: int
    counts: dict | None  # sparsekv's hits / misses / out_of_range
    resident_reads: int | None = None  # --slab engine: rows read from the engine's resident blocks


def run(cfg: Config, rc: RunConfig, kv: str = "both", transport: str = "inproc", run_dir: str | None = None,
        out=print, slab: str = "daemon") -> Result:
    model = DsaModel(cfg)
    host_rows = rc.host_blocks * rc.block_size
    modes = ["local", "sparsekv"] if kv == "both" else [kv]
    with contextlib.ExitStack() as stack:
        engines = []
        for mode in modes:
            if mode == "local":
                local = LocalKV(cfg.num_layers, host_rows, cfg.device)
                engines.append(Engine("local", model, local, local.write, host_rows))
            else:
                engines.append(stack.enter_context(sparsekv_engine(model, rc, transport, run_dir, slab,
                                                                   Scheduler.blocks_per_request(rc))))
        sched = Scheduler(rc, cfg.vocab)
        logits = {e.name: [] for e in engines}
        worst, equal = 0.0, True
        for step in range(rc.steps):
            p = sched.plan(step)
            for r in p.admitted:
                rows = sched.prompt_rows(r)
                for e in engines:
                    e.prefill(r, rows)
            before = _counts(engines[-1].handle) or {}
            for e in engines:
                logits[e.name].append(e.step(p, rc.block_size))
            left = sched.finish(p)
            line = f"step {step:3d}  running {len(p.running)} (+{len(p.admitted)} new, -{len(left)} left)"
            counts = _counts(engines[-1].handle)
            if counts:
                line += f"  hits {counts['hits'] - before['hits']:4d} misses {counts['misses'] - before['misses']:4d}"
            if len(engines) == 2:
                a, b = logits["local"][-1], logits["sparsekv"][-1]
                same = torch.equal(a, b)
                diff = float((a - b).abs().max()) if a.numel() else 0.0
                equal &= same
                worst = max(worst, diff)
                line += f"  max|local - sparsekv| {diff:.3g} {'equal' if same else 'DIFFERENT'}"
            else:
                line += f"  digest {_digest(logits[modes[0]][-1])}"
            out(line)
        counts = _counts(engines[-1].handle)
        resident = engines[-1].resident
        resident_reads = resident.reads if resident is not None else None
    out(f"requests: {rc.requests - len(sched.waiting)} admitted, {len(sched.running)} still running; "
        f"host blocks handed out again after their request left: {sched.reused_blocks}"
        + (f"; sparsekv: {counts}" if counts else "")
        + (f"; rows read from the engine's resident blocks: {resident_reads}" if resident_reads is not None else ""))
    if len(engines) == 2:
        out(f"outputs {'equal' if equal else 'NOT equal'}: local vs sparsekv over {rc.steps} steps, "
            f"max abs diff {worst:.3g}")
        return Result(logits, equal, worst, sched.reused_blocks, counts, resident_reads)
    out(f"outputs digest ({modes[0]}, {rc.steps} steps): {_digest(*logits[modes[0]])}")
    return Result(logits, None, None, sched.reused_blocks, counts, resident_reads)


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv", choices=["local", "sparsekv", "both"], default="both")
    ap.add_argument("--transport", choices=["inproc", "zmq", "doorbell"], default="inproc",
                    help="sparsekv in this process, through a daemon (a private one unless --run-dir), "
                         "or the device handle")
    ap.add_argument("--run-dir", help="an existing sparsekvd's run dir (--transport zmq or doorbell; a cuda one for a model on the GPU)")
    ap.add_argument("--slab", choices=["daemon", "engine"], default="daemon",
                    help="engine: the hot region inside the engine's own KV cache, beside the resident blocks "
                         "it keeps itself (--transport zmq or doorbell)")
    ap.add_argument("--device", default="cpu", help="where the model runs (cuda:0 with --transport doorbell; zmq takes either, "
                         "a private daemon of the matching backend)")
    ap.add_argument("--steps", type=int, default=RunConfig.steps)
    ap.add_argument("--requests", type=int, default=RunConfig.requests)
    ap.add_argument("--layers", type=int, default=Config.num_layers)
    ap.add_argument("--layers-per-indexer", type=int, default=Config.layers_per_indexer)
    ap.add_argument("--top-k", type=int, default=Config.top_k)
    ap.add_argument("--seed", type=int, default=RunConfig.seed)
    a = ap.parse_args(argv)
    for name in ("steps", "requests", "layers", "layers_per_indexer", "top_k"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.layers_per_indexer > a.layers:
        ap.error(f"--layers-per-indexer {a.layers_per_indexer} is more than --layers {a.layers}")
    if a.run_dir and a.transport == "inproc":
        ap.error("--run-dir names a daemon: add --transport zmq or doorbell")
    cfg = Config(num_layers=a.layers, top_k=a.top_k, layers_per_indexer=a.layers_per_indexer, seed=a.seed,
                 device=a.device)
    rc = RunConfig(steps=a.steps, requests=a.requests, seed=a.seed)
    try:
        layout_for(cfg, rc)
    except LayoutError as e:  # e.g. a top-k the hot regions cannot hold
        ap.error(str(e))
    res = run(cfg, rc, a.kv, a.transport, a.run_dir, slab=a.slab)
    return 0 if res.equal in (True, None) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SparseKVError as e:  # no daemon at --run-dir, a refusal: one line (2: not a comparison)
        print(f"run.py: {e}", file=sys.stderr)
        sys.exit(2)
