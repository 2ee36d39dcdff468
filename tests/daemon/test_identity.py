"""Who a client is comes from the kernel, not from its HELLO: the session's pid, uid and
gid are the connection's SO_PEERCRED, read when the daemon accepts it; a client is watched
through a pidfd of that pid, so one that lies about its pid is still reclaimed the moment
it dies, without waiting for the reaper's tick; a second HELLO never throws an attached
rank away."""

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

import helpers
from helpers import request
from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.daemon import peers as peers_mod
from sparsekv.daemon.backends import CpuBackend
from sparsekv.daemon.peers import PidWatch
from sparsekv.daemon.pool import HostPool
from sparsekv.daemon.server import Daemon
from sparsekv.proto import ERROR_HINTS, ErrorCode, MsgType

MiB = 1 << 20


@pytest.fixture
def sleeper():
    """A child process to stand for a client (killed after the test)."""
    procs = []

    def make():
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        procs.append(p)
        return p

    yield make
    for p in procs:
        p.kill()
        p.wait()


def hello_fields(pid=1):
    return {"pid": pid, "rank": 0, "device": "cpu", "name": "t"}


def assert_error(h, code, words=""):
    assert h["ok"] is False, h
    assert h["code"] == int(code), h
    assert words in h["msg"], h["msg"]
    assert ERROR_HINTS[code] in h["msg"]


# -- HELLO ---------------------------------------------------------------------------------
def test_session_identity_comes_from_the_kernel_not_the_hello(dm, sleeper, caplog):
    child = sleeper()
    with caplog.at_level(logging.INFO, logger="sparsekv.server"):
        h = request(dm, b"A", MsgType.HELLO, hello_fields(pid=1), peer=helpers.peer(child.pid, 1234, 99))[0]
    assert h["ok"], h
    s = dm.sessions[b"A"]
    assert (s.pid, s.uid, s.gid, s.verified) == (child.pid, 1234, 99, True)
    assert s.proc_started is not None  # of the kernel's pid: pid reuse is told apart
    claim = [r for r in caplog.records if "claims pid 1" in r.getMessage()]
    assert claim and claim[0].levelno == logging.INFO and f"the kernel says {child.pid}" in claim[0].getMessage()
    # The same claim as the kernel's says nothing
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sparsekv.server"):
        assert request(dm, b"B", MsgType.HELLO, hello_fields(pid=child.pid), peer=helpers.peer(child.pid))[0]["ok"]
    assert not [r for r in caplog.records if "claims pid" in r.getMessage()]


def test_a_hellos_claimed_pid_cannot_forge_a_line_of_the_log(dm, sleeper, caplog):
    """Found by a review: the claimed pid was logged as it came: a string holding a line
    break put a line of the client's choosing into the daemon's log."""
    child = sleeper()
    with caplog.at_level(logging.INFO, logger="sparsekv.server"):
        h = request(dm, b"A", MsgType.HELLO, hello_fields(pid="1\nsparsekvd FORGED"),
                    peer=helpers.peer(child.pid, 1234, 99))[0]
    assert h["ok"], h
    claim = [r.getMessage() for r in caplog.records if "claims pid" in r.getMessage()]
    assert claim and not any(ch in m for m in claim for ch in "\n\r\x85\u2028"), claim


def test_in_process_hello_is_the_daemons_own_user_unverified_and_never_reaped(dm):
    assert request(dm, b"A", MsgType.HELLO, hello_fields(pid=os.getpid()), peer=None)[0]["ok"]
    s = dm.sessions[b"A"]
    assert (s.pid, s.uid, s.gid, s.verified, s.watch) == (0, os.getuid(), os.getgid(), False, None)
    assert dm.sessions.reap_dead() == 0 and b"A" in dm.sessions


def test_kernel_pid_0_is_outside_our_pid_namespace_warned_and_not_reaped(dm, caplog):
    with caplog.at_level(logging.INFO, logger="sparsekv.server"):
        assert request(dm, b"A", MsgType.HELLO, hello_fields(pid=77), peer=helpers.peer(0, 1000, 1000))[0]["ok"]
    s = dm.sessions[b"A"]
    assert (s.pid, s.uid, s.verified, s.watch) == (0, 1000, True, None)
    assert any(r.levelno == logging.WARNING and "pid namespace" in r.getMessage() for r in caplog.records)
    assert dm.sessions.reap_dead() == 0


