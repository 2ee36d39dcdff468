"""Counters the daemon keeps, and their renderings: a table, JSON, and Prometheus metrics.

Hot path: handlers bump plain ints in ``Stats.c``; a TOPK also appends its handling time
to a window (p50/p99) and observes it in a Prometheus histogram. Everything else is read
at scrape time (:class:`SnapshotCollector`).
"""

from __future__ import annotations

import collections
import json
import time
from importlib import metadata
from typing import Callable, Iterator

import numpy as np
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sparsekv.proto import ErrorCode

COUNTERS = (
    # name (the Prometheus counter is sparsekv_<name>_total), help
    ("steps", "decode steps begun, each rank's of a TP group counted"),
    ("topk_batches", "top-k batches served, each rank's of a TP group counted"),
    ("tp_followed", "top-k batches a TP rank got from its group's resolve, made for a peer (gathered only)"),
    ("hits", "top-k columns found in the hot region (a TP group's batch counted once)"),
    ("misses", "top-k columns gathered from the host pool (a TP group's batch counted once)"),
    ("rows_moved", "rows copied host to hot slab (misses, and on the cpu backend prefetched rows, x layers of the group)"),
    ("bytes_moved", "bytes copied host to hot slab (as rows_moved: prefetched bytes on the cpu backend only)"),
    ("out_of_range", "top-k ids < -1 or >= host_rows (ignored, never read)"),
    ("prefetched", "rows fetched ahead into the next index group's regions (attach with prefetch)"),
    ("prefetch_hits", "prefetched rows a resolve then found (misses taken off the critical path)"),
    ("prefetch_wasted", "prefetched rows that lost their slot (evicted, reset, invalidated) before any resolve "
                        "found them; a detached rank's are in neither this nor prefetch_hits"),
    ("rows_written", "rows written into the host pool"),
    ("bytes_written", "bytes written into the host pool"),
    ("hot_invalidated", "hot slots dropped because their row was rewritten"),
    ("rows_staged", "rows copied to prefill staging buffers"),
    ("block_lookups", "block store lookups (BLOCK_LOOKUP)"),
    ("block_hits", "blocks found and pinned by lookups"),
    ("block_hit_tokens", "positions of the blocks found by lookups (not prefilled again; a request refused after "
                          "its lookup counts them too)"),
    ("block_hit_bytes", "pool bytes of the blocks found by lookups (every layer's rows)"),
    ("block_chain_lookups", "lookups that named a chain found before by its token instead of sending its hashes"),
    ("block_chain_resends", "lookups naming a token no longer answered (the client sent the hashes instead)"),
    ("block_commits", "blocks cached under a hash (BLOCK_COMMIT)"),
    ("block_evictions", "cached blocks evicted (least recently unpinned first) to allocate"),
    ("block_keys_bytes_written", "indexer key bytes written into blocks' keys plane (BLOCK_WRITE_KEYS)"),
    ("block_keys_bytes_read", "indexer key bytes read from blocks' keys plane (BLOCK_READ_KEYS)"),
    ("block_keys_bytes_loaded", "indexer key bytes copied into engines' buffers (BLOCK_LOAD_KEYS)"),
    ("requests", "requests handled"),
    ("errors", "requests answered with an error"),
    ("async_errors", "requests not run, answered with an error their rank found after the fact (also in errors)"),
    ("fd_refusals", "fd socket requests refused with an answer (a bad, used or withdrawn token, not the attaching "
     "process, no request within 1 s, a descriptor beside a request other than a deposit, more than one descriptor, "
     "a deposit of no descriptor or over its caps), and ATTACHes naming another process's slab deposit"),
    ("fd_connections_empty", "fd socket connections closed by their client before sending anything (not answered, "
     "not logged)"),
    ("fd_connections_refused", "fd socket connections answered busy when accepted: their uid had its share open, "
     "or every connection was open"),
    ("connections_refused", "control connections closed when accepted: their uid had max_connections_per_uid open"),
    ("connections_expired", "control connections closed because no HELLO came within hello_timeout_s, or a "
     "message stayed unfinished"),
    ("connections_broken", "control connections closed for breaking the protocol or a message over "
     "max_message_bytes"),
    ("stats_connections_refused", "stats socket connections answered busy when accepted: their uid had its share "
     "open, or every connection was open"),
    ("metrics_connections_refused", "HTTP /metrics connections answered 503 when accepted: every connection was open"),
    ("messages_refused", "requests refused before their frames were read (a size or frame limit)"),
    ("reads_paused", "times a connection's reads waited for the inflight_bytes budget"),
    ("sessions_expired", "sessions not attached, dropped after idle_timeout_s without a request"),
    ("sessions_closed", "sessions dropped when their connection closed without BYE"),
)

