"""RUN_DIR/stats.sock of a real daemon (stats, json, prometheus, clients, unknown
commands) and the ``sparsekv stats`` / ``sparsekv clients`` commands that read it."""

import json
import os
import subprocess
import sys

import pytest

import cli_inproc
import helpers
import promcheck
from sparsekv.client import BadRequest, Client

LAYOUT = helpers.layout(num_layers=2, row_bytes=32, top_k=4, region_stride=8, max_reqs=2, host_rows=128)


@pytest.fixture(scope="module")
def busy(module_daemon):
    """Two clients (this process as rank 0, a spawned process as rank 3) on one engine,
    after one step with hits, misses, an out-of-range id and one error. Shared by the
    tests of this module, which only read the daemon's figures."""
    daemon = module_daemon
    c = Client(daemon.run_dir, rank=0, name="main", timeout_s=10).connect()
    other = helpers.RankProc(daemon.run_dir, 3, name="other")
    try:
        c.attach(LAYOUT, engine="e")
        other.call("connect")
        other.call("attach", layout=LAYOUT.to_wire(), engine="e")
        c.step(0, [0])
        c.topk(0, 0, [[1, 2, 3, 999]])  # 3 misses, 1 out of range
        c.step(1, [0])
        c.topk(1, 0, [[1, 2, 5, -1]])  # 2 hits, 1 miss
        with pytest.raises(BadRequest, match="DUPLICATE_IDS"):
            c.topk(1, 0, [[1, 1, -1, -1]])
        yield daemon, c, other
    finally:
        other.close()
        c.close()


def test_json_has_every_counter_and_gauge(busy):
    daemon, c, other = busy
    s = json.loads(helpers.stats_query(daemon.run_dir, "json"))
    assert (s["hits"], s["misses"], s["out_of_range"]) == (2, 4, 1)
    assert s["rows_moved"] == 4 and s["bytes_moved"] == 4 * 32
    assert s["errors_by_code"] == {"DUPLICATE_IDS": 1} and s["errors"] == 1
    assert s["clients"] == 2 and s["attached"] == 2 and s["engines"] == 1
    assert s["pool_bytes"] == 64 << 20 and s["pool_used_bytes"] >= LAYOUT.pool_bytes
    assert 0 <= s["pool_huge_bytes"] <= s["pool_bytes"] and s["pool_huge_bytes"] % (2 << 20) == 0
    assert s["hit_rate"] == pytest.approx(2 / 6)
    assert s["backend"] == "cpu" and s["pid"] == daemon.proc.pid
    assert s["topk_latency_us"]["n"] >= 2 and s["topk_latency_us"]["p99"] >= s["topk_latency_us"]["p50"] > 0


def test_stats_table_is_human_readable(busy):
    daemon, *_ = busy
    out = helpers.stats_query(daemon.run_dir, "stats")
    assert "hit rate       33.33 %  (2 hits, 4 misses)" in out
    assert "out of range   1" in out
    assert "errors         1  DUPLICATE_IDS=1" in out
    s = json.loads(helpers.stats_query(daemon.run_dir, "json"))
    assert f"MiB used, {s['pool_huge_bytes'] * 100 // s['pool_bytes']} % in huge pages" in out


def test_empty_command_means_stats(busy):
    daemon, *_ = busy
    assert helpers.stats_query(daemon.run_dir, "").startswith("backend        cpu")


