"""The operator listeners' limits (daemon/operator_requests.py): the stats socket and the
HTTP ``/metrics`` endpoint count their connections apart, the stats socket gives each uid
a share (and operators a reserve), a silent connection is closed after 1 s, and one
beyond a limit is answered busy (a line; 503) instead of closed without a word. Found by an
adversarial review: 32 idle connections of any local user, on either listener, locked
the operator, Prometheus and ``sparsekv health`` out of both for as long as they were
held."""

import os
import socket
import subprocess
import sys
import time

import pytest

import cli_inproc
import fake_stats
import helpers
from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.cli.health import READY, StatsSocketError, probe, stats_query
from sparsekv.daemon import operator_requests as ops
from sparsekv.daemon.peers import Peer
from sparsekv.daemon.uid_slots import UidSlots


def peer(uid: int) -> Peer:
    return Peer(uid, uid, 1000 + uid, True)


# -- the stats socket's slots, by uid (daemon/uid_slots.py) --------------------------------
def test_one_uid_gets_its_share_and_operators_their_reserve():
    slots = UidSlots(lambda p: p.uid == 0, max_open=32, per_uid=8, reserved=8, what="stats socket connections")
    mine = [slots.take(peer(1000)) for _ in range(8)]
    assert mine == [(False, "")] * 8
    held, why = slots.take(peer(1000))
    assert held is None and why == "uid 1000 has 8 stats socket connections open, its share of the 32"
    for uid in (1001, 1002, 1003):  # three more uids take the rest
        assert [slots.take(peer(uid))[0] for _ in range(8)] == [False] * 8
    assert slots.open == 32
    held, why = slots.take(peer(1004))  # a fifth uid: nothing left but the operators' reserve
    assert held is None and why == "32 stats socket connections open (at most 32, 8 a uid)"
    assert [slots.take(peer(0))[0] for _ in range(8)] == [True] * 8  # root: the reserve
    assert slots.take(peer(0))[0] is None and slots.open == 40  # the bound on descriptors
    slots.give(peer(1000), False)
    assert slots.take(peer(1004)) == (False, "")  # a slot given back is anyone's
    slots.give(peer(0), True)
    assert slots.take(peer(0)) == (True, "")
    assert slots.by_uid[1000] == 7 and slots.by_uid[1004] == 1


def test_operators_are_asked_about_only_when_a_connection_would_be_refused():
    asked = []
    slots = UidSlots(lambda p: asked.append(p.uid) or False, max_open=4, per_uid=2, reserved=1, what="connections")
    assert slots.take(peer(5)) == (False, "") and not asked
    for _ in range(3):
        slots.take(peer(6))
    assert asked == [6]  # its third: refused (not an operator)


def test_the_defaults_leave_room_for_four_uids_and_the_operators():
    assert (ops.STATS_MAX_OPEN, ops.STATS_PER_UID, ops.STATS_RESERVED, ops.HTTP_MAX_OPEN) == (32, 8, 8, 32)
    assert ops.REQUEST_TIMEOUT_S == 1.0


# -- the command line's side: an explicit busy line --------------------------------------
@pytest.mark.parametrize("reads_command", [False, True])
def test_a_busy_line_is_busy_for_the_stats_commands_and_ready_for_health(tmp_path, reads_command):
    """The daemon answers ``error: busy: ...`` and closes, its command unread (the client's
    next read is a reset) or read."""
    def answer(c):
        if reads_command:
            c.recv(100)
        else:
            time.sleep(0.05)  # the command is there, unread, when the daemon closes
        c.sendall(b"error: busy: 32 stats socket connections open (at most 32, 8 a uid); try again\n")
        c.close()

    with fake_stats.fake_stats_socket(str(tmp_path), answer):
        with pytest.raises(StatsSocketError) as ei:
            stats_query(str(tmp_path), "json", 2.0)
        assert ei.value.kind == "busy"
        assert str(ei.value) == (f"daemon at {tmp_path}/stats.sock is busy: 32 stats socket connections open "
                                 "(at most 32, 8 a uid); try again")
        h = probe(str(tmp_path), 2.0)
        assert h.code == READY and "is busy: 32 stats socket connections" in h.message
        for command in ("stats", "clients"):
            r = cli_inproc.run(command, "--run-dir", tmp_path)
            assert r.returncode == 1 and r.stdout == "" and "is busy: 32 stats socket" in r.stderr, r
        assert cli_inproc.run("health", "--run-dir", tmp_path).returncode == 0


