"""``sparsekvd`` as a process: sd_notify to a test NOTIFY_SOCKET (STATUS and
EXTEND_TIMEOUT_USEC while starting, READY once serving, STOPPING on SIGTERM, also during
the pre-fault), clean exit removing its sockets, SIGHUP logged and ignored, one daemon
per run dir, ``--print-config`` precedence and sources, clear errors for bad settings
(``--backend cuda`` without a GPU before the pool), log lines for journald and for
people, ``--version``, and no shared memory left behind, even by a daemon that was
killed."""

import datetime
import importlib.metadata
import io
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
import uuid
from types import SimpleNamespace

import psutil
import pytest

import helpers
from sparsekvd_proc import DAEMON, clean_env, log_text, run_dir, sparsekvd, wait_serving  # noqa: F401 (a fixture)
from sparsekv.client import Client
from sparsekv.daemon import main as main_mod
from sparsekv.daemon import start_checks
from sparsekv.daemon.backends import cuda_probe, cuda_unavailable, run_dir_tag
from sparsekv.daemon.config import Config
from sparsekv.daemon.main import JournalFormatter, UtcFormatter, log_handler, on_journald
from sparsekv.daemon.pinned import PoolPinner

def receive_until(sock, want: bytes, timeout_s=30.0) -> list[bytes]:
    """Datagrams up to and including the first that contains ``want``."""
    got = []
    sock.settimeout(timeout_s)
    while True:
        msg = sock.recv(4096)
        got.append(msg)
        if want in msg.split(b"\n"):
            return got


@pytest.mark.parametrize("address", ["path", "abstract"])
def test_sd_notify_status_ready_stopping_and_clean_exit(run_dir, address):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if address == "path":
        notify = os.path.join(os.path.dirname(run_dir), "notify.sock")
        s.bind(notify)
    else:
        notify = f"@sparsekv-test-{uuid.uuid4().hex}"
        s.bind("\0" + notify[1:])
    with s, sparsekvd(run_dir, env=clean_env(NOTIFY_SOCKET=notify, WATCHDOG_USEC="100000")) as p:
        before_ready = receive_until(s, b"READY=1")
        # READY comes once the control socket is bound: a client may connect right away
        assert os.path.exists(os.path.join(run_dir, "control.sock"))
        assert os.path.exists(os.path.join(run_dir, "stats.sock"))
        assert os.path.exists(os.path.join(run_dir, "fds.sock"))
        status = [m for m in before_ready[:-1] if m.startswith(b"STATUS=")]
        assert status and b"pre-faulting host pool" in status[0], before_ready
        # systemd's TimeoutStartSec= must not kill a long pre-fault that keeps moving
        assert all(b"EXTEND_TIMEOUT_USEC=" in m for m in status), status
        assert b"STATUS=serving on the cpu backend, pool 64MiB" in before_ready[-1]  # (not "1 device(s)")
        # watchdog pings at half of WATCHDOG_USEC
        receive_until(s, b"WATCHDOG=1", timeout_s=5)
        c = Client(run_dir).connect()
        try:
            c.attach(helpers.layout())
            assert len(helpers.shm_slabs(run_dir)) == 1
            p.send_signal(signal.SIGTERM)  # with a client still attached
            after = receive_until(s, b"STOPPING=1")
            assert p.wait(timeout=20) == 0, log_text(p)
        finally:
            c.close()
    assert any(b"STOPPING=1" in m for m in after)
    for name in ("control.sock", "stats.sock", "fds.sock", "sparsekvd.lock"):
        assert not os.path.exists(os.path.join(run_dir, name)), name
    assert helpers.shm_slabs(run_dir) == []  # slabs of attached clients removed too


def test_sigint_stops_the_daemon_cleanly(run_dir):
    with sparsekvd(run_dir) as p:
        wait_serving(run_dir, p)
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=20) == 0, log_text(p)
        assert "stopped" in log_text(p)
    assert not os.path.exists(os.path.join(run_dir, "control.sock"))


