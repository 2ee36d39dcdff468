"""Does a ZeroMQ one-way hop on this VM cost two wake-ups of idle CPUs (the sender's and the
receiver's I/O threads), and does putting each process's I/O thread on the CPU of its
busy-polling thread remove them? Both sides busy-poll; the client pauses 500 us between
requests like a decode step. Variants: default placement; app thread and I/O thread pinned
together (one CPU a process); app thread pinned alone; a raw SOCK_SEQPACKET pair (no I/O
thread) for reference.
    python3 tests/gpu/micro_zmq_affinity.py
"""
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time

import numpy as np
import zmq


def _ctx(cpu, io_too):
    """A context whose I/O thread runs on ``cpu`` too (``io_too``) or where the kernel puts
    it (started before this thread is pinned: a new thread inherits its creator's CPUs)."""
    ctx = zmq.Context()
    if cpu is None:
        return ctx
    if io_too:
        ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
    else:
        ctx.socket(zmq.PAIR).close(0)  # starts the I/O thread, unpinned
    os.sched_setaffinity(0, {cpu})
    return ctx


def zserver(path, cpu, io_too, ready):
    ctx = _ctx(cpu, io_too)
    s = ctx.socket(zmq.ROUTER)
    s.bind(f"ipc://{path}")
    ready.set()
    while True:
        if not s.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            continue
        fr = s.recv_multipart()
        tr = time.perf_counter_ns()
        s.send_multipart([fr[0], tr.to_bytes(8, "little"), time.perf_counter_ns().to_bytes(8, "little")])
        if fr[1] == b"stop":
            break
    s.close(0)
    ctx.term()


def zclient(path, cpu, io_too, n):
    ctx = _ctx(cpu, io_too)
    c = ctx.socket(zmq.DEALER)
    c.connect(f"ipc://{path}")
    ins, outs, rtts = [], [], []
    for i in range(n):
        ts = time.perf_counter_ns()
        c.send(b"h")
        while not c.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            pass
        fr = c.recv_multipart()
        rx = time.perf_counter_ns()
        tr, tx = int.from_bytes(fr[0], "little"), int.from_bytes(fr[1], "little")
        if i >= 100:
            ins.append(tr - ts), outs.append(rx - tx), rtts.append(rx - ts)
        time.sleep(0.0005)
    c.send(b"stop")
    c.recv_multipart()
    c.close(0)
    ctx.term()
    return ins, outs, rtts


def userver(path, cpu, ready):
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(path)
    s.listen(1)
    ready.set()
    c, _ = s.accept()
    c.setblocking(False)
    while True:
        try:
            m = c.recv(64)
        except BlockingIOError:
            continue
        tr = time.perf_counter_ns()
        c.send(tr.to_bytes(8, "little") + time.perf_counter_ns().to_bytes(8, "little"))
        if m == b"stop":
            break


def uclient(path, cpu, n):
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    c.connect(path)
    c.setblocking(False)
    ins, outs, rtts = [], [], []
    for i in range(n + 1):
        ts = time.perf_counter_ns()
        c.send(b"h" if i < n else b"stop")
        while True:
            try:
                m = c.recv(64)
                break
            except BlockingIOError:
                pass
        rx = time.perf_counter_ns()
        tr, tx = int.from_bytes(m[:8], "little"), int.from_bytes(m[8:], "little")
        if 100 <= i < n:
            ins.append(tr - ts), outs.append(rx - tx), rtts.append(rx - ts)
        time.sleep(0.0005)
    return ins, outs, rtts


def run(name, n, scpu, ccpu, io_too, raw=False):
    mpc = mp.get_context("spawn")
    path = os.path.join(tempfile.mkdtemp(), "s.sock")
    ready = mpc.Event()
    if raw:
        p = mpc.Process(target=userver, args=(path, scpu, ready))
    else:
        p = mpc.Process(target=zserver, args=(path, scpu, io_too, ready))
    p.start()
    ready.wait(10)
    # The client in a process of its own too: a pin of this one would leak into the next
    # variants (and into the processes it starts).
    with mpc.Pool(1) as pool:
        ins, outs, rtts = pool.apply(uclient if raw else zclient,
                                     (path, ccpu, n) if raw else (path, ccpu, io_too, n))
    p.join(10)
    if p.is_alive():
        p.kill()
    f = lambda a, q: np.percentile(a, q) / 1e3  # noqa: E731
    print(f"{name:34s} {f(ins, 50):7.1f} {f(outs, 50):7.1f} {f(rtts, 50):7.1f} {f(rtts, 90):7.1f}", flush=True)
    return f(rtts, 50)


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    cpus = sorted(os.sched_getaffinity(0))
    a, b = cpus[len(cpus) // 2], cpus[(len(cpus) // 2 + 1) % len(cpus)]
    print(f"cpus {len(cpus)}; server on {a}, client on {b} where pinned")
    print(f"{'variant':34s} {'in p50':>7s} {'out p50':>7s} {'rtt p50':>7s} {'rtt p90':>7s}  (us)")
    for rnd in range(2):
        run("zmq default", n, None, None, False)
        run("zmq app+io thread on one cpu", n, a, b, True)
        run("zmq app thread pinned alone", n, a, b, False)
        run("raw seqpacket, pinned", n, a, b, False, raw=True)
