"""The fd socket's limits (daemon/fd_server.py, proto/fd_socket.py): connections are shared
out by uid (SO_PEERCRED, ``daemon/uid_slots.py``) with a reserve for operators, a silent
connection is closed after 1 s, and one beyond a limit is answered busy (QUOTA_EXCEEDED,
``"busy": true``), which the client tries again for a moment and then raises as
``QuotaExceeded``. Found by a review after the stats socket's fix (4d88c81): 64 idle
connections of any local user, for all uids together, each held up to 5 s, made every
other engine's ATTACH fail ("Broken pipe") for as long as they were held."""

import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time

import pytest

import helpers
from sparsekv.client import Client, QuotaExceeded
from sparsekv.client import rank_memory
from sparsekv.daemon import fd_server as fds_mod
from sparsekv.daemon.fd_server import FdServer
from sparsekv.daemon.peers import Peer
from sparsekv.proto import LIMITS, ErrorCode, ProtocolError
from sparsekv.proto import fd_socket
from sparsekv.proto.fd_socket import FD_SOCKET


def test_the_defaults_leave_room_for_a_whole_tp_group_of_one_uid_and_the_operators():
    """A uid's share holds a TP group of the largest size connecting in one instant (64
    processes attaching, or depositing slabs, at once held at most 6 connections open: the
    loop answers each in well under a millisecond); four uids are needed to fill the rest."""
    srv = FdServer(None, lambda cid: {}, lambda *a: False, lambda peer: peer.uid == 0)
    assert (srv.slots.max_open, srv.slots.per_uid, srv.slots.reserved) == (256, 64, 64)
    assert fds_mod.PER_UID >= LIMITS.max_tp_size
    assert (fd_socket.REQUEST_TIMEOUT_S, fd_socket.BUSY_RETRY_S) == (1.0, 2.0)
    for _ in range(64):
        srv.slots.take(Peer(1000, 1000, 1, True))
    assert srv.slots.take(Peer(1000, 1000, 1, True)) == (None, "uid 1000 has 64 fd socket connections open, its "
                                                               "share of the 256")
    assert srv.slots.take(Peer(0, 0, 1, True)) == (False, "")  # another uid: its own share


# -- the client's side: a busy answer is tried again, then typed -------------------------
class FakeFdSocket:
    """A fds.sock that answers each connection from ``answers`` (the last one repeated):
    ``"busy"`` (the daemon's busy line, the request left unread, as the daemon does),
    ``"busy-first"`` (the same, written and closed before the client could send),
    ``"denied"``, or ``"ok"`` (a deposit's id, or a descriptor of /dev/null as ``slab``)."""

    def __init__(self, path, answers):
        self.answers, self.served = list(answers), 0
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(path)
        self.srv.listen(8)
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            what = self.answers[min(self.served, len(self.answers) - 1)]
            self.served += 1
            with c:
                if what.startswith("busy"):
                    if what == "busy":
                        time.sleep(0.005)  # the request is there, unread, when it closes
                    c.sendall(fd_socket.answer(False, code=ErrorCode.QUOTA_EXCEEDED, busy=True,
                                               msg="busy: uid 7 has 64 fd socket connections open, its share of the "
                                                   "256; try again"))
                    continue
                request, fds, _, _ = socket.recv_fds(c, 200, 8)
                for fd in fds:
                    os.close(fd)
                if what == "denied":
                    c.sendall(fd_socket.answer(False, code=ErrorCode.PERMISSION_DENIED, msg="unknown token"))
                elif request.startswith(b"deposit"):
                    c.sendall(fd_socket.answer(True, deposit="d1"))
                else:
                    with open(os.devnull) as f:
                        socket.send_fds(c, [fd_socket.answer(True, fds=["slab"])], [f.fileno()])

    def close(self):
        self.srv.close()


@pytest.fixture
def fake(tmp_path):
    made = []

    def make(answers):
        made.append(FakeFdSocket(str(tmp_path / FD_SOCKET), answers))
        return made[-1]

    yield make
    for f in made:
        f.close()


