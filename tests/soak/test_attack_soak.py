"""Attack soak (marked ``soak``: ``make soak`` runs it): every attack of
tests/daemon/test_attacks.py and test_routing_ids.py in a loop (``attacker.py``: 250 MiB
frames before HELLO, endless messages, connection floods, duplicate routing ids, a process
taking its uid's every client place and closing them without BYE) against one private
cpu daemon, while two loops replay a trace through it with ``--verify`` for
``SPARSEKV_SOAK_S`` seconds (default 60).

At the end: every replay exact (0 mismatched rows) and finished, no INTERNAL reply, the
daemon alive, its RSS within 64 MiB of what it was once the first replays had run."""

import json
import os
import subprocess
import sys
import threading
import time

import psutil
import pytest

import helpers
from sparsekv.proto import settings
from sparsekv.bench.private_daemon import PrivateDaemon

pytestmark = pytest.mark.soak
SOAK_S = settings.SOAK_S.get()
MiB = 1 << 20
SYNTH = ["--steps", 30, "--batch", 4, "--top-k", 16, "--region-stride", 32, "--max-reqs", 8, "--host-rows", 2048,
         "--row-bytes", 32, "--num-layers", 2, "--context", 150, "--lifetime", 12, "--seed", 9]
HERE = os.path.dirname(os.path.abspath(__file__))


def test_replays_stay_exact_and_memory_flat_under_every_attack(tmp_path):
    trace = tmp_path / "t.npz"
    r = helpers.run_cli("trace", "synth", "--out", trace, *SYNTH)
    assert r.returncode == 0, r.stderr
    other = None if helpers.why_not_other_users() else 65534
    with PrivateDaemon(pool_bytes=64 * MiB, extra_args=["--reap-interval-s", "0.2"],
                       log_path=str(tmp_path / "d.log")) as d:
        if other is not None:
            helpers.open_to_other_users(d.run_dir, "control.sock")
        daemon = psutil.Process(d.proc.pid)
        results, errors = [], []

        def replays(n):
            for i in range(n or 10**9):
                if n == 0 and time.monotonic() > deadline:
                    return
                r = helpers.run_cli("replay", trace, "--out", tmp_path / f"r{threading.get_ident()}.npz",
                                    "--transport", "zmq", "--verify", "--connect", d.run_dir, timeout_s=120)
                if r.returncode != 0:
                    errors.append(r.stderr[-2000:])
                    continue
                results.append(json.loads(r.stdout.strip().splitlines()[-1]))

        deadline = float("inf")
        replays(2)  # warm: the daemon's serving path, before its RSS is read
        rss0 = daemon.memory_info().rss
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
        attacker = subprocess.Popen([*helpers.as_user(other), sys.executable, os.path.join(HERE, "attacker.py"),
                                     d.run_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                    cwd="/tmp")
        deadline = time.monotonic() + SOAK_S
        loops = [threading.Thread(target=replays, args=(0,)) for _ in range(2)]
        for t in loops:
            t.start()
        for t in loops:
            t.join()
        attacker.stdin.close()
        counts = json.loads(attacker.stdout.readline())
        assert attacker.wait(60) == 0
        assert d.proc.poll() is None, "the daemon died"
        stats = helpers.stats_json(d.run_dir)
        rss1 = daemon.memory_info().rss
    summary = {"replays": len(results), "failed": len(errors), "attacks": counts, "rss_growth_mib":
               round((rss1 - rss0) / MiB, 1), "errors_by_code": stats["errors_by_code"]}
    print(json.dumps(summary))
    assert not errors, errors[:3]
    assert len(results) >= 4 and all(s["mismatched_rows"] == 0 for s in results), summary
    assert counts["rounds"] >= 1 and counts["failures"] == 0, summary
    assert "INTERNAL" not in stats["errors_by_code"], summary
    assert rss1 - rss0 <= 64 * MiB, summary