# Top-k handling time: from ~10 us (cuda: enqueue only) to tens of ms (a cold cpu gather).
LATENCY_BUCKETS_S = (10e-6, 20e-6, 50e-6, 100e-6, 200e-6, 500e-6,
                     1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3, 100e-3)
TOPK_HISTOGRAM = "sparsekv_topk_duration_seconds"


def package_version() -> str:
    """The installed distribution's version (``sparsekvd --version``, build_info)."""
    try:
        return metadata.version("sparsekv")
    except metadata.PackageNotFoundError:
        return "unknown"


class Stats:
    """The daemon's counters (``c``), errors by code and the top-k latency.

    Arguments:
        window: how many recent top-k latencies p50/p99 are computed over.
        registry: where the latency histogram is registered (a new one if None).
    """

    def __init__(self, window: int = 8192, registry: CollectorRegistry | None = None):
        self.started = time.time()
        self.c: dict[str, int] = {name: 0 for name, _ in COUNTERS}
        self.errors_by_code: collections.Counter[str] = collections.Counter()
        self._lat_us: collections.deque[float] = collections.deque(maxlen=window)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.topk_seconds = Histogram(TOPK_HISTOGRAM, "top-k request handling time in the daemon (receive to reply)",
                                      buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self._observe = self.topk_seconds.observe  # bound once: the hot path skips a lookup

    def add(self, **deltas: int) -> None:
        for k, v in deltas.items():
            self.c[k] += int(v)

    def error(self, code_name: str) -> None:
        self.c["errors"] += 1
        self.errors_by_code[code_name] += 1

    def latency(self, seconds: float) -> None:
        """One top-k's handling time: into the recent window and the histogram. O(1)."""
        self._lat_us.append(seconds * 1e6)
        self._observe(seconds)

    def latency_us(self) -> dict[str, float]:
        if not self._lat_us:
            return {"p50": 0.0, "p99": 0.0, "n": 0}
        a = np.fromiter(self._lat_us, dtype=np.float64)
        return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "n": int(a.size)}

    def _histogram_totals(self) -> tuple[int, float]:
        count, total = 0, 0.0
        for fam in self.topk_seconds.collect():
            for s in fam.samples:
                if s.name.endswith("_count"):
                    count = int(s.value)
                elif s.name.endswith("_sum"):
                    total = float(s.value)
        return count, total

    def snapshot(self, device: dict, gauges: dict) -> dict:
        """Counters (host ones plus ``device``, those counted on GPUs) and ``gauges``."""
        c = dict(self.c)
        for k, v in device.items():
            c[k] += v
        looked = c["hits"] + c["misses"]
        count, total = self._histogram_totals()
        return {
            **c,
            "hit_rate": c["hits"] / looked if looked else 0.0,
            "errors_by_code": dict(self.errors_by_code),
            "topk_latency_us": self.latency_us(),
            # every top-k since start: rates and means over any interval (`sparsekv top`)
            "topk_seconds_count": count,
            "topk_seconds_sum": total,
            "start_time_s": self.started,
            "uptime_s": round(time.time() - self.started, 3),
            **gauges,
        }


