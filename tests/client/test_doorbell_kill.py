"""An engine killed in the middle of its decode steps, on the GPU under MPS: the daemon and
the other engines on that GPU go on, exact.

The engine's ``skv_db_indices`` waits for its layer's ready word by polling it
(client/doorbell.py), so an engine killed at a random moment of a replay loop is often
killed with such a kernel running. (Under MPS a process killed with a kernel that never
ends has taken the server and every client with it; this kernel ends once the daemon's
gather sets the word, which the engine's bell had already asked for.) Marked ``cuda``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from sparsekv.bench.private_daemon import PrivateDaemon

from test_doorbell import ARENA, DAEMON_LOG, attach, layout, reference, run_steps, steps

# The victim: an engine on the doorbell that replays one captured step for ever (its
# top-k names rows of its own requests, 64 distinct a row), saying "running" once it has.
VICTIM = r"""
import sys
import torch
from sparsekv.client import Client
from sparsekv.proto import Layout

lay = Layout(num_layers=3, row_bytes=656, top_k=64, region_stride=128, max_reqs=8, host_rows=8 * 1024,
             index_groups=((0, 1), (2,)), max_batch=8).validate()
c = Client(sys.argv[1], name="victim", device="cuda:0").connect()
c.attach(lay, engine=sys.argv[2], transport="doorbell")
h = c.doorbell_handle()
B = 4
state = torch.arange(B, dtype=torch.int32, device="cuda")
reset = torch.ones(B, dtype=torch.bool, device="cuda")
span = lay.host_rows // lay.max_reqs
topk = torch.stack([torch.randperm(600, device="cuda")[: lay.top_k] + r * span for r in range(B)]).int()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    h.begin_step(state, reset)
    for layers in lay.groups:
        for layer in layers:
            h.swap_in(state, None, topk, layer=layer)
n = 0
while True:
    graph.replay()
    n += 1
    if n % 16 == 0:
        torch.cuda.synchronize()
    if n == 64:
        print("running", flush=True)
"""


def _kill_a_victim(run_dir: str, engine: str, after_s: float) -> None:
    proc = subprocess.Popen([sys.executable, "-c", VICTIM, run_dir, engine], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "running", f"the victim did not start: {line!r} {proc.stderr.read()[-2000:]}"
        time.sleep(after_s)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.cuda
def test_an_engine_killed_mid_step_leaves_the_daemon_and_another_engine_exact():
    """Engine B's steps are exact before, between and after two victims are SIGKILLed
    while replaying steps; the daemon lives; an engine attached after them is exact too."""
    import torch

    lay = layout()
    plan = steps(lay, 6, seed=11)
    want = reference(lay, plan, positions=False)
    with PrivateDaemon(pool_bytes=5 * lay.pool_bytes + (8 << 20), backend="cuda", extra_args=ARENA,
                       log_path=DAEMON_LOG) as d:
        cb, hb = attach(d.run_dir, lay, engine="b")
        try:
            run_steps(hb, lay, plan, want, range(2), torch)
            for i, after_s in enumerate((0.2, 0.53)):
                _kill_a_victim(d.run_dir, f"victim{i}", after_s)
                assert d.proc.poll() is None, "the daemon died with the engine"
                run_steps(hb, lay, plan, want, range(2 + 2 * i, 4 + 2 * i), torch)
            cn, hn = attach(d.run_dir, lay, engine="new")
            try:
                run_steps(hn, lay, plan, want, range(6), torch)
            finally:
                hn.close()
                cn.close()
        finally:
            hb.close()
            cb.close()
