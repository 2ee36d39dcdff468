"""A command that starts processes takes them along when it dies: ``sparsekv replay``'s
private daemon (SIGKILL: the kernel's parent-death signal; SIGTERM: the command stops it
and removes its run dir) and ``sparsekv demo``'s daemon and rank processes. Real
processes, cpu backend."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import cli_inproc
import helpers

TRACE = ["--steps", 2000, "--batch", 4, "--top-k", 16, "--region-stride", 32, "--max-reqs", 8, "--host-rows", 2048,
         "--row-bytes", 32, "--num-layers", 2, "--context", 150, "--lifetime", 12]

# run_demo on a small pool and (nearly) endless steps; the ranks get DEFAULTS through their arguments.
DEMO = """
import sys
from sparsekv.cli import demo
demo.DEFAULTS.update(host_rows=4096, num_layers=4, top_k=16, region_stride=32, batch=4, context=150, steps=10**6)
demo.run_demo(backend="cpu", progress=False)
"""


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its new parent to reap it counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def children(pid: int) -> dict[int, str]:
    """The children of ``pid`` (of all its threads) and their command lines."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                kids = [int(k) for k in fh.read().split()]
        except OSError:
            continue
        for k in kids:
            try:
                with open(f"/proc/{k}/cmdline", "rb") as fh:
                    out[k] = fh.read().replace(b"\0", b" ").decode()
            except OSError:
                pass
    return out


def wait_for(what, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what.__doc__ or what}")


def assert_all_die(pids, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if alive(p)]
    for p in left:  # do not leave them behind for the next test
        os.kill(p, signal.SIGKILL)
    assert not left, f"still running after their parent died: {left}"


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "t.npz"
    assert cli_inproc.run("trace", "synth", "--quiet", "--out", path, *TRACE).returncode == 0
    return path


def start_replay(trace_path, tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "sparsekv.cli.main", "replay", str(trace_path), "--out",
                          str(tmp_path / "r.npz"), "--transport", "zmq", "--verify"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def daemon():
        return [(pid, cmd) for pid, cmd in children(p.pid).items() if "sparsekv.daemon.main" in cmd]

    (pid, cmd), = wait_for(daemon)
    return p, pid, cmd.split("--run-dir ")[1].split()[0]


def test_a_replay_killed_by_sigkill_takes_its_private_daemon_along(trace_path, tmp_path):
    p, daemon, run_dir = start_replay(trace_path, tmp_path)
    wait_for(lambda: os.path.exists(os.path.join(run_dir, "control.sock")))
    p.kill()
    p.communicate()
    assert_all_die([daemon])
    shutil.rmtree(run_dir, ignore_errors=True)  # its maker was killed: nobody else removes it


def test_a_replay_stopped_by_sigterm_stops_its_daemon_and_removes_its_run_dir(trace_path, tmp_path):
    p, daemon, run_dir = start_replay(trace_path, tmp_path)
    wait_for(lambda: os.path.exists(os.path.join(run_dir, "control.sock")))
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
    assert not alive(daemon) and not os.path.exists(run_dir)
    assert not (tmp_path / "r.npz").exists()


def test_a_demo_killed_by_sigkill_takes_its_daemon_and_ranks_along():
    p = subprocess.Popen([sys.executable, "-c", DEMO], stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def daemon_and_ranks():
        kids = children(p.pid)
        ranks = [k for k, cmd in kids.items() if "spawn_main" in cmd]
        daemons = [k for k, cmd in kids.items() if "sparsekv.daemon.main" in cmd]
        return daemons + ranks if len(ranks) == 2 and daemons else None

    pids = wait_for(daemon_and_ranks)
    run_dir = children(p.pid)[pids[0]].split("--run-dir ")[1].split()[0]
    time.sleep(2)  # the ranks attach and decode
    assert p.poll() is None, p.communicate()
    p.kill()
    p.communicate()
    assert_all_die(pids)
    shutil.rmtree(run_dir, ignore_errors=True)