def test_clients_listing_shows_the_kernels_pid_and_uid(dm, sleeper):
    child = sleeper()
    request(dm, b"A", MsgType.HELLO, hello_fields(pid=1), peer=helpers.peer(child.pid, 1234, 99))[0]
    header, row = dm.sessions.client_lines().splitlines()
    cols = dict(zip(header.split("\t"), row.split("\t")))
    assert cols["pid"] == str(child.pid) and cols["uid"] == "1234"
    assert header.split("\t")[:3] == ["id", "pid", "rank"] and header.split("\t")[-1] == "name"


def test_hello_again_from_another_process_cannot_take_over_the_connection(dm, sleeper):
    a, b = sleeper(), sleeper()
    assert request(dm, b"A", MsgType.HELLO, hello_fields(), peer=helpers.peer(a.pid))[0]["ok"]
    h = request(dm, b"A", MsgType.HELLO, hello_fields(), peer=helpers.peer(b.pid))[0]
    assert_error(h, ErrorCode.PERMISSION_DENIED, "another process")
    assert dm.sessions[b"A"].pid == a.pid and dm.sessions[b"A"].client_id == 1
    # the connection's own process may start over (not attached)
    assert request(dm, b"A", MsgType.HELLO, hello_fields(), peer=helpers.peer(a.pid))[0]["client_id"] == 2


# -- liveness: the pidfd -------------------------------------------------------------------
def test_client_claiming_pid_1_is_reaped_when_its_real_process_dies(dm, sleeper, tmp_path):
    child = sleeper()
    assert request(dm, b"A", MsgType.HELLO, hello_fields(pid=1), peer=helpers.peer(child.pid))[0]["ok"]
    assert request(dm, b"A", MsgType.ATTACH, {"engine": "e", "layout": helpers.layout().to_wire()})[0]["ok"]
    assert dm.sessions[b"A"].watch is not None
    assert dm.sessions.reap_dead() == 0
    child.kill()
    child.wait()
    assert dm.sessions.reap_dead() == 1
    assert not dm.sessions and not dm.engines and dm.pool.used_bytes == 0
    assert helpers.shm_slabs(str(tmp_path), str(tmp_path)) == []


def test_zombie_is_dead_to_the_pidfd(dm, sleeper):
    child = sleeper()
    assert request(dm, b"A", MsgType.HELLO, hello_fields(), peer=helpers.peer(child.pid))[0]["ok"]
    child.kill()  # not waited for: a zombie
    helpers.wait_for(lambda: dm.sessions[b"A"].watch.exited(), what="the pidfd to turn readable")
    assert dm.sessions.reap_dead() == 1


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_dead_client_is_reclaimed_by_the_event_loop_at_once(tmp_path, sleeper, loop):
    """No reaper tick runs here: only the pidfd registered with the loop can reap."""
    async def main():
        pool = HostPool(8 * MiB, threads=1)
        backend = CpuBackend(str(tmp_path), shm_dir=str(tmp_path))
        dm = Daemon(str(tmp_path), backend, pool, reap_interval_s=3600)
        try:
            child = sleeper()
            assert request(dm, b"A", MsgType.HELLO, hello_fields(pid=1), peer=helpers.peer(child.pid))[0]["ok"]
            assert request(dm, b"A", MsgType.ATTACH, {"engine": "e", "layout": helpers.layout().to_wire()})[0]["ok"]
            await asyncio.sleep(0.05)
            assert b"A" in dm.sessions  # alive: nothing happens
            t0 = time.monotonic()
            child.kill()
            while b"A" in dm.sessions and time.monotonic() - t0 < 5:
                await asyncio.sleep(0.005)
            assert b"A" not in dm.sessions, "the dead client was not reaped"
            assert time.monotonic() - t0 < 1.0
            assert not dm.engines and pool.used_bytes == 0
        finally:
            for s in list(dm.sessions.values()):
                dm.sessions.detach(s)
            backend.close()
            pool.close()

    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        uvloop.run(main())
    else:
        asyncio.run(main())


