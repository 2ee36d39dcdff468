"""Requests that share a long system prompt, served from sparsekv's block store (DESIGN §9),
and an engine process killed and restarted mid-run.

    python examples/dsa_decode/prefix.py                     # cpu: a private sparsekvd, the model on the CPU
    python examples/dsa_decode/prefix.py --device cuda:0 --transport doorbell   # GPU: a private cuda sparsekvd
    python examples/dsa_decode/prefix.py --run-dir /tmp/skv  # a running sparsekvd

Every request is one system prompt (``--system-blocks`` blocks) followed by a tail of its
own. The same requests are served twice on one schedule, each time by two engine
lifetimes: the first serves up to ``--kill-at`` steps, the second serves every request
the first did not finish, from its start.

1. Without the block store (in this process): each request's prompt is prefilled whole
   into blocks of its own; the first lifetime ends at the kill step.
2. With the block store (``attach(..., block_size=)``), in engine processes of their own:
   a request looks its prompt's full blocks up (``lookup`` of their chain hashes),
   reserves the blocks it misses, points its block table at the blocks found and reads
   their indexer keys from the store (``read_keys``), allocates the rest, prefills only those, writes the
   indexer keys of its full prompt blocks (``write_keys``) and commits them; it releases
   its table when done. The first process is SIGKILLed at the kill step with requests in flight (pins
   and blocks held); a new process attaches to the same engine name, finds the prompt
   blocks and prefills only what they miss.

Counted per lifetime: prompt tokens prefilled (KV rows and indexer keys computed and
written), those of the system prompt, tokens served from the store, and positions whose
indexer keys were read from the store (the blocks' second plane, DESIGN §9: an engine
reads them for blocks it did not write itself, or wrote in an earlier process). The
outputs (each request's logits, every step) of the two runs must be equal, bit for bit.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import Config, DsaModel  # noqa: E402
from run import Engine, Plan, Request, RunConfig, Scheduler, layout_for, private_daemon, sparsekv_engine  # noqa: E402

from sparsekv.client import Client, SparseKVError  # noqa: E402

ENGINE_NO_STORE = "dsa-prefix-no-store"
COUNTS = ("admitted", "done", "prefilled", "prefilled_system", "cached", "index_keys_read", "lookups")
BLOCK_COUNTERS = ("block_lookups", "block_hits", "block_hit_tokens", "block_commits", "block_evictions",
                  "block_keys_bytes_written", "block_keys_bytes_read")


@dataclass(frozen=True)
class PrefixConfig:
    requests: int = 8
    system_blocks: int = 6  # the shared system prompt, in blocks of block_size tokens
    tail: tuple[int, int] = (1, 40)  # each request's own prompt tokens (range)
    new_tokens: tuple[int, int] = (4, 12)  # decoded tokens (range)
    max_reqs: int = 3  # request state rows: the fixed batch of a step
    block_size: int = 16
    host_blocks: int = 96  # room for a killed engine's blocks until the daemon reaps it
    kill_at: int = 10  # the first engine lifetime runs this many steps
    seed: int = 2

    @property
    def system_tokens(self) -> int:
        return self.system_blocks * self.block_size

    def run_config(self) -> RunConfig:
        """What run.py's layout and engine take."""
        return RunConfig(max_reqs=self.max_reqs, block_size=self.block_size, host_blocks=self.host_blocks,
                         prompt=(self.system_tokens + self.tail[0], self.system_tokens + self.tail[1]),
                         new_tokens=self.new_tokens, seed=self.seed)


def namespace(cfg: Config) -> str:
    """The engine name of the run with the store, its namespace: it names the model (its
    config, weights' seed and device included), so that a daemon that outlives this run
    never serves one model's blocks to another."""
    return "dsa-prefix-" + hashlib.sha256(json.dumps(dataclasses.asdict(cfg)).encode()).hexdigest()[:12]


