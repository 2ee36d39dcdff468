"""A rank's shared memory has no name: the cpu slab is a memfd, handed over
``RUN_DIR/fds.sock`` (SCM_RIGHTS) to the process that attached it, for a one-time token
from the ATTACH reply. Nothing of the run dir appears in /dev/shm; a wrong token, a used
one, a withdrawn one (the rank detached), or the right one from another process or user is
refused with a reason and counted (``fd_refusals``), and the daemon goes on serving."""

import json
import mmap
import os
import socket
import stat
import subprocess
import sys

import numpy as np
import pytest

import helpers
from helpers import request
from sparsekv.client import Client
from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.proto import ErrorCode, MsgType, ProtocolError
from sparsekv.proto.fd_socket import FD_SOCKET, fetch_fds

MiB = 1 << 20

# Presents a token (argv) on the fd socket; prints what came back.
FETCH = r"""
import json, os, sys
from sparsekv.proto import ProtocolError
from sparsekv.proto.fd_socket import fetch_fds
try:
    fds = fetch_fds(sys.argv[1], sys.argv[2])
except ProtocolError as e:
    print(json.dumps({"ok": False, "code": e.code.name, "msg": e.args[0]}))
else:
    print(json.dumps({"ok": True, "fds": {k: os.fstat(fd).st_size for k, fd in fds.items()}}))
"""

# HELLO + ATTACH over the control socket, prints the ATTACH reply, then fetches its fds
# when told (a line on stdin) and prints the result.
ATTACHER = r"""
import json, os, sys
from sparsekv.proto import MsgType, ProtocolError
from sparsekv.proto.fd_socket import fetch_fds
run_dir, layout = sys.argv[1], json.loads(sys.argv[2])
""" + helpers.RAW_CALL + r"""
call(MsgType.HELLO, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": "attacher"})
h = call(MsgType.ATTACH, {"engine": "e", "layout": layout})
print(json.dumps(h), flush=True)
sys.stdin.readline()
try:
    fds = fetch_fds(os.path.join(run_dir, h["handles"]["fd_socket"]), h["handles"]["fd_token"])
except ProtocolError as e:
    print(json.dumps({"ok": False, "code": e.code.name, "msg": e.args[0]}), flush=True)
else:
    print(json.dumps({"ok": True, "fds": {k: os.fstat(fd).st_size for k, fd in fds.items()}}), flush=True)
sys.stdin.read()
"""


def fetch_elsewhere(path, token, prefix=()):
    """The fd socket's answer to ``token`` in another process (``prefix``: setpriv ...)."""
    r = subprocess.run([*prefix, sys.executable, "-c", FETCH, path, token], capture_output=True, text=True,
                       timeout=30, cwd="/tmp")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def attach_raw(c: Client, lay):
    """ATTACH without fetching the descriptors: the reply's handles (with the token)."""
    reply, _ = c._call(MsgType.ATTACH, {"engine": "e", "layout": lay.to_wire()})
    return reply["handles"]


def raw_answer(path, data: bytes) -> tuple[dict, list]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(data)
        msg, fds, _, _ = socket.recv_fds(s, 4096, 8)
    for fd in fds:
        os.close(fd)
    return json.loads(msg), fds


def test_attach_maps_the_slab_through_the_fd_socket_and_leaves_nothing_in_dev_shm(daemon):
    lay = helpers.layout(staging_rows=4)
    path = os.path.join(daemon.run_dir, FD_SOCKET)
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    with Client(daemon.run_dir) as c:
        att = c.attach(lay)
        helpers.fill(c, lay)
        c.step(0, np.array([0, 1], np.int32), reset=np.ones(2, bool))
        topk = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int32)
        r = c.topk(0, 0, topk)
        # the daemon's gather reached this process's mapping
        assert helpers.bad_rows(att.slab, lay.groups[0], [0, 1], topk, r.slots, lay.host_rows) == 0
        assert c.stage(np.arange(3, dtype=np.int32)) == 3 * lay.row_bytes * lay.num_layers
        assert (att.staging[0, :3] == helpers.gen_pattern(0, range(3), lay.row_bytes)).all()
        # a memfd the daemon holds; nothing of the run dir in /dev/shm, no file of this client's
        assert helpers.slab_memfds(daemon.run_dir) == [f"memfd:sparsekv-{helpers.run_dir_tag(daemon.run_dir)}-1"]
        assert helpers.shm_files(daemon.run_dir) == []
        assert not any(os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/shm") for fd in os.listdir("/proc/self/fd")
                       if os.path.islink(f"/proc/self/fd/{fd}"))
    assert helpers.stats_json(daemon.run_dir)["fd_refusals"] == 0