def test_pidfd_is_closed_on_detach_and_opened_again_on_attach(dm, sleeper):
    child = sleeper()
    assert request(dm, b"A", MsgType.HELLO, hello_fields(), peer=helpers.peer(child.pid))[0]["ok"]
    wire = helpers.layout().to_wire()
    assert request(dm, b"A", MsgType.ATTACH, {"engine": "e", "layout": wire})[0]["ok"]
    fd = dm.sessions[b"A"].watch.fd
    assert is_pidfd(fd)
    assert request(dm, b"A", MsgType.DETACH)[0]["ok"]
    assert dm.sessions[b"A"].watch is None and not is_pidfd(fd)
    assert dm.sessions.reap_dead() == 0  # detached and alive: the periodic check keeps it
    assert request(dm, b"A", MsgType.ATTACH, {"engine": "e", "layout": wire})[0]["ok"]
    assert dm.sessions[b"A"].watch is not None  # attached again: watched again
    child.kill()
    child.wait()
    assert dm.sessions.reap_dead() == 1 and not dm.engines


def test_detached_client_is_still_reaped_by_the_periodic_check(dm, sleeper):
    child = sleeper()
    assert request(dm, b"A", MsgType.HELLO, hello_fields(), peer=helpers.peer(child.pid))[0]["ok"]
    assert request(dm, b"A", MsgType.DETACH)[0]["ok"]
    child.kill()
    child.wait()
    assert dm.sessions.reap_dead() == 1 and not dm.sessions


def test_without_pidfd_open_the_periodic_check_reaps_the_kernels_pid(dm, sleeper, monkeypatch):
    def no_pidfd(pid, flags=0):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(peers_mod.os, "pidfd_open", no_pidfd)
    child = sleeper()
    assert request(dm, b"A", MsgType.HELLO, hello_fields(pid=1), peer=helpers.peer(child.pid))[0]["ok"]
    assert request(dm, b"A", MsgType.ATTACH, {"engine": "e", "layout": helpers.layout().to_wire()})[0]["ok"]
    assert dm.sessions[b"A"].watch is None
    assert dm.sessions.reap_dead() == 0
    child.kill()
    child.wait()
    assert dm.sessions.reap_dead() == 1 and not dm.engines


def is_pidfd(fd: int) -> bool:
    try:
        return "pidfd" in os.readlink(f"/proc/self/fd/{fd}")  # anon_inode:[pidfd], or pidfd:[n] (pidfs)
    except OSError:
        return False


def test_pid_watch_close_is_idempotent(sleeper):
    child = sleeper()
    w = PidWatch(child.pid)
    assert not w.exited()
    w.close()
    w.close()
    assert w.exited()  # closed: nothing to watch


# -- over the socket ------------------------------------------------------------------------
def clients(run_dir):
    lines = helpers.stats_query(run_dir, "clients").splitlines()
    header = lines[0].split("\t")
    return [dict(zip(header, line.split("\t"))) for line in lines[1:]]


def test_client_lying_about_its_pid_is_reclaimed_at_once_over_the_socket(tmp_path):
    # A reap tick of a minute: only the pidfd can reclaim the client within the test.
    with PrivateDaemon(pool_bytes=64 * MiB, backend="cpu", extra_args=["--reap-interval-s", "60"],
                       log_path=str(tmp_path / "d.log"), start_timeout_s=30) as d:
        p, (hello, att) = helpers.raw_client(d.run_dir, 1, [["e", helpers.layout().to_wire()]])
        assert hello["ok"] and att["ok"], (hello, att)
        (row,) = clients(d.run_dir)
        assert (row["pid"], row["uid"], row["attached"]) == (str(p.pid), str(os.getuid()), "yes")
        p.kill()
        p.wait()
        t0 = time.monotonic()
        s = helpers.wait_for(lambda: (x := helpers.stats_json(d.run_dir))["clients"] == 0 and x, timeout_s=10,
                             what="the daemon to reclaim the dead client")
        assert time.monotonic() - t0 < 5
        assert s["engines"] == 0 and s["pool_used_bytes"] == 0
        # The slab's mapping is let go on a worker thread once the rank is gone.
        helpers.wait_for(lambda: helpers.shm_slabs(d.run_dir) == [], timeout_s=5, what="the slab unmapped")


