"""``sparsekvd`` as a process: sd_notify to a test NOTIFY_SOCKET (STATUS while starting,
READY once serving, STOPPING on SIGTERM), clean exit removing its sockets, one daemon
per run dir, ``--print-config`` precedence, clear errors for bad settings, and no shared
memory left behind, even by a daemon that was killed."""

import contextlib
import os
import signal
import socket
import subprocess
import tomllib
import uuid

import pytest

import helpers
from sparsekv.client import Client

DAEMON = [helpers.PY, "-m", "sparsekv.daemon.main"]


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SPARSEKV_", "NOTIFY_SOCKET", "WATCHDOG_", "RUNTIME_DIRECTORY"))}
    env.update(extra)
    return env


@contextlib.contextmanager
def sparsekvd(run_dir, *args, env=None, pool="64MiB"):
    """A daemon process; killed if the test leaves it running."""
    with open(os.path.join(os.path.dirname(run_dir), "sparsekvd.log"), "w+b") as log:
        p = subprocess.Popen([*DAEMON, "--backend", "cpu", "--run-dir", run_dir, "--pool-size", pool, *args],
                             stdout=log, stderr=log, env=env or clean_env())
        p.log = log
        try:
            yield p
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()


def log_text(p) -> str:
    p.log.flush()
    p.log.seek(0)
    return p.log.read().decode(errors="replace")


def wait_serving(run_dir, p, timeout_s=30.0):
    """Until process ``p`` answers on the stats socket (a stale control.sock left by a
    killed daemon must not count)."""

    def serving():
        if p.poll() is not None:
            return True
        try:
            return helpers.stats_json(run_dir)["pid"] == p.pid
        except (OSError, ValueError):
            return False

    helpers.wait_for(serving, timeout_s, what="the daemon to serve")
    assert p.poll() is None, log_text(p)


def receive_until(sock, want: bytes, timeout_s=30.0) -> list[bytes]:
    """Datagrams up to and including the first that contains ``want``."""
    got = []
    sock.settimeout(timeout_s)
    while True:
        msg = sock.recv(4096)
        got.append(msg)
        if want in msg.split(b"\n"):
            return got


@pytest.fixture
def run_dir():
    with helpers.short_tmpdir() as d:
        run = os.path.join(d, "run")
        yield run
        for path in helpers.shm_slabs(run):  # a test that failed after killing a daemon
            os.unlink(path)


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
        status = [m for m in before_ready[:-1] if m.startswith(b"STATUS=")]
        assert status and b"pre-faulting host pool" in status[0], before_ready
        assert b"STATUS=serving" in before_ready[-1]
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
    for name in ("control.sock", "stats.sock", "sparsekvd.lock"):
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
        assert f"another sparsekvd (pid {first.pid}) serves {run_dir}" in second.stderr
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


@pytest.mark.parametrize(
    "args, env, words",
    [
        (["--pool-size", "12XB"], {}, "--pool-size: bad value for pool_size: bad size '12XB'"),
        (["--pool-size", "0"], {}, "pool_size must be positive"),
        ([], {"SPARSEKV_POOL_SIZE": "lots"}, "environment SPARSEKV_POOL_SIZE: bad value for pool_size"),
    ],
)
def test_bad_size_is_a_clear_error_with_exit_2(run_dir, args, env, words):
    r = subprocess.run([*DAEMON, "--backend", "cpu", "--run-dir", run_dir, *args], capture_output=True, text=True,
                       timeout=30, env=clean_env(**env))
    assert r.returncode == 2
    assert words in r.stderr
    assert not os.path.exists(run_dir)  # refused before touching anything


def test_pool_larger_than_ram_is_refused_and_leaves_nothing(run_dir):
    r = subprocess.run([*DAEMON, "--backend", "cpu", "--run-dir", run_dir, "--pool-size", "64TiB"],
                       capture_output=True, text=True, timeout=30, env=clean_env())
    assert r.returncode == 1
    assert "does not fit in available RAM" in r.stderr and "lower --pool-size" in r.stderr
    assert os.listdir(run_dir) == []  # no sockets, lock released and removed


def test_slabs_of_a_killed_daemon_are_removed_by_the_next_start(run_dir):
    with sparsekvd(run_dir) as p:
        wait_serving(run_dir, p)
        c = Client(run_dir).connect()
        c.attach(helpers.layout())
        stale = helpers.shm_slabs(run_dir)
        assert len(stale) == 1
        p.kill()
        p.wait()
        c.close()
    assert helpers.shm_slabs(run_dir) == stale  # SIGKILL: nobody cleaned up
    with sparsekvd(run_dir) as p:
        wait_serving(run_dir, p)
        assert helpers.shm_slabs(run_dir) == []
        with Client(run_dir) as c:  # the stale control.sock did not block the new daemon
            c.attach(helpers.layout())
            assert len(helpers.shm_slabs(run_dir)) == 1
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0
    assert helpers.shm_slabs(run_dir) == []