def index_bytes(cfg: Config) -> int:
    """Bytes of one position's indexer key in one layer (float32 ``index_dim``): the
    store's keys plane holds them as bytes."""
    return cfg.index_dim * 4


def make_requests(pc: PrefixConfig, vocab: int) -> list[Request]:
    """The run's requests, the same for the same seed: the system prompt plus a tail each."""
    g = torch.Generator().manual_seed(pc.seed)

    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    system = torch.randint(vocab, (pc.system_tokens,), generator=g)
    return [Request(i, 0, torch.cat([system, torch.randint(vocab, (draw(*pc.tail),), generator=g)]),
                    draw(*pc.new_tokens)) for i in range(pc.requests)]


class Lifetime:
    """One engine lifetime's scheduler: state rows, each request's block table (from the
    engine's block store when it has one, else from a free list of its own) and the
    prefill of what the store does not hold."""

    def __init__(self, engine: Engine, pc: PrefixConfig):
        self.e, self.pc, self.store = engine, pc, engine.blocks
        self.max_blocks = Scheduler.blocks_per_request(pc.run_config())  # the block table's columns
        self.free_rows = list(range(pc.max_reqs))
        self.free_blocks = list(range(pc.host_blocks))  # without a store
        self.running: dict[int, Request] = {}
        self.keys_of: dict[int, bytes] = {}  # block -> the hash whose indexer keys this engine holds there
        self.counts = dict.fromkeys(COUNTS, 0)

    def rows(self, r: Request, start: int, end: int) -> torch.Tensor:
        bs = self.pc.block_size
        return torch.tensor([r.blocks[p // bs] * bs + p % bs for p in range(start, end)], dtype=torch.long)

    def admit(self, r: Request) -> None:
        bs, store, c = self.pc.block_size, self.store, self.counts
        n = len(r.prompt) - 1  # positions the prefill writes: the last token is the first step's input
        need, full = -(-(len(r.prompt) + r.new_tokens) // bs), n // bs
        if store is None:
            hit, own, keys = [], self.free_blocks[:need], None
            del self.free_blocks[:need]
        else:
            keys = store.hashes(r.prompt[: full * bs].numpy())
            hit = store.lookup(keys).tolist()  # a block this engine pins already costs nothing
            store.reserve(need - len(hit))  # PoolExhausted: the pool is too small for this run
            own = store.alloc(need - len(hit)).tolist()
            c["lookups"] += 1
        r.state_row, r.blocks, r.length = self.free_rows.pop(0), hit + own, n
        for b in own:
            self.keys_of.pop(b, None)
        model, dev = self.e.model, self.e.device
        # The store's rows are read where they lie; the indexer keys of the hits this engine
        # does not hold already come from the store's keys plane into its own.
        need = [i for i, b in enumerate(hit) if self.keys_of.get(b) != keys[i].tobytes()]
        if need:
            got = torch.from_numpy(store.read_keys([hit[i] for i in need]).view(np.float32)).to(dev)
            rows = torch.cat([self.rows(r, i * bs, (i + 1) * bs) for i in need]).to(dev)
            self.e.index_keys[:, rows] = got.transpose(0, 1).reshape(model.cfg.num_layers, -1, model.cfg.index_dim)
            self.keys_of.update((hit[i], keys[i].tobytes()) for i in need)
            c["index_keys_read"] += len(need) * bs
        h = len(hit) * bs
        if n > h:  # the prefill of what the store did not have, a block at a time: each
            # block's rows come from a computation of the same shape with or without the
            # store (a matrix product's rows may round differently with its row count).
            chunks = [model.prompt_rows(r.prompt[a:min(a + bs, n)].to(dev)) for a in range(h, n, bs)]
            rows = self.rows(r, h, n).to(dev)
            self.e.write(rows, torch.cat([kv for kv, _ in chunks], 1))
            self.e.index_keys[:, rows] = torch.cat([keys for _, keys in chunks], 1)
        if store is not None and full > len(hit):
            mine, new_keys = own[: full - len(hit)], keys[len(hit):]
            # Their indexer keys [blocks, layers, block_size, index_dim] first: committed with them.
            plane = torch.stack([k for _, k in chunks[: len(mine)]])
            store.write_keys(mine, plane.cpu().numpy().view(np.uint8))
            held = store.commit(mine, new_keys).tolist()
            self.keys_of.update((b, k.tobytes()) for b, k, w in zip(mine, new_keys, held) if b == w)
        self.e.next_token[r.rid] = int(r.prompt[-1])
        c["admitted"] += 1
        c["prefilled"] += n - h
        c["prefilled_system"] += max(0, min(n, self.pc.system_tokens) - h)
        c["cached"] += h

    def plan(self, admitted: list[Request]) -> Plan:
        return Plan.of(self.running, admitted, self.pc.max_reqs, self.max_blocks,
                       lambda r: self.rows(r, r.length, r.length + 1)[0])

    def finish(self, r: Request) -> None:
        """``r`` is done: its blocks released (cached ones stay cached), its state row free."""
        if self.store is None:
            self.free_blocks = sorted(self.free_blocks + r.blocks)
        else:
            self.store.release(r.blocks)
        del self.running[r.state_row]
        self.free_rows = sorted(self.free_rows + [r.state_row])
        self.counts["done"] += 1


def serve(engine: Engine, pc: PrefixConfig, requests: list[Request], stop_at: int | None = None,
          out=print) -> dict:
    """Serve ``requests`` (all waiting at step 0) until done, or ``stop_at`` steps. Each
    finished request is ``out({"done": rid, "digest": sha256 of its logits, "tokens":
    ...})``. Returns the lifetime's counts and ``in_flight``: requests running at the stop."""
    life, waiting, logits = Lifetime(engine, pc), list(requests), {}
    step = 0
    while (waiting or life.running) and step != stop_at:
        admitted = []
        while waiting and life.free_rows:
            r = waiting.pop(0)
            life.admit(r)
            life.running[r.state_row] = r
            admitted.append(r)
            logits[r.rid] = []
        p = life.plan(admitted)
        step_logits = engine.step(p, pc.block_size)
        for i, s in enumerate(sorted(life.running)):  # the live tokens, by state row
            r = life.running[s]
            logits[r.rid].append(step_logits[i])
            r.last_row, r.length, r.decoded = int(p.new_rows[s]), r.length + 1, r.decoded + 1
            if r.decoded == r.new_tokens:
                life.finish(r)
                done = torch.stack(logits.pop(r.rid))
                out({"done": r.rid, "digest": hashlib.sha256(done.numpy().tobytes()).hexdigest(),
                     "tokens": done.argmax(1).tolist()})
        step += 1
    return {**life.counts, "steps": step, "in_flight": len(life.running)}


# -- the driver ----------------------------------------------------------------------------
@dataclass
class Result:
    outputs: dict[str, dict[int, dict]]  # run ("no_store", "store") -> request -> {"digest", "tokens"}
    lifetimes: dict[str, list[dict]]  # run -> each engine lifetime's counts
    block_counters: dict[str, int]  # the daemon's, over the run with the store
    equal: bool


def _lifetime_in_process(cfg, pc, transport, run_dir, rids, stop_at, outputs) -> dict:
    """An engine lifetime without the block store, in this process; it ends at ``stop_at``."""
    reqs = [r for r in make_requests(pc, cfg.vocab) if r.rid in rids]
    with sparsekv_engine(DsaModel(cfg), pc.run_config(), transport, run_dir,
                         engine=f"{ENGINE_NO_STORE}-{os.getpid()}") as e:  # (its rows: this run's alone)
        return serve(e, pc, reqs, stop_at, out=lambda d: outputs.update({d["done"]: d}))


def _lifetime_process(cfg, pc, transport, run_dir, rids, stop_at, outputs) -> dict:
    """An engine process with the block store; at ``stop_at`` it pauses and is SIGKILLed."""
    spec = {"cfg": dataclasses.asdict(cfg), "pc": dataclasses.asdict(pc), "transport": transport,
            "run_dir": run_dir, "rids": rids, "stop_at": stop_at, "threads": torch.get_num_threads(),
            "t0": time.time()}
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--engine-process", json.dumps(spec)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        for line in p.stdout:
            msg = json.loads(line)
            if "done" in msg:
                outputs[msg["done"]] = msg
            elif "paused" in msg:
                os.kill(p.pid, signal.SIGKILL)  # mid-run: requests in flight, their pins and blocks held
                p.wait()
                return {**msg["paused"], "pid": p.pid, "killed": True}
            elif "end" in msg:
                p.wait()
                return {**msg["end"], "pid": p.pid}
        raise SystemExit(f"the engine process ended (exit status {p.wait()}) before its run did; "
                         "its stderr is above")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _block_counters(run_dir: str) -> dict:
    with Client(run_dir, name="dsa-prefix-stats") as c:
        stats = c.stats()
    return {k: stats.get(k, 0) for k in BLOCK_COUNTERS}


def run(cfg: Config, pc: PrefixConfig, transport: str = "zmq", run_dir: str | None = None, out=print) -> Result:
    """Both runs (module docstring) through the daemon at ``run_dir`` (a private one when
    None); prints what each engine lifetime did and whether the outputs are equal."""
    on_gpu = str(cfg.device).startswith("cuda")
    if transport == "doorbell" and not on_gpu:
        raise SystemExit("--transport doorbell runs the model on the GPU: add --device cuda:0")
    rids = [r.rid for r in make_requests(pc, cfg.vocab)]
    outputs, lifetimes = {"no_store": {}, "store": {}}, {"no_store": [], "store": []}
    with contextlib.ExitStack() as stack:
        if run_dir is None:
            run_dir = stack.enter_context(private_daemon(layout_for(cfg, pc.run_config()), on_gpu, engines=2)).run_dir
        for name, lifetime in (("no_store", _lifetime_in_process), ("store", _lifetime_process)):
            before = _block_counters(run_dir)  # the last one read: before the run with the store
            first = lifetime(cfg, pc, transport, run_dir, rids, pc.kill_at, outputs[name])
            rest = [i for i in rids if i not in outputs[name]]
            lifetimes[name] = [first, lifetime(cfg, pc, transport, run_dir, rest, None, outputs[name])]
        after = _block_counters(run_dir)
    counters = {k: after[k] - before[k] for k in BLOCK_COUNTERS}
    equal = outputs["store"] == outputs["no_store"] and sorted(outputs["store"]) == rids
    for name, title in (("no_store", "without the block store (this process)"),
                        ("store", f"with the block store (engine processes, engine {namespace(cfg)})")):
        out(f"{title}: {pc.requests} requests, a system prompt of {pc.system_tokens} tokens and a tail each")
        for i, c in enumerate(lifetimes[name]):
            how = (f"killed (SIGKILL) after {c['steps']} steps with {c['in_flight']} requests in flight"
                   if c.get("killed") else f"stopped after {c['steps']} steps" if i == 0 and c["in_flight"]
                   else f"{c['steps']} steps")
            started = f", attached {c['attached_s']:.2f} s after its process started" if "attached_s" in c else ""
            pid = f" (pid {c['pid']})" if "pid" in c else ""
            out(f"  engine {i + 1}{pid}: {how}{started}; "
                f"{c['admitted']} admitted, {c['done']} done; prompt tokens prefilled {c['prefilled']} (system prompt "
                f"{c['prefilled_system']}), served from the store {c['cached']}, indexer keys read from it "
                f"{c['index_keys_read']}")
    out("daemon's block counters over the run with the store: "
        + ", ".join(f"{k} {v}" for k, v in counters.items()))
    sys_prefills = {name: sum(c["prefilled_system"] for c in lifetimes[name]) / pc.system_tokens for name in lifetimes}
    restarted = bool(lifetimes["store"][0].get("killed"))
    out(f"system prompt prefilled {sys_prefills['no_store']:g} times without the store, "
        f"{sys_prefills['store']:g} with it "
        + ("(across the restart)" if restarted else "(no restart: the first engine ended every request before "
           "--kill-at)"))
    out(f"outputs {'equal, bit for bit' if equal else 'NOT equal'}: {len(outputs['store'])} of {pc.requests} "
        "requests, the sha256 of each request's logits over all its steps")
    return Result(outputs, lifetimes, counters, equal)


def engine_process(spec: dict) -> None:
    """An engine lifetime with the block store: one JSON line per finished request, then
    ``{"paused": counts}`` (and it waits to be killed) or ``{"end": counts}``."""
    torch.set_num_threads(spec["threads"])
    cfg = Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["cfg"].items()})
    pc = PrefixConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["pc"].items()})
    model = DsaModel(cfg)
    reqs = [r for r in make_requests(pc, cfg.vocab) if r.rid in spec["rids"]]

    def out(msg):
        print(json.dumps(msg), flush=True)

    with sparsekv_engine(model, pc.run_config(), spec["transport"], spec["run_dir"], engine=namespace(cfg),
                         block_size=pc.block_size, index_bytes=index_bytes(cfg)) as e:
        attached_s = time.time() - spec["t0"]
        counts = {**serve(e, pc, reqs, spec["stop_at"], out), "attached_s": attached_s}
        if counts["in_flight"] and spec["stop_at"] is not None:
            out({"paused": counts})
            sys.stdin.read()  # until killed (or the driver is gone)
            return
        out({"end": counts})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", choices=["zmq", "doorbell"], default="zmq",
                    help="zmq: the portable handle; doorbell: the device handle (--device cuda:N)")
    ap.add_argument("--device", default="cpu", help="where the model runs (a GPU: a private cuda daemon)")
    ap.add_argument("--run-dir", help="a running sparsekvd (a cuda one for a model on the GPU)")
    ap.add_argument("--requests", type=int, default=PrefixConfig.requests)
    ap.add_argument("--system-blocks", type=int, default=PrefixConfig.system_blocks)
    ap.add_argument("--kill-at", type=int, default=PrefixConfig.kill_at, help="steps the first engine serves")
    ap.add_argument("--seed", type=int, default=PrefixConfig.seed)
    ap.add_argument("--engine-process", help=argparse.SUPPRESS)  # the driver's engine processes
    a = ap.parse_args(argv)
    if a.engine_process:
        engine_process(json.loads(a.engine_process))
        return 0
    if not a.device.startswith("cuda"):
        torch.set_num_threads(1)  # a tiny model: more threads only fight the daemon for the cores
    d = PrefixConfig()
    most = (d.host_blocks * d.block_size // d.max_reqs - d.tail[1] - d.new_tokens[1]) // d.block_size
    for name in ("requests", "kill_at"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if not 1 <= a.system_blocks <= most:
        ap.error(f"--system-blocks must be in [1, {most}] (a request's system prompt, own tokens and new tokens "
                 f"in the host pool's blocks), got {a.system_blocks}")
    cfg = Config(device=a.device, seed=a.seed)
    pc = PrefixConfig(requests=a.requests, system_blocks=a.system_blocks, kill_at=a.kill_at, seed=a.seed)
    return 0 if run(cfg, pc, a.transport, a.run_dir).equal else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SparseKVError as e:  # no daemon at --run-dir, a refusal: one line (2: not a comparison)
        print(f"prefix.py: {e}", file=sys.stderr)
        sys.exit(2)
