"""``sparsekv top``: a live view of one daemon, refreshed each interval, as rates.

Each frame compares two samples of the stats socket (``json`` and ``clients``) taken one
interval apart: rates *in that interval* (never totals since start), the recent top-k
p50/p99, pool and slab use, each client's requests/s. On a terminal each frame first
clears the screen (ANSI codes), elsewhere frames follow each other.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

from .health import stats_query

CLEAR = "\x1b[H\x1b[2J"


@dataclass(frozen=True)
class Sample:
    t: float  # time.monotonic() when taken
    snap: dict  # the `json` answer
    clients: list[dict]  # the `clients` answer, one dict per client (by header name)


def parse_clients(text: str) -> list[dict]:
    lines = [line for line in text.splitlines() if line]
    if not lines:
        return []
    header = lines[0].split("\t")
    return [dict(zip(header, line.split("\t"))) for line in lines[1:]]


def take_sample(run_dir: str, timeout_s: float = 5.0) -> Sample:
    snap = json.loads(stats_query(run_dir, "json", timeout_s))
    clients = parse_clients(stats_query(run_dir, "clients", timeout_s))
    return Sample(time.monotonic(), snap, clients)


def rates(prev: Sample, cur: Sample) -> dict:
    """Per-second rates of the interval between two samples, and the interval's hit rate
    and mean top-k time (None when nothing happened)."""
    dt = max(cur.t - prev.t, 1e-9)
    a, b = prev.snap, cur.snap

    def d(key: str) -> float:
        return b.get(key, 0) - a.get(key, 0)

    looked = d("hits") + d("misses")
    n_topk = d("topk_seconds_count")
    out = {key: d(key) / dt for key in ("requests", "topk_batches", "steps", "errors", "hits", "misses",
                                       "rows_moved", "bytes_moved", "rows_written", "bytes_written")}
    out["dt_s"] = dt
    out["hit_rate"] = d("hits") / looked if looked > 0 else None
    out["topk_mean_us"] = d("topk_seconds_sum") / n_topk * 1e6 if n_topk > 0 else None
    before = {c.get("id"): c for c in prev.clients}
    per_client = []
    for c in cur.clients:
        old = before.get(c.get("id"))
        req = _int(c.get("requests")) - (_int(old.get("requests")) if old else 0)
        err = _int(c.get("errors")) - (_int(old.get("errors")) if old else 0)
        per_client.append({**c, "requests_per_s": req / dt, "errors_per_s": err / dt})
    out["clients"] = per_client
    return out


def _int(v) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _latency(lat: dict) -> str:
    """The daemon's recent top-k latencies: ``-`` while its window holds none."""
    if not lat.get("n"):
        return "p50 -   p99 -   (last 0)"
    return f"p50 {lat.get('p50', 0):.0f} us   p99 {lat.get('p99', 0):.0f} us   (last {lat['n']})"


def render(run_dir: str, prev: Sample, cur: Sample, clear: bool = False) -> str:
    """One frame: what happened between ``prev`` and ``cur``."""
    r = rates(prev, cur)
    s = cur.snap
    lat = s.get("topk_latency_us", {})
    hit = "-" if r["hit_rate"] is None else f"{r['hit_rate'] * 100:.2f} %"
    mean = "" if r["topk_mean_us"] is None else f"   mean {r['topk_mean_us']:.0f} us this interval"
    pool, used = s.get("pool_bytes", 0), s.get("pool_used_bytes", 0)
    lines = [
        f"sparsekv top   {run_dir}   backend {s.get('backend', '?')}   pid {s.get('pid', '?')}   "
        f"up {s.get('uptime_s', 0):.0f} s   interval {r['dt_s']:.1f} s   "
        + time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "",
        f"requests  {r['requests']:10.1f} /s   top-k {r['topk_batches']:.1f} /s   steps {r['steps']:.1f} /s   "
        f"errors {r['errors']:.1f} /s",
        f"hit rate  {hit:>12}   ({r['hits']:.0f} hits/s, {r['misses']:.0f} misses/s)",
        f"moved     {r['bytes_moved'] / 1e9:10.3f} GB/s ({r['rows_moved']:.0f} rows/s)   "
        f"written {r['bytes_written'] / 1e9:.3f} GB/s",
        f"top-k     {_latency(lat)}{mean}",
        f"pool      {_mib(used)} / {_mib(pool)} used ({used / pool * 100 if pool else 0:.1f} %)   "
        f"engines {s.get('engines', 0)}   clients {s.get('clients', 0)} ({s.get('attached', 0)} attached)",
    ]
    engines = s.get("per_engine", {})
    if engines:
        lines += ["", f"{'engine':<20} {'ranks':>5} {'pool':>12} {'slabs':>12} {'tp group':>16}"]
        for name, e in sorted(engines.items()):
            tp = f"{e['tp_size']}, lag {e.get('tp_lag', 0)}" if e.get("tp_size", 1) > 1 else "-"
            lines.append(f"{name[:20]:<20} {e.get('ranks', 0):>5} {_mib(e.get('pool_bytes', 0)):>12} "
                         f"{_mib(e.get('slab_bytes', 0)):>12} {tp:>16}")
    for device, a in sorted(s.get("arenas", {}).items()):
        lines.append(f"arena {device}: {_mib(a['used_bytes'])} / {_mib(a['bytes'])} used")
    if s.get("device_errors"):
        lines.append("device errors  " + " ".join(f"{k}={v}" for k, v in sorted(s["device_errors"].items())))
    lines += ["", f"{'id':>4} {'pid':>8} {'rank':>4} {'engine':<16} {'req/s':>10} {'err/s':>7}  name"]
    for c in sorted(r["clients"], key=lambda c: -c["requests_per_s"]):
        lines.append(f"{c.get('id', '?'):>4} {c.get('pid', '?'):>8} {c.get('rank', '?'):>4} "
                     f"{c.get('engine', '-')[:16]:<16} {c['requests_per_s']:10.1f} {c['errors_per_s']:7.1f}  "
                     f"{c.get('name', '-')}")
    if not r["clients"]:
        lines.append("   (no clients)")
    return (CLEAR if clear else "") + "\n".join(lines) + "\n"


def run_top(run_dir: str, interval_s: float = 1.0, once: bool = False, out=None, timeout_s: float = 5.0) -> int:
    """Print a frame every ``interval_s`` until interrupted; ``once``: one frame after one
    interval; each sample's answers within ``timeout_s``. Raises
    :class:`~.health.StatsSocketError` when the daemon cannot be asked."""
    out = sys.stdout if out is None else out
    clear = out.isatty() and not once
    prev = take_sample(run_dir, timeout_s)
    try:
        while True:
            time.sleep(interval_s)
            cur = take_sample(run_dir, timeout_s)
            if cur.snap.get("pid") != prev.snap.get("pid"):  # a new daemon: its counters start at 0
                prev = cur
                continue
            out.write(render(run_dir, prev, cur, clear=clear))
            if not clear:
                out.write("\n")
            out.flush()
            if once:
                return 0
            prev = cur
    except KeyboardInterrupt:
        return 0
