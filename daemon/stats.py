"""Counters the daemon keeps, and their three renderings (table, JSON, Prometheus)."""

from __future__ import annotations

import collections
import json
import time

import numpy as np

COUNTERS = (
    # name, help
    ("steps", "decode steps begun"),
    ("topk_batches", "top-k batches resolved"),
    ("hits", "top-k columns found in the hot region"),
    ("misses", "top-k columns gathered from the host pool"),
    ("rows_moved", "rows copied host to hot slab (misses x layers of the group)"),
    ("bytes_moved", "bytes copied host to hot slab"),
    ("out_of_range", "top-k ids < -1 or >= host_rows (ignored, never read)"),
    ("rows_written", "rows written into the host pool"),
    ("bytes_written", "bytes written into the host pool"),
    ("hot_invalidated", "hot slots dropped because their row was rewritten"),
    ("rows_staged", "rows copied to prefill staging buffers"),
    ("requests", "requests handled"),
    ("errors", "requests answered with an error"),
    ("async_errors", "requests not run, answered with an error their rank found after the fact (also in errors)"),
)


class Stats:
    def __init__(self, window: int = 8192):
        self.started = time.time()
        self.c: dict[str, int] = {name: 0 for name, _ in COUNTERS}
        self.errors_by_code: collections.Counter[str] = collections.Counter()
        self._lat_us: collections.deque[float] = collections.deque(maxlen=window)

    def add(self, **deltas: int) -> None:
        for k, v in deltas.items():
            self.c[k] += int(v)

    def error(self, code_name: str) -> None:
        self.c["errors"] += 1
        self.errors_by_code[code_name] += 1

    def latency(self, seconds: float) -> None:
        self._lat_us.append(seconds * 1e6)

    def latency_us(self) -> dict[str, float]:
        if not self._lat_us:
            return {"p50": 0.0, "p99": 0.0, "n": 0}
        a = np.fromiter(self._lat_us, dtype=np.float64)
        return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "n": int(a.size)}

    def snapshot(self, device: dict, gauges: dict) -> dict:
        """Counters (host ones plus ``device``, those counted on GPUs) and ``gauges``."""
        c = dict(self.c)
        for k, v in device.items():
            c[k] += v
        looked = c["hits"] + c["misses"]
        return {
            **c,
            "hit_rate": c["hits"] / looked if looked else 0.0,
            "errors_by_code": dict(self.errors_by_code),
            "topk_latency_us": self.latency_us(),
            "uptime_s": round(time.time() - self.started, 3),
            **gauges,
        }


def render_table(snap: dict) -> str:
    lat = snap["topk_latency_us"]
    lines = [
        f"backend        {snap.get('backend', '?')}  devices {','.join(snap.get('devices', []))}"
        + ("" if "mps" not in snap else f"  MPS {'on' if snap['mps'] else 'OFF (every GPU hand-off costs ~300 us)'}"),
        f"uptime         {snap['uptime_s']:.0f} s",
        f"clients        {snap.get('clients', 0)}  engines {snap.get('engines', 0)}",
        f"pool           {snap.get('pool_used_bytes', 0) / 2**20:.1f} / {snap.get('pool_bytes', 0) / 2**20:.1f} MiB used",
        f"hit rate       {snap['hit_rate'] * 100:.2f} %  ({snap['hits']} hits, {snap['misses']} misses)",
        f"moved          {snap['rows_moved']} rows, {snap['bytes_moved'] / 2**20:.1f} MiB",
        f"written        {snap['rows_written']} rows, {snap['bytes_written'] / 2**20:.1f} MiB",
        f"out of range   {snap['out_of_range']}",
        f"top-k latency  p50 {lat['p50']:.0f} us  p99 {lat['p99']:.0f} us  (last {lat['n']})",
        f"errors         {snap['errors']}"
        + ("  " + " ".join(f"{k}={v}" for k, v in sorted(snap["errors_by_code"].items())) if snap["errors_by_code"] else ""),
    ]
    if snap.get("device_errors"):  # cuda: rows the kernels refused or mended, by kind
        lines.append("device errors  " + " ".join(f"{k}={v}" for k, v in sorted(snap["device_errors"].items())))
    return "\n".join(lines) + "\n"


def render_json(snap: dict) -> str:
    return json.dumps(snap, sort_keys=True) + "\n"


def render_prometheus(snap: dict) -> str:
    out = []
    for name, help_text in COUNTERS:
        out += [f"# HELP sparsekv_{name}_total {help_text}", f"# TYPE sparsekv_{name}_total counter",
                f"sparsekv_{name}_total {snap[name]}"]
    out += ["# HELP sparsekv_errors_by_code_total requests answered with an error, by code",
            "# TYPE sparsekv_errors_by_code_total counter"]
    for code, n in sorted(snap["errors_by_code"].items()):
        out.append(f'sparsekv_errors_by_code_total{{code="{code}"}} {n}')
    if "device_errors" in snap:  # cuda backend only
        out += ["# HELP sparsekv_device_errors_total batch rows the GPU kernels refused or mended, by kind",
                "# TYPE sparsekv_device_errors_total counter"]
        for kind, n in sorted(snap["device_errors"].items()):
            out.append(f'sparsekv_device_errors_total{{kind="{kind}"}} {n}')
    gauges = (
        ("hit_rate", "hits / (hits + misses) since start"),
        ("clients", "attached or connected clients"),
        ("engines", "engines with a pool range"),
        ("pool_bytes", "bytes of the host pool"),
        ("pool_used_bytes", "bytes of the host pool given to engines"),
        ("uptime_s", "seconds since the daemon started"),
    )
    if "mps" in snap:  # cuda backend only
        gauges += (("mps", "1 when the NVIDIA MPS control daemon is running"),)
    for name, help_text in gauges:
        out += [f"# HELP sparsekv_{name} {help_text}", f"# TYPE sparsekv_{name} gauge",
                f"sparsekv_{name} {int(snap[name]) if isinstance(snap.get(name), bool) else snap.get(name, 0)}"]
    lat = snap["topk_latency_us"]
    out += ["# HELP sparsekv_topk_latency_us top-k handling time in the daemon, recent window",
            "# TYPE sparsekv_topk_latency_us summary",
            f'sparsekv_topk_latency_us{{quantile="0.5"}} {lat["p50"]}',
            f'sparsekv_topk_latency_us{{quantile="0.99"}} {lat["p99"]}',
            f"sparsekv_topk_latency_us_count {lat['n']}"]
    return "\n".join(out) + "\n"