# -- a real daemon -------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def metrics_daemon(tmp_path):
    port = free_port()
    with PrivateDaemon(pool_bytes=16 << 20, backend="cpu", extra_args=["--metrics-port", str(port)],
                       log_path=str(tmp_path / "d.log"), start_timeout_s=30) as d:
        yield d, port


def http_get(port: int, path: str = "/metrics") -> bytes:
    """One request; the whole answer (a reset after it, as a busy endpoint's, is fine)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        try:
            s.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        except (BrokenPipeError, ConnectionResetError):
            pass
        out = b""
        try:
            while b := s.recv(65536):
                out += b
        except ConnectionResetError:
            pass
    return out


def closed_within(socks, timeout_s: float) -> float:
    """Seconds until the daemon closed every one of ``socks`` (none of them said a word)."""
    t0 = time.monotonic()
    for s in socks:
        s.settimeout(max(0.01, timeout_s - (time.monotonic() - t0)))
        try:
            assert s.recv(1) == b""
        except ConnectionResetError:
            pass
    return time.monotonic() - t0


def test_idle_http_connections_get_503_and_leave_the_stats_socket_served(metrics_daemon):
    """32 silent connections to /metrics: the 33rd is answered 503 with Retry-After; the
    stats socket answers all along; the silent ones are closed after 1 s (was 5 s, and the
    stats socket closed every connection without a word)."""
    d, port = metrics_daemon
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(ops.HTTP_MAX_OPEN)]
    try:
        time.sleep(0.05)  # all accepted
        assert stats_query(d.run_dir, "health").startswith("ready pid=")
        # Then the 33rd: busy, so the 32 were held when the stats socket answered (they
        # never reconnect; only the request timeout closes them).
        answer = http_get(port).decode()
        head = answer.split("\r\n")
        assert head[0] == "HTTP/1.0 503 Service Unavailable" and "Retry-After: 1" in head, answer
        assert answer.endswith("busy: 32 connections open (at most 32); try again\n")
        snap = helpers.stats_json(d.run_dir)
        assert (snap["metrics_connections_refused"], snap["stats_connections_refused"]) == (1, 0)
        assert closed_within(held, 4.0) < 3.0
    finally:
        for s in held:
            s.close()
    assert http_get(port).startswith(b"HTTP/1.0 200 OK")
    assert "sparsekv_metrics_connections_refused_total 1.0" in http_get(port).decode()


def test_idle_stats_connections_of_one_uid_get_a_busy_line_and_leave_http_served(metrics_daemon):
    """This test's uid (root, or the daemon's own: an operator) holds its share and the
    operators' reserve, 16 in all: the 17th is answered busy, which `sparsekv stats` says
    (exit 1) and `sparsekv health` counts as ready; /metrics answers all along."""
    d, port = metrics_daemon
    path = f"{d.run_dir}/stats.sock"
    n = ops.STATS_PER_UID + ops.STATS_RESERVED
    held = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            held.append(s)
        time.sleep(0.05)  # all accepted
        assert http_get(port).startswith(b"HTTP/1.0 200 OK")
        assert cli_inproc.run("health", "--run-dir", d.run_dir).returncode == 0
        # Then the busy answers: the 16 were held when those two were answered (they never
        # reconnect; only the request timeout closes them).
        r = cli_inproc.run("stats", "--run-dir", d.run_dir)
        assert r.returncode == 1 and "is busy: uid" in r.stderr, r
        with pytest.raises(StatsSocketError) as ei:
            stats_query(d.run_dir, "json")
        assert ei.value.kind == "busy" and str(ei.value).endswith(
            "is busy: uid %d has 8 stats socket connections open, its share of the 32; try again" % os.getuid())
        assert closed_within(held, 4.0) < 3.0
    finally:
        for s in held:
            s.close()
    snap = helpers.stats_json(d.run_dir)
    assert (snap["stats_connections_refused"], snap["metrics_connections_refused"]) == (3, 0)
    assert "operator busy  3 stats socket, 0 HTTP connections refused" in stats_query(d.run_dir, "stats")


# Run as another uid: at the go line, hold N silent connections to the stats socket, then
# ask once more and print the answer; then print how long the daemon took to close them.
# N = 0: only the one question.
HOLDER = r"""
import socket, sys, time
path, n = sys.argv[1], int(sys.argv[2])
print("up", flush=True)
sys.stdin.readline()
held = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    held.append(s)
t0 = time.monotonic()
time.sleep(0.05)
s = socket.socket(socket.AF_UNIX)
s.settimeout(5)
s.connect(path)
try:
    s.sendall(b"health\n")
except OSError:
    pass
out = b""
try:
    while b := s.recv(4096):
        out += b
