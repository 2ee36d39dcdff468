"""Where a process's ZeroMQ I/O threads run, beside the thread that polls the socket.

A ZeroMQ message between two processes passes through each side's I/O thread. On a VM an
idle CPU costs tens of microseconds to wake; a busy-polling thread keeps its own CPU awake,
so an I/O thread pinned to that same CPU wakes where the work already is. Measured on the
H200 machine (tests/gpu/micro_zmq_affinity.py, docs/PERF.md session 12): a 64-byte round
trip between two busy-polling processes, p50 104 us with the threads placed by the kernel,
62-79 us with each process's I/O thread on its polling thread's CPU.

Used by the daemon (``control_cpu``: its event-loop thread and I/O threads on one CPU;
every thread it starts afterwards gets the process's whole CPU set back through
:func:`unpinned`) and by the client (``Client(cpu=...)``: its I/O thread on the CPU of the
caller's thread).
"""
from __future__ import annotations

import os

_whole: set[int] | None = None  # the process's CPUs before pin_thread, while a thread is pinned


def allowed_cpus() -> set[int]:
    return set(os.sched_getaffinity(0))


def check_cpu(cpu: int, what: str) -> int:
    """``cpu`` if this process may run on it, else ValueError naming ``what``."""
    cpus = allowed_cpus()
    if int(cpu) not in cpus:
        raise ValueError(f"{what} {cpu} is not among the CPUs this process may use ({_ranges(cpus)})")
    return int(cpu)


def pin_thread(cpu: int) -> None:
    """Pin the calling thread to ``cpu``. Threads it starts afterwards inherit that: start
    them through :func:`unpinned` to give them the whole set back."""
    global _whole
    if _whole is None:
        _whole = allowed_cpus()
    os.sched_setaffinity(0, {int(cpu)})


def release_thread() -> None:
    """The calling thread back on the CPUs the process had before :func:`pin_thread` (a
    no-op when nothing was pinned). A ``ThreadPoolExecutor`` initializer."""
    if _whole is not None:
        try:
            os.sched_setaffinity(0, _whole)
        except OSError:
            pass  # a CPU went offline since: stay where the kernel put us


def unpinned(target):
    """``target`` wrapped to run on the process's whole CPU set (a thread's target)."""
    def run(*args, **kwargs):
        release_thread()
        return target(*args, **kwargs)
    return run


def single_cpu() -> int | None:
    """The one CPU the calling thread is pinned to, or None when it may run on several."""
    cpus = allowed_cpus()
    return next(iter(cpus)) if len(cpus) == 1 else None


def place_io_threads(ctx, cpu: int) -> None:
    """Pin the I/O threads of ZeroMQ context ``ctx`` (not started yet: before its first
    socket) to ``cpu``."""
    import zmq  # noqa: PLC0415

    ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, int(cpu))


def _ranges(cpus: set[int]) -> str:
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)