def test_second_daemon_on_the_same_run_dir_is_refused(run_dir):
    with sparsekvd(run_dir) as first:
        wait_serving(run_dir, first)
        second = subprocess.run([*DAEMON, "--backend", "cpu", "--run-dir", run_dir, "--pool-size", "64MiB"],
                                capture_output=True, text=True, timeout=30, env=clean_env())
        assert second.returncode == 1
        assert f"another sparsekvd (pid {first.pid}) holds {run_dir} (serving it, or starting)" in second.stderr
        # --print-config says the same (the lock looked at, never taken)
        checked = subprocess.run([*DAEMON, "--backend", "cpu", "--run-dir", run_dir, "--pool-size", "64MiB",
                                  "--print-config"], capture_output=True, text=True, timeout=30, env=clean_env())
        assert checked.returncode == 1 and f"(pid {first.pid}) holds {run_dir}" in checked.stderr, checked.stderr
        # the first one still serves
        assert first.poll() is None
        assert helpers.stats_json(run_dir)["pid"] == first.pid


def test_print_config_shows_defaults_toml_env_command_line_precedence(tmp_path):
    toml = tmp_path / "d.toml"
    toml.write_text('[sparsekvd]\npool_size = "128MiB"\nmax_clients = 10\nreap_interval_s = 3.0\n'
                    'log_level = "debug"\n')
    env = clean_env(SPARSEKV_MAX_CLIENTS="20", SPARSEKV_REAP_INTERVAL_S="4", SPARSEKV_BACKEND="cpu")
    r = subprocess.run([*DAEMON, "--config", str(toml), "--reap-interval-s", "5", "--run-dir", "/tmp/x",
                        "--print-config"], capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode == 0, r.stderr
    cfg = tomllib.loads(r.stdout)
    assert cfg["pool_size"] == "128MiB"  # TOML over default
    assert cfg["log_level"] == "debug"  # TOML over default
    assert cfg["max_clients"] == 20  # env over TOML
    assert cfg["backend"] == "cpu"  # env over default
    assert cfg["reap_interval_s"] == 5.0  # command line over env over TOML
    assert cfg["run_dir"] == "/tmp/x"
    assert cfg["gather_blocks"] == 32 and cfg["shm_dir"] == "/dev/shm"  # defaults
    assert not os.path.exists("/tmp/x/control.sock")
    source = {ln.split(" ")[0]: ln.rsplit("# ", 1)[1] for ln in r.stdout.splitlines() if not ln.startswith("#")}
    assert source["pool_size"] == f"file {toml}" and source["max_clients"] == "env SPARSEKV_MAX_CLIENTS"
    assert source["reap_interval_s"] == "flag --reap-interval-s" and source["gather_blocks"] == "default"
    assert source["cuda_graphs"] == "default (debug switch)" and cfg["cuda_graphs"] is True
    assert cfg["pool_backing"] == "anon_thp" and cfg["pin_pool_at_start"] == "1" and cfg["pin_chunk_gib"] == 4.0


@pytest.mark.parametrize(
    "args, env, words",
    [
        (["--pool-size", "12XB"], {}, "--pool-size: bad value for pool_size: bad size '12XB'"),
        (["--pool-size", "0B"], {}, "pool_size must be >= 2MiB, got 0B"),
        (["--pool-size", "-1GiB"], {}, "flag --pool-size: bad value for pool_size: size '-1GiB' is negative"),
        (["--pool-size", "1Gb"], {}, "size '1Gb' reads as bits (lower-case b): write 1GB for bytes"),
        (["--hello-timeout-s", "-.5"], {}, "flag --hello-timeout-s: hello_timeout_s must be in (0.1, "),
        ([], {"SPARSEKV_POOL_SIZE": "lots"}, "environment SPARSEKV_POOL_SIZE: bad value for pool_size"),
        ([], {"SPARSEKV_POOL_SIZE": "1G"}, "size '1G' is ambiguous: write 1GiB (powers of 1024) or 1GB"),
        ([], {"SPARSEKV_MAX_CLIENTS": "abc"}, "environment SPARSEKV_MAX_CLIENTS: bad value for max_clients: an "
         "integer is needed, got 'abc'"),
        ([], {"SPARSEKV_PIN_CHUNK_GIB": "-1"}, "environment SPARSEKV_PIN_CHUNK_GIB: pin_chunk_gib must be in"),
        (["--max-clients", "abc"], {}, "flag --max-clients: bad value for max_clients"),
    ],
)
def test_bad_settings_are_one_line_naming_them_with_exit_2(run_dir, args, env, words):
    r = subprocess.run([*DAEMON, "--backend", "cpu", "--run-dir", run_dir, *args], capture_output=True, text=True,
                       timeout=30, env=clean_env(**env))
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"sparsekvd: {r.stderr.strip().removeprefix('sparsekvd: ')}"]
    assert words in r.stderr
    assert not os.path.exists(run_dir)  # refused before touching anything


