"""The operator's commands: ``sparsekv health`` (exit 0 ready / 1 starting / 2 unreachable,
``--live``), ``sparsekv top`` (rates of one interval), ``--version``, help text with
defaults for every option, and one line on stderr — never a traceback — for the common
mistakes (no daemon, a wrong run dir, a pool too small for a layout, no permission)."""

import argparse
import fcntl
import importlib.metadata
import io
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time

import pytest

import cli_inproc
import helpers
from fake_stats import fake_stats_socket
from sparsekv.cli import main as cli
from sparsekv.client import BadRequest, Client
from sparsekv.proto import ErrorCode
from sparsekv.cli import health as health_mod
from sparsekv.cli import top as top_mod

LAYOUT = helpers.layout(num_layers=2, row_bytes=32, top_k=4, region_stride=8, max_reqs=2, host_rows=128)


def one_line_error(r, returncode: int = 1) -> str:
    assert r.returncode == returncode, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    return r.stderr


# -- version and help ----------------------------------------------------------------------
def test_version():
    r = helpers.run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"sparsekv {importlib.metadata.version('sparsekv')}"


def all_parsers(p: argparse.ArgumentParser):
    yield p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                yield from all_parsers(sub)


def test_every_option_has_help_and_shows_its_default():
    for p in all_parsers(cli.build_parser()):
        fmt = p._get_formatter()
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert a.help, f"{p.prog} {a.option_strings or a.dest}: no help"
            switch = isinstance(a, (argparse._StoreTrueAction, argparse._VersionAction))
            if a.option_strings and not a.required and not switch:
                shown = fmt._expand_help(a) if hasattr(fmt, "_expand_help") else a.help
                assert "default" in shown, f"{p.prog} {a.option_strings}: {shown!r} shows no default"


def test_help_runs_for_every_command():
    assert cli_inproc.run("--help").returncode == 0
    for args in (["top", "--help"], ["health", "--help"], ["trace", "synth", "--help"], ["stats", "--help"]):
        r = cli_inproc.run(*args)
        assert r.returncode == 0 and "default" in r.stdout, args


# -- health --------------------------------------------------------------------------------
def test_health_ready(module_daemon):
    r = cli_inproc.run("health", "--run-dir", module_daemon.run_dir)
    assert r.returncode == 0 and r.stdout.startswith(f"ready pid={module_daemon.proc.pid}"), r.stderr
    assert cli_inproc.run("health", "--live", "--quiet", "--run-dir", module_daemon.run_dir).returncode == 0


def test_health_without_daemon_is_2(tmp_path):
    r = cli_inproc.run("health", "--run-dir", tmp_path)
    assert "no daemon at" in one_line_error(r, 2)
    assert cli_inproc.run("health", "--live", "--run-dir", tmp_path).returncode == 2
    r = cli_inproc.run("health", "--run-dir", tmp_path / "nope")
    assert "does not exist" in one_line_error(r, 2)


@pytest.fixture
def starting_daemon(tmp_path):
    """A run dir as a daemon leaves it while it pre-faults: the lock held (by this
    process, as sparsekvd holds it), its pid in the file, no sockets yet."""
    run = tmp_path / "run"
    run.mkdir()
    fd = os.open(run / "sparsekvd.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    yield run
    os.close(fd)


def test_health_while_starting_is_1_and_alive(starting_daemon):
    r = helpers.run_cli("health", "--run-dir", starting_daemon)
    assert f"pid {os.getpid()}" in one_line_error(r, 1) and "does not serve yet" in r.stderr
    r = helpers.run_cli("health", "--live", "--run-dir", starting_daemon)
    assert r.returncode == 0 and "starting" in r.stdout
    # a stale socket of a killed daemon (nobody listens) does not change that
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(starting_daemon / "stats.sock"))  # bound, never listening: connect is refused
        assert helpers.run_cli("health", "--run-dir", starting_daemon).returncode == 1


