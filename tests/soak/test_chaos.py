"""Chaos soak (marked ``soak``: ``make soak`` runs it, ``make test`` does not), on the cpu
backend, and on the cuda backend (clients on ``cuda:0``, slabs in GPU memory; marked
``cuda``: skipped without a GPU), for ``SPARSEKV_SOAK_S`` seconds (default 60); with
``SPARSEKV_SOAK_SUMMARY_DIR`` set, its figures also go to ``chaos-<backend>.json`` there.

One private daemon (``--reap-interval-s 0.2``) serves, all at once:

- ``CLIENTS`` verifying client processes (``chaos_worker.py``), each alone on its own
  engine. The correctness check is exact because each engine has a single process that
  both rewrites and reads: it fills every (layer, row) with generation 0 of the
  ``--verify`` pattern (bench/verify.py), every 5 steps rewrites 4 rows (2 of them hot)
  with the next generation through WRITE, and after each STEP + TOPK compares every
  delivered hot row with the pattern of that row's *current* generation. Its WRITE reply
  arrives before its next STEP is sent (program order in one process), so no row may show
  an older generation: there is no racy window to tolerate.
- a pair of processes (``chaos_pair.py``), two ranks of one engine: a writer rewriting
  random rows without pause and a reader stepping at the same time, checking that every
  delivered row holds a generation between the last WRITE finished before its step and
  the last one started before its reply (an exact check for racing ranks).
- random SIGKILLs of those clients and the pair's reader (never its writer: the pair's
  engine outlives every kill) every 1.5–3 s; the daemon must drop the killed pid's
  session within 2 s (its ``clients`` list), then the client is respawned on its engine;
- the daemon SIGKILLed twice (at 35 % and 70 % of the run) and restarted on the same run
  dir: every live client must raise ``DaemonUnavailable`` within 3 s of the kill, and be
  re-attached with its pool re-filled within 2 s of the new daemon serving;
- a fuzzing process (``chaos_fuzz.py``) sending random bytes and structurally valid but
  wrong messages to control.sock; no reply may be INTERNAL (its own count, and the
  daemon's ``errors_by_code`` read before each kill and at the end).

At the end: 0 wrong rows, no client error other than ``DaemonUnavailable``, the session
list equal to the live processes, the daemon's RSS growth and fd count over the last
incarnation (from the clients' re-attach to the end), and no shared-memory file of the run
dir left once the daemon stops. A one-line JSON summary is printed (``-s`` shows it).
"""

import contextlib
import json
import os
import random
import signal
import subprocess
import time

import psutil
import pytest

import helpers
from sparsekv.proto import settings
from sparsekv.bench.private_daemon import PrivateDaemon

pytestmark = pytest.mark.soak

SOAK_S = settings.SOAK_S.get()
CLIENTS = 4
READER, WRITER = CLIENTS, CLIENTS + 1  # chaos_pair.py: two ranks of one engine, racing
WORKERS = CLIENTS + 2
HERE = os.path.dirname(os.path.abspath(__file__))
POOL_BYTES = 64 << 20


def session_pids(run_dir: str) -> list[int]:
    lines = helpers.stats_query(run_dir, "clients").splitlines()
    col = lines[0].split("\t").index("pid")
    return [int(line.split("\t")[col]) for line in lines[1:] if line]


