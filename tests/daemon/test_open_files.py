"""``sparsekvd`` under systemd's default open-file limit (1024 soft): 1,100 idle ZeroMQ
connections used to make libzmq abort the daemon (EMFILE on an ipc accept is fatal in
libzmq). The daemon raises its soft limit to the hard one at start; where the hard limit
is 1024 too, it holds off new connections near the limit (``control.sock`` renamed to
``control.sock.busy``) instead of dying, and takes them again once they are closed."""

import os
import resource
import subprocess
import time

import pytest
import zmq

import helpers
from sparsekv.client import Client, DaemonUnavailable

IDLE = 1100


@pytest.fixture(autouse=True)
def enough_files_here():
    """This process opens ~2 descriptors per idle DEALER: raise its own soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * IDLE
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"the test process may open only {hard} files")
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def start(run_dir, log, soft: int, hard: int) -> subprocess.Popen:
    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    p = subprocess.Popen([helpers.PY, "-m", "sparsekv.daemon.main", "--backend", "cpu", "--run-dir", run_dir,
                          "--pool-size", "16MiB", "--shm-dir", run_dir,
                          # the process's open-files limit, met by one uid: no per-uid cap (on by default)
                          "--max-connections-per-uid", "0"], stdout=log, stderr=log, preexec_fn=limit)
    helpers.wait_for(lambda: p.poll() is not None or os.path.exists(os.path.join(run_dir, "control.sock")), 30,
                     what="the daemon to serve")
    return p


def idle_dealers(run_dir, n):
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, n + 100)
    socks = []
    for i in range(n):
        if i % 50 == 49:
            time.sleep(0.01)  # connections that pile up, not a flood
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"ipc://{os.path.join(run_dir, 'control.sock')}")
        socks.append(s)
    return ctx, socks


def close_all(ctx, socks):
    for s in socks:
        s.close(0)
    ctx.term()


def log_of(run_dir) -> str:
    with open(os.path.join(run_dir, "d.log"), errors="replace") as fh:
        return fh.read()


def test_1100_idle_connections_with_a_soft_limit_of_1024():
    with helpers.short_tmpdir() as run_dir, open(os.path.join(run_dir, "d.log"), "wb") as log:
        p = start(run_dir, log, 1024, 8192)
        ctx, socks = idle_dealers(run_dir, IDLE)
        try:
            helpers.wait_for(lambda: p.poll() is not None or helpers.stats_json(run_dir)["connections_open"] == IDLE,
                             10, what="every connection accepted")
            assert p.poll() is None, log_of(run_dir)
            with Client(run_dir, timeout_s=10) as c:
                c.attach(helpers.layout())
                assert c.stats()["clients"] == 1
            assert p.poll() is None
            assert "open files: soft limit raised from 1024 to 8192" in log_of(run_dir)
        finally:
            close_all(ctx, socks)
            p.terminate()
            assert p.wait(20) == 0, log_of(run_dir)


def test_hard_limit_of_1024_holds_off_new_connections_instead_of_aborting():
    with helpers.short_tmpdir() as run_dir, open(os.path.join(run_dir, "d.log"), "wb") as log:
        p = start(run_dir, log, 1024, 1024)
        busy = os.path.join(run_dir, "control.sock.busy")
        ctx, socks = idle_dealers(run_dir, IDLE)
        try:
            helpers.wait_for(lambda: os.path.exists(busy), 10, what="the daemon to hold off new connections")
            time.sleep(0.5)
            assert p.poll() is None, log_of(run_dir)
            with pytest.raises(DaemonUnavailable) as ei:
                Client(run_dir, timeout_s=5).connect()
            assert "refuses new connections" in str(ei.value)
            text = log_of(run_dir)
            assert "the limit 1024 is low" in text and "refusing new connections" in text
            close_all(ctx, socks)
            socks = []
            # Served again once the idle connections are gone (the guard checks each second).
            t0 = time.monotonic()
            helpers.wait_for(lambda: not os.path.exists(busy), 10, what="new connections to be accepted again")
            with Client(run_dir, timeout_s=10) as c:
                c.attach(helpers.layout())
                assert c.stats()["clients"] == 1
            assert time.monotonic() - t0 < 10
            assert p.poll() is None
        finally:
            if socks:
                close_all(ctx, socks)
            p.terminate()
            assert p.wait(20) == 0, log_of(run_dir)
