"""Where the control socket's hop runs: CPU lists, the daemon's loop thread placed, warm CPUs.

A request wakes the daemon's loop thread, which sleeps in ``epoll_wait`` once its busy
poll ends, and the reply wakes the client's thread unless it is still spinning; in a VM
whose guest halts, waking a CPU costs tens of microseconds (docs/PERF.md, "Transport
hand-off"). Two settings of the daemon take most of that off:

- ``io_cpus``: the CPUs of the daemon's loop thread, which reads and writes the control
  socket; its other threads are kept off them, so no worker sits on the CPU the loop needs.
- warm CPUs (:class:`CpuWarmer`, the daemon's ``warm_cpus``): one busy loop per CPU under
  ``SCHED_IDLE`` at nice 19 in a session of its own: a thread that wakes there preempts it,
  and the CPU never halts. Each such CPU shows 100 % busy in ``top`` and spends the power;
  how the kernel shares it between cgroups: deploy/README.md "Warm CPUs".
"""
from __future__ import annotations

import math
import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time

from .cgroups import cgroup_dirs

# Seen in `ps`: what the warm CPU loops are.
WARM_MARK = "sparsekv-warm-cpu"

# The loop each warm CPU runs. It dies with the process that started it (PR_SET_PDEATHSIG;
# checked once more after setting it, in case that process died in between).
_LOOP = """
import ctypes, os, signal, sys, time
cpu, parent = int(sys.argv[2]), int(sys.argv[3])
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(1, signal.SIGKILL) != 0:  # PR_SET_PDEATHSIG
    sys.exit("prctl(PR_SET_PDEATHSIG) failed: errno %d" % ctypes.get_errno())
if os.getppid() != parent:
    sys.exit(0)
libc.prctl(15, ("skv-warm-cpu%d" % cpu).encode()[:15])  # PR_SET_NAME: what top and pgrep show
os.setsid()  # a session, so an autogroup, of its own (never fails: not a group leader)
os.sched_setaffinity(0, {cpu})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
print("ok", flush=True)
# Its autogroup at nice 19: where the kernel groups tasks by session (sched_autogroup_enabled)
# the loop's group then weighs next to nothing against others. Without CAP_SYS_ADMIN the
# kernel takes one such write per 100 ms on the whole machine (EAGAIN): try for a while.
for _ in range(100):
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("19")
        break
    except BlockingIOError:
        time.sleep(0.11)
    except OSError:
        break
while True:
    pass
"""

_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?")  # (ASCII digits: \d takes any script's)
# CPU numbers accepted: glibc's cpu_set_t (CPU_SETSIZE, 1024 CPUs), which the warm loops'
# and other native placements use.
MAX_CPU = 1024


