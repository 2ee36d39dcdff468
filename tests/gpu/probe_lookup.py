"""Where a block lookup's time goes on this host's CPUs (issue 36: the goal is a GPU host's).

A private cpu daemon (the cuda daemon's latency settings: it polls 1 ms after a request,
the client spins 0.5 ms) serves a client that looks a cached 2,048-block chain up again
and again (by token, as ``bench prefix``'s ``prefix_lookup_us_128k``) and releases it. The
daemon's and the client's methods on the lookup's path are wrapped with timestamps
(``time.perf_counter_ns``: one clock for both processes), and for each lookup every stamp
is taken from its start; the medians print as a timeline. The wrappers cost ~0.3 µs
each: the timeline's end is above ``bench prefix``'s figure by about that many.

Then the same lookups without stamps, three placements alternated: free (the scheduler's),
the client and the daemon's loop thread on two CPUs of one core's siblings when the host
has SMT, and on two CPUs of different cores; the p50 of each (a host whose two spinning
threads share a core runs each slower).

    python3 tests/gpu/probe_lookup.py [--lookups N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from sparsekv.client import Client
from sparsekv.proto import Layout

# Run in the daemon's process (argv: this file's folder, the stamps' file, the daemon's
# arguments): wrap, then start the daemon (its stamps pickled at exit).
_DAEMON = r"""
import atexit, pickle, sys
sys.path.insert(0, sys.argv.pop(1))
from probe_lookup import stamp
from sparsekv.daemon import control_socket as cs, server as sv, zmtp, block_requests as br
from sparsekv.daemon.blocks import store
T = []
for cls, name, tag in ((cs.ControlSocket, "_read", "daemon read"), (zmtp.Decoder, "feed", "daemon parse"),
                       (sv.Daemon, "_received", "daemon received"), (sv.Daemon, "_handle", "daemon handle"),
                       (br.BlockRequests, "on_lookup", "daemon on_lookup"), (store.BlockStore, "find", "store find"),
                       (sv.Daemon, "_ok", "daemon reply encode"), (cs.ControlSocket, "send", "daemon send")):
    stamp(T, cls, name, tag)
