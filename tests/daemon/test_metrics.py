"""Prometheus metrics: the top-k histogram (buckets, seconds), families built from a snapshot (cuda-only ones included), the daemon's own
registry, and the optional loopback HTTP ``/metrics`` endpoint of a real daemon."""

import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from prometheus_client import REGISTRY

import helpers
import promcheck
from sparsekv.client import Client
from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.daemon.stats import COUNTERS, LATENCY_BUCKETS_S, Stats, registry_for, render_prometheus


def test_latency_feeds_the_window_and_a_histogram_in_seconds():
    st = Stats()
    for s in (15e-6, 15e-6, 300e-6, 0.5):  # 0.5 s: beyond the last bucket, counted in +Inf
        st.latency(s)
    v = promcheck.values(promcheck.families(render_prometheus(st.registry)))
    name = "sparsekv_topk_duration_seconds"
    assert v[f'{name}_bucket{{le="1e-05"}}'] == 0
    assert v[f'{name}_bucket{{le="2e-05"}}'] == 2
    assert v[f'{name}_bucket{{le="0.0005"}}'] == 3
    assert v[f'{name}_bucket{{le="0.1"}}'] == 3 and v[f'{name}_bucket{{le="+Inf"}}'] == 4
    assert v[f"{name}_count"] == 4 and v[f"{name}_sum"] == pytest.approx(0.50033)
    lat = st.latency_us()
    assert lat["n"] == 4 and lat["p50"] == pytest.approx(157.5)
    snap = st.snapshot({}, {})
    assert snap["topk_seconds_count"] == 4 and snap["topk_seconds_sum"] == pytest.approx(0.50033)


def test_buckets_span_10_us_to_100_ms():
    assert LATENCY_BUCKETS_S[0] == 10e-6 and LATENCY_BUCKETS_S[-1] == 100e-3
    assert list(LATENCY_BUCKETS_S) == sorted(LATENCY_BUCKETS_S)


def test_the_daemons_registry_is_its_own():
    st = Stats()
    st.latency(1e-4)
    assert REGISTRY.get_sample_value("sparsekv_topk_duration_seconds_count") is None
    assert st.registry is not REGISTRY


def cuda_snapshot() -> dict:
    st = Stats()
    st.error("DUPLICATE_IDS")
    return st.snapshot({"hits": 5, "misses": 3, "bytes_moved": 3 * 656}, {
        "backend": "cuda", "devices": ["cuda:0", "cuda:1"], "mps": True, "protocol_version": 3, "version": "9.9",
        "device_errors": {"duplicate_ids": 2, "bad_state_row": 0},
        "arenas": {"cuda:0": {"bytes": 16 << 30, "used_bytes": 1 << 30, "deferred_frees": 2,
                               "deferred_free_bytes": 3 << 20}, "cuda:1": {"bytes": 16 << 30, "used_bytes": 0}},
        "clients": 4, "attached": 4, "engines": 2, "pool_bytes": 64 << 30, "pool_used_bytes": 10 << 30,
        "pool_huge_bytes": 63 << 30, "per_engine": {"a": {"ranks": 2, "pool_bytes": 6 << 30, "slab_bytes": 1 << 29},
                       'b "quoted"\\': {"ranks": 2, "pool_bytes": 4 << 30, "slab_bytes": 1 << 29}},
    })


def test_cuda_families_device_errors_arenas_and_labels():
    text = render_prometheus(registry_for(cuda_snapshot()))
    fams = promcheck.families(text)
    promcheck.promtool_check(text)
    v = promcheck.values(fams)
    assert v["sparsekv_hits_total"] == 5 and v["sparsekv_bytes_moved_total"] == 3 * 656
    assert v['sparsekv_device_errors_total{kind="duplicate_ids"}'] == 2
    assert v['sparsekv_device_arena_used_bytes{device="cuda:0"}'] == 1 << 30
    assert v['sparsekv_device_arena_bytes{device="cuda:1"}'] == 16 << 30
    assert v['sparsekv_deferred_free_bytes{device="cuda:0"}'] == 3 << 20
    assert v['sparsekv_deferred_free_bytes{device="cuda:1"}'] == 0
    assert v['sparsekv_engine_ranks{engine="a"}'] == 2
    assert v['sparsekv_build_info{backend="cuda",protocol="3",version="9.9"}'] == 1
    assert v["sparsekv_mps"] == 1 and v["sparsekv_pool_huge_bytes"] == 63 << 30
    # an engine name with quotes and a backslash is escaped, and parses back
    assert any(k.startswith("sparsekv_engine_pool_bytes{engine=") and 'quoted' in k for k in v)
    assert fams["sparsekv_device_errors"].type == "counter"


