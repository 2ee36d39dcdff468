"""``sparsekv bench prefix``: the block store's costs as an engine sees them, through a
private daemon (cpu backend; on a GPU host it measures that host's CPU, which is what the
lookup runs on).

* ``prefix_lookup_us_p50`` / ``_p99`` (the p50 also as ``prefix_lookup_us_128k`` at the
  default shape): lookup + pin of a cached 128K-token prefix (2,048 blocks of
  64) through zmq (the release that follows each is timed apart: ``release_us_p50``): the same
  prefix again, as requests sharing a system prompt look it up (the client names the chain
  by the token an earlier reply gave it, DESIGN §9, and the store answers from the chain it
  found whole before, after checking it); ``prefix_lookup_sent_us_p50``: the same with
  its 2,048 hashes sent (a client that never looked it up); ``prefix_lookup_behind_us_p50``:
  a request behind that cached prompt, its hashes then 4 of its own (not cached);
  ``prefix_lookup_cold_us_p50``: a
  prefix of about that length not looked up whole before (the index's probes); where a
  repeated lookup's time goes, from the header times (``Client.timings``, p50s):
  ``lookup_send_us`` (the client's send to the daemon's receive), ``lookup_daemon_us``
  (receive to reply), ``lookup_reply_us`` (the reply to the client's read);
* ``restart_s_median``: a new engine process, from its start to the cached prefix pinned
  (import, connect, attach to the kept engine, hashes, lookup): what a restarted engine
  waits before it serves the prefix without prefilling it.

The engine's rows are DeepSeek-V3.2's (61 layers of 656 bytes) in a pool range of 8 GiB
(``pool_gib``).

When a GPU is there (CuPy sees one, torch is installed), also the load of the cached
prefix's indexer keys into the engine's GPU memory (``Client.blocks.load_keys``: the
daemon's bulk stream, after the engine's fence, an event back), DeepSeek-V3.2's shape:
2,048 blocks of 64 positions, 61 layers, 132 bytes a position and layer (1.06 GB), against
a bulk pinned host-to-device copy of the same bytes in the same run:

* ``prefix_index_load_vs_bulk``: load GB/s over bulk GB/s (medians; the goal: >= 0.8),
  with ``prefix_index_load_GBps`` and ``bulk_h2d_GBps``; the load timed on the engine's
  stream from before its fence to after its wait on the daemon's event (the request's
  round trip included), every byte checked once;
* what it costs the engine: ``load_call_us_p50`` (its thread in ``load_keys``: export,
  request, reply; it never waits for the copies) and ``load_stream_ms_p50`` (its stream
  waiting for the keys, when it has nothing else to run);
* ``prefix_index_load_vs_bulk_scattered``: the same with the blocks in a random order
  (one copy a block, 515 KB each, instead of one for the prefix).

Serving a cached prefix against recomputing it (``serve_tokens``, 32K by default: the
first ``serve_tokens / block_size`` blocks of the chain):

* ``prefix_serve_lookup_us_p50``: its lookup + pin, repeated, as requests sharing a system
  prompt look it up (the first lookup, the prefix not yet looked up whole, is left out);
* on a GPU, ``prefix_serve_load_ms`` (its indexer keys into the engine's GPU memory, the
  engine's stream from before the fence to after the wait) and ``prefix_serve_ms`` (both:
  what an engine waits before it decodes past the prefix; its MLA rows stay in the pool,
  served by the sparse decode path: the rows its first steps read come as misses there),
  against ``prefix_recompute_ms_bound``: the prefill's
  FLOPs on the deployment at the H200's dense peaks (``serve_capacity.prefill_bound``,
  DeepSeek-V3.2, attention data-parallel, experts over 8 GPUs), a lower bound of
  recomputing it; ``prefix_serve_vs_recompute`` is their ratio (``_32k`` at 32K tokens).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

import numpy as np

from sparsekv.client import Client
from sparsekv.client.blocks import Blocks
from sparsekv.daemon.backends import cuda_unavailable
from sparsekv.proto import LIMITS, Layout, MsgType
from sparsekv.proto.blocks import KeysPlane

from .private_daemon import PrivateDaemon
from .serve_capacity import PRESETS, prefill_bound

# A new engine: attach to the kept engine, hash the prompt, look it up; prints the hits
# and the seconds since the parent's clock reading in argv.
_RESTART = r"""
import json, sys, time
import numpy as np
from sparsekv.client import Client
from sparsekv.client.blocks import Blocks
from sparsekv.proto import Layout
run_dir, lay, block_size, n_tokens, t0 = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
with Client(run_dir, name="bench-restart") as c:
    c.attach(Layout.from_wire(lay), engine="bench-prefix", block_size=block_size)
    hit = c.blocks.lookup(c.blocks.hashes(np.arange(n_tokens)))
    print(json.dumps({"hit": int(hit.size), "s": time.time() - t0}), flush=True)