out = sys.argv.pop(1)
atexit.register(lambda: pickle.dump(T, open(out, "wb")))
sys.argv[0] = "sparsekvd"
from sparsekv.daemon.main import main
sys.exit(main())
"""


def stamp(T: list, cls, name: str, tag: str) -> None:
    """Wrap method ``name`` of ``cls``: (tag, time) into ``T`` when it is called, (tag + "
    end", time) when it returns."""
    f, now = getattr(cls, name), time.perf_counter_ns

    def g(*a, **k):
        T.append((tag, now()))
        try:
            return f(*a, **k)
        finally:
            T.append((tag + " end", now()))
    setattr(cls, name, g)


# The lookup reads no rows: a small pool (1 layer of 16-byte rows) starts in no time.
LAYOUT = Layout(num_layers=1, row_bytes=16, top_k=64, region_stride=128, max_reqs=1, host_rows=2048 * 64 * 2)


def cpu_pairs() -> dict[str, tuple[int, int] | None]:
    """Two CPUs of this process's set: siblings of one core (None without SMT) and two cores."""
    cpus = sorted(os.sched_getaffinity(0))
    core = {}
    for c in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") as f:
                core[c] = f.read().strip()
        except OSError:
            core[c] = str(c)
    siblings = next(((a, b) for a in cpus for b in cpus if a < b and core[a] == core[b]), None)
    cores = next(((a, b) for a in cpus for b in cpus if a < b and core[a] != core[b]), None)
    return {"siblings": siblings, "cores": cores}


def start_daemon(run_dir: str, stamps: str | None, io_cpu: int | None) -> subprocess.Popen:
    args = ["--run-dir", run_dir, "--backend", "cpu", "--pool-size", f"{LAYOUT.pool_bytes + (8 << 20)}B",
            "--busy-poll-us", "1000", *(["--io-cpus", str(io_cpu)] if io_cpu is not None else [])]
    cmd = ([sys.executable, "-c", _DAEMON, os.path.dirname(os.path.abspath(__file__)), stamps, *args] if stamps
           else [sys.executable, "-m", "sparsekv.daemon.main", *args])
    p = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    t0 = time.monotonic()
    while not os.path.exists(os.path.join(run_dir, "control.sock")):
        if p.poll() is not None or time.monotonic() - t0 > 60:
            raise RuntimeError(f"the daemon did not start (rc {p.poll()})")
        time.sleep(0.05)
    return p


def lookups(run_dir: str, n: int, stamps: list | None = None) -> list[tuple[int, int]]:
    """``n`` lookups of a cached chain by the same client (after 300 to warm up), each then
    released; (start, end) of each."""
    with Client(run_dir, name="probe-lookup", spin_us=500) as c:
        c.attach(LAYOUT, engine="probe", block_size=64)
        keys = c.blocks.hashes(np.arange(2048 * 64))
        got = c.blocks.alloc(2048)
        c.blocks.commit(got, keys)
        c.blocks.release(got)
        for _ in range(300):
            c.blocks.release(c.blocks.lookup(keys))
        if stamps is not None:
            stamps.clear()
        marks = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            got = c.blocks.lookup(keys)
            marks.append((t0, time.perf_counter_ns()))
            c.blocks.release(got)
        return marks


def timeline(marks, events) -> list[tuple[str, float]]:
    """The median time of each stamp from its lookup's start (the k-th of a tag: tag#k)."""
    events.sort(key=lambda e: e[1])
    rows: dict[str, list[int]] = {}
    j = 0
    for t0, t1 in marks:
        while j < len(events) and events[j][1] < t0:
            j += 1
        seen: dict[str, int] = {}
        k = j
        while k < len(events) and events[k][1] <= t1:
            tag = events[k][0]
            m = 1
            while f"{tag}#{m}" in seen:
                m += 1
            seen[f"{tag}#{m}"] = events[k][1] - t0
            k += 1
        seen["lookup returns"] = t1 - t0
        for tag, dt in seen.items():
            rows.setdefault(tag, []).append(dt)
    keep = [(tag, float(np.median(v)) / 1e3) for tag, v in rows.items() if len(v) >= len(marks) // 2]
    return sorted(keep, key=lambda x: x[1])


def client_stamps() -> list:
    from sparsekv.client import blocks, connection, wire

    T: list = []
    for cls, name, tag in ((blocks.ChainRefs, "match", "client match"), (connection.Connection, "_send", "client send"),
                           (wire.Wire, "_write", "client write"), (wire.Wire, "_feed", "client read"),
                           (connection.Connection, "_receive_one", "client decode")):
        stamp(T, cls, name, tag)
    return T


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    out: dict = {"cpus": len(os.sched_getaffinity(0))}
    with tempfile.TemporaryDirectory() as run_dir:
        stamps_file = os.path.join(run_dir, "stamps.pkl")
        mine = client_stamps()
        d = start_daemon(run_dir, stamps_file, None)
        try:
            marks = lookups(run_dir, args.lookups, mine)
        finally:
            d.send_signal(signal.SIGTERM)
            d.wait(30)
        events = list(mine) + pickle.load(open(stamps_file, "rb"))
        rows = timeline(marks, events)
    print("timeline (µs from the client's call, medians):")
    for tag, us in rows:
        print(f"  {us:8.1f}  {tag}")
    out["timeline_us"] = {tag: round(us, 1) for tag, us in rows}
    # Placements, alternated (no stamps: the plain client and daemon).
    pairs = cpu_pairs()
    out["pairs"] = {k: list(v) if v else None for k, v in pairs.items()}
    placed: dict[str, list[float]] = {}
    base = os.sched_getaffinity(0)
    for _ in range(2):
        for name, pair in (("free", None), *pairs.items()):
            if name != "free" and pair is None:
                continue
            with tempfile.TemporaryDirectory() as run_dir:
                d = start_daemon(run_dir, None, pair[1] if pair else None)
                try:
                    if pair:
                        os.sched_setaffinity(0, {pair[0]})
                    marks = lookups(run_dir, args.lookups // 2)
                finally:
                    os.sched_setaffinity(0, base)
                    d.send_signal(signal.SIGTERM)
                    d.wait(30)
            placed.setdefault(name, []).append(round(float(np.median([b - a for a, b in marks])) / 1e3, 1))
    out["placements_p50_us"] = placed
    print("placements (p50 µs, alternated):", json.dumps(placed), "pairs:", json.dumps(out["pairs"]))
    if args.out:
        with open(os.path.join(args.out, "probe-lookup.json"), "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