def test_the_daemon_readme_lists_every_metric_family_and_counter():
    """daemon/README.md's metrics table is the operator's list: every family a cuda
    snapshot renders (a superset of the cpu one's) and every counter of COUNTERS."""
    readme = (Path(__file__).resolve().parents[2] / "daemon" / "README.md").read_text()
    table = readme[readme.index("| metric | type | labels |"):]
    table = table[:table.index("\n\n")]
    named = set(re.findall(r"`(sparsekv_[a-z_]+)`", table))
    counters = re.search(r"`sparsekv_<counter>_total` \(([^)]*)\)", table).group(1)
    listed = set(re.findall(r"`([a-z_]+)`", counters))
    fams = promcheck.families(render_prometheus(registry_for(cuda_snapshot())))
    missing = sorted(f"{name}_total" if fam.type == "counter" else name for name, fam in fams.items()
                     if name.removeprefix("sparsekv_") not in listed and name not in named
                     and f"{name}_total" not in named)
    assert not missing, f"daemon/README.md's metrics table lacks {missing}"
    assert not {n for n, _ in COUNTERS} - listed - {"errors"}, "a counter of COUNTERS is not in the table"


def test_cpu_families_have_no_cuda_only_metrics():
    text = render_prometheus(registry_for(Stats().snapshot({}, {"backend": "cpu", "devices": ["cpu"]})))
    promcheck.families(text)
    promcheck.promtool_check(text)
    for name in ("sparsekv_device_errors", "sparsekv_device_arena_bytes", "sparsekv_mps"):
        assert name not in text


# -- the HTTP endpoint ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str):
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def tcp_listeners(pid: int) -> list:
    return [c.laddr for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]


def test_metrics_endpoint_on_loopback_serves_the_same_text(tmp_path):
    port = free_port()
    with PrivateDaemon(pool_bytes=64 << 20, extra_args=["--metrics-port", str(port)],
                       log_path=str(tmp_path / "d.log"), start_timeout_s=30) as d:
        with Client(d.run_dir, name="m") as c:
            c.attach(helpers.layout(), engine="e")
            c.step(0, [0])
            c.topk(0, 0, [[1, 2, -1, -1]])
            assert tcp_listeners(d.proc.pid) == [("127.0.0.1", port)]  # loopback only
            status, headers, body = http("GET", f"http://127.0.0.1:{port}/metrics")
            assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
            v = promcheck.values(promcheck.families(body))
            promcheck.promtool_check(body)
            assert v["sparsekv_misses_total"] == 2 and v["sparsekv_topk_duration_seconds_count"] == 1
            assert v['sparsekv_engine_ranks{engine="e"}'] == 1
            sock_text = helpers.stats_query(d.run_dir, "prometheus")
            assert promcheck.values(promcheck.families(sock_text))["sparsekv_misses_total"] == 2
            status, _, body = http("GET", f"http://127.0.0.1:{port}/metrics?x=1")
            assert status == 200 and "sparsekv_hits_total" in body
            assert http("HEAD", f"http://127.0.0.1:{port}/metrics")[0] == 200
            assert http("GET", f"http://127.0.0.1:{port}/")[0] == 404
            status, headers, _ = http("POST", f"http://127.0.0.1:{port}/metrics")
            assert status == 405 and headers["Allow"] == "GET, HEAD"
            # a client that connects and says nothing does not block the loop
            with socket.create_connection(("127.0.0.1", port)):
                assert helpers.stats_json(d.run_dir)["clients"] == 1
        assert f"metrics on http://127.0.0.1:{port}/metrics" in (tmp_path / "d.log").read_text()


def test_no_metrics_port_no_listener(daemon):
    assert tcp_listeners(daemon.proc.pid) == []


def test_metrics_port_in_use_fails_the_start_and_leaves_nothing(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(Exception, match="exited with code 1"):
            with PrivateDaemon(pool_bytes=64 << 20, extra_args=["--metrics-port", str(port)],
                               log_path=str(tmp_path / "d.log"), start_timeout_s=30):
                pass
    log = (tmp_path / "d.log").read_text()
    # Found by a review: the port was found taken only once the pool was pre-faulted (minutes
    # for a large one); now before it, naming the setting.
    assert f"cannot start: metrics_port {port} (flag --metrics-port): Address already in use" in log, log
    assert "pre-faulting" not in log


def test_a_second_daemon_with_the_same_metrics_port_is_told_of_the_first_not_the_port(tmp_path):
    """Found by a review: with the port checked before the run dir's lock, a second start
    on a served run dir said "Address already in use" instead of naming the daemon."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with PrivateDaemon(pool_bytes=64 << 20, extra_args=["--metrics-port", str(port)]) as d:
        r = subprocess.run([sys.executable, "-m", "sparsekv.daemon.main", "--backend", "cpu", "--pool-size", "64MiB",
                            "--run-dir", d.run_dir, "--metrics-port", str(port)], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 1 and "another sparsekvd" in r.stderr and "metrics_port" not in r.stderr, r.stderr