def test_health_after_a_killed_daemon_is_2(tmp_path):
    """Its lock file (with a pid) is left behind, but nobody holds the lock."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "sparsekvd.lock").write_text(f"{os.getpid()}\n")  # a live pid, but no flock
    assert health_mod.lock_holder(str(run)) is None
    assert cli_inproc.run("health", "--live", "--run-dir", run).returncode == 2


def test_without_proc_locks_a_lock_file_naming_a_reused_pid_is_stale(tmp_path, monkeypatch):
    """With /proc/locks unreadable the pid in the lock file is believed while it lives, but
    not when that process began after the file was written (a dead daemon's pid, reused)."""
    from sparsekv.proto import run_dir as run_dir_mod

    monkeypatch.setattr(run_dir_mod, "_flock_held", lambda st: None)  # cannot tell
    run = tmp_path / "run"
    run.mkdir()
    lock = run / "sparsekvd.lock"
    lock.write_text(f"{os.getpid()}\n")
    assert run_dir_mod.lock_holder(str(run)) == os.getpid()  # written after this process began
    os.utime(lock, (1e9, 1e9))  # written in 2001: before this process began
    assert run_dir_mod.lock_holder(str(run)) is None


def test_a_client_says_a_starting_daemon_is_starting(starting_daemon):
    """Found by an operator's review: an engine that connected while the daemon pre-faulted
    was told there was no daemon at all."""
    from sparsekv.client import DaemonUnavailable

    with pytest.raises(DaemonUnavailable, match=rf"sparsekvd \(pid {os.getpid()}\) holds {starting_daemon} but has "
                       r"no control socket: it is starting \(pre-faulting its pool or starting its backend\) or "
                       r"stopping"):
        Client(str(starting_daemon)).connect()


@pytest.mark.parametrize("command", [["stats"], ["stats", "--json"], ["clients"], ["top", "--once"]])
def test_the_stats_commands_say_a_starting_daemon_is_starting(starting_daemon, command):
    err = one_line_error(cli_inproc.run(*command, "--run-dir", starting_daemon))
    assert err.startswith(f"sparsekv {command[0]}: starting: sparsekvd (pid {os.getpid()})"), err
    assert "no daemon" not in err


def test_health_never_takes_the_lock(starting_daemon):
    """Probing while a daemon starts must not make it lose its own run dir."""
    before = open("/proc/locks").read().count("FLOCK")
    assert health_mod.probe(str(starting_daemon)).code == health_mod.NOT_READY
    assert open("/proc/locks").read().count("FLOCK") == before


def test_health_of_a_daemon_that_does_not_answer_is_2_within_the_timeout(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(run / "stats.sock"))
        s.listen()  # accepts, never answers: a stuck loop
        t0 = time.monotonic()
        r = cli_inproc.run("health", "--timeout-s", "0.3", "--run-dir", run)
        assert time.monotonic() - t0 < 10
    assert "did not answer within 0.3 s" in one_line_error(r, 2)


# -- common mistakes: one line, no traceback -----------------------------------------------
def test_permission_denied_on_the_socket_is_one_line(monkeypatch, capsys, module_daemon):
    def refuse(self, address):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    assert cli.main(["stats", "--run-dir", module_daemon.run_dir]) == 1
    err = capsys.readouterr().err
    assert err.startswith("sparsekv stats: permission denied on ") and err.count("\n") == 1
    assert "mode 0660" in err and "group" in err
    assert cli.main(["health", "--run-dir", module_daemon.run_dir]) == 2
    assert "permission denied" in capsys.readouterr().err


@pytest.fixture(scope="module")
def big_trace(tmp_path_factory):
    """A trace whose layout needs 128 MiB of pool (the test daemon has 64)."""
    path = tmp_path_factory.mktemp("trace") / "big.npz"
    r = cli_inproc.run("trace", "synth", "--out", path, "--steps", 2, "--batch", 2, "--top-k", 8,
                       "--region-stride", 16, "--max-reqs", 4, "--host-rows", 1 << 20, "--row-bytes", 64,
                       "--num-layers", 2, "--context", 64)
    assert r.returncode == 0, r.stderr
    return path


def test_replay_to_a_pool_too_small_is_one_line(module_daemon, big_trace, tmp_path):
    r = cli_inproc.run("replay", big_trace, "--out", tmp_path / "r.npz", "--transport", "zmq",
                       "--connect", module_daemon.run_dir)
    err = one_line_error(r)
    assert err.startswith("sparsekv replay: POOL_FULL: ") and "--pool-size" in err


def test_replay_to_a_wrong_run_dir_is_one_line_and_not_internal(big_trace, tmp_path):
    r = cli_inproc.run("replay", big_trace, "--out", tmp_path / "r.npz", "--transport", "zmq",
                       "--connect", tmp_path / "nowhere")
    err = one_line_error(r)
    assert err.startswith("sparsekv replay: no daemon socket at ") and "INTERNAL" not in err


def test_stats_with_a_wrong_run_dir_is_one_line(tmp_path):
    err = one_line_error(cli_inproc.run("clients", "--run-dir", tmp_path / "nope"))
    assert err.startswith("sparsekv clients: no daemon at ") and "does not exist" in err


def test_clients_json_is_a_list_of_clients(module_daemon):
    with Client(module_daemon.run_dir, rank=1, name="json-reader", timeout_s=10) as c:
        c.attach(LAYOUT, engine="e")
        r = cli_inproc.run("clients", "--json", "--run-dir", module_daemon.run_dir)
    assert r.returncode == 0, r.stderr
    clients = json.loads(r.stdout)
    me = next(x for x in clients if x["name"] == "json-reader")
    assert me["pid"] == os.getpid() and me["rank"] == 1 and me["engine"] == "e" and me["attached"] is True


def test_clients_json_cells_have_json_types():
    assert [cli._json_value(k, v) for k, v in (("attached", "no"), ("engine", "-"), ("pid", "12"), ("name", "-"),
                                               ("device", "cpu"), ("uid", "-3"))] == [False, None, 12, "", "cpu", -3]


def test_names_a_client_chose_stay_text_in_json():
    """Found by a review: the name "007" came out as 7, and "²" (a digit to str.isdigit)
    failed the whole command."""
    for key in ("name", "engine", "device"):  # (device: found by an adversarial review, "12" became 12)
        for text in ("007", "²", "12"):
            assert cli._json_value(key, text) == text
    assert cli._json_value("pid", "²") == "²"


def refused_in_client_and_hello(run_dir, name: str, words: str) -> None:
    """A client ``name`` refused (BAD_ARGUMENT, ``words``) by the client when made, and by the
    daemon in HELLO when a client sends it anyway (the client's check bypassed)."""
    with pytest.raises(BadRequest, match=re.escape(words)) as ei:
        Client(run_dir, name=name)
    assert ei.value.code == ErrorCode.BAD_ARGUMENT
    c = Client(run_dir)
    c.name = name
    with pytest.raises(BadRequest, match=re.escape(words)):
        c.connect()
    c.close()


def test_a_client_name_with_a_line_separator_is_refused_and_no_row_is_forged(module_daemon):
    """The client refuses such a name when made; a client that sends it anyway (the check
    bypassed) is refused in HELLO: the listing never shows it."""
    refused_in_client_and_hello(module_daemon.run_dir, "x\u2028forged\x85y",
                                "name must be text without control characters")
    r = cli_inproc.run("clients", "--json", "--run-dir", module_daemon.run_dir)
    assert r.returncode == 0, r.stderr
    assert not [row for row in json.loads(r.stdout) if "forged" in str(row.get("name"))]


def test_a_client_named_dash_is_refused_and_an_empty_name_lists_as_empty(module_daemon):
    """The tables show an empty name as "-": a client named "-" (in the client, and in HELLO
    when the client's check is bypassed) is refused, so "-" in the name column means empty,
    and ``--json`` gives it as ""."""
    refused_in_client_and_hello(module_daemon.run_dir, "-", 'name must not be "-"')
    with Client(module_daemon.run_dir, rank=3, name="", timeout_s=10) as c:
        r = cli_inproc.run("clients", "--json", "--run-dir", module_daemon.run_dir)
        assert r.returncode == 0, r.stderr
        me = [x for x in json.loads(r.stdout) if x["pid"] == os.getpid() and x["rank"] == 3]
    assert len(me) == 1 and me[0]["name"] == "", me


def test_top_asks_within_its_timeout(tmp_path):
    """Found by a review: top's --timeout-s was taken and ignored (5 s each ask)."""
    run = tmp_path / "run"
    run.mkdir()
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(run / "stats.sock"))
        s.listen()  # accepts, never answers
        t0 = time.monotonic()
        r = cli_inproc.run("top", "--once", "--timeout-s", "0.3", "--run-dir", run)
        assert time.monotonic() - t0 < 4
    assert "did not answer within 0.3 s" in one_line_error(r, 1)