def test_a_refused_start_removes_the_run_dir_it_made_and_only_that(run_dir):
    """Found by an operator's walkthrough: a start refused after the run dir was made left
    it behind (empty); one that existed stays."""
    os.mkdir(run_dir)
    fresh = os.path.join(run_dir, "made", "here")
    r = subprocess.run([*DAEMON, "--backend", "cpu", "--run-dir", fresh, "--pool-size", "64TiB"],
                       capture_output=True, text=True, timeout=30, env=clean_env())
    assert r.returncode == 2 and "more than this machine's RAM" in r.stderr
    assert os.listdir(run_dir) == []  # "made" and "made/here" both gone; run_dir, which existed, stays


def test_a_pool_larger_than_the_machines_ram_is_a_bad_setting_and_leaves_nothing(run_dir):
    """Found by an operator's review: it exited 1, and the unit restarted it into the same refusal."""
    r = subprocess.run([*DAEMON, "--backend", "cpu", "--run-dir", run_dir, "--pool-size", "64TiB"],
                       capture_output=True, text=True, timeout=30, env=clean_env())
    assert r.returncode == 2
    assert "cannot start: pool_size 64TiB (flag --pool-size) is more than this machine's RAM" in r.stderr
    assert not os.path.exists(run_dir)  # no sockets, the run dir it made removed


def test_a_pool_larger_than_the_ram_available_now_is_retried(monkeypatch, tmp_path, caplog):
    """More than the RAM free now but not more than the machine has: it may fit once other
    processes are gone, so exit 1 (the unit restarts it)."""
    total = psutil.virtual_memory().total
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=total, available=64 << 20))
    monkeypatch.setattr(main_mod, "setup_logging", lambda level: None)
    run = str(tmp_path / "run")
    with caplog.at_level(logging.ERROR, logger="sparsekv"):
        assert main_mod.main(["--backend", "cpu", "--run-dir", run, "--pool-size", "128MiB"]) == 1
    assert "pool_size 128MiB (flag --pool-size) does not fit in available RAM (64MiB); lower it" in caplog.text
    assert "pre-faulting" not in caplog.text
    assert not os.path.exists(run)  # the run dir it made removed


def test_print_config_says_what_the_start_says_first_with_its_code(monkeypatch, tmp_path, capsys, caplog):
    """Found by an adversarial review: --print-config did not check the RAM available now
    (0 where the start exited 1), and with two refusals it gave the larger code where the
    start stopped at its first (a setting no restart fixes was reported as retryable).
    Settings (exit 2) now come before what may pass later (1), in both."""
    total = psutil.virtual_memory().total
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=total, available=64 << 20))
    monkeypatch.setattr(main_mod, "setup_logging", lambda level: None)
    monkeypatch.setattr(start_checks, "metrics_port_refusal",
                        lambda cfg, sources: ("metrics_port 9: in use", 1) if cfg.metrics_port == 9 else None)
    run = str(tmp_path / "run")
    cases = [
        (["--pool-size", "128MiB"], 1, "does not fit in available RAM (64MiB)"),  # RAM free now: may pass later
        (["--pool-size", "128MiB", "--metrics-port", "9"], 1, "metrics_port 9: in use"),
        (["--pool-size", f"{2 * total}B", "--metrics-port", "9"], 2, "is more than this machine's RAM"),
        (["--pool-size", "128MiB", "--io-cpus", ",".join(map(str, sorted(os.sched_getaffinity(0))))], 2,
         "are all the CPUs this process may run on"),  # a setting: before the RAM free now
    ]
    for args, code, words in cases:
        argv = ["--backend", "cpu", "--run-dir", run, *args]
        assert main_mod.main([*argv, "--print-config"]) == code, args
        first = capsys.readouterr().err.splitlines()[0]
        assert first.startswith("sparsekvd: would not start: ") and words in first, (args, first)
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="sparsekv"):
            assert main_mod.main(argv) == code, args
        assert words in caplog.text, (args, caplog.text)
        assert not os.path.exists(run)


