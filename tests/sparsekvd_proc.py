"""A ``sparsekvd`` process for the tests of the daemon's entry point: its command, an
environment without the caller's settings, the process with its log, and the run dir
fixture."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import pytest

import helpers

DAEMON = [helpers.PY, "-m", "sparsekv.daemon.main"]


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SPARSEKV_", "NOTIFY_SOCKET", "WATCHDOG_", "RUNTIME_DIRECTORY", "JOURNAL_STREAM"))}
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


def start_and_stop_log(run_dir, *args, **kw) -> str:
    """The log of a daemon started with ``args`` (``sparsekvd``'s keywords), once it
    serves, then stopped with SIGTERM (exit 0)."""
    with sparsekvd(run_dir, *args, **kw) as p:
        wait_serving(run_dir, p)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0
        return log_text(p)


@pytest.fixture
def run_dir():
    with helpers.short_tmpdir() as d:
        run = os.path.join(d, "run")
        yield run
        for path in helpers.shm_files(run):  # a test that failed after making one
            os.unlink(path)