def test_health_gives_up_at_its_timeout_on_an_answer_that_never_ends(tmp_path):
    """Found by a review: the timeout bounded each read, so a peer sending a byte every
    0.2 s held health for ever."""
    run = tmp_path / "run"
    run.mkdir()

    def dribble(conn):
        def go():
            with conn:
                try:
                    for _ in range(100):
                        conn.sendall(b"x")
                        time.sleep(0.2)
                except OSError:
                    pass
        threading.Thread(target=go, daemon=True).start()

    with fake_stats_socket(str(run), dribble):
        t0 = time.monotonic()
        r = cli_inproc.run("health", "--timeout-s", "1", "--run-dir", run)
        assert time.monotonic() - t0 < 5
    assert "did not answer within 1 s" in one_line_error(r, 2)


def test_an_unexpected_error_is_one_line_with_its_type(monkeypatch, capsys, tmp_path):
    def broken(*args):
        raise TypeError("boom")

    monkeypatch.setattr(cli, "stats_query", broken)
    assert cli.main(["stats", "--run-dir", str(tmp_path)]) == 1
    assert capsys.readouterr().err == "sparsekv stats: unexpected TypeError: boom\n"


@pytest.mark.parametrize("text, ok", [("0.5", True), ("3", True), ("0", False), ("-1", False), ("inf", False),
                                      ("nan", False), ("x", False)])
