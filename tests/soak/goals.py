"""The reliability goals of docs/RELIABILITY.md, measured against private cpu daemons.

    .venv/bin/python tests/soak/goals.py [--only fuzz,idle,frame,reclaim] [--fuzz-s 600]
        [--idle 10000] [--cycles 1000]

- ``fuzz``: ``--fuzz-s`` seconds of fuzzing by 2 ``chaos_fuzz.py`` processes (random
  frames, random msgpack, structurally valid messages with wrong contents) and a thread
  writing random bytes straight onto raw connections of control.sock (no ZMTP at all).
  Counts INTERNAL replies (the goal: 0), samples the daemon's RSS (growth from the end of
  the first minute to the end: < 16 MiB), then runs a verifying client
  (``chaos_worker.py``: fill, rewrites, every delivered row checked) for 15 s: 0 wrong.
- ``idle``: ``--idle`` idle raw connections, from 10 processes, against a daemon whose
  open-file limit is 1024 (soft and hard). The daemon must stay alive; a new client must
  be served: the time from the flood's start until one is, while the flood still holds
  every connection it got (the daemon closes those that send no HELLO within
  ``hello_timeout_s``, 10 s by default). ``idle_other_uid``: the same flood from uid 65534
  (root needed) against ``max_connections_per_uid = 256``: another user is served during it.
- ``frame``: one 1 GiB frame sent to control.sock: refused unread; the daemon's peak RSS
  (VmHWM) growth (goal < 64 MiB).
- ``reclaim``: ``--cycles`` times: a forked client connects, attaches an engine of its
  own and is SIGKILLed; the time until the daemon has dropped its session (p50, p99,
  max; goal p99 <= 2 s), and at the end the daemon's descriptors, memfds, pool use and
  RSS against the start (goal: no leak).

One JSON line per goal, then a table. Figures for docs/RELIABILITY.md, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import helpers  # noqa: E402
from sparsekv.bench.private_daemon import PrivateDaemon  # noqa: E402

MiB = 1 << 20


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else None


def _hwm_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def _served(run_dir: str, timeout_s: float = 2.0) -> bool:
    from sparsekv.client import Client  # noqa: PLC0415

    try:
        with Client(run_dir, timeout_s=timeout_s) as c:
            c.attach(helpers.layout(), engine=f"probe{random.randrange(1 << 30)}")
            return True
    except Exception:  # noqa: BLE001 - refused, busy, timed out: not served
        return False


# -- fuzz ------------------------------------------------------------------------------------
def _raw_garbage(path: str, stop: threading.Event, counts: dict) -> None:
    rng = random.Random(7)
    while not stop.is_set():
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(0.2)
            s.connect(path)
            for _ in range(rng.randrange(1, 6)):
                s.sendall(rng.randbytes(rng.randrange(1, 4096)))
                counts["raw_bytes"] += 1
            s.close()
            counts["raw_conns"] += 1
        except OSError:
            counts["raw_refused"] += 1
            time.sleep(0.01)


def goal_fuzz(seconds: float) -> dict:
    with helpers.short_tmpdir() as tmp, PrivateDaemon(pool_bytes=64 * MiB, extra_args=["--reap-interval-s", "0.5"],
                                                      log_path=os.path.join(tmp, "d.log")) as d:
        proc = psutil.Process(d.proc.pid)
        fuzzers = [subprocess.Popen([sys.executable, os.path.join(HERE, "chaos_fuzz.py"), d.run_dir, str(seed),
                                     os.path.join(tmp, f"fz{seed}.json")]) for seed in (1, 2)]
        stop, counts = threading.Event(), {"raw_bytes": 0, "raw_conns": 0, "raw_refused": 0}
        raw = threading.Thread(target=_raw_garbage, args=(os.path.join(d.run_dir, "control.sock"), stop, counts))
        raw.start()
        t0 = time.monotonic()
        rss = []
        while time.monotonic() - t0 < seconds:
            time.sleep(min(5.0, seconds / 20))
            rss.append((time.monotonic() - t0, proc.memory_info().rss / MiB))
            if d.proc.poll() is not None:
                break
        stop.set()
        raw.join()
        for p in fuzzers:
            p.kill()
            p.wait()
        alive = d.proc.poll() is None
        tot = {"sent": 0, "replies": 0, "internal": 0}
        for seed in (1, 2):
            with open(os.path.join(tmp, f"fz{seed}.json")) as f:
                s = json.load(f)
            for k in tot:
                tot[k] += s[k]
        snap = helpers.stats_json(d.run_dir)
        base = next((m for t, m in rss if t >= min(60.0, seconds / 4)), rss[0][1])
        # then a verifying client on the same daemon
        events = os.path.join(tmp, "verify.jsonl")
        w = subprocess.Popen([sys.executable, os.path.join(HERE, "chaos_worker.py"), d.run_dir, "after", "3", events])
        time.sleep(15)
        w.send_signal(signal.SIGKILL)
        w.wait()
        evs = [json.loads(line) for line in open(events) if line.strip().endswith("}")]
        prog = [e for e in evs if e["ev"] == "progress"]
        return {"goal": "fuzz", "seconds": round(time.monotonic() - t0, 1), "daemon_alive": alive,
                "messages": tot["sent"], "replies": tot["replies"], "internal_replies": tot["internal"],
                "daemon_internal": snap["errors_by_code"].get("INTERNAL", 0), **counts,
                "rss_base_mib": round(base, 1), "rss_end_mib": round(rss[-1][1], 1),
                "rss_growth_mib": round(rss[-1][1] - base, 1),
                "verify_rows": prog[-1]["rows"] if prog else 0, "verify_bad": sum(e["bad"] for e in evs if e["ev"] == "bad"),
                "verify_errors": sum(1 for e in evs if e["ev"] == "error")}


# -- idle connections -----------------------------------------------------------------------
_FLOOD = r"""
import os, resource, socket, sys, time
path, n, hold_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
resource.setrlimit(resource.RLIMIT_NOFILE, (n + 64, max(n + 64, resource.getrlimit(resource.RLIMIT_NOFILE)[1])))
socks, failed, t0 = [], 0, time.monotonic()
while len(socks) < n and time.monotonic() - t0 < hold_s:
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        socks.append(s)
    except OSError:
        s.close()
        failed += 1
        time.sleep(0.001)