def test_a_killed_daemon_leaves_no_slab_and_older_stale_files_are_removed(run_dir):
    with sparsekvd(run_dir) as p:
        wait_serving(run_dir, p)
        c = Client(run_dir).connect()
        c.attach(helpers.layout())
        assert len(helpers.shm_slabs(run_dir)) == 1 and helpers.shm_files(run_dir) == []  # a memfd, no file
        p.kill()
        p.wait()
        c.close()
    assert helpers.shm_slabs(run_dir) == []  # SIGKILL: the memfd went with the process
    # an older sparsekvd's slab file (it died): removed by the next start
    old = f"/dev/shm/sparsekv-{run_dir_tag(run_dir)}-1-0123456789abcdef"
    with open(old, "wb") as f:
        f.write(b"stale")
    with sparsekvd(run_dir) as p:
        wait_serving(run_dir, p)
        assert helpers.shm_slabs(run_dir) == [] and not os.path.exists(old)
        with Client(run_dir) as c:  # the stale control.sock did not block the new daemon
            c.attach(helpers.layout())
            assert len(helpers.shm_slabs(run_dir)) == 1
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0
    assert helpers.shm_slabs(run_dir) == []


def test_version():
    r = subprocess.run([*DAEMON, "--version"], capture_output=True, text=True, timeout=30, env=clean_env())
    assert r.returncode == 0 and r.stdout.strip() == f"sparsekvd {importlib.metadata.version('sparsekv')}"


def test_backend_cuda_without_a_gpu_fails_before_the_pool_is_prefaulted(run_dir):
    if cuda_unavailable() is None:
        pytest.skip("a GPU is usable here")
    r = subprocess.run([*DAEMON, "--backend", "cuda", "--run-dir", run_dir, "--pool-size", "64MiB"],
                       capture_output=True, text=True, timeout=60, env=clean_env())
    # CuPy missing: no restart installs it (exit 2); a GPU the driver does not serve yet may come (1)
    assert r.returncode == (2 if cuda_probe()[1] else 1)
    assert "cannot start: backend cuda (flag --backend):" in r.stderr
    assert "does not fit" not in r.stderr and "pre-faulting" not in r.stderr
    assert not os.path.exists(run_dir)  # not even the lock


def test_sighup_and_sigusr1_are_logged_and_ignored(run_dir):
    """SIGUSR1's default (found by an operator's review) killed the daemon without its clean-up."""
    with sparsekvd(run_dir) as p:
        wait_serving(run_dir, p)
        p.send_signal(signal.SIGHUP)
        helpers.wait_for(lambda: "SIGHUP ignored" in log_text(p), 10, what="the SIGHUP log line")
        p.send_signal(signal.SIGUSR1)
        helpers.wait_for(lambda: "SIGUSR1 ignored" in log_text(p), 10, what="the SIGUSR1 log line")
        assert p.poll() is None and helpers.stats_json(run_dir)["pid"] == p.pid  # still serving
        with Client(run_dir) as c:
            c.attach(helpers.layout())
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0, log_text(p)
        text = log_text(p)
    assert re.search(r" WARNING sparsekv: SIGHUP ignored", text)
    # pre-fault progress is in the log at INFO
    assert re.search(r" INFO sparsekv: sparsekvd \S+ \(pid \d+\) on .*: pre-faulting host pool of 64MiB", text)
    assert re.search(r" INFO sparsekv.pool: pool 64MiB pre-faulted in", text)
    assert not os.path.exists(run_dir)  # the run dir it made removed


def wait_datagram(sock, pred, timeout_s=30.0) -> list[bytes]:
    got = []
    sock.settimeout(timeout_s)
    while True:
        got.append(sock.recv(4096))
        if pred(got[-1]):
            return got