"""


def bench_prefix(blocks: int = 2048, block_size: int = 64, reps: int = 200, restarts: int = 3,
                 pool_gib: float = 8.0, serve_tokens: int = 32768) -> dict:
    """The cpu figures (module docstring): an engine of DeepSeek-V3.2's rows (61 layers of
    656 bytes) whose pool range is ``pool_gib`` (the restart goal's 8 GiB by default); on a
    GPU also the indexer keys' load, and serving the first ``serve_tokens`` positions."""
    if not 0 < reps < blocks:
        raise ValueError(f"reps must be in [1, blocks): each looks up a chain one block shorter, got {reps} of {blocks}")
    if serve_tokens <= 0 or serve_tokens % block_size:
        raise ValueError(f"serve_tokens must be a positive multiple of block_size {block_size}, got {serve_tokens}")
    serve_blocks = min(blocks, serve_tokens // block_size)
    row_bytes, layers = 656, 61
    host_rows = int(pool_gib * 2**30) // (layers * row_bytes) // block_size * block_size
    n_tokens = blocks * block_size
    if host_rows < n_tokens:
        raise ValueError(f"a pool of {pool_gib} GiB holds {host_rows // block_size} blocks of {block_size} "
                         f"DeepSeek-V3.2 rows, fewer than the {blocks} looked up")
    lay = Layout(num_layers=layers, row_bytes=row_bytes, top_k=64, region_stride=128, max_reqs=1, host_rows=host_rows)
    lookup_us, cold_us, sent_us, release_us, restart_s, legs = [], [], [], [], [], []
    # The latency settings of a cuda daemon and its clients (the daemon polls its socket
    # 1 ms after a request, the client spins 0.5 ms for its reply), on the cpu backend.
    with PrivateDaemon(pool_bytes=lay.pool_bytes + (8 << 20), backend="cpu", extra_args=["--busy-poll-us", "1000"]) as d:
        with Client(d.run_dir, name="bench", spin_us=500) as c:
            c.attach(lay, engine="bench-prefix", block_size=block_size)
            keys = c.blocks.hashes(np.arange(n_tokens))
            got = c.blocks.alloc(blocks)
            c.blocks.commit(got, keys)
            c.blocks.release(got)
            # The same client's lookups with every hash sent (no chain named by its token).
            sending = Blocks(c._call, c.blocks.namespace, block_size)
            for i in range(3 * reps):
                # 0: the whole prefix again (requests sharing a system prompt: the client names
                # the chain a reply gave it, the store answers from its memo, once checked);
                # 1: a prefix one block shorter each time, never looked up whole before (the
                # index's probes); 2: the whole prefix again, its hashes sent.
                kind = i % 3
                n = blocks - 1 - i // 3 if kind == 1 else blocks
                t0 = time.perf_counter()
                got = (sending if kind == 2 else c.blocks).lookup(keys[:n])
                t1 = time.perf_counter()
                c.blocks.release(got)
                t2 = time.perf_counter()
                assert got.size == n, f"the cached prefix has {got.size} of {n} blocks"
                (lookup_us, cold_us, sent_us)[kind].append((t1 - t0) * 1e6)
                if kind == 0:
                    ts, tr, tx, rx = c.timings[MsgType.BLOCK_LOOKUP]
                    legs.append((tr - ts, tx - tr, rx - tx))
                release_us.append((t2 - t1) * 1e6)
            serve_us = []  # the served prefix, looked up again and again (the first time apart)
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                got = c.blocks.lookup(keys[:serve_blocks])
                serve_us.append((time.perf_counter() - t0) * 1e6)
                c.blocks.release(got)
                assert got.size == serve_blocks, f"the cached prefix has {got.size} of {serve_blocks} blocks"
            behind_us = []  # requests behind the cached prompt: its hashes, then 4 of their own (not cached)
            rng = np.random.default_rng(0)
            for _ in range(reps):
                chain = np.concatenate([keys, rng.integers(-2**63, 2**63 - 1, (4, 2), dtype=np.int64)])
                t0 = time.perf_counter()
                got = c.blocks.lookup(chain)
                behind_us.append((time.perf_counter() - t0) * 1e6)
                c.blocks.release(got)
                assert got.size == blocks, f"the cached prompt has {got.size} of {blocks} blocks"
            # c closes here: the engine is kept for its cached blocks, as after a crash
        for _ in range(restarts):
            out = subprocess.run([sys.executable, "-c", _RESTART, d.run_dir, json.dumps(lay.to_wire()),
                                  str(block_size), str(n_tokens), repr(time.time())],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout)
            assert r["hit"] == blocks, r
            restart_s.append(r["s"])
    p50 = round(float(np.median(lookup_us)), 1)
    out = {"bench": "prefix", "blocks": blocks, "block_size": block_size, "reps": reps,
           "pool_gib": round(lay.pool_bytes / 2**30, 2),
           "prefix_lookup_us_p50": p50,
           "prefix_lookup_us_p99": round(float(np.percentile(lookup_us, 99)), 1),
           # The key (docs/perf/latest.json), at its shape: 2,048 blocks of 64.
           **({"prefix_lookup_us_128k": p50} if (blocks, block_size) == (2048, 64) else {}),
           "prefix_lookup_cold_us_p50": round(float(np.median(cold_us)), 1),
           "prefix_lookup_sent_us_p50": round(float(np.median(sent_us)), 1),
           "prefix_lookup_behind_us_p50": round(float(np.median(behind_us)), 1),
           **{k: round(float(v) * 1e-3, 1) for k, v in zip(("lookup_send_us", "lookup_daemon_us", "lookup_reply_us"),
                                                          np.median(np.array(legs), axis=0))},
           "release_us_p50": round(float(np.median(release_us)), 1),
           "restart_s_median": round(float(np.median(restart_s)), 3),
           "prefix_serve_tokens": serve_blocks * block_size,
           "prefix_serve_lookup_us_p50": round(float(np.median(serve_us[1:])), 1),
           "prefix_recompute_ms_bound": round(prefill_bound(PRESETS["v32"], serve_blocks * block_size)["bound_s"] * 1e3,
                                              1)}
    if cuda_unavailable() is None and importlib.util.find_spec("torch") is not None:
        out.update(bench_index_load(blocks, block_size, serve_blocks=serve_blocks))
        out.update(serve_figures(out))
    return out


def serve_figures(out: dict) -> dict:
    """Serving the cached prefix (its lookup, then its keys' load) against recomputing it."""
    serve_ms = out["prefix_serve_lookup_us_p50"] * 1e-3 + out["prefix_serve_load_ms"]
    ratio = serve_ms / out["prefix_recompute_ms_bound"]
    return {"prefix_serve_ms": round(serve_ms, 3), "prefix_serve_vs_recompute": round(ratio, 5),
            **({"prefix_serve_vs_recompute_32k": round(ratio, 5)} if out["prefix_serve_tokens"] == 32768 else {})}


def bench_index_load(blocks: int = 2048, block_size: int = 64, layers: int = 61, index_bytes: int = 132,
                     reps: int = 10, serve_blocks: int = 512) -> dict:
    """The GPU part (module docstring): a cuda daemon of its own, one engine rank on cuda:0;
    also the load of the prefix's first ``serve_blocks`` blocks alone (the served prefix)."""
    import torch  # noqa: PLC0415  (GPU hosts only)

    lay = Layout(num_layers=layers, row_bytes=16, top_k=64, region_stride=128, max_reqs=1,
                 host_rows=blocks * block_size)
    plane = KeysPlane.of(lay, block_size, index_bytes)
    bb, nbytes = plane.block_bytes, blocks * plane.block_bytes
    # Every block's keys distinct: a random block, XOR its id, its id in the first bytes.
    keys = np.empty((blocks, bb), np.uint8)
    keys[:] = np.random.default_rng(0).integers(0, 256, bb, dtype=np.uint8)
    keys ^= (np.arange(blocks) % 251).astype(np.uint8)[:, None]
    keys[:, :4] = np.arange(blocks, dtype="<i4").view(np.uint8).reshape(blocks, 4)
    dev = torch.device("cuda", 0)
    with PrivateDaemon(pool_bytes=plane.end + (64 << 20), backend="cuda",
                       extra_args=["--device-arena-size", "1GiB"]) as d, \
            Client(d.run_dir, name="bench-index-load", device="cuda:0") as c:
        c.attach(lay, engine="bench-index", block_size=block_size, index_bytes=index_bytes, fence=True)
        own = c.blocks.alloc(blocks)
        step = LIMITS.max_keys_bytes // bb  # blocks a write_keys may carry
        for i in range(0, blocks, step):
            c.blocks.write_keys(own[i:i + step], keys[i:i + step].reshape(-1, layers, block_size, index_bytes))
        hashes = c.blocks.hashes(np.arange(blocks * block_size))
        c.blocks.commit(own, hashes)
        c.blocks.release(own)  # cached, unpinned: then looked up as a hit is
        hit = c.blocks.lookup(hashes)
        assert hit.size == blocks, f"the cached prefix has {hit.size} of {blocks} blocks"
        row = np.zeros(int(own.max()) + 1, np.int64)
        row[own] = np.arange(blocks)  # block id -> its keys' row in ``keys``
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        c.blocks.load_keys(hit, dst)  # warm: the buffer imported, the event opened
        torch.cuda.synchronize(dev)
        got = dst.cpu().numpy().reshape(blocks, bb)
        assert (got == keys[row[hit]]).all(), "the loaded keys differ from those written"
        load_ms, call_us = _timed(lambda: c.blocks.load_keys(hit, dst), reps, dev, torch)
        shuffled = np.random.default_rng(1).permutation(hit)
        c.blocks.load_keys(shuffled, dst)
        torch.cuda.synchronize(dev)
        assert (dst.cpu().numpy().reshape(blocks, bb) == keys[row[shuffled]]).all(), "the scattered load differs"
        scattered_ms, _ = _timed(lambda: c.blocks.load_keys(shuffled, dst), reps, dev, torch)
        serve_ms, _ = _timed(lambda: c.blocks.load_keys(hit[:serve_blocks], dst), reps, dev, torch)
        torch.cuda.synchronize(dev)
        assert (dst[:serve_blocks * bb].cpu().numpy().reshape(serve_blocks, bb) == keys[row[hit[:serve_blocks]]]).all(), \
            "the served prefix's keys differ from those written"
        src = torch.from_numpy(keys.reshape(-1)).pin_memory()
        bulk_ms, _ = _timed(lambda: dst.copy_(src, non_blocking=True), reps, dev, torch)
        assert torch.equal(dst.view(blocks, bb)[:1].cpu(), src.view(blocks, bb)[:1])
    gbps = {k: nbytes / (float(np.median(v)) * 1e-3) / 1e9 for k, v in
            (("load", load_ms), ("scattered", scattered_ms), ("bulk", bulk_ms))}
    return {"index_load_bytes": nbytes, "index_layers": layers, "index_bytes": index_bytes,
            "prefix_index_load_GBps": round(gbps["load"], 2), "bulk_h2d_GBps": round(gbps["bulk"], 2),
            "prefix_index_load_vs_bulk": round(gbps["load"] / gbps["bulk"], 3),
            "prefix_index_load_scattered_GBps": round(gbps["scattered"], 2),
            "prefix_index_load_vs_bulk_scattered": round(gbps["scattered"] / gbps["bulk"], 3),
            "load_call_us_p50": round(float(np.median(call_us)), 1),
            "load_stream_ms_p50": round(float(np.median(load_ms)), 3),
            "prefix_serve_load_ms": round(float(np.median(serve_ms)), 3)}


def _timed(enqueue, reps: int, dev, torch) -> tuple[list[float], list[float]]:
    """``reps`` runs of ``enqueue`` on the current stream of ``dev``, each alone: the
    stream's milliseconds from before it to after it (CUDA events), and the host's
    microseconds in the call (``torch``: the module, imported by the caller)."""
    stream_ms, call_us = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(dev)
        start.record()
        t0 = time.perf_counter()
        enqueue()
        call_us.append((time.perf_counter() - t0) * 1e6)
        end.record()
        end.synchronize()
        stream_ms.append(start.elapsed_time(end))
    return stream_ms, call_us
