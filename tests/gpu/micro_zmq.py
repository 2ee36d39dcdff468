"""Where a ZeroMQ request's time goes between two processes on one host: one-way times
(client send -> server receive, server send -> client receive; CLOCK_MONOTONIC) for small
and top-k-sized messages, with the server sleeping in its event loop (uvloop reader on
the zmq FD, like sparsekvd) or busy-polling, and the client blocking or busy-polling.
    python3 tests/gpu/micro_zmq.py
"""
import multiprocessing as mp
import os
import tempfile
import time

import numpy as np
import zmq


def server(path, mode, ready):
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.bind(f"ipc://{path}")
    ready.set()

    def handle():
        while s.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            fr = s.recv_multipart(copy=False)
            tr = time.perf_counter_ns()
            if len(fr) == 2 and fr[1].bytes == b"stop":
                s.send_multipart([fr[0], b"bye"])
                return True
            s.send_multipart([fr[0], tr.to_bytes(8, "little"), time.perf_counter_ns().to_bytes(8, "little")], copy=True)
        return False

    if mode == "loop":
        import asyncio

        import uvloop

        async def main():
            loop = asyncio.get_running_loop()
            done = asyncio.Event()
            loop.add_reader(s.getsockopt(zmq.FD), lambda: handle() and done.set())
            if handle():
                return
            await done.wait()

        uvloop.run(main())
    else:  # busy
        while not handle():
            pass
    s.close(0)
    ctx.term()


def client(path, size, busy, n=2000):
    ctx = zmq.Context()
    c = ctx.socket(zmq.DEALER)
    c.connect(f"ipc://{path}")
    payload = np.zeros(size // 4, np.int32)
    ins, outs, rtts = [], [], []
    for i in range(n):
        ts = time.perf_counter_ns()
        c.send_multipart([b"h", memoryview(payload)], copy=size < 65536)
        if busy:
            while not c.poll(0):
                pass
        else:
            c.poll(1000)
        fr = c.recv_multipart()
        rx = time.perf_counter_ns()
        tr, tx = int.from_bytes(fr[0], "little"), int.from_bytes(fr[1], "little")
        if i >= 100:
            ins.append(tr - ts)
            outs.append(rx - tx)
            rtts.append(rx - ts)
        time.sleep(0.0005)  # like a decode step: the peer goes idle between requests
    c.send_multipart([b"stop"])
    c.recv_multipart()
    c.close(0)
    ctx.term()
    return np.median(ins) / 1e3, np.median(outs) / 1e3, np.median(rtts) / 1e3


if __name__ == "__main__":
    ctxm = mp.get_context("spawn")
    print(f"{'server':6s} {'client':6s} {'bytes':>7s} {'in us':>7s} {'out us':>7s} {'rtt us':>7s}")
    for smode in ("loop", "busy"):
        for busy in (False, True):
            for size in (64, 131072):
                path = os.path.join(tempfile.mkdtemp(), "s.sock")
                ready = ctxm.Event()
                p = ctxm.Process(target=server, args=(path, smode, ready))
                p.start()
                ready.wait(10)
                i, o, r = client(path, size, busy)
                p.join(10)
                print(f"{smode:6s} {'busy' if busy else 'block':6s} {size:7d} {i:7.1f} {o:7.1f} {r:7.1f}")