def test_a_wrong_token_is_refused_and_the_daemon_keeps_serving(daemon):
    path = os.path.join(daemon.run_dir, FD_SOCKET)
    for data in (b"0123456789abcdef0123456789abcdef\n", b"\n", b"x" * 500):  # unknown, empty, over-long
        msg, fds = raw_answer(path, data)
        assert msg["ok"] is False and msg["code"] == "PERMISSION_DENIED" and fds == [], msg
        assert "unknown or already used token" in msg["msg"], msg
    with pytest.raises(ProtocolError, match="unknown or already used token") as e:
        fetch_fds(path, "nope")
    assert e.value.code == ErrorCode.PERMISSION_DENIED
    with Client(daemon.run_dir) as c:  # still serving
        c.attach(helpers.layout())
    assert helpers.stats_json(daemon.run_dir)["fd_refusals"] == 4


def test_a_token_serves_once_and_only_the_process_that_attached(daemon):
    lay = helpers.layout()
    path = os.path.join(daemon.run_dir, FD_SOCKET)
    with Client(daemon.run_dir) as c:
        h = attach_raw(c, lay)
        assert "path" not in h and h["fd_socket"] == FD_SOCKET and h["fd"] == "slab"
        # another process of the same user, which did not attach: refused, token kept
        other = fetch_elsewhere(path, h["fd_token"])
        assert other["ok"] is False and other["code"] == "PERMISSION_DENIED", other
        assert "did not attach this rank" in other["msg"]
        # the process that attached
        fds = fetch_fds(path, h["fd_token"])
        try:
            assert list(fds) == ["slab"] and os.fstat(fds["slab"]).st_size == h["bytes"]
            mm = mmap.mmap(fds["slab"], h["bytes"])
        finally:
            for fd in fds.values():
                os.close(fd)
        a = np.frombuffer(mm, np.uint8)
        a[:] = 0x5A  # the daemon's slab: the same pages
        del a
        mm.close()
        # used: never again, whoever asks
        with pytest.raises(ProtocolError, match="unknown or already used token"):
            fetch_fds(path, h["fd_token"])
        assert fetch_elsewhere(path, h["fd_token"])["ok"] is False
        assert c.stats()["attached"] == 1  # the session lives on
    assert helpers.stats_json(daemon.run_dir)["fd_refusals"] == 3
    assert "presented the token of client" in open(daemon.log_path).read()


def test_the_token_is_withdrawn_when_the_rank_detaches(daemon):
    path = os.path.join(daemon.run_dir, FD_SOCKET)
    with Client(daemon.run_dir) as c:
        h = attach_raw(c, helpers.layout())
        c._call(MsgType.DETACH)
        with pytest.raises(ProtocolError, match="unknown or already used token"):
            fetch_fds(path, h["fd_token"])
        h2 = attach_raw(c, helpers.layout())  # a new attach, a new token
        assert h2["fd_token"] != h["fd_token"]
        for fd in fetch_fds(path, h2["fd_token"]).values():
            os.close(fd)