def test_prometheus_is_parsed_by_prometheus_client_and_promtool(busy):
    daemon, *_ = busy
    text = helpers.stats_query(daemon.run_dir, "prometheus")
    assert text.endswith("\n")
    fams = promcheck.families(text)  # prometheus_client's own parser
    promcheck.promtool_check(text)  # `promtool check metrics` (skips its part when not installed)
    v = promcheck.values(fams)
    assert v["sparsekv_hits_total"] == 2 and v["sparsekv_misses_total"] == 4
    assert v["sparsekv_bytes_moved_total"] == 4 * 32 and v["sparsekv_out_of_range_total"] == 1
    assert v['sparsekv_errors_total{code="DUPLICATE_IDS"}'] == 1
    assert v['sparsekv_errors_total{code="POOL_FULL"}'] == 0  # every code, before its first error
    assert "sparsekv_errors_by_code_total" not in text  # one errors family
    assert v["sparsekv_pool_bytes"] == 64 << 20 and v["sparsekv_clients"] == 2
    assert v['sparsekv_engine_ranks{engine="e"}'] == 2
    assert v['sparsekv_engine_pool_bytes{engine="e"}'] == LAYOUT.pool_bytes
    assert v['sparsekv_engine_slab_bytes{engine="e"}'] == 2 * LAYOUT.slab_bytes
    info = [s for s in fams["sparsekv_build_info"].samples]
    assert len(info) == 1 and info[0].labels["backend"] == "cpu" and info[0].labels["version"]
    assert info[0].labels["protocol"] and info[0].value == 1
    assert fams["sparsekv_hits"].type == "counter" and fams["sparsekv_clients"].type == "gauge"
    hist = fams["sparsekv_topk_duration_seconds"]
    assert hist.type == "histogram"
    assert v["sparsekv_topk_duration_seconds_count"] == 2  # the two answered top-k batches
    assert v['sparsekv_topk_duration_seconds_bucket{le="+Inf"}'] == 2
    assert v["sparsekv_topk_duration_seconds_sum"] > 0
    # seconds since the epoch, not an uptime that resets the series' meaning
    assert abs(v["sparsekv_start_time_seconds"] - helpers.stats_json(daemon.run_dir)["start_time_s"]) < 1e-3


def test_health_command_answers_ready(daemon):
    assert helpers.stats_query(daemon.run_dir, "health").startswith(f"ready pid={daemon.proc.pid}")


def parse_clients(text):
    lines = text.splitlines()
    header = lines[0].split("\t")
    assert header[:3] == ["id", "pid", "rank"]
    return [dict(zip(header, line.split("\t"), strict=True)) for line in lines[1:]]


def test_clients_lists_one_line_per_client_with_pid_and_rank(busy):
    daemon, c, other = busy
    rows = parse_clients(helpers.stats_query(daemon.run_dir, "clients"))
    assert {(r["pid"], r["rank"], r["name"]) for r in rows} == {(str(os.getpid()), "0", "main"),
                                                                 (str(other.pid), "3", "other")}
    assert all(r["engine"] == "e" and r["attached"] == "yes" for r in rows)
    # per-client counters (``sparsekv top`` shows their rates): main sent HELLO, ATTACH, two
    # TOPK each carrying its step's STEP, and one refused TOPK; as the daemon's own count,
    # HELLO and the refused one included
    by_name = {r["name"]: r for r in rows}
    assert by_name["main"]["errors"] == "1" and by_name["other"]["errors"] == "0"
    assert by_name["main"]["requests"] == "5" and by_name["other"]["requests"] == "2"


def test_json_has_per_engine_use_and_the_histogram_totals(busy):
    daemon, *_ = busy
    s = helpers.stats_json(daemon.run_dir)
    assert s["per_engine"] == {"e": {"ranks": 2, "pool_bytes": LAYOUT.pool_bytes, "slab_bytes": 2 * LAYOUT.slab_bytes,
                                     "tp_size": 1, "tp_lag": 0}}
    assert s["topk_seconds_count"] == 2 and s["topk_seconds_sum"] > 0
    assert s["version"] and "arenas" not in s  # cpu: no device arenas


def test_unknown_command_gives_an_error_line(daemon):
    out = helpers.stats_query(daemon.run_dir, "bogus")
    assert out.startswith("error: unknown command 'bogus'") and out.endswith("\n") and out.count("\n") == 1
    assert "stats, json, prometheus, clients, blocks, health" in out
    # the socket keeps serving
    assert json.loads(helpers.stats_query(daemon.run_dir, "json"))["clients"] == 0


