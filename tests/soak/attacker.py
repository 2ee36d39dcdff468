"""The attacks of tests/daemon/test_attacks.py and test_routing_ids.py in a loop, one after
another, against ``argv[1]`` (a run dir), until stdin closes; prints a JSON line of counts.
Run by tests/soak/test_attack_soak.py (as another uid where it can, so that its slot hog
takes that uid's share, not the replays')."""

import contextlib
import json
import os
import socket
import sys
import threading
import time

import zmq

from zmtp_peer import GREETING, READY, hello, raw_peer
from sparsekv.proto import zmtp
from sparsekv.proto import MsgType, decode, encode

MiB = 1 << 20
run_dir = sys.argv[1]
path = os.path.join(run_dir, "control.sock")
ctx = zmq.Context(io_threads=2)
stop = threading.Event()
counts = {"rounds": 0, "big_frames": 0, "endless": 0, "flooded": 0, "dup_ids": 0, "hogged": 0, "failures": 0}
BIG = zmq.Frame(bytes(250 * MiB))


def dealer(ident=None):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if ident:
        s.setsockopt(zmq.ROUTING_ID, ident)
    s.connect(f"ipc://{path}")
    return s


def big_frames(n=6):
    socks = [dealer() for _ in range(n)]
    for s in socks:
        s.send_multipart([b"x" * 100, BIG], copy=False)
    time.sleep(0.5)
    for s in socks:
        s.close(0)
    counts["big_frames"] += n


def endless():
    s = raw_peer(path)
    try:
        hello(s)
        head = encode(MsgType.STATS, 2, None)[0]
        s.sendall(zmtp.frame_header(len(head), zmtp.MORE) + head)
        chunk = zmtp.frame_header(8 * MiB, zmtp.MORE) + bytes(8 * MiB)
        for _ in range(12):
            s.sendall(chunk)
    except OSError:  # closed by the daemon: what it must do
        pass
    finally:
        s.close()
    counts["endless"] += 1


def flood(n=500):
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX)
        s.setblocking(False)
        with contextlib.suppress(OSError):
            s.connect(path)
            s.send(GREETING + READY)
        socks.append(s)
    time.sleep(0.2)
    for s in socks:
        s.close()
    counts["flooded"] += n


def dup_ids():
    ident = b"skv-soak-dup"
    a, b = dealer(ident), dealer(ident)
    for s in (a, b):
        s.send_multipart(encode(MsgType.HELLO, 1, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": "dup"}))
    for s in (a, b):
        if s.poll(5000):
            decode(s.recv_multipart())
        else:
            counts["failures"] += 1
    a.close(0)
    b.close(0)
    counts["dup_ids"] += 1


def hog():
    """HELLOs until refused, then every connection closed without BYE."""
    held = []
    while len(held) < 300:
        s = dealer()
        s.send_multipart(encode(MsgType.HELLO, 1, {"pid": 1, "rank": 0, "device": "cpu", "name": "hog"}))
        if not s.poll(5000):
            counts["failures"] += 1
            s.close(0)
            break
        held.append(s)
        if not decode(s.recv_multipart())[0]["ok"]:
            break
    counts["hogged"] += len(held)
    for s in held:
        s.close(0)


def run():
    while not stop.is_set():
        for attack in (big_frames, endless, flood, dup_ids, hog):
            if stop.is_set():
                break
            try:
                attack()
            except Exception as e:  # noqa: BLE001 - counted; the soak fails on any
                counts["failures"] += 1
                print(f"{attack.__name__}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        counts["rounds"] += 1


t = threading.Thread(target=run, daemon=True)
t.start()
sys.stdin.read()
stop.set()
t.join(60)
print(json.dumps(counts), flush=True)