@pytest.mark.skipif(helpers.why_not_other_users() is not None, reason=str(helpers.why_not_other_users()))
def test_another_user_cannot_get_the_fds_of_a_users_rank(tmp_path):
    with PrivateDaemon(pool_bytes=64 * MiB, backend="cpu", log_path=str(tmp_path / "d.log"),
                       start_timeout_s=30) as d:
        os.chmod(d.run_dir, 0o755)  # let other users reach the sockets, as the daemon's group may
        for name in ("control.sock", FD_SOCKET):
            os.chmod(os.path.join(d.run_dir, name), 0o666)
        path = os.path.join(d.run_dir, FD_SOCKET)
        owner = subprocess.Popen([*helpers.as_user(65534), sys.executable, "-c", ATTACHER, d.run_dir,
                                  json.dumps(helpers.layout().to_wire())],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/tmp")
        try:
            att = json.loads(owner.stdout.readline())
            assert att["ok"], att
            h = att["handles"]
            # another user, holding the owner's token (leaked): refused
            stranger = fetch_elsewhere(path, h["fd_token"], helpers.as_user(65533))
            assert stranger["ok"] is False and stranger["code"] == "PERMISSION_DENIED", stranger
            assert "did not attach this rank" in stranger["msg"] and "65533" in stranger["msg"]
            # and no file of the daemon's to open instead
            assert helpers.shm_files(d.run_dir) == []
            # the owner still gets its slab
            owner.stdin.write("fetch\n")
            owner.stdin.flush()
            got = json.loads(owner.stdout.readline())
            assert got == {"ok": True, "fds": {"slab": h["bytes"]}}, got
            assert helpers.stats_json(d.run_dir)["fd_refusals"] == 1
        finally:
            owner.kill()
            owner.wait()


# -- in process: the decision itself -------------------------------------------------------
def test_the_fd_answer_in_process(tmp_path):
    with helpers.inproc_daemon(tmp_path) as d:
        assert request(d, b"a", MsgType.HELLO, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": ""})[0]["ok"]
        h = request(d, b"a", MsgType.ATTACH, {"engine": "e", "layout": helpers.layout().to_wire()})[0]["handles"]
        line = h["fd_token"].encode() + b"\n"
        uid, gid = os.getuid(), os.getgid()
        # nothing in time; another process (an in-process session is the daemon's own process)
        for got, why in ((d.fd_server._answer(None, [], os.getpid(), uid, gid), "no request within"),
                         (d.fd_server._answer(line, [], os.getpid() + 1, uid, gid), "did not attach this rank")):
            answer, fds = got
            assert fds == [] and json.loads(answer)["code"] == "PERMISSION_DENIED" and why in answer.decode()
        answer, fds = d.fd_server._answer(line, [], os.getpid(), uid, gid)
        assert json.loads(answer) == {"ok": True, "fds": ["slab"]} and fds == [d.backend.share_fds(1)["slab"]]
        answer, fds = d.fd_server._answer(line, [], os.getpid(), uid, gid)
        assert fds == [] and "already used" in answer.decode()
        assert d.snapshot()["fd_refusals"] == 3 and d.fd_server.offers == {}


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_the_fd_socket_serves_on_either_event_loop_and_is_removed_at_stop(loop):
    """``Daemon.serve`` in a thread of this process (so the attaching process is this one)."""
    import asyncio
    import threading

    from sparsekv.daemon.backends import CpuBackend
    from sparsekv.daemon.pool import HostPool
    from sparsekv.daemon.server import Daemon

    runner = pytest.importorskip("uvloop").run if loop == "uvloop" else asyncio.run
    with helpers.short_tmpdir() as run_dir:
        pool = HostPool(8 * MiB, threads=1)
        backend = CpuBackend(run_dir, shm_dir=run_dir)
        d = Daemon(run_dir, backend, pool)
        ready, box = threading.Event(), {}

        async def serve():
            box["loop"] = asyncio.get_running_loop()
            await d.serve(on_ready=ready.set)

        t = threading.Thread(target=lambda: runner(serve()), daemon=True)
        t.start()
        try:
            assert ready.wait(10)
            assert sorted(os.listdir(run_dir)) == ["control.sock", FD_SOCKET, "stats.sock"]
            with Client(run_dir) as c:
                att = c.attach(helpers.layout())
                att.slab[...] = 3
                assert (backend._slabs[1].mm[:16] == b"\x03" * 16)  # the daemon's mapping
                msg, _ = raw_answer(os.path.join(run_dir, FD_SOCKET), b"bad\n")
                assert msg["ok"] is False
        finally:
            box["loop"].call_soon_threadsafe(d.stop)
            t.join(10)
            backend.close()
            pool.close()
        assert not t.is_alive() and os.listdir(run_dir) == []
        assert d.stats.c["fd_refusals"] == 1


def test_cuda_host_blocks_are_a_sealed_memfd_closed_with_them(monkeypatch):
    """The cuda backend's pinned step blocks (no GPU here: registration stubbed)."""
    import fcntl

    from sparsekv.daemon.cuda import buffers
    from sparsekv.daemon.cuda.buffers import HostBlocks

    class Unpinned:
        def __init__(self, address, nbytes, row_bytes):
            self.device_base = address

        def close(self):
            pass

    monkeypatch.setattr(buffers, "PinnedRegion", Unpinned)
    h = HostBlocks(10_000, "sparsekv-0123456789-blocks-3")
    fd = h.fd
    assert os.readlink(f"/proc/self/fd/{fd}") == "/memfd:sparsekv-0123456789-blocks-3 (deleted)"
    assert os.fstat(fd).st_size == h.nbytes == 3 * mmap.PAGESIZE
    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
    client = mmap.mmap(fd, h.nbytes)  # what a client maps from the descriptor it got
    h.array[5] = 9
    assert client[5] == 9
    client.close()
    h.close()
    assert h.fd is None
    anon = HostBlocks(100)
    assert anon.fd is None  # in process: anonymous, nothing to hand out
    anon.close()