def test_cli_stats_json_and_clients(busy):
    daemon, c, other = busy
    r = cli_inproc.run("stats", "--json", "--run-dir", daemon.run_dir)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert (s["hits"], s["misses"], s["clients"]) == (2, 4, 2)
    # the installed console script
    script = os.path.join(os.path.dirname(sys.executable), "sparsekv")
    r = subprocess.run([script, "clients", "--run-dir", daemon.run_dir], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert {(row["pid"], row["rank"]) for row in parse_clients(r.stdout)} == {(str(os.getpid()), "0"),
                                                                              (str(other.pid), "3")}
    r = cli_inproc.run("stats", "--prometheus", "--run-dir", daemon.run_dir)
    assert r.returncode == 0 and "sparsekv_hits_total 2" in r.stdout
    r = cli_inproc.run("stats", "--run-dir", daemon.run_dir)
    assert r.returncode == 0 and "hit rate" in r.stdout


def test_cli_without_daemon_says_so(tmp_path):
    r = cli_inproc.run("stats", "--json", "--run-dir", str(tmp_path))
    assert r.returncode == 1
    assert f"no daemon at {tmp_path}/stats.sock" in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_mps_state_is_shown_for_the_cuda_backend():
    """Operators see at a glance when MPS is off (every GPU hand-off then costs ~300 us)."""
    from sparsekv.daemon.stats import Stats, registry_for, render_prometheus, render_table

    snap = Stats().snapshot({}, {"backend": "cuda", "devices": ["cuda:0"], "mps": False})
    assert "MPS OFF" in render_table(snap)
    assert "sparsekv_mps 0.0" in render_prometheus(registry_for(snap)).splitlines()
    cpu = Stats().snapshot({}, {"backend": "cpu", "devices": ["cpu"]})
    assert "MPS" not in render_table(cpu) and "sparsekv_mps" not in render_prometheus(registry_for(cpu))


def test_an_engine_name_is_kept_apart_from_its_rank_count_in_the_table():
    """Found by an operator's review: "engine deepseek-v3.21 rank(s)" for deepseek-v3.2 and one rank."""
    from sparsekv.daemon.stats import Stats, render_table

    engine = {"ranks": 1, "pool_bytes": 2 << 20, "slab_bytes": 1 << 20}
    snap = Stats().snapshot({}, {"backend": "cpu", "devices": ["cpu"],
                                 "per_engine": {"deepseek-v3.2": engine, "short": engine}})
    table = render_table(snap)
    assert "engine deepseek-v3.2 1 rank(s), pool 2.0 MiB" in table
    assert "engine short    1 rank(s)" in table


def test_a_daemon_that_served_no_top_k_shows_no_hit_rate_or_latency():
    """Found by an operator's look at a fresh daemon: "hit rate 0.00 %" and "p50 0 us"
    before any top-k, as if every lookup had missed in no time."""
    from sparsekv.daemon.stats import Stats, render_table

    stats = Stats()
    table = render_table(stats.snapshot({}, {"backend": "cpu", "devices": ["cpu"]}))
    assert "hit rate       -  (0 hits, 0 misses)" in table
    assert "top-k latency  p50 -  p99 -  (last 0)" in table
    stats.add(hits=3, misses=1)
    stats.latency(40e-6)
    table = render_table(stats.snapshot({}, {"backend": "cpu", "devices": ["cpu"]}))
    assert "hit rate       75.00 %  (3 hits, 1 misses)" in table
    assert "top-k latency  p50 40 us  p99 40 us  (last 1)" in table


# The stats socket's `clients` answer, asked by this script's user.
CLIENTS_QUERY = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(5)
s.connect(sys.argv[1] + "/stats.sock")
s.sendall(b"clients\n")
out = b""
while b := s.recv(65536):
    out += b
sys.stdout.write(out.decode())
"""


@pytest.mark.skipif(helpers.why_not_other_users() is not None, reason=str(helpers.why_not_other_users()))
def test_the_clients_listing_shows_other_uids_clients_only_to_root_and_the_admin_group(tmp_path):
    from sparsekv.bench.private_daemon import PrivateDaemon

    admin = 4242
    with PrivateDaemon(pool_bytes=16 << 20, backend="cpu", extra_args=["--admin-gid", str(admin)],
                       log_path=str(tmp_path / "d.log"), start_timeout_s=30) as d, Client(d.run_dir, name="rootc"):
        helpers.open_to_other_users(d.run_dir, "control.sock", "stats.sock")
        nobody, (hello,) = helpers.raw_client(d.run_dir, 1, [], uid=65534)
        try:
            assert hello["ok"], hello

            def seen(uid=None, groups=()):
                r = subprocess.run([*helpers.as_user(uid, groups), sys.executable, "-c", CLIENTS_QUERY, d.run_dir],
                                   capture_output=True, text=True, timeout=30, cwd="/tmp")
                assert r.returncode == 0, r.stderr
                return sorted((row["uid"], row["name"]) for row in parse_clients(r.stdout))

            both = [("0", "rootc"), ("65534", "raw")]
            assert seen() == both  # root
            assert seen(65534) == [("65534", "raw")]  # its own only
            assert seen(65533) == []  # a member of the daemon's group, no client of its own
            assert seen(65533, groups=(admin,)) == both  # the admin group
        finally:
            nobody.kill()
            nobody.wait()