ROOT = pytest.mark.skipif(helpers.why_not_other_users() is not None, reason=str(helpers.why_not_other_users()))


@ROOT
def test_another_users_engine_is_permission_denied_over_the_socket(tmp_path):
    lay, other = helpers.layout().to_wire(), helpers.layout(top_k=2).to_wire()
    with PrivateDaemon(pool_bytes=64 * MiB, backend="cpu", log_path=str(tmp_path / "d.log"),
                       start_timeout_s=30) as d:
        os.chmod(d.run_dir, 0o755)  # let other users reach the socket (a test daemon's dir is 0700)
        os.chmod(os.path.join(d.run_dir, "control.sock"), 0o666)
        owner, (h, att) = helpers.raw_client(d.run_dir, 1, [["e", lay]], uid=65534)
        assert h["ok"] and att["ok"], att
        stranger, (h, same, diff) = helpers.raw_client(d.run_dir, 1, [["e", lay], ["e", other]], uid=65533)
        for r in (same, diff):  # the same answer whatever the layout
            assert r["ok"] is False and r["code"] == int(ErrorCode.PERMISSION_DENIED), r
            assert "top_k" not in r["msg"] and "65534" not in r["msg"] and "layout" not in r["msg"].split("(")[0]
        rows = {r["pid"]: r for r in clients(d.run_dir)}
        assert rows[str(owner.pid)]["uid"] == "65534" and rows[str(stranger.pid)]["uid"] == "65533"
        assert rows[str(stranger.pid)]["attached"] == "no"
        # root joins naming the owner (told who it is otherwise); for root, as for the owner,
        # another layout is LAYOUT_MISMATCH with the layout
        owned = {"owner_uid": 65534}
        root, (h, unnamed, mismatch, joined) = helpers.raw_client(d.run_dir, 1, [["e", lay], ["e", other, owned],
                                                                                  ["e", lay, owned]])
        assert unnamed["code"] == int(ErrorCode.PERMISSION_DENIED) and "owner_uid=65534" in unnamed["msg"], unnamed
        assert mismatch["code"] == int(ErrorCode.LAYOUT_MISMATCH) and "top_k" in mismatch["msg"], mismatch
        assert joined["ok"], joined
        owner2, (h, own_mismatch) = helpers.raw_client(d.run_dir, 1, [["e", other]], uid=65534)
        assert own_mismatch["code"] == int(ErrorCode.LAYOUT_MISMATCH), own_mismatch
        for p in (owner, stranger, root, owner2):
            p.kill()
            p.wait()


def test_attach_beyond_the_rank_memory_limit_is_refused_before_allocating(dm):
    """max_slab_bytes (config) bounds one rank's slab + staging + residency state: a
    layout past it is TOO_LARGE, and no pool range is taken."""
    dm.engine_requests.max_slab_bytes = 1 * MiB
    assert request(dm, b"a", MsgType.HELLO, hello_fields())[0]["ok"]
    lay = helpers.layout(num_layers=4, row_bytes=64, top_k=64, region_stride=128, max_reqs=64, host_rows=256)
    h = request(dm, b"a", MsgType.ATTACH, {"engine": "big", "layout": lay.to_wire()})[0]
    assert_error(h, ErrorCode.TOO_LARGE)
    assert dm.pool.used_bytes == 0 and len(dm.engines) == 0
    dm.engine_requests.max_slab_bytes = 64 * MiB
    assert request(dm, b"a", MsgType.ATTACH, {"engine": "big", "layout": lay.to_wire()})[0]["ok"]