print(len(socks), failed, flush=True)
time.sleep(max(0.0, hold_s - (time.monotonic() - t0)))
"""


def goal_idle(n: int, procs: int = 10, hold_s: float = 30.0, flood_uid: int | None = None, cap: int = 0) -> dict:
    with helpers.short_tmpdir() as run_dir, open(os.path.join(run_dir, "d.log"), "wb") as log:
        def limit():
            resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

        d = subprocess.Popen([sys.executable, "-m", "sparsekv.daemon.main", "--backend", "cpu", "--run-dir", run_dir,
                              "--pool-size", "16MiB", "--max-connections-per-uid", str(cap)],
                             stdout=log, stderr=log, preexec_fn=limit)
        path = os.path.join(run_dir, "control.sock")
        helpers.wait_for(lambda: os.path.exists(path), 30, what="the daemon to serve")
        if flood_uid is not None:
            helpers.open_to_other_users(run_dir)
        t0 = time.monotonic()
        floods = [subprocess.Popen([*helpers.as_user(flood_uid), sys.executable, "-c", _FLOOD, path, str(n // procs),
                                    str(hold_s)], stdout=subprocess.PIPE, text=True, cwd="/tmp") for _ in range(procs)]
        served_at, tries = None, 0
        while time.monotonic() - t0 < hold_s - 2 and served_at is None:
            time.sleep(0.5)
            tries += 1
            if d.poll() is not None:
                break
            if _served(run_dir):
                served_at = time.monotonic() - t0
        got = failed = 0
        for f in floods:
            line = f.stdout.readline().split()
            if len(line) == 2:
                got, failed = got + int(line[0]), failed + int(line[1])
        alive = d.poll() is None
        snap = helpers.stats_json(run_dir) if alive else {}
        for f in floods:
            f.kill()
            f.wait()
        t_end, after = time.monotonic(), None  # the first client served once the flood is gone, and when
        while alive and after is None and time.monotonic() - t_end < 30:
            if _served(run_dir, 2):
                after = round(time.monotonic() - t_end, 1)
            else:
                time.sleep(0.2)
        d.terminate()
        code = d.wait(30)
        log.flush()
        with open(os.path.join(run_dir, "d.log"), errors="replace") as f:
            tail = f.read().splitlines()[-6:]
        return {"goal": "idle" if flood_uid is None else f"idle_uid{flood_uid}_cap{cap}",
                "daemon_log_tail": tail if code else [], "connections_refused": snap.get("connections_refused"), "connections_tried": n, "connections_made": got, "connects_refused": failed,
                "daemon_alive": alive, "served_during_flood_after_s": None if served_at is None else round(served_at, 1),
                "served_after_flood_after_s": after, "connections_expired": snap.get("connections_expired"),
                "daemon_exit": code}


# -- a 1 GiB frame -----------------------------------------------------------------------
_BIG = r"""
import sys, zmq
s = zmq.Context().socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 2000)
s.connect(f"ipc://{sys.argv[1]}")
s.send_multipart([b"\x81\xa1v\x02", bytearray(1 << 30)], copy=False)
s.close()
"""


def goal_frame() -> dict:
    with helpers.short_tmpdir() as tmp, PrivateDaemon(pool_bytes=64 * MiB, log_path=os.path.join(tmp, "d.log")) as d:
        before = _hwm_kib(d.proc.pid)
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", _BIG, os.path.join(d.run_dir, "control.sock")], check=True, timeout=120)
        took = time.monotonic() - t0
        time.sleep(0.5)
        after = _hwm_kib(d.proc.pid)
        return {"goal": "frame", "frame_bytes": 1 << 30, "daemon_alive": d.proc.poll() is None,
                "served_after": _served(d.run_dir), "peak_rss_growth_mib": round((after - before) / 1024, 1),
                "sender_s": round(took, 2)}


# -- SIGKILLed clients ------------------------------------------------------------------
def _child(run_dir: str, engine: str, w: int) -> None:
    from sparsekv.client import Client  # noqa: PLC0415

    try:
        c = Client(run_dir, timeout_s=10).connect()
        c.attach(helpers.layout(), engine=engine)
        os.write(w, b"k")
    except BaseException:  # noqa: BLE001
        os.write(w, b"x")
    time.sleep(60)
    os._exit(0)


def _memfds(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:sparsekv")
        except OSError:
            pass
    return n


def goal_reclaim(cycles: int) -> dict:
    with helpers.short_tmpdir() as tmp, PrivateDaemon(pool_bytes=64 * MiB, log_path=os.path.join(tmp, "d.log")) as d:
        proc = psutil.Process(d.proc.pid)

        def state():
            snap = helpers.stats_json(d.run_dir)
            return {"fds": proc.num_fds(), "memfds": _memfds(d.proc.pid), "pool_used": snap["pool_used_bytes"],
                    "clients": snap["clients"], "rss_mib": round(proc.memory_info().rss / MiB, 1)}

        times, failures = [], 0
        start = None
        for i in range(cycles):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                _child(d.run_dir, f"k{i}", w)
            os.close(w)
            ok = os.read(r, 1) == b"k"
            os.close(r)
            failures += not ok
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            os.waitpid(pid, 0)
            while helpers.stats_json(d.run_dir)["clients"] != 0:
                if time.monotonic() - t0 > 10:
                    break
                time.sleep(0.002)
            times.append(time.monotonic() - t0)
            if i == 10:
                time.sleep(0.5)
                start = state()  # after warm-up (first imports, first engines), no client
        time.sleep(0.5)
        end = state()
        return {"goal": "reclaim", "cycles": cycles, "attach_failures": failures,
                "reclaim_p50_ms": round(_pct(times, 50) * 1e3, 1), "reclaim_p99_ms": round(_pct(times, 99) * 1e3, 1),
                "reclaim_max_ms": round(max(times) * 1e3, 1), "start": start, "end": end}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="fuzz,idle,idle_other_uid,frame,reclaim")
    ap.add_argument("--fuzz-s", type=float, default=600)
    ap.add_argument("--idle", type=int, default=10_000)
    ap.add_argument("--cycles", type=int, default=1000)
    a = ap.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    out = []
    for name in a.only.split(","):
        r = {"fuzz": lambda: goal_fuzz(a.fuzz_s), "idle": lambda: goal_idle(a.idle),
             "idle_other_uid": lambda: goal_idle(a.idle, flood_uid=65534, cap=256), "frame": goal_frame,
             "reclaim": lambda: goal_reclaim(a.cycles)}[name]()
        print(json.dumps(r), flush=True)
        out.append(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