def test_seconds_are_finite_and_positive(text, ok):
    if ok:
        assert cli.seconds(text) == float(text)
    else:
        with pytest.raises(argparse.ArgumentTypeError):
            cli.seconds(text)


def test_a_bad_argument_is_one_line_without_the_usage_block():
    err = one_line_error(cli_inproc.run("top", "--interval-s", "x"), 2)
    assert err == "sparsekv top: argument --interval-s: a number of seconds is needed, got 'x' (see sparsekv top --help)\n"
    for bad in ("0", "nan", "86401", "1e300"):  # past a day: a socket timeout or sleep overflows near 1e10 s
        err = one_line_error(cli_inproc.run("top", "--interval-s", bad), 2)
        assert err == (f"sparsekv top: argument --interval-s: a number of seconds in (0, 86400] is needed, got {bad!r} "
                       "(see sparsekv top --help)\n")


# -- top -----------------------------------------------------------------------------------
def sample(t, clients=(), **counters) -> top_mod.Sample:
    snap = {"pid": 7, "backend": "cpu", "uptime_s": t, "pool_bytes": 64 << 20, "pool_used_bytes": 16 << 20,
            "engines": 1, "clients": len(clients), "attached": len(clients),
            "topk_latency_us": {"p50": 40.0, "p99": 90.0, "n": 100},
            "per_engine": {"e": {"ranks": 2, "pool_bytes": 12 << 20, "slab_bytes": 3 << 20, "tp_size": 2, "tp_lag": 5},
                           "solo": {"ranks": 1, "pool_bytes": 1 << 20, "slab_bytes": 1 << 20}}, **counters}
    return top_mod.Sample(t, snap, [dict(c) for c in clients])


