"""What a peer can make the daemon hold (daemon/control_socket.py), against a private cpu
daemon with real sockets: the daemon's memory stays bounded and everyone else is served.

- 24 connections each sending a 250 MiB frame before HELLO: each is refused at its frame's
  header, unread (peak RSS within 256 MiB of before);
- a session sending one endless multipart message: its frames are dropped as read, and the
  connection closed past ``max_message_bytes``;
- many sessions each sending a large request at once: the frames over ``SMALL_FRAME`` wait
  for the ``inflight_bytes`` budget, unread (peak RSS within budget + margin), and each is
  answered;
- repeated floods of connections: RSS after them within 32 MiB of before.
(Routing-id reuse: test_routing_ids.py; one uid taking every place: test_fair_shares.py.)"""

import contextlib
import os
import resource
import socket
import threading
import time

import numpy as np
import zmq

import helpers
from helpers import vm
from zmtp_peer import GREETING, READY, hello, raw_peer, read_reply, send_message
from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.client import Client
from sparsekv.proto import zmtp
from sparsekv.proto import LIMITS, MsgType, encode

MiB = 1 << 20


@contextlib.contextmanager
def daemon(*args):
    with PrivateDaemon(pool_bytes=16 * MiB, extra_args=list(args)) as d:
        d.path = os.path.join(d.run_dir, "control.sock")
        with Client(d.run_dir, timeout_s=10, name="warm") as c:  # the serving path, warmed
            c.stats()
        yield d


def closed(s: socket.socket, timeout_s: float = 5) -> bool:
    s.settimeout(timeout_s)
    try:
        while s.recv(1 << 20):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def test_large_frames_before_hello_are_refused_unread():
    with daemon() as d:
        pid = d.proc.pid
        before, hwm = vm(pid, "VmRSS"), vm(pid, "VmHWM")
        ctx = zmq.Context(io_threads=2)
        payload = zmq.Frame(bytes(250 * MiB))
        socks = []
        for _ in range(24):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"ipc://{d.path}")
            s.send_multipart([b"x" * 100, payload], copy=False)
            socks.append(s)
        time.sleep(2)
        with Client(d.run_dir, timeout_s=5) as c:  # served on
            assert c.stats()["clients"] == 1
        assert vm(pid, "VmHWM") - max(before, hwm) <= 256 * MiB
        for s in socks:
            s.close(0)
        ctx.term()


def test_an_endless_message_is_dropped_as_read_and_its_connection_closed():
    with daemon() as d:
        pid = d.proc.pid
        before = vm(pid, "VmRSS")
        s = raw_peer(d.path)
        assert hello(s)["ok"]
        head = encode(MsgType.STATS, 2, None)[0]  # declares no arrays: what follows is dropped
        chunk = zmtp.frame_header(8 * MiB, zmtp.MORE) + bytes(8 * MiB)
        s.sendall(zmtp.frame_header(len(head), zmtp.MORE) + head)
        sent = 0
        try:
            for _ in range(40):  # 320 MiB: past max_message_bytes
                s.sendall(chunk)
                sent += 1
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert sent * 8 * MiB >= LIMITS.max_message_bytes - 8 * MiB
        reply = read_reply(s)
        assert reply["error"] == "TOO_LARGE" and reply["id"] == 2, reply
        assert closed(s)
        assert vm(pid, "VmRSS") - before <= 32 * MiB
        with Client(d.run_dir, timeout_s=5) as c:
            assert c.stats()["clients"] == 1


def test_large_requests_at_once_wait_for_the_budget_unread_and_are_all_answered():
    budget = 64 * MiB
    with daemon("--inflight-bytes", "64MiB", "--max-clients-per-uid", "0", "--max-connections-per-uid", "0") as d:
        pid = d.proc.pid
        before = vm(pid, "VmRSS")
        peers = [raw_peer(d.path) for _ in range(12)]
        for i, s in enumerate(peers):
            assert hello(s, f"p{i}")["ok"]
        data = np.zeros((1, 1024, 16 * 1024), np.uint8)  # one 16 MiB frame each: 192 MiB in all
        msgs = [encode(MsgType.WRITE, 3, {"layers": None}, {"rows": np.arange(1024, dtype=np.int32), "data": data})
                for _ in peers]
        peak = [0]
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                peak[0] = max(peak[0], vm(pid, "VmRSS"))
                time.sleep(0.002)

        w = threading.Thread(target=watch, daemon=True)
        w.start()
        senders = [threading.Thread(target=send_message, args=(s, *m)) for s, m in zip(peers, msgs)]
        for t in senders:
            t.start()
        replies = [read_reply(s) for s in peers]
        for t in senders:
            t.join(10)
        stop.set()
        w.join()
        assert all(r["id"] == 3 and r["error"] == "NOT_ATTACHED" for r in replies), replies
        snap = helpers.stats_json(d.run_dir)
        assert snap["reads_paused"] > 0 and snap["inflight_bytes_peak"] <= budget, snap
        assert snap["inflight_bytes"] == 0
        assert peak[0] - before <= budget + 64 * MiB, (peak[0] - before) / MiB
        for s in peers:
            s.close()


def test_floods_of_connections_leave_no_memory_behind():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    try:
        with daemon("--max-connections-per-uid", "0") as d:
            pid = d.proc.pid
            before = vm(pid, "VmRSS")
            for _ in range(6):
                socks = []
                for _ in range(2000):
                    s = socket.socket(socket.AF_UNIX)
                    s.setblocking(False)
                    with contextlib.suppress(OSError):
                        s.connect(d.path)
                        s.send(GREETING + READY)
                    socks.append(s)
                time.sleep(0.3)
                for s in socks:
                    s.close()
            helpers.wait_for(lambda: helpers.stats_json(d.run_dir)["connections_open"] == 0, timeout_s=10,
                             what="the flood's connections closed")
            assert vm(pid, "VmRSS") - before <= 32 * MiB, (vm(pid, "VmRSS") - before) / MiB
            with Client(d.run_dir, timeout_s=5) as c:
                assert c.stats()["clients"] == 1
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
