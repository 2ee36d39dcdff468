"""Is the ZeroMQ hop's cost on this VM the wake-up of halted vCPUs? Runs ``bench
cuda_transport`` (with device wait): as is, with the I/O threads placed on two warm CPUs
(``warm_io``, what deploy/README.md recommends), with a SCHED_IDLE busy loop on
every CPU (a vCPU that never halts is woken by a posted interrupt instead of the host's
scheduler; any other thread preempts the loop at once), then as is again. Prints the
guest's idle driver first.
    python3 tests/gpu/warm_cpus.py [STEPS]
"""
import json
import os
import subprocess
import sys
import time

from sparsekv.client.bench import bench_cuda_transport

KEYS = ("zmq_handoff_p50_us", "zmq_device_wait_handoff_p50_us", "bare_zmq_event_rtt_p50_us", "topk_socket_in_p50_us",
        "topk_socket_out_p50_us", "daemon_host_us_per_step", "daemon_enqueue_p50_us", "send_to_enqueue_p50_us",
        "inproc_p50_us")


def idle_info() -> None:
    base = "/sys/devices/system/cpu/cpuidle"
    for name in ("current_driver", "current_governor", "current_governor_ro"):
        try:
            with open(os.path.join(base, name)) as f:
                print(f"cpuidle {name}: {f.read().strip()}")
        except OSError:
            pass
    try:
        states = sorted(os.listdir("/sys/devices/system/cpu/cpu0/cpuidle"))
        names = []
        for s in states:
            with open(f"/sys/devices/system/cpu/cpu0/cpuidle/{s}/name") as f:
                names.append(f.read().strip())
        print(f"cpu0 idle states: {names}")
    except OSError as e:
        print(f"cpu0 idle states: {e}")
    with open("/proc/cmdline") as f:
        print(f"cmdline: {f.read().strip()}")


def spinners() -> list:
    code = "import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\nwhile True: pass"
    procs = []
    for cpu in sorted(os.sched_getaffinity(0)):
        procs.append(subprocess.Popen(["taskset", "-c", str(cpu), sys.executable, "-c", code]))
    time.sleep(0.5)
    return procs


def one(label: str, steps: int, warm_io: bool = False) -> dict:
    r = bench_cuda_transport(steps=steps, device_wait=True, warm_io=warm_io)
    row = {k: r.get(k) for k in KEYS}
    print(f"{label}: {json.dumps(row)}", flush=True)
    return row


def main() -> int:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    idle_info()
    rows = {"idle_a": one("cpus as they are", steps)}
    rows["warm_io"] = one("I/O threads on two warm CPUs (deploy/README.md)", steps, warm_io=True)
    procs = spinners()
    try:
        rows["warm"] = one("SCHED_IDLE loop on every cpu", steps)
    finally:
        for p in procs:
            p.kill()
    rows["idle_b"] = one("cpus as they are, again", steps)
    print(f"{'key':34s} {'idle':>8s} {'warm_io':>8s} {'all warm':>8s} {'idle':>8s}")
    for k in KEYS:
        print(f"{k:34s} " + " ".join(f"{rows[r][k] if rows[r][k] is not None else '-':>8}" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
