"""A peer that reuses a live client's ZeroMQ routing id.

Under a libzmq ROUTER with ``ZMQ_ROUTER_HANDOVER`` such a connection took the victim's pipe
(the victim hung) and libzmq 4.3.5 aborted the daemon when the victim closed. The daemon
now reads its control connections itself (daemon/control_socket.py): a session belongs to
the connection its HELLO came on, and the routing id a peer announces is never looked at.
Here, with real processes: the attacker's connection is a session of its own, the victim
is served throughout, and its close takes down neither the daemon nor the attacker."""

import json
import os
import subprocess
import sys

import zmq

import helpers
from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.client import Client
from sparsekv.proto import MsgType, decode, encode

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
        me = _call(victim, MsgType.HELLO, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": "v"})
        assert me["ok"]
        assert _call(victim, MsgType.ATTACH, {"engine": "v", "layout": helpers.layout().to_wire()})["ok"]
        attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, path, ident.hex()], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, cwd="/tmp")
        try:
            got = json.loads(attacker.stdout.readline())
            assert got["hello"]["ok"] and got["hello"]["client_id"] != me["client_id"], got  # a session of its own
            for _ in range(20):  # the victim is served on, every time
                assert _call(victim, MsgType.STATS, wait_ms=2000)["ok"]
            assert helpers.stats_json(d.run_dir)["clients"] == 2
            victim.close(0)  # the victim goes while the attacker's connection stays
            helpers.wait_for(lambda: helpers.stats_json(d.run_dir)["clients"] == 1, timeout_s=3,
                             what="the victim's session gone with its connection")
            assert d.proc.poll() is None, "the daemon died when the victim closed"
            attacker.stdin.write("go\n")
            attacker.stdin.flush()
            got = json.loads(attacker.stdout.readline())
            assert got["stats"]["ok"], got
            with Client(d.run_dir, timeout_s=5) as c:  # and everyone else is served
                assert c.stats()["clients"] == 2
            assert d.proc.poll() is None
        finally:
            attacker.stdin.close()
            attacker.wait(10)
        ctx.term()