def test_top_shows_rates_of_the_interval_not_totals():
    a = sample(10.0, [{"id": "1", "pid": "11", "rank": "0", "engine": "e", "requests": "100", "errors": "0",
                       "name": "r0"}],
               requests=1000, topk_batches=500, hits=9000, misses=1000, bytes_moved=10**9, rows_moved=100,
               errors=0, topk_seconds_count=500, topk_seconds_sum=0.02)
    b = sample(12.0, [{"id": "1", "pid": "11", "rank": "0", "engine": "e", "requests": "300", "errors": "2",
                       "name": "r0"},
                      {"id": "2", "pid": "12", "rank": "1", "engine": "e", "requests": "50", "errors": "0",
                       "name": "r1"}],
               requests=1400, topk_batches=700, hits=9300, misses=1100, bytes_moved=5 * 10**9, rows_moved=300,
               errors=2, topk_seconds_count=700, topk_seconds_sum=0.03)
    r = top_mod.rates(a, b)
    assert r["requests"] == 200 and r["topk_batches"] == 100 and r["bytes_moved"] == 2e9
    assert r["hit_rate"] == pytest.approx(300 / 400)  # this interval's, not 9300/10400
    assert r["topk_mean_us"] == pytest.approx(50.0)
    by_id = {c["id"]: c for c in r["clients"]}
    assert by_id["1"]["requests_per_s"] == 100 and by_id["1"]["errors_per_s"] == 1
    assert by_id["2"]["requests_per_s"] == 25  # new in the interval: counted from 0
    out = top_mod.render("/run/x", a, b)
    assert "75.00 %" in out and "2.000 GB/s" in out and "200.0 /s" in out and "p50 40 us" in out
    assert "12.0 MiB" in out and "3.0 MiB" in out and "16.0 MiB / 64.0 MiB used (25.0 %)" in out
    assert [line.split()[-1] for line in out.splitlines() if line.startswith(("e ", "solo "))] == ["5", "-"]
    assert "2, lag 5" in out  # a TP group, and how far behind its slowest rank is
    assert "\x1b" not in out and top_mod.render("/run/x", a, b, clear=True).startswith(top_mod.CLEAR)


def test_top_with_nothing_happening_shows_no_rate():
    a, b = sample(1.0), sample(2.0)
    out = top_mod.render("/r", a, b)
    assert "hit rate             -" in out and "(no clients)" in out
    idle = top_mod.render("/r", sample(1.0, topk_latency_us={"p50": 0.0, "p99": 0.0, "n": 0}),
                          sample(2.0, topk_latency_us={"p50": 0.0, "p99": 0.0, "n": 0}))
    assert "top-k     p50 -   p99 -   (last 0)" in idle  # no latencies yet: no 0 us to misread


def test_top_once_against_a_daemon_under_load(module_daemon):
    c = Client(module_daemon.run_dir, rank=0, name="loader", timeout_s=10).connect()
    c.attach(LAYOUT, engine="e")
    stop = threading.Event()

    def load():
        step = 0
        while not stop.is_set():
            c.step(step, [0])
            c.topk(step, 0, [[step % 100, (step + 1) % 100, 120, -1]])
            step += 1
            time.sleep(0.002)

    t = threading.Thread(target=load)
    t.start()
    try:
        p = subprocess.run([helpers.PY, "-m", "sparsekv.cli.main", "top", "--once", "--interval-s", "0.3",
                            "--run-dir", module_daemon.run_dir],
                           capture_output=True, text=True, timeout=60)
    finally:
        stop.set()
        t.join()
        c.close()
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "\x1b" not in out  # not a terminal: no screen clearing
    lines = out.splitlines()
    req = next(line for line in lines if line.startswith("requests"))
    assert float(req.split()[1]) > 10, out
    assert "GB/s" in out and "hit rate" in out and "p99" in out
    engine = next(line for line in lines if line.startswith("e "))
    assert engine.split()[1] == "1"
    client = next(line for line in lines if line.rstrip().endswith("loader"))
    assert float(client.split()[4]) > 10, out  # its requests per second