def read_events(path: str, kind: str | None = None) -> list[dict]:
    """The JSON events a worker wrote (only those of ``kind`` when given)."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            if kind is not None and f'"ev": "{kind}"' not in line:
                continue
            try:
                out.append(json.loads(line))
            except ValueError:  # a line cut by SIGKILL
                pass
    return out


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q / 100 * len(xs)))], 4)


class Chaos:
    def __init__(self, d: PrivateDaemon, tmp: str):
        self.d, self.tmp = d, tmp
        self.workers: dict[int, subprocess.Popen] = {}  # engine index -> process
        self.events: dict[int, str] = {}  # pid -> events file
        self.seed = 0
        self.timeline: list[tuple[float, str]] = []  # (wall time, what): spawns and kills, for a report
        self.pair_state = os.path.join(tmp, "pair.state")  # chaos_pair.py's shared generations
        with open(self.pair_state, "wb") as f:
            f.write(bytes(8 * (2 * 256 + 1)))

    def spawn(self, i: int) -> None:
        """Worker ``i``: a verifying client alone on engine e{i} (i < CLIENTS), or the
        pair's reader (READER) or writer (WRITER), two ranks of one engine."""
        self.seed += 1
        path = os.path.join(self.tmp, f"w{i}-{self.seed}.jsonl")
        device = "cuda:0" if self.d.backend == "cuda" else "cpu"
        if i < CLIENTS:
            cmd = [os.path.join(HERE, "chaos_worker.py"), self.d.run_dir, f"e{i}", str(self.seed), path, device]
        else:
            cmd = [os.path.join(HERE, "chaos_pair.py"), "reader" if i == READER else "writer", self.d.run_dir,
                   self.pair_state, str(self.seed), path, device]
        p = subprocess.Popen([helpers.PY, *cmd])
        self.timeline.append((time.time(), f"spawn worker {i} pid {p.pid}"))
        self.workers[i] = p
        self.events[p.pid] = path

    def attached_since(self, t: float, pids) -> dict[int, float]:
        """pid -> the first time (wall clock) after ``t`` it reported being attached."""
        out = {}
        for pid in pids:
            for e in read_events(self.events[pid], "attached"):
                if e["t"] >= t:
                    out[pid] = e["t"]
                    break
        return out

    def explain(self, pids) -> str:
        """Why these workers did not report: each one's last events and its threads' stacks
        (SIGUSR2: the workers install faulthandler on it, into ``<events>.stacks``)."""
        out = []
        for pid in pids:
            path = self.events[pid]
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR2)
        time.sleep(0.5)
        for pid in pids:
            path = self.events[pid]
            last = read_events(path)[-3:]
            stacks = ""
            with contextlib.suppress(OSError), open(path + ".stacks") as f:
                stacks = f.read()[-3000:]
            out.append(f"worker {pid}: last events {last}\n{stacks}")
        return "\n".join(out)

    def wait_for_workers(self, pred, pids, timeout_s: float, what: str, since: float | None = None):
        """``helpers.wait_for`` that, on a timeout, says what each of ``pids`` was doing
        (and how long ago ``since``, a wall time such as a daemon kill, was)."""
        try:
            return helpers.wait_for(pred, timeout_s, what=what)
        except AssertionError as e:
            when = f" (at {time.time():.3f}; {time.time() - since:.2f} s after {since:.3f})" if since else ""
            raise AssertionError(f"{e}{when}\n{self.explain(list(pids))}") from None

    def restart_daemon(self) -> tuple[subprocess.Popen, float]:
        """A new daemon on the same run dir, as PrivateDaemon starts one; returns it and
        the wall time it began to serve: when its control.sock was renamed into place (the
        file's ctime, set by the kernel: this process, busy on two loaded cores, may
        notice later than the clients do)."""
        d = self.d
        cmd = [helpers.PY, "-m", "sparsekv.daemon.main", "--run-dir", d.run_dir, "--backend", d.backend,
               "--pool-size", f"{d.pool_bytes}B", *d.extra_args]
        log = open(os.path.join(self.tmp, "sparsekvd.log"), "ab")
        p = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
        log.close()

        def serving():
            assert p.poll() is None, "the restarted daemon exited"
            try:
                return helpers.stats_json(d.run_dir)["pid"] == p.pid
            except (OSError, ValueError):
                return False

        helpers.wait_for(serving, 30, interval_s=0.005, what="the restarted daemon to serve")
        d.proc = p  # PrivateDaemon stops this one at exit
        return p, os.stat(os.path.join(d.run_dir, "control.sock")).st_ctime


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_chaos_soak_kills_restarts_and_fuzz_leave_every_row_correct(tmp_path, backend):
    tmp = str(tmp_path)
    rnd = random.Random(11)
    summary = {"soak_s": SOAK_S, "clients": CLIENTS, "backend": backend}
    reclaim, detect, reattach, internal_seen = [], [], [], []
    incarnations = []  # the killed daemons: RSS growth and fds just before each kill
    d = PrivateDaemon(pool_bytes=POOL_BYTES, backend=backend, extra_args=["--reap-interval-s", "0.2"],
                      log_path=os.path.join(tmp, "sparsekvd.log"), start_timeout_s=30)
    fuzz_path = os.path.join(tmp, "fuzz.json")
    fuzz = None
    with d:
        run_dir = d.run_dir
        helpers.wait_for(lambda: _serving(run_dir, d.proc.pid), 30, what="the daemon to serve")
        ch = Chaos(d, tmp)
        try:
            for i in range(WORKERS):
                ch.spawn(i)
            t_start = time.time()
            pids = [p.pid for p in ch.workers.values()]
            ch.wait_for_workers(lambda: len(ch.attached_since(0, pids)) == WORKERS, pids, 30,
                                what="every client to attach")
            fuzz = subprocess.Popen([helpers.PY, os.path.join(HERE, "chaos_fuzz.py"), run_dir, "5", fuzz_path])
            proc = psutil.Process(d.proc.pid)
            summary["rss_start_mib"] = round(proc.memory_info().rss / 2**20, 1)
            summary["fds_start"] = proc.num_fds()
            kills_at = [t_start + 0.35 * SOAK_S, t_start + 0.70 * SOAK_S]
            next_client_kill = time.time() + rnd.uniform(1.5, 3.0)
            end = t_start + SOAK_S
            client_kills = daemon_kills = 0
            last_ready = 0.0  # when the daemon now serving began to
            while time.time() < end:
                now = time.time()
                if kills_at and now >= kills_at[0]:
                    kills_at.pop(0)
                    internal_seen.append(helpers.stats_json(run_dir)["errors_by_code"].get("INTERNAL", 0))
                    inc = psutil.Process(d.proc.pid)
                    grown = inc.memory_info().rss / 2**20 - summary["rss_start_mib"]
                    incarnations.append({"rss_growth_mib": round(grown, 1), "fds": inc.num_fds()})
                    # Only the clients the daemon serves must notice its death: a respawned
                    # worker still starting (a cuda one imports torch for seconds) attaches
                    # to whichever daemon it finds and has nothing to lose.
                    live = list(ch.attached_since(last_ready, [p.pid for p in ch.workers.values()]))
                    t_kill = time.time()
                    ch.timeline.append((t_kill, f"SIGKILL daemon pid {d.proc.pid}"))
                    os.kill(d.proc.pid, signal.SIGKILL)
                    d.proc.wait()
                    daemon_kills += 1
                    time.sleep(0.5)  # the socket left behind: clients get "connection refused"
                    new, t_ready = ch.restart_daemon()
                    ch.timeline.append((t_ready, f"daemon pid {new.pid} serves"))
                    last_ready = t_ready
                    waiting = list(live)  # the clients that have not reported the loss yet

                    def lost_all():
                        got = {}
                        for pid in live:
                            for e in read_events(ch.events[pid], "lost"):
                                if e["t"] >= t_kill:
                                    got[pid] = e["t"]
                                    break
                        waiting[:] = [pid for pid in live if pid not in got]
                        return got if len(got) == len(live) else None

                    restarted = time.time() - t_kill
                    lost = ch.wait_for_workers(lost_all, waiting, 5, since=t_kill,
                                               what=f"every client to notice the daemon's death (the new daemon "
                                                    f"served {restarted:.2f} s after the kill)")
                    detect += [t - t_kill for t in lost.values()]
                    back = helpers.wait_for(lambda: (a := ch.attached_since(t_kill, live)) and len(a) == len(live)
                                            and a, 10, interval_s=0.01, what="every client to re-attach")
                    reattach += [max(0.0, t - t_ready) for t in back.values()]
                    proc = psutil.Process(d.proc.pid)
                    summary["rss_start_mib"] = round(proc.memory_info().rss / 2**20, 1)  # the last incarnation
                    summary["fds_start"] = proc.num_fds()
                    next_client_kill = time.time() + rnd.uniform(1.5, 3.0)
                elif now >= next_client_kill:
                    i = rnd.randrange(CLIENTS + 1)  # a lone client or the pair's reader, never its writer
                    victim = ch.workers[i]
                    # Only a client the daemon knows (attached after the last restart).
                    if victim.pid in session_pids(run_dir):
                        t0 = time.monotonic()
                        ch.timeline.append((time.time(), f"SIGKILL worker {i} pid {victim.pid}"))
                        victim.kill()
                        victim.wait()
                        helpers.wait_for(lambda: victim.pid not in session_pids(run_dir), 5, interval_s=0.005,
                                         what="the killed client's session to be reclaimed")
                        reclaim.append(time.monotonic() - t0)
                        client_kills += 1
                        ch.spawn(i)
                    next_client_kill = time.time() + rnd.uniform(1.5, 3.0)
                else:
                    time.sleep(0.02)
            # Wait until every client is attached again, then look at the daemon.
            helpers.wait_for(lambda: all(ch.attached_since(0, [p.pid]) for p in ch.workers.values()), 10,
                             what="the last respawned clients to attach")
            time.sleep(1.0)
            fuzz.kill()
            fuzz.wait()
            live = {p.pid for p in ch.workers.values()}
            helpers.wait_for(lambda: set(session_pids(run_dir)) == live, 5,
                             what="the session list to equal the live clients")
            stats = helpers.stats_json(run_dir)
            proc = psutil.Process(d.proc.pid)
            summary["rss_end_mib"] = round(proc.memory_info().rss / 2**20, 1)
            summary["fds_end"] = proc.num_fds()
            summary["daemon_clients_end"] = stats["clients"]
        finally:
            for p in ch.workers.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in ch.workers.values():
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            if fuzz is not None and fuzz.poll() is None:
                fuzz.kill()
                fuzz.wait()
        internal_seen.append(stats["errors_by_code"].get("INTERNAL", 0))
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(20)
        leftover = helpers.shm_slabs(run_dir)

    # -- figures ---------------------------------------------------------------------------
    checks = rows = bad = 0
    errors, bad_events = [], []
    pair = {"reader": 0, "writer": 0}  # the pair's checks, its writes
    for path in ch.events.values():
        last = {}
        for e in read_events(path):
            if "checks" in e:
                last = e
            if e["ev"] == "bad":
                bad_events.append(e)
            if e["ev"] == "error":
                errors.append(e)
        checks += last.get("checks", 0)
        rows += last.get("rows", 0)
        if "role" in last:
            pair[last["role"]] += last.get("checks", 0) if last["role"] == "reader" else last.get("writes", 0)
    bad = sum(e["bad"] for e in bad_events)
    fz = json.load(open(fuzz_path)) if os.path.exists(fuzz_path) else {}
    summary.update({
        "checks": checks, "rows_checked": rows, "wrong_rows": bad, "client_errors": len(errors),
        "client_kills": client_kills, "daemon_kills": daemon_kills,
        "reclaim_s_p50": pct(reclaim, 50), "reclaim_s_p99": pct(reclaim, 99), "reclaim_s_max": pct(reclaim, 100),
        "detect_s_max": pct(detect, 100), "detect_s_p50": pct(detect, 50),
        "reattach_s_max": pct(reattach, 100), "reattach_s_p50": pct(reattach, 50),
        "fuzz_sent": fz.get("sent", 0), "fuzz_replies": fz.get("replies", 0), "fuzz_internal": fz.get("internal"),
        "pair_checks": pair["reader"], "pair_writes": pair["writer"],
        "daemon_internal": internal_seen, "shm_left": len(leftover), "killed_incarnations": incarnations,
    })
    summary["rss_growth_mib"] = round(summary["rss_end_mib"] - summary["rss_start_mib"], 1)
    print("CHAOS_SUMMARY " + json.dumps(summary))
    if os.environ.get("SPARSEKV_SOAK_SUMMARY_DIR"):  # the figures of a passing run too (pytest hides prints)
        with open(os.path.join(os.environ["SPARSEKV_SOAK_SUMMARY_DIR"], f"chaos-{backend}.json"), "w") as f:
            json.dump(summary, f)
    if errors or bad_events:  # what the daemons said, for the report
        with contextlib.suppress(OSError), open(os.path.join(tmp, "sparsekvd.log"), errors="replace") as f:
            said = [line.rstrip() for line in f if " WARNING " in line or " ERROR " in line or "refused" in line]
        print("DAEMON_WARNINGS\n" + "\n".join(said[-60:]))
        for e in (errors + bad_events)[:10]:  # whole (pytest shortens the assertion's repr)
            print("CLIENT_EVENT " + json.dumps(e))
        # when each failing worker did what, among the test's spawns and kills
        lines = list(ch.timeline)
        for pid in {e["pid"] for e in errors + bad_events}:
            lines += [(e["t"], f"pid {pid} {e['ev']} " + json.dumps({k: v for k, v in e.items() if k not in
                                                                     ("t", "pid", "ev", "where", "msg")}))
                      for e in read_events(ch.events[pid])]
        t0 = min((t for t, _ in lines), default=0.0)
        print("CHAOS_TIMELINE\n" + "\n".join(f"{t - t0:8.3f} {what}" for t, what in sorted(lines)))

    assert bad == 0, [json.dumps(e) for e in bad_events[:5]]
    assert not errors, [json.dumps(e) for e in errors[:5]]  # whole: type and message
    assert checks > 0 and client_kills > 0 and daemon_kills == 2
    assert reclaim and max(reclaim) < 2.0, reclaim
    assert detect and max(detect) < 3.0, detect
    assert reattach and max(reattach) < 2.0, reattach
    assert fz.get("sent", 0) > 0 and fz.get("internal") == 0 and not any(internal_seen), (fz, internal_seen)
    assert summary["daemon_clients_end"] == WORKERS
    assert summary["pair_checks"] > 0 and summary["pair_writes"] > 0, summary
    assert not leftover, leftover


def _serving(run_dir: str, pid: int) -> bool:
    try:
        return helpers.stats_json(run_dir)["pid"] == pid
    except (OSError, ValueError):
        return False