@pytest.mark.parametrize("busy", ["busy", "busy-first"])
def test_a_busy_answer_is_tried_again_until_served(tmp_path, fake, busy):
    f = fake([busy] * 3 + ["ok"])
    fds = fd_socket.fetch_fds(str(tmp_path / FD_SOCKET), "ab" * 16)
    assert list(fds) == ["slab"] and f.served == 4
    os.close(fds["slab"])
    f.served = 0
    with open(os.devnull) as dev:
        assert fd_socket.deposit_fd(str(tmp_path / FD_SOCKET), dev.fileno()) == "d1" and f.served == 4


def test_a_daemon_busy_for_longer_is_a_quota_exceeded_naming_it(tmp_path, fake, monkeypatch):
    monkeypatch.setattr(fd_socket, "BUSY_RETRY_S", 0.2)
    f = fake(["busy"])
    t0 = time.monotonic()
    with pytest.raises(ProtocolError) as ei:
        fd_socket.fetch_fds(str(tmp_path / FD_SOCKET), "ab" * 16)
    assert 0.1 < time.monotonic() - t0 < 1.0 and f.served > 3
    assert ei.value.code == ErrorCode.QUOTA_EXCEEDED and ei.value.detail == {"busy": True}
    with pytest.raises(QuotaExceeded, match=r"^QUOTA_EXCEEDED: the fd socket .* refused this process: busy: uid 7 "
                                            r"has 64 fd socket connections open, its share of the 256; try again$"):
        rank_memory.fetch_fds(str(tmp_path), {"fd_token": "ab" * 16, "fd_socket": FD_SOCKET}, 5.0)
    with pytest.raises(ProtocolError, match="busy: uid 7"):
        with open(os.devnull) as dev:
            fd_socket.deposit_fd(str(tmp_path / FD_SOCKET), dev.fileno())


def test_other_refusals_are_not_tried_again(tmp_path, fake):
    f = fake(["denied", "ok"])
    with pytest.raises(ProtocolError) as ei:
        fd_socket.fetch_fds(str(tmp_path / FD_SOCKET), "ab" * 16)
    assert ei.value.code == ErrorCode.PERMISSION_DENIED and ei.value.detail == {} and f.served == 1


# -- a real daemon -------------------------------------------------------------------------
def raw_answer(path: str) -> dict:
    """One connection's answer to a request, no second try."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(path)
        try:
            s.sendall(b"0" * 32 + b"\n")
        except OSError:
            pass
        data = b""
        try:
            while not data.endswith(b"\n") and (b := s.recv(4096)):
                data += b
        except ConnectionResetError:
            pass
    return json.loads(data)


def test_this_uids_idle_connections_get_busy_answers_and_are_closed_after_a_second(daemon):
    """This test's uid (root, or the daemon's own: an operator) holds its share and the
    operators' reserve, 128 idle connections: the next is answered busy at once, naming
    the share; an ATTACH meanwhile is served once the idle ones are closed (1 s; was 5 s),
    its fetch tried again until then. Before: 64 idle connections, and the 65th was closed
    without a word: the ATTACH failed ("Broken pipe")."""
    path = os.path.join(daemon.run_dir, FD_SOCKET)
    held = []
    try:
        for _ in range(fds_mod.PER_UID + fds_mod.RESERVED):
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            held.append(s)
        t0 = time.monotonic()
        time.sleep(0.05)  # all accepted
        busy = raw_answer(path)
        assert busy == {"ok": False, "code": "QUOTA_EXCEEDED", "busy": True,
                        "msg": f"busy: uid {os.getuid()} has 64 fd socket connections open, its share of the 256; "
                               "try again"}, busy  # (so the 128 were still held)
        with Client(daemon.run_dir) as c:
            c.attach(helpers.layout())  # its fetch busy until the idle ones are closed
            attached = time.monotonic() - t0
        assert 0.5 < attached < 4.5, attached  # (the idle ones closed after 1 s: was 5 s)
        for s in held:  # each answered "no request within 1 s" and closed
            s.settimeout(1)
            assert "no request within 1 s" in s.recv(4096).decode()
    finally:
        for s in held:
            s.close()
    snap = helpers.stats_json(daemon.run_dir)
    assert snap["fd_connections_refused"] >= 2 and snap["fd_refusals"] == len(held)
    table = helpers.stats_query(daemon.run_dir, "stats")
    assert f"fd socket busy {snap['fd_connections_refused']} connections refused" in table


# Run as another uid: at a line on stdin, open N idle connections to the fd socket; print
# the first busy answer among them (null: none); then wait until killed.
HOLDER = r"""
import json, socket, sys, time
path, n = sys.argv[1], int(sys.argv[2])
print("up", flush=True)
sys.stdin.readline()
held = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    held.append(s)
time.sleep(0.05)
first = None
for s in held:
    s.setblocking(False)
    try:
        b = s.recv(4096)
    except BlockingIOError:
        continue
    if first is None and b'"busy"' in b:
        first = json.loads(b)
