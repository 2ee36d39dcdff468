"""Where a layer's time goes on the portable path: HostSwapIn over zmq on a cuda daemon.

A diagnostic, not a test: a private cuda daemon, one rank, a decode step of ``--layers``
layers (one index group each, as ``bench decode``), a top-k of random positions on the
GPU and a tiny attention per layer; per leader ``swap_in`` it records the handle's parts
(positions mapped on the GPU, the TOPK request, and of the call the host's time blocked
on replies and on ring entries' events) and the reply's
timestamps (client sent, daemon received, GPU work enqueued, daemon replied, reply read:
one clock for the host). Prints the medians, in microseconds, with and without device
wait and fence events (with fences the top-k goes from the GPU into the step block and
"map" is the mapping on the GPU, enqueued; without, the copy to the host follows it).

    python3 tests/gpu/probe_zmq_layer.py --batch 16 --steps 20            # all hits: the host's costs
    python3 tests/gpu/probe_zmq_layer.py --batch 64 --steps 20 --rotate   # misses: the gathers' too
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def run(batch: int, layers: int, steps: int, device_wait: bool, fence: bool = True, rotate: bool = False,
        top_k: int = 2048, block: int = 64, context: int = 8192) -> dict:
    """``rotate``: each layer's top-k changes every step (many misses: the GPU's gathers
    dominate); else the same each step (all hits after the first: the host's costs show)."""
    import torch

    from sparsekv.client import swap_in as swap_in_mod
    from sparsekv.bench.decode import _arena_bytes
    from sparsekv.client.client import Client
    from sparsekv.bench.private_daemon import PrivateDaemon
    from sparsekv.proto import Layout, MsgType

    blocks = context // block
    lay = Layout(num_layers=layers, row_bytes=656, top_k=top_k, region_stride=top_k, max_reqs=batch,
                 host_rows=batch * blocks * block, index_groups=tuple((i,) for i in range(layers)),
                 max_batch=batch).validate()
    parts: dict[str, list] = {k: [] for k in ("swap_in", "map", "topk", "reply_waits", "entry_waits", "sock_in",
                                             "daemon_enqueue", "daemon_reply", "sock_out")}
    waits = {"reply_waits": 0, "entry_waits": 0}  # host time blocked in this leader call
    real_rows = swap_in_mod._device_rows

    def timed_rows(*a):
        t0 = time.perf_counter_ns()
        r = real_rows(*a)
        parts["map"].append(time.perf_counter_ns() - t0)
        return r

    swap_in_mod._device_rows = timed_rows
    try:
        size = f"{_arena_bytes(lay, 1) >> 30}GiB"
        with PrivateDaemon(pool_bytes=lay.pool_bytes + (256 << 20), backend="cuda",
                           extra_args=["--device-arena-size", size, "--max-slab-bytes", size]) as d, \
                Client(d.run_dir, device="cuda:0", name="probe-zmq", device_wait=device_wait) as c:
            c.attach(lay, fence=fence)
            real_topk = c.topk

            def timed_topk(*a, **k):
                t0 = time.perf_counter_ns()
                r = real_topk(*a, **k)
                parts["topk"].append(time.perf_counter_ns() - t0)
                return r

            c.topk = timed_topk

            def blocking(name, fn):
                def timed(*a, **k):
                    t0 = time.perf_counter_ns()
                    try:
                        return fn(*a, **k)
                    finally:
                        waits[name] += time.perf_counter_ns() - t0
                return timed

            c._receive_until = blocking("reply_waits", c._receive_until)
            c.attachment._wait_event = blocking("entry_waits", c.attachment._wait_event)
            h = swap_in_mod.HostSwapIn(c)
            dev = torch.device("cuda:0")
            table = torch.arange(batch * blocks, dtype=torch.int32, device=dev).view(batch, blocks)
            req = torch.arange(batch, dtype=torch.int32, device=dev)
            gen = torch.Generator(device=dev).manual_seed(1)
            topks = [torch.rand(batch, context, generator=gen, device=dev).argsort(dim=1)[:, :top_k].to(torch.int32)
                     for _ in range(4)]  # distinct positions per row
            kv32 = [h.kv(i).view(torch.int32) for i in range(layers)]
            out = torch.empty(batch, dtype=torch.int32, device=dev)
            state = np.arange(batch, dtype=np.int32)
            step_us, last = [], None
            for s in range(steps + 3):
                torch.cuda.synchronize()
                t_step = time.perf_counter_ns()
                h.begin_step(state, np.full(batch, s == 0), None)
                for layer in range(layers):
                    waits["reply_waits"] = waits["entry_waits"] = 0
                    t0 = time.perf_counter_ns()
                    idx = h.swap_in(req, table, topks[((s if rotate else 0) + layer) % 4], layer=layer,
                                    block_size=block)
                    parts["swap_in"].append(time.perf_counter_ns() - t0)
                    parts["reply_waits"].append(waits["reply_waits"])
                    parts["entry_waits"].append(waits["entry_waits"])
                    got = c.timings.get(MsgType.TOPK)  # device wait: an earlier reply's, read later
                    if got is not None and got != last:
                        last = got
                        ts, tr, tx, rx = got
                        tl = c.enqueued_at
                        parts["sock_in"].append(tr - ts)
                        parts["daemon_enqueue"].append((tl - tr) if tl is not None else np.nan)
                        parts["daemon_reply"].append((tx - tl) if tl is not None else np.nan)
                        parts["sock_out"].append(rx - tx)
                    rows = kv32[layer].index_select(0, idx.clamp(min=0).reshape(-1).long())
                    torch.sum((rows.sum(dim=1) * (idx >= 0).reshape(-1)).view(idx.shape), dim=1, out=out)
                torch.cuda.synchronize()
                step_us.append((time.perf_counter_ns() - t_step) / 1e3)
            h.check()
            h.close()
    finally:
        swap_in_mod._device_rows = real_rows
    warm = 3 * layers  # the first steps load kernels and fault in state
    res = {k: float(np.nanmedian(np.array(v[warm:] if len(v) > warm else v, dtype=float))) / 1e3
           for k, v in parts.items() if v}
    res["step_per_layer"] = float(np.median(step_us[3:])) / layers
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rotate", action="store_true", help="a new top-k every step (misses) instead of the same")
    a = ap.parse_args()
    rows = {(dw, f): run(a.batch, a.layers, a.steps, dw, f, a.rotate) for f in (False, True) for dw in (False, True)}
    keys = list(dict.fromkeys(k for r in rows.values() for k in r))
    print(f"batch {a.batch}, {a.layers} layers, {a.steps} steps: medians, us per layer (leader call)")
    print(f"{'part':<16}" + "".join(f"{f'wait={int(dw)} fence={int(f)}':>18}" for dw, f in rows))
    for k in keys:
        print(f"{k:<16}" + "".join(f"{r.get(k, float('nan')):>18.1f}" for r in rows.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