def parse_cpu_list(text: str, what: str = "cpu list") -> tuple[int, ...]:
    """``"3"``, ``"2,3"``, ``"4-7,12"`` (the kernel's cpulist format) → sorted CPU numbers;
    ``""`` → ``()``. ValueError naming ``what`` and the bad part otherwise."""
    text = text.strip()
    if not text:
        return ()
    cpus: set[int] = set()
    for part in text.split(","):
        m = _ITEM.fullmatch(part.strip())
        if m is None:
            raise ValueError(f"{what}: {part.strip()!r} is not a CPU number or range (e.g. 3, 2,3 or 4-7)")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"{what}: range {part.strip()!r} runs backwards")
        if hi >= MAX_CPU:
            raise ValueError(f"{what}: CPU {hi} is beyond the {MAX_CPU} CPUs a thread can be placed on here")
        cpus.update(range(lo, hi + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus) -> str:
    """The inverse of :func:`parse_cpu_list`, with ranges folded: ``(2, 3, 4, 7)`` → ``"2-4,7"``."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def check_cpus_usable(cpus, what: str) -> None:
    """ValueError unless a thread of this process can be put on every CPU of ``cpus`` (online,
    in its cpuset; its own affinity may leave them out): tried on a thread of its own, so
    that a bad setting is refused at start, naming it, before anything is placed."""
    if not cpus:
        return
    bad: list[str] = []

    def attempt() -> None:
        for c in sorted(set(cpus)):
            try:
                os.sched_setaffinity(0, {c})  # 0: the calling thread
            except OSError:
                bad.append(str(c))

    t = threading.Thread(target=attempt, name="cpu-check")
    t.start()
    t.join()
    if bad:
        raise ValueError(f"{what} names CPU(s) {format_cpu_list(int(c) for c in bad)}, which this process cannot run on "
                         f"(not online, or outside its cpuset); it runs on {format_cpu_list(os.sched_getaffinity(0))}")


def keep_off(cpus) -> None:
    """Keep the calling thread, and every thread it starts from now on, off ``cpus``
    (unless that would leave it no CPU)."""
    allowed = os.sched_getaffinity(0)
    rest = allowed - set(cpus)
    if rest and rest != allowed:
        os.sched_setaffinity(0, rest)


def cpu_quota(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """CPUs' worth of run time per period that this process's cgroup and its ancestors
    allow (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``; the smallest), or None without a
    quota. Each warm CPU's loop spends one CPU of it, ``SCHED_IDLE`` or not."""
    quotas = [q for version, d in cgroup_dirs("cpu", cgroup_root, proc_cgroup)
              if (q := (_quota_v2 if version == 2 else _quota_v1)(d)) is not None]
    return min(quotas) if quotas else None


def _quota_v2(d: str) -> float | None:
    try:
        with open(os.path.join(d, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return int(quota) / int(period) if quota != "max" and int(period) > 0 else None
    except (OSError, ValueError):
        return None


def _quota_v1(d: str) -> float | None:
    try:
        with open(os.path.join(d, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(d, "cpu.cfs_period_us")) as f:
            period = int(f.read())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


class CpuWarmer:
    """One ``SCHED_IDLE`` busy loop per CPU of ``cpus``, in child processes that die with
    the thread that started them (PR_SET_PDEATHSIG: hence the main thread). ``start()``
    returns once every loop runs (or raises, with none left)."""

    def __init__(self, cpus, start_timeout_s: float = 30.0):
        self.cpus = tuple(sorted(set(int(c) for c in cpus)))
        self.start_timeout_s = start_timeout_s
        self._procs: list[subprocess.Popen] = []
        self._revived: dict[int, float] = {}  # cpu -> when its loop was last started again
        self.revived = 0  # loops started again since start()

    def start(self) -> "CpuWarmer":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("CpuWarmer.start() from a thread other than the main one: its loops would die "
                               "with that thread")
        check_cpus_usable(self.cpus, "warm_cpus")
        try:
            for cpu in self.cpus:
                self._procs.append(self._spawn(cpu))
            for cpu, p in zip(self.cpus, self._procs):
                line = _read_line(p, self.start_timeout_s)
                if line != "ok":
                    err = _stderr_tail(p)
                    raise RuntimeError(f"the warm loop for CPU {cpu} did not start"
                                       + (f": {err}" if err else f" within {self.start_timeout_s:g} s"))
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def _spawn(cpu: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-I", "-S", "-c", _LOOP, WARM_MARK, str(cpu), str(os.getpid())],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                close_fds=True)

    def running(self) -> int:
        """How many loops are still running."""
        return sum(1 for p in self._procs if p.poll() is None)

    def revive(self, min_interval_s: float = 60.0) -> list[tuple[int, str]]:
        """Start again each loop that has exited (someone killed it), at most once per
        ``min_interval_s`` a CPU, without waiting (main thread only, as start). Returns
        (cpu, why it had exited) of each one started again."""
        now = time.monotonic()
        out = []
        for i, (cpu, p) in enumerate(zip(self.cpus, self._procs)):
            if p.poll() is None or now - self._revived.get(cpu, -math.inf) < min_interval_s:
                continue
            why = _stderr_tail(p)
            _close_pipes(p)
            self._procs[i] = self._spawn(cpu)
            self._revived[cpu] = now
            self.revived += 1
            out.append((cpu, why))
        return out

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def stop(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self._procs:
            p.wait()
            _close_pipes(p)
        self._procs = []

    close = stop

    def __enter__(self) -> "CpuWarmer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _read_line(p: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(min(0.5, max(0.0, deadline - time.monotonic()))):
                return p.stdout.readline().decode(errors="replace").strip()
            if p.poll() is not None:
                return ""
    return ""


def _close_pipes(p: subprocess.Popen) -> None:
    for f in (p.stdout, p.stderr):
        if f is not None:
            f.close()


def _stderr_tail(p: subprocess.Popen) -> str:
    if p.poll() is None:
        return ""
    try:
        text = p.stderr.read().decode(errors="replace").strip()
    except (OSError, ValueError):
        return ""
    if text:
        return text.splitlines()[-1]
    if p.returncode < 0:
        try:
            return f"killed by {signal.Signals(-p.returncode).name}"
        except ValueError:
            pass
    return f"exit code {p.returncode}"