print(json.dumps(first), flush=True)
sys.stdin.read()
"""

# Run as another uid: at a line on stdin, attach with a Client (when argv[3] names an
# engine) and print "attached" or the error; then print one raw request's answer.
ENGINE = r"""
import json, socket, sys
from sparsekv.client import Client
from sparsekv.proto import Layout
run_dir, layout = sys.argv[1], Layout.from_wire(json.loads(sys.argv[2]))
print("up", flush=True)
sys.stdin.readline()
if sys.argv[3]:
    try:
        with Client(run_dir, name="engine") as c:
            c.attach(layout, engine=sys.argv[3])
            print("attached", flush=True)
    except Exception as e:
        print(f"{type(e).__name__}: {e}", flush=True)
s = socket.socket(socket.AF_UNIX)
s.settimeout(5)
s.connect(run_dir + "/fds.sock")
try:
    s.sendall(b"0" * 32 + b"\n")
except (BrokenPipeError, ConnectionResetError):
    pass  # answered busy and closed before it read the request: the answer is still here
print(s.recv(4096).decode().strip(), flush=True)
"""


def start(uid, script, *args):
    p = subprocess.Popen([*helpers.as_user(uid), sys.executable, "-c", script, *map(str, args)], cwd="/tmp",
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "up\n"
    return p


def go(p):
    p.stdin.write("go\n")
    p.stdin.flush()


@pytest.mark.skipif(helpers.why_not_other_users() is not None, reason=str(helpers.why_not_other_users()))
def test_other_uids_holding_the_fd_socket_lock_out_no_other_engine(daemon):
    """uid 65534 opens 100 idle connections: it gets its 64, the other 36 are answered busy
    naming its share; an engine of uid 65533 attaches all the same. Then four uids hold
    64 each, the 256 shared: root still attaches at once (the operators' reserve), and a
    fifth uid's request is answered busy (every shared connection open). Before:
    one uid's 64 idle connections failed every other engine's ATTACH."""
    helpers.open_to_other_users(daemon.run_dir, "control.sock", FD_SOCKET)
    path = os.path.join(daemon.run_dir, FD_SOCKET)
    lay = json.dumps(helpers.layout().to_wire())
    procs = {"engine": start(65533, ENGINE, daemon.run_dir, lay, "e65533"),
             "stranger": start(65530, ENGINE, daemon.run_dir, lay, ""),
             65534: start(65534, HOLDER, path, 100)}
    try:
        go(procs[65534])
        assert json.loads(procs[65534].stdout.readline()) == {
            "ok": False, "code": "QUOTA_EXCEEDED", "busy": True,
            "msg": "busy: uid 65534 has 64 fd socket connections open, its share of the 256; try again"}
        go(procs["engine"])
        assert procs["engine"].stdout.readline().strip() == "attached"
        answer = json.loads(procs["engine"].stdout.readline())
        assert answer["code"] == "PERMISSION_DENIED" and "unknown or already used token" in answer["msg"], answer

        holders = [procs[65534]] + [start(uid, HOLDER, path, 64) for uid in (65531, 65532, 65535)]
        procs.update(zip((65531, 65532, 65535), holders[1:]))
        procs[65534].kill()  # its 64 given back; it holds them again below
        procs[65534].wait()
        holders[0] = procs[65534] = start(65534, HOLDER, path, 64)
        for p in holders:  # every holder at once
            go(p)
        for p in holders:
            assert json.loads(p.stdout.readline()) is None  # 64 each: none refused
        with Client(daemon.run_dir) as c:  # root: the operators' reserve, no second try
            c.attach(helpers.layout(), engine="root")
        # Then the stranger: its answer counts 256 open, so all were held when root attached
        # (the holders never reconnect; only the request timeout closes theirs).
        go(procs["stranger"])
        assert json.loads(procs["stranger"].stdout.readline()) == {
            "ok": False, "code": "QUOTA_EXCEEDED", "busy": True,
            "msg": "busy: 256 fd socket connections open (at most 256, 64 a uid); try again"}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    assert helpers.stats_json(daemon.run_dir)["fd_connections_refused"] == 37


# -- descriptors a request brings; the log lines refusals cause -----------------------------
def daemon_fds(d) -> int:
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def closed_by_the_daemon(r: int, timeout_s: float) -> bool:
    """Whether the pipe whose write end was sent (and closed here) reads EOF within
    ``timeout_s``: every copy of that end closed, the daemon's too."""
    ready, _, _ = select.select([r], [], [], timeout_s)
    return bool(ready) and os.read(r, 1) == b""


def read_answer(s: socket.socket) -> dict:
    data = b""
    try:
        while not data.endswith(b"\n") and (b := s.recv(4096)):
            data += b
    except ConnectionResetError:  # the daemon closed with our later messages unread
        pass
    return json.loads(data)


@pytest.mark.parametrize("per_message", [1, 8])
def test_a_request_bringing_many_descriptors_is_refused_and_the_daemon_holds_one_at_most(daemon, per_message):
    """8 connections each send 32 one-byte messages (no newline), each with 1 or 8
    descriptors: each is refused at once, BAD_ARGUMENT, at its second descriptor (or its
    first message of 8), and the daemon never holds more than one of them a connection.
    Before: the daemon read 8 a message and kept all until the request's 1 s was over,
    ~1,000 a connection, 65,000 in one uid's share: past its RLIMIT_NOFILE, no engine of
    another uid could attach ("no ZMTP handshake"). An engine attaches meanwhile."""
    path = os.path.join(daemon.run_dir, FD_SOCKET)
    before = daemon_fds(daemon)
    dev = os.open(os.devnull, os.O_RDONLY)
    conns = []
    try:
        for _ in range(8):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(5)
            s.connect(path)
            conns.append(s)
            for _ in range(32):
                try:
                    socket.send_fds(s, [b"x"], [dev] * per_message)
                except OSError:  # refused and closed already
                    break
                time.sleep(0.001)  # each message read apart
        time.sleep(0.1)
        held = daemon_fds(daemon) - before
        assert held <= 2 * len(conns), f"the daemon holds {held} more descriptors for {len(conns)} connections"
        with Client(daemon.run_dir) as c:
            c.attach(helpers.layout())
        for s in conns:
            assert read_answer(s) == {"ok": False, "code": "BAD_ARGUMENT", "msg": "a request brings at most one "
                                      "descriptor (a deposit's); this one brought more"}
    finally:
        os.close(dev)
        for s in conns:
            s.close()
    helpers.wait_for(lambda: daemon_fds(daemon) <= before + 2, 5, what="the daemon's descriptors back")
    assert helpers.stats_json(daemon.run_dir)["fd_refusals"] == len(conns)


def test_descriptors_a_request_brought_are_closed_when_refused_or_silent(daemon):
    """A second descriptor: both closed as it is refused, at once (not after the request's
    1 s). One descriptor and then silence: closed with the timeout's answer."""
    path = os.path.join(daemon.run_dir, FD_SOCKET)
    pipes = [os.pipe() for _ in range(3)]
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(path)
            t0 = time.monotonic()
            socket.send_fds(s, [b"de"], [pipes[0][1]])
            time.sleep(0.05)
            socket.send_fds(s, [b"posit\n"], [pipes[1][1]])
            for _, w in pipes[:2]:
                os.close(w)
            assert read_answer(s)["code"] == "BAD_ARGUMENT" and time.monotonic() - t0 < 0.5
            assert closed_by_the_daemon(pipes[0][0], 1) and closed_by_the_daemon(pipes[1][0], 1)
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(path)
            socket.send_fds(s, [b"deposi"], [pipes[2][1]])
            os.close(pipes[2][1])
            assert not closed_by_the_daemon(pipes[2][0], 0.5)  # held while the request may go on
            assert read_answer(s)["msg"] == "no request within 1 s"
            assert closed_by_the_daemon(pipes[2][0], 1)
    finally:
        for r, _ in pipes:
            os.close(r)


def test_a_descriptor_held_for_a_request_is_closed_when_the_daemon_stops():
    """In process: the request's task cancelled (``FdServer.close``) with one descriptor
    received. Before: the descriptors read so far were _read_line's, lost when it was
    cancelled or raised: kept open until the process ended."""
    import asyncio

    class Counts:
        def add(self, **kw):
            pass

    r, w = os.pipe()

    async def main(run_dir):
        srv = FdServer(Counts(), lambda cid: {}, lambda *a: False)
        await srv.start(os.path.join(run_dir, FD_SOCKET))
        s = socket.socket(socket.AF_UNIX)
        s.connect(os.path.join(run_dir, FD_SOCKET))
        socket.send_fds(s, [b"dep"], [w])
        os.close(w)
        await asyncio.sleep(0.1)  # received, the request not finished
        assert not closed_by_the_daemon(r, 0)
        srv.close()
        await asyncio.sleep(0.05)  # the cancelled task's finally
        s.close()

    try:
        with helpers.short_tmpdir() as run_dir:
            asyncio.run(main(run_dir))
        assert closed_by_the_daemon(r, 1)
    finally:
        os.close(r)


def test_empty_and_refused_connections_log_a_bounded_number_of_lines(daemon, tmp_path):
    """300 connections closed without a word and 60 with an unknown token: the empty ones
    are counted (``fd_connections_empty``), neither refused nor logged; the refusals logged
    10 lines (``ratelog.py``). Before: one INFO line each, every empty connection an
    "unknown or already used token" refusal (13,562 lines in 2 s)."""
    path = os.path.join(daemon.run_dir, FD_SOCKET)
    for _ in range(300):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
    helpers.wait_for(lambda: helpers.stats_json(daemon.run_dir)["fd_connections_empty"] == 300, 5,
                     what="300 empty connections counted")  # (served: the backlog free again)
    for _ in range(60):
        assert "unknown or already used token" in raw_answer(path)["msg"]
    assert helpers.stats_json(daemon.run_dir)["fd_refusals"] == 60
    assert "fd socket      300 connections closed without a request" in helpers.stats_query(daemon.run_dir, "stats")
    log = (tmp_path / "sparsekvd.log").read_text()
    assert log.count("fd socket: refused") == 10, log
    assert "without a request" not in log


def test_refusals_are_logged_a_few_a_cause_then_summed_up(caplog):
    clock = [0.0]
    srv = FdServer(None, lambda cid: {}, lambda *a: False, clock=lambda: clock[0])
    srv.stats = type("S", (), {"add": lambda self, **kw: None})()
    with caplog.at_level(logging.INFO, logger="sparsekv.server"):
        for _ in range(25):
            srv._answer(b"nope\n", [], 1, 1000, 1000)
            srv._answer(None, [], 1, 1000, 1000)
        clock[0] = 11.0
        srv.expire()  # every reap_interval_s
    lines = [r.getMessage() for r in caplog.records]
    assert sum("unknown or already used token" in m for m in lines) == 10
    assert sum("no request within 1 s" in m for m in lines) == 10
    assert sorted(m for m in lines if "left out" in m) == [
        "15 more log lines of cause 'fd socket: no request in time' left out in the last 11 s (10 logged; at most 10 "
        "a cause every 10 s)",
        "15 more log lines of cause 'fd socket: unknown token' left out in the last 11 s (10 logged; at most 10 a "
        "cause every 10 s)"]