HANDED_OVER = r"""
import json, os, sys, time
from sparsekv.client.wire import Wire, connect_unix
from sparsekv.proto import MsgType, decode, encode
run_dir = sys.argv[1]
w = Wire(connect_unix(run_dir + "/control.sock", 5))
def call(t, fields):
    w.send(encode(t, 1, fields))
    assert w.wait(10000), "no reply"
    return decode(w.recv())[0]
hello = {"rank": 0, "device": "cpu", "name": "handed"}
layout = json.loads(sys.argv[3])
if sys.argv[2] in ("first", "detached"):  # the opener says HELLO itself first
    print("opener", call(MsgType.HELLO, {**hello, "pid": os.getpid()})["ok"], flush=True)
if sys.argv[2] == "detached":  # and attaches and detaches (DETACH stops watching its pid)
    print("opener", call(MsgType.ATTACH, {"engine": "e", "layout": layout})["ok"],
          call(MsgType.DETACH, {})["ok"], flush=True)
opener = os.getpid()
if os.fork():
    os._exit(0)  # the opener exits; its child keeps the connection
deadline = time.monotonic() + 30
while os.getppid() == opener:  # reparented once the opener has exited
    assert time.monotonic() < deadline, "the opener did not exit"
    time.sleep(0.01)
if sys.argv[2] == "detached":
    r = call(MsgType.ATTACH, {"engine": "e", "layout": layout})
else:
    r = call(MsgType.HELLO, {**hello, "pid": os.getpid()})
print("child", r["ok"], r.get("code"), r.get("msg", ""), flush=True)
"""


@pytest.mark.parametrize("first", ["first", "not", "detached"])
def test_hello_on_a_connection_whose_opener_exited_is_refused(tmp_path, first):
    """Found by a review: a connection handed to a child outlives its opener, whose pid
    (SO_PEERCRED's) the kernel may give to another process; a HELLO on it took that
    process's groups for its own (a recycled pid in the admin group let another uid join an
    engine). The daemon now holds the opener's pidfd and refuses such a HELLO."""
    # No reaping meanwhile: the detached opener's session, its pid gone, would be dropped
    # first (NOT_HELLO), however soon the child asks.
    with PrivateDaemon(pool_bytes=64 * MiB, backend="cpu", log_path=str(tmp_path / "d.log"), start_timeout_s=30,
                       extra_args=["--reap-interval-s", "3600"]) as d:
        p = subprocess.run([sys.executable, "-c", HANDED_OVER, d.run_dir, first,
                            json.dumps(helpers.layout().to_wire())], capture_output=True, text=True,
                           timeout=30, cwd=str(tmp_path))
        lines = [line for line in p.stdout.splitlines() if line.startswith("child")]
        assert lines, (p.stdout, p.stderr)
        assert lines[0].startswith(f"child False {int(ErrorCode.PERMISSION_DENIED)}"), lines
        assert "the process that opened this connection has exited" in lines[0]


def test_the_listener_counts_each_connections_pidfd_against_the_descriptor_reserve(tmp_path):
    """Found by a review: each control connection holds its opener's pidfd beside its
    socket, but the listener counted one descriptor a connection, so a burst of
    connections used up the reserve kept for memfds and the fd socket twice as fast."""
    from sparsekv.daemon.control_socket import ControlSocket

    cs = ControlSocket(str(tmp_path / "control.sock"), on_message=lambda *a: None, on_closed=lambda *a: None)
    cs.open(None)
    try:
        socks = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(5)]
        for s in socks:
            s.connect(str(tmp_path / "control.sock"))
        helpers.wait_for(lambda: cs.poll() or len(cs._conns) == 5 or None, timeout_s=5, what="5 connections")
        held = len(cs._conns) + sum(c.pidfd is not None for c in cs._conns.values())
        assert held == 10 and cs.listener._connections() == held
        for s in socks:
            s.close()
    finally:
        cs.close()


def test_a_session_asking_stats_is_judged_by_its_groups_too(sleeper):
    """STATS over control.sock hands the session itself to ``sees_all``; a session has no
    ``groups`` read at accept (a Peer of the stats socket has): its groups come from /proc
    (found reading the change: an AttributeError, INTERNAL, for any uid but root's and the
    daemon's once admin_gid was set)."""
    from types import SimpleNamespace

    from sparsekv.daemon.sessions import Session, Sessions

    p = sleeper()
    s = Session(b"c1", 1, p.pid, 0, "cpu", "t", None, uid=os.getuid() + 12345, gid=7, verified=True)
    judge = SimpleNamespace(admin_gid=4242)
    assert Sessions.sees_all(judge, s) is False  # not in 4242: sees its own uid's
    s.gid = 4242
    assert Sessions.sees_all(judge, s) is True