# -- Prometheus ----------------------------------------------------------------------------
class SnapshotCollector(Collector):
    """Metric families built from ``snapshot()`` at each scrape (nothing per request).
    ``owner_uid``: while set (one render, on the loop), the engines of that uid only."""

    def __init__(self, snapshot: Callable[..., dict]):
        self._snapshot = snapshot
        self.owner_uid: int | None = None

    def collect(self) -> Iterator[Metric]:
        return metric_families(self._snapshot(self.owner_uid))


def metric_families(snap: dict) -> Iterator[Metric]:
    """The metric families of one snapshot: counters ``*_total`` in base units, gauges,
    with engine and device labels where the figure is per engine or device."""
    for name, help_text in COUNTERS:
        if name == "errors":
            continue  # one family with a code label, below
        yield CounterMetricFamily(f"sparsekv_{name}", help_text, value=snap.get(name, 0))
    errors = CounterMetricFamily("sparsekv_errors", "requests answered with an error, by error code", labels=["code"])
    by_code = dict(snap.get("errors_by_code", {}))
    for code in ErrorCode:  # every code, zeros included: rate() needs the series before the first error
        if code != ErrorCode.OK:
            errors.add_metric([code.name], by_code.pop(code.name, 0))
    for code, n in sorted(by_code.items()):
        errors.add_metric([code], n)
    yield errors
    if "device_errors" in snap:  # cuda backend only
        dev = CounterMetricFamily("sparsekv_device_errors", "batch rows the GPU kernels refused or mended, by kind",
                                  labels=["kind"])
        for kind, n in sorted(snap["device_errors"].items()):
            dev.add_metric([kind], n)
        yield dev

    info = GaugeMetricFamily("sparsekv_build_info", "always 1; the daemon's version, backend and protocol version",
                             labels=["version", "backend", "protocol"])
    info.add_metric([str(snap.get("version", package_version())), str(snap.get("backend", "")),
                     str(snap.get("protocol_version", ""))], 1)
    yield info
    gauges = (
        ("start_time_seconds", "start_time_s", "when the daemon started, seconds since the Unix epoch"),
        ("clients", "clients", "connected clients"),
        ("connections", "connections_open", "open control connections (with or without a HELLO)"),
        ("inflight_bytes", "inflight_bytes", "bytes of requests being read or waiting, in the inflight_bytes budget"),
        ("inflight_bytes_peak", "inflight_bytes_peak", "the most inflight_bytes held at once since the start"),
        ("attached_clients", "attached", "clients attached to an engine"),
        ("engines", "engines", "engines with a pool range"),
        ("pool_bytes", "pool_bytes", "bytes of the host pool"),
        ("pool_used_bytes", "pool_used_bytes", "bytes of the host pool given to engines (2 MiB aligned ranges)"),
        ("pool_huge_bytes", "pool_huge_bytes", "bytes of the host pool in transparent huge pages (read at start)"),
    )
    for metric, key, help_text in gauges:
        yield GaugeMetricFamily(f"sparsekv_{metric}", help_text, value=snap.get(key, 0))
    yield GaugeMetricFamily("sparsekv_warm_cpus_running", "idle-priority loops keeping CPUs from halting "
                            "(warm_cpus), running", value=snap.get("warm_cpus_running", 0))
    yield CounterMetricFamily("sparsekv_warm_cpus_revived", "warm CPU loops that had exited and were started again",
                              value=snap.get("warm_cpus_revived", 0))
    if "mps" in snap:  # cuda backend only
        yield GaugeMetricFamily("sparsekv_mps", "1 when the NVIDIA MPS control daemon is running",
                                value=int(bool(snap["mps"])))

    per_engine = snap.get("per_engine", {})
    for metric, key, help_text in (
        ("engine_pool_bytes", "pool_bytes", "bytes of the host pool holding this engine's rows (and its "
         "indexer keys plane)"),
        ("engine_ranks", "ranks", "ranks attached to this engine"),
        ("engine_slab_bytes", "slab_bytes", "bytes of this engine's hot slabs, all ranks"),
        ("engine_tp_size", "tp_size", "ranks of this engine's TP group, resolving once (1: each rank resolves its own)"),
        ("engine_tp_lag", "tp_lag", "requests the slowest rank of this engine's TP group has still to reach (a rank "
         "that stopped shows here; the group refuses more than tp_max_lag)"),
    ):
        fam = GaugeMetricFamily(f"sparsekv_{metric}", help_text, labels=["engine"])
        for engine, e in sorted(per_engine.items()):
            fam.add_metric([engine], e.get(key, 0))
        yield fam
    blocks = GaugeMetricFamily("sparsekv_engine_blocks", "blocks of this engine's block store by state (DESIGN §9): "
                               "blocks (all), free, cached, referenced (cached, pinned), evictable (cached, unpinned), "
                               "private, reserved_total", labels=["engine", "state"])
    for engine, e in sorted(per_engine.items()):
        for state, n in sorted(e.get("blocks", {}).items()):
            blocks.add_metric([engine, state], n)
    yield blocks
    if "arenas" in snap:  # cuda: one allocation per GPU for slabs and rings
        size = GaugeMetricFamily("sparsekv_device_arena_bytes", "bytes of the GPU's arena", labels=["device"])
        used = GaugeMetricFamily("sparsekv_device_arena_used_bytes", "bytes of the GPU's arena given to ranks",
                                 labels=["device"])
        held = GaugeMetricFamily("sparsekv_deferred_free_bytes", "bytes of detached ranks' pinned host blocks and "
                                 "CUDA IPC imports held until no doorbell rank is attached", labels=["device"])
        for device, a in sorted(snap["arenas"].items()):
            size.add_metric([device], a["bytes"])
            used.add_metric([device], a["used_bytes"])
            held.add_metric([device], a.get("deferred_free_bytes", 0))
        yield size
        yield used
        yield held


