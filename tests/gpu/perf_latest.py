"""Run the benchmarks whose figures the issues name, and write them as one flat JSON
object (docs/perf/latest.json's format: key -> number, plus date, commit, machine).
Run on the GPU machine, under MPS:
    python3 tests/gpu/perf_latest.py OUT.json [COMMIT] [DECODE.json [KERNELS.json ...]]
DECODE.json, KERNELS.json: what ``sparsekv bench decode --json`` and ``sparsekv bench
kernels --json`` wrote in the same run; their numbers are merged in
(``doorbell_overhead_us_per_layer``, ``decode_daemon_vs_inproc``, ``gather_vs_bulk``, ...).
"""

import datetime
import json
import subprocess
import sys

from sparsekv.bench.bench import bench_cuda_transport


def machine() -> str:
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except OSError:
        gpu = []
    return f"{len(gpu)} x {gpu[0]}" if gpu else "unknown"


def main() -> int:
    out = sys.argv[1]
    commit = sys.argv[2] if len(sys.argv) > 2 else "unknown"
    # The hop as deployed on a VM (deploy/README.md "Warm CPUs": the I/O threads on CPUs
    # kept warm) gives the headline keys; the same bench as installed (nothing placed)
    # runs right before it, under cuda_transport_* and zmq_handoff_cold_p50_us.
    cold = bench_cuda_transport(steps=400)
    print(json.dumps(cold))
    latest = {f"cuda_transport_{k}": v for k, v in numbers(cold).items()}
    latest["zmq_handoff_cold_p50_us"] = cold["zmq_handoff_p50_us"]
    latest["daemon_host_us_per_step_cold"] = cold["daemon_host_us_per_step"]
    for path in sys.argv[3:]:
        try:
            with open(path) as f:
                more = json.load(f)
        except (OSError, ValueError) as e:
            print(f"no figures merged from {path}: {e}", file=sys.stderr)
        else:
            latest.update({k: v for k, v in more.items()
                           if isinstance(v, (int, float)) and not isinstance(v, bool)})
    latest.update(date=datetime.date.today().isoformat(), commit=commit, machine=machine())
    write(out, latest)
    try:
        warm = bench_cuda_transport(steps=400, warm_io=True)
    except Exception as e:  # noqa: BLE001 - say it; the file has the rest (no headline transport keys)
        print(f"warm-io transport bench failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(warm))
    latest.update({f"cuda_transport_warm_io_{k}": v for k, v in numbers(warm).items()})
    latest["zmq_handoff_p50_us"] = warm["zmq_handoff_p50_us"]
    latest["daemon_host_us_per_step"] = warm["daemon_host_us_per_step"]
    write(out, latest)
    # Then device wait (Client(device_wait=True)), in a run of its own: the figures above
    # are written first, whatever happens to it.
    try:
        r = bench_cuda_transport(steps=400, device_wait=True)
    except Exception as e:  # noqa: BLE001 - say it; the file has the rest
        print(f"device-wait transport bench failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(r))
    for k in ("zmq_device_wait_p50_us", "zmq_device_wait_handoff_p50_us", "zmq_handoff_p50_us", "inproc_p50_us",
              "bare_zmq_event_rtt_p50_us"):
        if isinstance(r.get(k), (int, float)):
            latest[f"cuda_transport_dw_run_{k}"] = r[k]
    write(out, latest)
    return 0


def numbers(r: dict) -> dict:
    return {k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def write(out: str, latest: dict) -> None:
    with open(out, "w") as f:
        json.dump(latest, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