def test_sigterm_during_prefault_stops_cleanly(run_dir):
    """A real pool, pre-faulted by one thread: SIGHUP, SIGUSR1, then SIGTERM while it pre-faults."""
    notify = os.path.join(os.path.dirname(run_dir), "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(notify)
        with sparsekvd(run_dir, "--prefault-threads", "1", pool="4GiB", env=clean_env(NOTIFY_SOCKET=notify)) as p:
            got = wait_datagram(s, lambda m: b"pre-faulting host pool of 4GiB: " in m or b"READY=1" in m)
            p.send_signal(signal.SIGHUP)
            time.sleep(0.3)  # two signals at once may be handled in either order
            p.send_signal(signal.SIGUSR1)
            time.sleep(0.3)
            p.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            got += wait_datagram(s, lambda m: b"STOPPING=1" in m)
            rc = p.wait(timeout=30)
            took_s = time.monotonic() - t0
            text = log_text(p)
    if any(b"READY=1" in m for m in got):
        pytest.skip("the pool pre-faulted before the signal came (fast machine)")
    assert rc == 0, text
    assert "SIGHUP ignored" in text and "SIGUSR1 ignored" in text
    assert "SIGTERM during start: stopping" in text and "stopped before serving" in text
    assert "pre-faulted in" not in text  # stopped part way, not at the end
    assert took_s < 10, text
    assert not os.path.exists(run_dir)  # no sockets, the run dir it made removed


def test_sigterm_during_prefault_in_process(monkeypatch, tmp_path):
    """The same, deterministic: a pool whose pre-fault never ends unless interrupted."""
    class EndlessPool:
        def __init__(self, size_bytes, threads, progress, on_faulted=None, backing="anon_thp"):
            progress(0.01)
            os.kill(os.getpid(), signal.SIGTERM)  # the handler is ours by now
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                time.sleep(0.01)
            raise AssertionError("the pre-fault was not interrupted")

    def no_backend(*a):
        raise AssertionError("the backend started after SIGTERM")

    notify = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(notify)
        s.settimeout(5)
        monkeypatch.setattr(main_mod, "HostPool", EndlessPool)
        monkeypatch.setattr(main_mod, "make_backend", no_backend)
        monkeypatch.setattr(main_mod, "setup_logging", lambda level: None)
        for k in ("WATCHDOG_USEC", "WATCHDOG_PID"):
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setenv("NOTIFY_SOCKET", notify)
        before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)
        run = str(tmp_path / "run")
        assert main_mod.main(["--backend", "cpu", "--run-dir", run, "--pool-size", "1GiB"]) == 0
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)) == before  # restored
        got = wait_datagram(s, lambda m: b"STOPPING=1" in m, timeout_s=5)
    assert any(b"EXTEND_TIMEOUT_USEC=" in m for m in got)
    assert not os.path.exists(run)  # the run dir it made removed


