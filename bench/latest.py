"""``sparsekv bench latest``: the figures docs/perf/latest.json holds, in one flat JSON
object (key -> number, plus date, commit and machine): ``cuda_transport`` as installed,
with the daemon's loop on a warm CPU, and with device wait (:data:`RUNS`), and what ``bench
decode``/``kernels --json`` wrote in the same run (``--merge``). Rewritten after each run
(a run cut short keeps what it measured). Needs a GPU (run it under MPS).
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys

from .decode_report import write_json
from .transport import bench_cuda_transport

STEPS = 400


def add_arguments(p) -> None:
    p.add_argument("--merge", nargs="+", default=[], metavar="FILE",
                   help="latest: JSON figures of bench decode / kernels --json from the same run, merged in")
    p.add_argument("--commit", default=None,
                   help="latest: the commit measured (default: git rev-parse --short HEAD, else unknown)")


def run_args(a) -> int:
    """``sparsekv bench latest --json OUT [--merge FILE ...] [--commit HASH]``."""
    if not a.json_path:
        print("sparsekv bench latest: --json PATH is required (where the figures go)", file=sys.stderr)
        return 2
    latest = {}
    for path in a.merge:
        try:
            with open(path) as f:
                latest.update(numbers(json.load(f)))
        except (OSError, ValueError) as e:
            print(f"sparsekv bench latest: no figures merged from {path}: {e}", file=sys.stderr)
    latest.update(date=datetime.date.today().isoformat(), commit=a.commit or _git_commit(), machine=machine())
    return run(a.json_path, latest)


# (run, its keys' prefix, the keys it also gives unprefixed): as installed; with the I/O
# threads on warm CPUs (the headline hand-off: the hop as deployed on a VM); with device wait.
RUNS = (({}, "cuda_transport_", {"zmq_handoff_p50_us": "zmq_handoff_cold_p50_us",
                                  "daemon_host_us_per_step": "daemon_host_us_per_step_cold"}),
        ({"warm_io": True}, "cuda_transport_warm_io_", {"zmq_handoff_p50_us": "zmq_handoff_p50_us",
                                                         "daemon_host_us_per_step": "daemon_host_us_per_step"}),
        ({"device_wait": True}, "cuda_transport_dw_run_", {}))
DW_KEYS = ("zmq_device_wait_p50_us", "zmq_device_wait_handoff_p50_us", "zmq_handoff_p50_us", "inproc_p50_us",
           "bare_zmq_event_rtt_p50_us")  # of the device-wait run, the keys kept


def run(out: str, latest: dict) -> int:
    """The transport runs of RUNS into ``latest``, written to ``out`` after each; a run that
    fails ends it (exit 1) with what came before written."""
    for kw, prefix, plain in RUNS:
        try:
            r = bench_cuda_transport(steps=STEPS, **kw)
        except Exception as e:  # noqa: BLE001 - say it; the file has the runs before
            print(f"sparsekv bench latest: transport bench {kw} failed: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        print(json.dumps(r))
        got = numbers(r)
        latest.update({prefix + k: v for k, v in got.items() if "device_wait" not in kw or k in DW_KEYS})
        latest.update({name: got[k] for k, name in plain.items()})
        write_json(out, latest)
    return 0


def numbers(r: dict) -> dict:
    return {k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def machine() -> str:
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        gpu = []
    return f"{len(gpu)} x {gpu[0]}" if gpu else "unknown"


def _git_commit() -> str:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return r.stdout.strip() if r.returncode == 0 else "unknown"
