"""Is the ZeroMQ hop's cost on this VM the wake-up of halted vCPUs, and does the
``warm_io`` placement (deploy/README.md "Warm CPUs": each side's I/O threads on a CPU kept
from halting by a SCHED_IDLE loop) remove it? Runs ``bench cuda_transport`` (with device
wait) as installed (A) and with ``warm_io`` (B) in A B B A A B order, so that the
machine's drift between runs cancels in the pairs; optionally a run with a loop on every
CPU. Prints the guest's idle driver, the thread siblings and the steal time first.
    [WARM_ROUNDS=3] [ALL=1] python3 tests/gpu/warm_cpus.py [STEPS]
"""
import json
import os
import subprocess
import sys
import time

from sparsekv.bench.bench import bench_cuda_transport

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


def topology() -> None:
    """Which vCPUs share a core (a busy loop on a sibling slows the other thread)."""
    sib = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                sib[cpu] = f.read().strip()
        except OSError:
            pass
    print(f"thread siblings: {sorted(set(sib.values()))}")
    try:
        with open("/proc/stat") as f:
            print("steal (jiffies, all cpus):", f.readline().split()[8])
    except (OSError, IndexError):
        pass


def main() -> int:
    """``abba`` (the default when ROUNDS > 0): as installed (A) and warm_io (B) in the order
    A B B A A B ..., 2 x ROUNDS runs, each arm's median and the median of each B minus its
    neighbouring A: drift of the machine between runs cancels. Then (ALL=1) one run with a
    loop on every CPU."""
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    rounds = int(os.environ.get("WARM_ROUNDS", "3"))
    idle_info()
    topology()
    order = []
    for r in range(rounds):
        order += ["A", "B"] if r % 2 == 0 else ["B", "A"]
    runs = []
    for i, arm in enumerate(order):
        runs.append((arm, one(f"run {i + 1} {'warm_io' if arm == 'B' else 'as installed'}", steps,
                              warm_io=arm == "B")))
    if os.environ.get("ALL") == "1":
        procs = spinners()
        try:
            runs.append(("ALL", one("SCHED_IDLE loop on every cpu", steps)))
        finally:
            for p in procs:
                p.kill()
    topology()
    import statistics  # noqa: PLC0415

    print(f"{'key':34s} {'A (as is)':>10s} {'B (warm)':>10s} {'B-A pairs':>10s}  per pair")
    for k in KEYS:
        a = [r[k] for arm, r in runs if arm == "A" and r.get(k) is not None]
        b = [r[k] for arm, r in runs if arm == "B" and r.get(k) is not None]
        pairs = [runs[2 * i + 1][1][k] - runs[2 * i][1][k] if runs[2 * i][0] == "A" else
                 runs[2 * i][1][k] - runs[2 * i + 1][1][k] for i in range(rounds)
                 if runs[2 * i][1].get(k) is not None and runs[2 * i + 1][1].get(k) is not None]
        if a and b:
            print(f"{k:34s} {statistics.median(a):10.1f} {statistics.median(b):10.1f} "
                  f"{statistics.median(pairs):+10.1f}  {' '.join(f'{d:+.1f}' for d in pairs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
