"""A connection that reuses a live client's ZeroMQ routing id (issue 32, item 1).

With ``ZMQ_ROUTER_HANDOVER=1`` such a connection took the id's pipe over: the victim hung,
and when it closed libzmq 4.3.5 aborted the daemon (``Assertion failed: !_io_error
(src/stream_engine_base.cpp:310)``). The control socket now leaves handover off: the first
connection keeps its id, a later one under the same id is never read (its messages never
reach the daemon; its connection is closed by the HELLO deadline), and once the id is free
again a new connection under it reaches the old session only as the process that said
HELLO (every request's ``Peer-Address`` is checked: PERMISSION_DENIED otherwise).

Two kinds of tests: the attack with real processes against a private daemon, and a guard on
the libzmq behaviour the daemon relies on (it fails if an upgrade changes it)."""

import json
import os
import subprocess
import sys
import time

import zmq

import helpers
from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.client import Client
from sparsekv.daemon.control_socket import router
from sparsekv.proto import ErrorCode, MsgType, decode, encode

MiB = 1 << 20

# Both scripts below: a DEALER of another process under the routing id given in argv.
DEALER_UNDER_ID = r"""
import json, sys
import zmq
from sparsekv.proto import MsgType, decode, encode
path, ident = sys.argv[1], bytes.fromhex(sys.argv[2])
s = zmq.Context().socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 0)
s.setsockopt(zmq.ROUTING_ID, ident)
s.connect(f"ipc://{path}")
"""

# The attacker says HELLO, reports whether anything answered, then (on a line from the
# test) asks STATS and reports again, then waits for stdin to close.
ATTACKER = DEALER_UNDER_ID + r"""
def ask(t, fields, wait_ms):
    s.send_multipart(encode(t, 7, fields))
    if not s.poll(wait_ms):
        return None
    return decode(s.recv_multipart())[0]
h = ask(MsgType.HELLO, {"pid": 1, "rank": 0, "device": "cpu", "name": "attacker"}, 1000)
print(json.dumps({"hello": h}), flush=True)
sys.stdin.readline()
print(json.dumps({"stats": ask(MsgType.STATS, None, 1000)}), flush=True)
sys.stdin.read()
"""

# Another process that asks STATS under the routing id and prints the reply.
THIEF = DEALER_UNDER_ID + r"""
s.send_multipart(encode(MsgType.STATS, 1, None))
print(json.dumps(decode(s.recv_multipart())[0] if s.poll(5000) else None), flush=True)
"""


def _dealer(ctx, path, ident, **opts):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.ROUTING_ID, ident)
    for k, v in opts.items():
        s.setsockopt(getattr(zmq, k), v)
    s.connect(path)
    return s


def _call(s, t, fields=None, wait_ms=5000):
    s.send_multipart(encode(t, 1, fields))
    assert s.poll(wait_ms), f"no reply to {t.name}"
    return decode(s.recv_multipart())[0]


def test_a_second_process_under_a_live_clients_routing_id_neither_hangs_it_nor_aborts_the_daemon(tmp_path):
    with PrivateDaemon(pool_bytes=64 * MiB, backend="cpu", log_path=str(tmp_path / "d.log"),
                       start_timeout_s=30) as d:
        path = os.path.join(d.run_dir, "control.sock")
        ctx = zmq.Context()
        ident = b"skv" + os.urandom(13)
        victim = _dealer(ctx, f"ipc://{path}", ident, RECONNECT_IVL=-1)
        assert _call(victim, MsgType.HELLO, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": "v"})["ok"]
        # attached: its session outlives its connection (an unattached one goes with it)
        assert _call(victim, MsgType.ATTACH, {"engine": "v", "layout": helpers.layout().to_wire()})["ok"]
        attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, path, ident.hex()], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, cwd="/tmp")
        try:
            got = json.loads(attacker.stdout.readline())
            assert got["hello"] is None, got  # never read: the id belongs to the victim's connection
            for _ in range(20):  # the victim is served on, every time
                assert _call(victim, MsgType.STATS, wait_ms=2000)["ok"]
            assert helpers.stats_json(d.run_dir)["clients"] == 1
            victim.close(0)  # the victim goes while the attacker's connection stays
            time.sleep(0.5)
            assert d.proc.poll() is None, "the daemon died when the victim closed"
            attacker.stdin.write("go\n")
            attacker.stdin.flush()
            got = json.loads(attacker.stdout.readline())
            assert got["stats"] is None, got  # its connection was never identified: still nothing read
            assert d.proc.poll() is None
            # The id is free now: a new connection under it from another process reaches
            # the victim's attached session only to be refused (it is the victim process's).
            thief = subprocess.run([sys.executable, "-c", THIEF, path, ident.hex()], capture_output=True, text=True,
                                   timeout=30, cwd="/tmp")
            h = json.loads(thief.stdout)
            assert h["ok"] is False and h["code"] == int(ErrorCode.PERMISSION_DENIED), h
            assert "said HELLO" in h["msg"]
            with Client(d.run_dir, timeout_s=5) as c:  # and everyone else is served
                assert c.stats()["clients"] == 2
            assert d.proc.poll() is None
        finally:
            attacker.stdin.close()
            attacker.wait(10)
        ctx.term()


# -- the libzmq behaviour the daemon relies on ---------------------------------------------
def _recv(sock, wait_ms):
    return sock.recv_multipart() if sock.poll(wait_ms) else None


def test_libzmq_keeps_a_routing_id_with_its_first_connection_and_never_reads_a_duplicate():
    """The control socket's ROUTER (``control_socket.router``) must (1) keep a routing id
    with the connection that has it, (2) never deliver what a second connection under that
    id sends, not even after the first closes, (3) give the id to a new connection once the
    first is gone, and (4) survive all of it. A libzmq upgrade that changes any of these
    fails here."""
    ctx = zmq.Context()
    with helpers.short_tmpdir() as d:
        path = f"ipc://{os.path.join(d, 'c')}"
        r = router(ctx)
        r.bind(path)
        ident = b"skv-dup"
        try:
            a = _dealer(ctx, path, ident, RECONNECT_IVL=-1)
            a.send(b"a1")
            assert _recv(r, 5000) == [ident, b"a1"]
            b = _dealer(ctx, path, ident)
            b.send(b"b1")
            assert _recv(r, 500) is None  # (2)
            r.send_multipart([ident, b"to-a"])
            assert _recv(a, 5000) == [b"to-a"]  # (1)
            assert _recv(b, 300) is None
            a.close(0)
            time.sleep(0.3)
            b.send(b"b2")
            assert _recv(r, 500) is None  # (2) after the first closed
            c = _dealer(ctx, path, ident)
            c.send(b"c1")
            assert _recv(r, 5000) == [ident, b"c1"]  # (3)
            r.send_multipart([ident, b"to-c"])
            assert _recv(c, 5000) == [b"to-c"]
            assert _recv(b, 300) is None
            for s in (b, c):
                s.close(0)
        finally:
            r.close(0)
    ctx.term()