# -- logs ----------------------------------------------------------------------------------
def test_journald_lines_carry_a_syslog_priority_and_no_time(run_dir):
    log_path = os.path.join(os.path.dirname(run_dir), "sparsekvd.log")
    open(log_path, "wb").close()  # sparsekvd() reopens it with "w+": same inode
    st = os.stat(log_path)
    with sparsekvd(run_dir, env=clean_env(JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")) as p:
        wait_serving(run_dir, p)
        p.send_signal(signal.SIGHUP)
        helpers.wait_for(lambda: "SIGHUP" in log_text(p), 10, what="the SIGHUP log line")
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0
        lines = log_text(p).splitlines()
    assert lines and all(re.match(r"^<[0-7]>", line) for line in lines), lines
    assert any(line.startswith("<6>INFO sparsekv.server: ready") for line in lines), lines
    assert any(line.startswith("<4>WARNING sparsekv: SIGHUP ignored") for line in lines), lines
    assert not any(re.search(r"\d{4}-\d\d-\d\dT\d\d:", line) for line in lines)


def test_other_lines_carry_a_utc_iso_time(run_dir):
    # JOURNAL_STREAM inherited from a unit but stderr redirected elsewhere: not the journal
    with sparsekvd(run_dir, env=clean_env(JOURNAL_STREAM="1:2")) as p:
        wait_serving(run_dir, p)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0
        lines = log_text(p).splitlines()
    stamp = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z (DEBUG|INFO|WARNING|ERROR) sparsekv")
    assert lines and all(stamp.match(line) for line in lines), lines
    first = datetime.datetime.fromisoformat(stamp.match(lines[0]).group(1)).replace(tzinfo=datetime.timezone.utc)
    assert abs((datetime.datetime.now(datetime.timezone.utc) - first).total_seconds()) < 120  # UTC, not local


def test_journald_detection_and_formats(tmp_path):

    with open(tmp_path / "err", "w") as f:
        st = os.fstat(f.fileno())
        assert on_journald(f, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        assert not on_journald(f, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"})
        assert not on_journald(f, {"JOURNAL_STREAM": "garbage"}) and not on_journald(f, {})
        assert isinstance(log_handler(f, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}).formatter, JournalFormatter)
        assert isinstance(log_handler(f, {}).formatter, UtcFormatter)
    assert not on_journald(io.StringIO(), {"JOURNAL_STREAM": "1:2"})  # no file descriptor
    rec = logging.LogRecord("sparsekv.x", logging.ERROR, __file__, 1, "first\nsecond", None, None)
    assert JournalFormatter().format(rec) == "<3>ERROR sparsekv.x: first\n<3>second"  # one journal entry a line
    for level, prio in ((logging.DEBUG, 7), (logging.INFO, 6), (logging.WARNING, 4), (logging.CRITICAL, 2)):
        rec = logging.LogRecord("n", level, __file__, 1, "m", None, None)
        assert JournalFormatter().format(rec).startswith(f"<{prio}>")


def test_importing_the_daemon_leaves_the_cuda_environment_alone():
    """The daemon's CUDA settings (more hardware queues, eager module loading) are set
    by main() for a cuda or auto backend only, never at import: a test run or a tool
    that imports the module would hand them to every CUDA process it starts (under MPS,
    processes asking for 32 queues each could not all create contexts on the H200)."""
    code = ("import os, sys\n"
            "from sparsekv.daemon import main as m\n"
            "keys = list(m.CUDA_ENV)\n"
            "assert keys and not any(k in os.environ for k in keys), [k for k in keys if k in os.environ]\n"
            "m.set_cuda_environment()\n"
            "assert all(os.environ[k] == v for k, v in m.CUDA_ENV.items())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MODULE_LOADING")}
    r = subprocess.run([helpers.PY, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_the_pool_is_page_locked_at_start_unless_told_not_to_and_for_the_cuda_backend(monkeypatch):
    """pool_pinner: a PoolPinner (the pool registered while it is faulted; "after": once
    it is) by default when cuda will serve it, in chunks of pin_chunk_gib; None with
    pin_pool_at_start "0", for the cpu backend and where CuPy sees no GPU."""
    monkeypatch.setattr(main_mod, "cuda_unavailable", lambda: None)
    assert main_mod.pool_pinner(Config(backend="cuda", pin_pool_at_start="0")) is None  # registration at attach
    p = main_mod.pool_pinner(Config(backend="cuda", pool_size=64 << 20))
    assert isinstance(p, PoolPinner) and p.region is None  # nothing registered before the fault
    assert p.while_faulting and p.max_chunk_bytes == 4 << 30  # the default: chunk by chunk while faulted
    assert main_mod.pool_pinner(Config(backend="cpu")) is None
    assert isinstance(main_mod.pool_pinner(Config(backend="auto", pool_size=64 << 20)), PoolPinner)
    monkeypatch.setattr(main_mod, "cuda_unavailable", lambda: "no CUDA device")
    assert main_mod.pool_pinner(Config(backend="auto")) is None
    monkeypatch.setattr(main_mod, "cuda_unavailable", lambda: None)
    after = main_mod.pool_pinner(Config(backend="cuda", pool_size=64 << 20, pin_pool_at_start="after"))
    assert not after.while_faulting
    big = main_mod.pool_pinner(Config(backend="cuda", pool_size=64 << 20, pin_chunk_gib=16))
    assert big.max_chunk_bytes == 16 << 30


def test_backend_auto_on_a_gpu_it_cannot_use_fails_before_the_pool_is_prefaulted(monkeypatch, tmp_path, caplog):
    """Found by a review of the operator's path: auto on a GPU machine without CuPy (or with
    a broken driver) pre-faulted the whole pool (minutes for a large one; five times under
    the unit's restarts) before make_backend refused it."""
    from sparsekv.daemon import backends

    monkeypatch.setattr(backends, "cuda_probe", lambda: ("CuPy is not installed", True))
    monkeypatch.setattr(backends, "gpu_present", lambda: "/dev/nvidiactl exists")

    def no_pool(*a, **kw):
        raise AssertionError("the pool was pre-faulted")

    monkeypatch.setattr(main_mod, "HostPool", no_pool)
    monkeypatch.setattr(main_mod, "setup_logging", lambda level: None)
    run = str(tmp_path / "run")
    with caplog.at_level(logging.ERROR, logger="sparsekv"):
        assert main_mod.main(["--backend", "auto", "--run-dir", run, "--pool-size", "1GiB"]) == 2
    assert "cannot start: backend auto (flag --backend): this machine has an NVIDIA GPU" in caplog.text
    assert not os.path.exists(run)  # not even the lock


def test_a_metrics_port_the_sandbox_forbids_is_one_line_naming_the_drop_in(monkeypatch, tmp_path, caplog):
    """Found by the review: under the unit (AF_UNIX only) opening the IPv4 socket raised
    out of the start: a traceback, and the lock file left behind."""
    real = socket.socket

    def af_unix_only(family=socket.AF_INET, *a, **kw):
        if family == socket.AF_INET:
            raise PermissionError(1, "Operation not permitted")
        return real(family, *a, **kw)

    monkeypatch.setattr(start_checks.socket, "socket", af_unix_only)
    monkeypatch.setattr(main_mod, "setup_logging", lambda level: None)
    run = str(tmp_path / "run")
    with caplog.at_level(logging.ERROR, logger="sparsekv"):
        assert main_mod.main(["--backend", "cpu", "--run-dir", run, "--pool-size", "64MiB",
                              "--metrics-port", "9400"]) == 2  # a setting: the unit does not retry it
    assert "metrics_port 9400 (flag --metrics-port): cannot open an IPv4 socket (Operation not permitted)" \
        in caplog.text and "sparsekvd.service.d/metrics.conf" in caplog.text
    assert not os.path.exists(run)  # the run dir it made removed


def test_a_metrics_port_this_user_may_not_take_exits_2_and_a_taken_one_1(monkeypatch, tmp_path, caplog):
    """Found by a review: a port below 1024 (EACCES for the unit's user) exited 1, so the
    unit retried a setting that can never work; a taken port may be free at the next start."""
    import errno as errno_mod

    def refusing(err):
        class Sock(socket.socket):
            def bind(self, address):
                raise OSError(err, os.strerror(err))
        return Sock

    monkeypatch.setattr(main_mod, "setup_logging", lambda level: None)
    for err, code in ((errno_mod.EACCES, 2), (errno_mod.EADDRINUSE, 1)):
        monkeypatch.setattr(start_checks.socket, "socket", refusing(err))
        run = str(tmp_path / f"run{err}")
        assert main_mod.main(["--backend", "cpu", "--run-dir", run, "--pool-size", "64MiB",
                              "--metrics-port", "80"]) == code
        assert not os.path.exists(run)  # the run dir it made removed


def test_a_run_dir_that_is_a_file_is_a_bad_setting(tmp_path):
    """Found by an operator's review: exit 1, so the unit restarted it into the same refusal."""
    f = tmp_path / "afile"
    f.write_text("")
    for run in (f, f / "sub"):
        r = subprocess.run([*DAEMON, "--backend", "cpu", "--run-dir", str(run), "--pool-size", "64MiB"],
                           capture_output=True, text=True, timeout=30, env=clean_env())
        assert r.returncode == 2, r.stderr
        assert f"cannot start: run dir {run} " in r.stderr and "(run_dir: flag --run-dir)" in r.stderr
    assert f.read_text() == ""



def test_devices_naming_gpus_not_visible_are_refused_before_the_pool_for_auto_and_cuda(monkeypatch):
    """Found by a review: with backend auto the check was skipped, and CudaBackend refused
    it only after the whole pool was pre-faulted. Exit 1: a GPU being reset or repartitioned
    comes back."""
    from sparsekv.daemon import backends

    monkeypatch.setattr(backends, "cuda_probe", lambda: (None, False))
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(
        cuda=SimpleNamespace(runtime=SimpleNamespace(getDeviceCount=lambda: 1))))
    for backend in ("auto", "cuda"):
        assert start_checks.backend_refusal(Config(backend=backend, devices="0,3"), {"devices": "file x.toml"}) == (
            "devices 0,3 (file x.toml) names GPU(s) [3], but 1 are visible", 1)
        assert start_checks.backend_refusal(Config(backend=backend, devices="0"), {}) is None
    assert start_checks.backend_refusal(Config(backend="cpu", devices="3"), {}) is None


def test_a_stop_with_stats_connections_open_logs_no_traceback(run_dir):
    """Found by an adversarial review: each stats connection still open at SIGTERM (its
    handler waiting for a command) logged an asyncio ERROR with a CancelledError traceback."""
    import socket as socket_mod

    with sparsekvd(run_dir) as p:
        wait_serving(run_dir, p)
        idle = []
        for _ in range(4):
            s = socket_mod.socket(socket_mod.AF_UNIX)
            s.connect(os.path.join(run_dir, "stats.sock"))
            idle.append(s)
        helpers.wait_for(lambda: helpers.stats_json(run_dir)["pid"] == p.pid, 10, what="the daemon's answer")
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0
        text = log_text(p)
        for s in idle:
            s.close()
    assert " ERROR " not in text and "Traceback" not in text, text