except ConnectionResetError:
    pass
print(out.decode().strip() or "(nothing)", flush=True)
for s in held:
    s.settimeout(5)
    try:
        s.recv(1)
    except OSError:
        pass
print(f"{time.monotonic() - t0:.2f}", flush=True)
"""


@pytest.mark.skipif(helpers.why_not_other_users() is not None, reason=str(helpers.why_not_other_users()))
def test_other_uids_filling_the_stats_socket_lock_out_neither_root_nor_http(metrics_daemon):
    """Four uids hold their share each (8, the 32 shared slots): each one's 9th is busy,
    naming its share; a fifth uid is busy (all 32 open); root is still answered (the
    operators' reserve), and so is /metrics. Before: one uid's 32 locked out everyone."""
    d, port = metrics_daemon
    helpers.open_to_other_users(d.run_dir, "stats.sock")
    path = f"{d.run_dir}/stats.sock"
    uids = (65531, 65532, 65533, 65534)
    procs = [subprocess.Popen([*helpers.as_user(uid), sys.executable, "-c", HOLDER, path, str(n)], cwd="/tmp",
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for uid, n in [*((u, ops.STATS_PER_UID) for u in uids), (65530, 0)]]
    try:
        for p in procs:
            assert p.stdout.readline() == "up\n"
        for p in procs[:4]:  # every holder at once
            p.stdin.write("go\n")
            p.stdin.flush()
        for uid, p in zip(uids, procs):
            assert p.stdout.readline().strip() == (f"error: busy: uid {uid} has 8 stats socket connections open, "
                                                   "its share of the 32; try again")
        assert stats_query(d.run_dir, "health").startswith("ready pid=")  # root: the reserve
        assert probe(d.run_dir).message.startswith("ready pid=")
        assert http_get(port).startswith(b"HTTP/1.0 200 OK")
        # Then the fifth uid: busy, all 32 open, so they were held when root was answered.
        procs[4].stdin.write("go\n")
        procs[4].stdin.flush()
        assert procs[4].stdout.readline().strip() == ("error: busy: 32 stats socket connections open (at most 32, "
                                                      "8 a uid); try again")
        for p in procs[:4]:
            assert float(p.stdout.readline()) < 3.0  # the silent ones closed after 1 s
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert helpers.stats_json(d.run_dir)["stats_connections_refused"] == 5


def test_a_command_line_too_long_is_answered_and_logs_no_error(metrics_daemon, tmp_path):
    """70 KB without a newline on the stats socket (over its reader's 64 KiB): one line
    `error: command too long …`, then closed; on HTTP, a request head as long: 431. Before:
    the stats socket's readline() raised ValueError, uncaught: no answer, and asyncio logged
    "Unhandled exception in client_connected_cb" at ERROR with a traceback, each connection."""
    d, port = metrics_daemon
    for _ in range(3):
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(os.path.join(d.run_dir, "stats.sock"))
            s.sendall(b"x" * 70_000)
            answer = b""
            try:
                while b := s.recv(4096):
                    answer += b
            except ConnectionResetError:
                pass
        assert answer == (b"error: command too long (no newline within 65536 bytes); try stats, json, prometheus, "
                          b"clients, blocks, health\n")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET /metrics HTTP/1.0\r\nX: " + b"x" * 70_000)
            answer = b""
            try:
                while b := s.recv(4096):
                    answer += b
            except ConnectionResetError:
                pass
        # (b"": a reset, should the close find bytes of the head still unread)
        assert answer == b"" or answer.startswith(b"HTTP/1.0 431 Request Header Fields Too Large\r\n"), answer
    assert stats_query(d.run_dir, "health").startswith("ready")
    assert http_get(port).startswith(b"HTTP/1.0 200 OK")
    log = (tmp_path / "d.log").read_text()
    assert " ERROR " not in log and "Traceback" not in log and "Unhandled" not in log, log


def test_an_empty_request_line_is_a_bad_request_not_a_handler_crash(metrics_daemon, tmp_path):
    """Found by an adversarial review: ``\\r\\n\\r\\n`` (no request line) raised IndexError in
    the handler (no answer, seven ERROR lines in the log a request, for any local user)."""
    d, port = metrics_daemon
    for raw in (b"\r\n\r\n", b" \r\n\r\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(raw)
            out = b""
            while b := s.recv(65536):
                out += b
        assert out.startswith(b"HTTP/1.0 400 Bad Request") and out.endswith(b"bad request line\n"), out
    assert http_get(port).startswith(b"HTTP/1.0 200 OK")
    assert "Traceback" not in (tmp_path / "d.log").read_text()