def test_top_without_daemon_is_one_line(tmp_path):
    assert "no daemon at" in one_line_error(cli_inproc.run("top", "--once", "--run-dir", tmp_path))


def test_top_clears_the_screen_only_on_a_terminal(monkeypatch):
    frames = iter([sample(1.0, requests=0), sample(2.0, requests=10), sample(3.0, requests=30)])
    monkeypatch.setattr(top_mod, "take_sample", lambda run_dir, timeout_s: next(frames))
    monkeypatch.setattr(top_mod.time, "sleep", lambda s: None)

    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    with pytest.raises(StopIteration):  # runs until the samples run out
        top_mod.run_top("/r", 1.0, once=False, out=out)
    assert out.getvalue().count(top_mod.CLEAR) == 2
    frames = iter([sample(1.0, requests=0), sample(2.0, requests=10)])
    out = Tty()
    assert top_mod.run_top("/r", 1.0, once=True, out=out) == 0
    assert top_mod.CLEAR not in out.getvalue()


@pytest.mark.parametrize("argv", [["stats", "--json"], ["stats", "--prometheus"], ["clients", "--json"],
                                  ["blocks", "--json"], ["top", "--once"]])
def test_a_daemon_that_answers_an_error_fails_the_command_with_its_message(tmp_path, argv):
    """Found by an adversarial review: a daemon older than the CLI answers a command it
    does not know with ``error: unknown command ...``; `blocks --json` printed [] and exited
    0, `stats --json` printed the error as its JSON, `top` exited 2 on a JSON error."""
    run = tmp_path / "run"
    run.mkdir()

    def older(conn):
        with conn:
            conn.recv(4096)
            conn.sendall(b"error: unknown command 'x'; try stats, clients\n")

    with fake_stats_socket(str(run), older):
        r = cli_inproc.run(*argv, "--run-dir", run)
    assert "refused" in one_line_error(r, 1) and "unknown command 'x'" in r.stderr, r.stderr
    assert r.stdout == ""


def test_the_run_dir_setting_is_read_as_the_daemon_reads_it(tmp_path, monkeypatch):
    """Found by an adversarial review: SPARSEKV_RUN_DIR='~/skv' (or with a trailing blank)
    was /root/skv to the daemon and '~/skv' to clients and the CLI: one unit setting it for
    both left them in different directories. A blank one is refused."""
    from sparsekv.daemon import config
    from sparsekv.proto.settings import RUN_DIR, SettingError

    monkeypatch.setenv("HOME", str(tmp_path))
    for text in ("~/skv", f" {tmp_path}/skv ", "skv"):
        env = {"SPARSEKV_RUN_DIR": text}
        assert RUN_DIR.get(env) == config.load(None, env).run_dir
    assert RUN_DIR.get({"SPARSEKV_RUN_DIR": "~/skv"}) == str(tmp_path / "skv")
    with pytest.raises(SettingError, match="SPARSEKV_RUN_DIR: bad value for run_dir: an empty path"):
        RUN_DIR.get({"SPARSEKV_RUN_DIR": "  "})
    r = cli_inproc.run("health", "--run-dir", "")
    assert "--run-dir: an empty path; name a directory" in one_line_error(r, 2)


def test_a_blank_config_file_variable_is_refused_not_ignored():
    from sparsekv.daemon import config
    from sparsekv.proto.settings import SettingError

    with pytest.raises(SettingError, match="SPARSEKV_CONFIG: bad value for config: a blank path"):
        config.load(None, {"SPARSEKV_CONFIG": " "})


def test_top_into_a_closed_pipe_ends_quietly(module_daemon):
    # `sparsekv top | head -1`: the reader leaves; top ends as a tool killed by SIGPIPE
    # would (exit 141), saying nothing, instead of "Broken pipe" and exit 1.
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([helpers.PY, "-m", "sparsekv.cli.main", "top", "--interval-s", "0.05",
                            "--run-dir", module_daemon.run_dir],
                           stdout=w, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)
    assert p.returncode == 128 + signal.SIGPIPE, p.stderr
    assert p.stderr == ""
