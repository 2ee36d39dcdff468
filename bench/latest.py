"""``sparsekv bench latest``: the figures docs/perf/latest.json holds, in one flat JSON
object (key -> number, plus date, commit and machine). Runs ``cuda_transport`` as
installed, then with its I/O threads on warm CPUs (the headline keys: the hop as deployed
on a VM, deploy/README.md "Warm CPUs"), then with device wait; merges in the figures that
``sparsekv bench decode --json`` and ``sparsekv bench kernels --json`` wrote in the same
run (``--merge``). The file is rewritten after each run, so that a run cut short keeps
what it measured. Needs a GPU (run it under MPS).
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys

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


def run(out: str, latest: dict) -> int:
    """The three transport runs into ``latest``, written to ``out`` after each."""
    cold = bench_cuda_transport(steps=STEPS)
    print(json.dumps(cold))
    latest.update({f"cuda_transport_{k}": v for k, v in numbers(cold).items()})
    latest["zmq_handoff_cold_p50_us"] = cold["zmq_handoff_p50_us"]
    latest["daemon_host_us_per_step_cold"] = cold["daemon_host_us_per_step"]
    write(out, latest)
    try:
        warm = bench_cuda_transport(steps=STEPS, warm_io=True)
    except Exception as e:  # noqa: BLE001 - say it; the file has the rest (no headline transport keys)
        print(f"sparsekv bench latest: warm-io transport bench failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(warm))
    latest.update({f"cuda_transport_warm_io_{k}": v for k, v in numbers(warm).items()})
    latest["zmq_handoff_p50_us"] = warm["zmq_handoff_p50_us"]
    latest["daemon_host_us_per_step"] = warm["daemon_host_us_per_step"]
    write(out, latest)
    try:
        dw = bench_cuda_transport(steps=STEPS, device_wait=True)
    except Exception as e:  # noqa: BLE001 - say it; the file has the rest
        print(f"sparsekv bench latest: device-wait transport bench failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(dw))
    for k in ("zmq_device_wait_p50_us", "zmq_device_wait_handoff_p50_us", "zmq_handoff_p50_us", "inproc_p50_us",
              "bare_zmq_event_rtt_p50_us"):
        if k in numbers(dw):
            latest[f"cuda_transport_dw_run_{k}"] = dw[k]
    write(out, latest)
    return 0


def numbers(r: dict) -> dict:
    return {k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def write(out: str, latest: dict) -> None:
    with open(out, "w") as f:
        json.dump(latest, f, indent=1, sort_keys=True)
        f.write("\n")


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