def registry_for(snap: dict) -> CollectorRegistry:
    """A registry exposing one fixed snapshot (no histogram): for tests and tools."""
    reg = CollectorRegistry()
    reg.register(SnapshotCollector(lambda owner_uid=None: snap))
    return reg


def render_prometheus(registry: CollectorRegistry) -> str:
    """The Prometheus text exposition format (0.0.4) of ``registry``."""
    return generate_latest(registry).decode()


# -- people and scripts --------------------------------------------------------------------
def _latency(lat: dict) -> str:
    """The top-k latency window's line: ``-`` while it holds none (no 0 us to misread)."""
    if not lat.get("n"):
        return "p50 -  p99 -  (last 0)"
    return f"p50 {lat['p50']:.0f} us  p99 {lat['p99']:.0f} us  (last {lat['n']})"


def render_table(snap: dict) -> str:
    lat = snap["topk_latency_us"]
    hit = f"{snap['hit_rate'] * 100:.2f} %" if snap["hits"] + snap["misses"] else "-"  # none yet: no 0 % to misread
    lines = [
        f"backend        {snap.get('backend', '?')}  devices {','.join(snap.get('devices', []))}"
        + ("" if "mps" not in snap else f"  MPS {'on' if snap['mps'] else 'OFF (every GPU hand-off costs ~300 us)'}"),
        f"uptime         {snap['uptime_s']:.0f} s",
        f"clients        {snap.get('clients', 0)}  engines {snap.get('engines', 0)}",
        f"pool           {snap.get('pool_used_bytes', 0) / 2**20:.1f} / {snap.get('pool_bytes', 0) / 2**20:.1f} MiB used, "
        f"{snap.get('pool_huge_bytes', 0) * 100 // max(1, snap.get('pool_bytes', 0))} % in huge pages",
        f"hit rate       {hit}  ({snap['hits']} hits, {snap['misses']} misses)",
        f"moved          {snap['rows_moved']} rows, {snap['bytes_moved'] / 2**20:.1f} MiB",
        f"written        {snap['rows_written']} rows, {snap['bytes_written'] / 2**20:.1f} MiB",
        f"out of range   {snap['out_of_range']}",
        f"top-k latency  {_latency(lat)}",
        f"errors         {snap['errors']}"
        + ("  " + " ".join(f"{k}={v}" for k, v in sorted(snap["errors_by_code"].items())) if snap["errors_by_code"] else ""),
    ]
    if snap.get("prefetched"):
        lines.insert(6, f"prefetched     {snap['prefetched']} rows: {snap['prefetch_hits']} hit, "
                        f"{snap['prefetch_wasted']} lost unused")
    closed = {k: snap.get(f"connections_{k}", 0) for k in ("refused", "expired")}
    if any(closed.values()) or snap.get("sessions_expired"):
        lines.append(f"connections    {snap.get('connections_open', 0)} open, closed: {closed['refused']} over the "
                     f"per-uid cap, {closed['expired']} without HELLO; {snap.get('sessions_expired', 0)} idle "
                     "sessions expired")
    busy = {k: snap.get(f"{k}_connections_refused", 0) for k in ("stats", "metrics")}
    if any(busy.values()):  # operator connections over their limits, answered busy
        lines.append(f"operator busy  {busy['stats']} stats socket, {busy['metrics']} HTTP connections refused")
    if snap.get("fd_refusals"):  # fds.sock: a bad token, not the process that attached, no request in time...
        lines.append(f"fd refusals    {snap['fd_refusals']}")
    if snap.get("fd_connections_empty"):  # fds.sock connections closed before sending anything
        lines.append(f"fd socket      {snap['fd_connections_empty']} connections closed without a request")
    if snap.get("fd_connections_refused"):  # fds.sock connections over their uid's share or the limit
        lines.append(f"fd socket busy {snap['fd_connections_refused']} connections refused")
    if snap.get("device_errors"):  # cuda: rows the kernels refused or mended, by kind
        lines.append("device errors  " + " ".join(f"{k}={v}" for k, v in sorted(snap["device_errors"].items())))
    if snap.get("io_cpus") or snap.get("warm_cpus"):
        lines.append(f"cpus           loop on {snap.get('io_cpus') or 'any'}; warm {snap.get('warm_cpus') or 'none'}"
                     + (f" (loops running: {snap.get('warm_cpus_running', 0)})" if snap.get("warm_cpus") else ""))
    for engine, e in sorted(snap.get("per_engine", {}).items()):
        lines.append(f"engine {engine:<8} {e['ranks']} rank(s), pool {e['pool_bytes'] / 2**20:.1f} MiB, "
                     f"slabs {e['slab_bytes'] / 2**20:.1f} MiB")
        if e.get("tp_size", 1) > 1:
            lines.append(f"  tp group     {e['tp_size']} ranks, one resolve; slowest rank {e['tp_lag']} request(s) behind")
        if "blocks" in e:
            b = e["blocks"]
            lines.append(f"  blocks       {b['cached']} cached ({b['referenced']} referenced), {b['free']} free, "
                         f"{b['private']} private, {b['reserved_total']} reserved of {b['blocks']}")
    for device, a in sorted(snap.get("arenas", {}).items()):
        lines.append(f"arena {device:<9}{a['used_bytes'] / 2**20:.1f} / {a['bytes'] / 2**20:.1f} MiB used"
                     + (f"; {a['deferred_frees']} free(s) of {a['deferred_free_bytes'] / 2**20:.1f} MiB held while a "
                        "doorbell rank is attached" if a.get("deferred_frees") else ""))
    return "\n".join(lines) + "\n"


def render_json(snap: dict) -> str:
    return json.dumps(snap, sort_keys=True) + "\n"
