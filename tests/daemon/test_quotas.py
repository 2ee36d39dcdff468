"""Per-uid quotas and the control socket's connections (daemon/control_socket.py).

- ``max_clients_per_uid``: a HELLO beyond it is QUOTA_EXCEEDED; other uids are served.
- ``max_pool_bytes_per_uid``: a new engine that would bring its creator's engines over it
  is QUOTA_EXCEEDED before its range is allocated; joining an engine costs nothing.
- ``max_connections_per_uid``: a connection beyond it is closed when accepted, counted.
- ``hello_timeout_s``: a connection without a HELLO by then is closed, counted.
- ``idle_timeout_s``: a session not attached is dropped after that long idle (its
  connection stays); an attached one is kept.
"""

import os
import socket
import time

import pytest
import zmq

import helpers
from helpers import registry_attach as attach
from sparsekv.client import Client, NotAttached, QuotaExceeded
from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.daemon.backends import CpuBackend
from sparsekv.daemon.engine import Owner
from sparsekv.daemon.pool import HostPool
from sparsekv.daemon.registry import EngineRegistry
from sparsekv.proto import ErrorCode, ProtocolError


MiB = 1 << 20
OTHERS = pytest.mark.skipif(helpers.why_not_other_users() is not None, reason=str(helpers.why_not_other_users()))


def daemon(tmp_path, *args, pool_bytes=64 * MiB):
    return PrivateDaemon(pool_bytes=pool_bytes, backend="cpu", extra_args=list(args),
                         log_path=str(tmp_path / "d.log"), start_timeout_s=30)


# -- clients per uid -----------------------------------------------------------------------
def test_a_hello_beyond_the_uids_client_quota_is_refused_and_a_place_frees_on_close(tmp_path):
    with daemon(tmp_path, "--max-clients-per-uid", "2") as d:
        a, b = Client(d.run_dir).connect(), Client(d.run_dir).connect()
        with pytest.raises(QuotaExceeded) as e:
            Client(d.run_dir, timeout_s=5).connect()
        assert e.value.code == ErrorCode.QUOTA_EXCEEDED
        assert f"uid {os.getuid()} has 2 clients" in str(e.value) and "max_clients_per_uid 2" in str(e.value)
        a.close()
        c = Client(d.run_dir).connect()  # BYE freed a place
        assert helpers.stats_json(d.run_dir)["errors_by_code"] == {"QUOTA_EXCEEDED": 1}
        b.close()
        c.close()


@OTHERS
def test_another_uid_is_served_while_one_uid_holds_its_client_quota(tmp_path):
    with daemon(tmp_path, "--max-clients-per-uid", "1") as d:
        helpers.open_to_other_users(d.run_dir)
        first, (hello,) = helpers.raw_client(d.run_dir, 1, [], uid=65534)
        second, (refused,) = helpers.raw_client(d.run_dir, 1, [], uid=65534)
        other, (served,) = helpers.raw_client(d.run_dir, 1, [], uid=65533)
        try:
            assert hello["ok"] and served["ok"], (hello, served)
            assert refused["ok"] is False and refused["code"] == int(ErrorCode.QUOTA_EXCEEDED), refused
        finally:
            for p in (first, second, other):
                p.kill()
                p.wait()


# -- pool bytes per uid --------------------------------------------------------------------
def test_a_new_engine_beyond_the_uids_pool_quota_is_refused_before_allocating(tmp_path):
    pool = HostPool(64 * MiB, threads=1)
    lay = helpers.layout(host_rows=4096, row_bytes=256)  # 1 MiB of pool a layer, 2 MiB: one range
    assert lay.pool_bytes == 2 * MiB
    reg = EngineRegistry(pool, CpuBackend(str(tmp_path), shm_dir=str(tmp_path)),
                         max_pool_bytes_per_uid=lay.pool_bytes * 2)
    try:
        alice, bob = Owner(1000, 1000), Owner(1001, 1001)
        attach(reg, 1, 0, "cpu", "a1", lay, owner=alice)
        attach(reg, 2, 1, "cpu", "a1", lay, owner=alice)  # joining costs nothing
        attach(reg, 3, 0, "cpu", "a2", lay, owner=alice)
        used = pool.used_bytes
        with pytest.raises(ProtocolError) as e:
            attach(reg, 4, 0, "cpu", "a3", lay, owner=alice)
        assert e.value.code == ErrorCode.QUOTA_EXCEEDED and "uid 1000" in str(e.value)
        assert pool.used_bytes == used and "a3" not in reg  # nothing allocated, nothing listed
        attach(reg, 5, 0, "cpu", "b1", lay, owner=bob)  # another uid has its own quota
        assert reg.pool_bytes_of(1000) == 2 * lay.pool_bytes and reg.pool_bytes_of(1001) == lay.pool_bytes
        reg.detach(3, "a2")
        attach(reg, 6, 0, "cpu", "a3", lay, owner=alice)  # room again
    finally:
        for cid, name in ((1, "a1"), (2, "a1"), (5, "b1"), (6, "a3")):
            if name in reg:
                reg.detach(cid, name)
        pool.close()


def test_the_ranks_one_uid_attached_are_bounded_together_and_detach_and_abort_give_back(tmp_path):
    """max_rank_bytes_per_uid (Config.max_slab_share_per_uid of the host's memory): seen, one
    uid's 5 attaches took 7.7 GB of a 24 GB host, each checked only against what was free."""
    from sparsekv.daemon.residency.base import rank_bytes

    pool = HostPool(8 * MiB, threads=1)
    lay = helpers.layout()
    one = rank_bytes(lay)["total"]
    reg = EngineRegistry(pool, CpuBackend(str(tmp_path), shm_dir=str(tmp_path)), max_rank_bytes_per_uid=2 * one)
    alice, bob = Owner(1000, 1000), Owner(1001, 1001)
    try:
        attach(reg, 1, 0, "cpu", "e", lay, owner=alice)
        attach(reg, 2, 1, "cpu", "e", lay, owner=alice)
        assert reg.rank_bytes_by_uid == {1000: 2 * one}
        with pytest.raises(ProtocolError) as e:
            attach(reg, 3, 2, "cpu", "e", lay, owner=alice)
        assert e.value.code == ErrorCode.QUOTA_EXCEEDED and "uid 1000" in str(e.value)
        assert 3 not in reg.space("e").ranks and reg.rank_bytes_by_uid == {1000: 2 * one}
        attach(reg, 4, 0, "cpu", "f", lay, owner=bob)  # another uid counts its own
        p = reg.begin_attach(5, 1, "cpu", "f", lay, owner=bob)  # an attach given up gives its share back
        assert reg.rank_bytes_by_uid[1001] == 2 * one
        reg.abort(p)
        assert reg.rank_bytes_by_uid[1001] == one
        reg.detach(2, "e")
        attach(reg, 6, 1, "cpu", "e", lay, owner=alice)  # room again
        assert reg.rank_bytes_by_uid == {1000: 2 * one, 1001: one}
    finally:
        for cid, name in ((1, "e"), (4, "f"), (6, "e")):
            reg.detach(cid, name)
        assert reg.rank_bytes_by_uid == {}
        pool.close()


def test_the_pool_quota_charges_whole_ranges(tmp_path):
    pool = HostPool(8 * MiB, threads=1)
    small = helpers.layout()  # 1 KiB of rows, but a 2 MiB range of the pool
    reg = EngineRegistry(pool, CpuBackend(str(tmp_path), shm_dir=str(tmp_path)), max_pool_bytes_per_uid=3 * MiB)
    try:
        attach(reg, 1, 0, "cpu", "one", small, owner=Owner(1000, 1000))
        assert reg.pool_bytes_of(1000) == 2 * MiB
        with pytest.raises(ProtocolError) as e:
            attach(reg, 2, 0, "cpu", "two", small, owner=Owner(1000, 1000))
        assert e.value.code == ErrorCode.QUOTA_EXCEEDED
    finally:
        reg.detach(1, "one")
        pool.close()


def test_the_pool_quota_over_the_socket(tmp_path):
    lay = helpers.layout(host_rows=4096, row_bytes=256)
    with daemon(tmp_path, "--max-pool-bytes-per-uid", f"{lay.pool_bytes + lay.pool_bytes // 2}B") as d:
        with Client(d.run_dir) as a, Client(d.run_dir) as b:
            a.attach(lay, engine="first")
            with pytest.raises(QuotaExceeded):
                b.attach(lay, engine="second")
            b.attach(lay, engine="first")  # another rank of the same engine
        snap = helpers.stats_json(d.run_dir)
        assert snap["errors_by_code"] == {"QUOTA_EXCEEDED": 1} and snap["engines"] == 0


# -- connections -----------------------------------------------------------------------------
def _raw_connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.settimeout(0.05)
    return s


def _closed_by_peer(s: socket.socket) -> bool:
    """Whether the daemon ended this raw connection (EOF after its ZMTP greeting)."""
    try:
        while True:
            data = s.recv(4096)
            if not data:
                return True
    except (socket.timeout, BlockingIOError):
        return False
    except ConnectionResetError:
        return True


def test_connections_beyond_the_uids_cap_are_closed_and_counted(tmp_path):
    with daemon(tmp_path, "--max-connections-per-uid", "3", "--hello-timeout-s", "30") as d:
        path = os.path.join(d.run_dir, "control.sock")
        socks = [_raw_connect(path) for _ in range(5)]
        try:
            helpers.wait_for(lambda: helpers.stats_json(d.run_dir)["connections_refused"] == 2, timeout_s=5,
                             what="two connections refused")
            closed = helpers.wait_for(lambda: (n := sum(map(_closed_by_peer, socks))) == 2 and n, timeout_s=5,
                                      what="two connections closed")
            assert closed == 2
            snap = helpers.stats_json(d.run_dir)
            assert snap["connections_open"] == 3 and snap["connections_refused"] == 2
            with pytest.raises(Exception):  # the uid is at its cap: a client of it is closed too
                Client(d.run_dir, timeout_s=0.5).connect()
        finally:
            for s in socks:
                s.close()
        helpers.wait_for(lambda: helpers.stats_json(d.run_dir)["connections_open"] == 0, timeout_s=5,
                         what="the raw connections gone")
        with Client(d.run_dir) as c:  # served again once the others left
            assert c.info["client_id"] >= 1
        assert "connections_refused_total" in helpers.stats_query(d.run_dir, "prometheus").replace("sparsekv_", "")


SILENT = r"""
import json, socket, sys, time, zmq
path = sys.argv[1]
silent = zmq.Context().socket(zmq.DEALER)  # handshakes, heartbeats, never says HELLO
silent.setsockopt(zmq.LINGER, 0)
silent.setsockopt(zmq.RECONNECT_IVL, 60_000)  # stays closed once closed
mon = silent.get_monitor_socket(zmq.EVENT_DISCONNECTED)
t0 = time.monotonic()
silent.connect("ipc://" + path)
raw = socket.socket(socket.AF_UNIX)  # not even a handshake (libzmq's own limit is 5 s)
raw.connect(path)
raw.settimeout(5)
out = {"dealer_closed_s": time.monotonic() - t0 if mon.poll(5000) else None}
try:
    while raw.recv(4096):
        pass
    out["raw_closed_s"] = time.monotonic() - t0
except OSError:
    out["raw_closed_s"] = None
print(json.dumps(out), flush=True)
"""


def test_a_connection_without_hello_is_closed_after_the_timeout_and_clients_are_not(tmp_path):
    # The silent peers are another process: connections of a process that said HELLO
    # need none (its libzmq's reconnects).
    import json
    import subprocess

    with daemon(tmp_path, "--hello-timeout-s", "0.3") as d, Client(d.run_dir) as c:
        r = subprocess.run([helpers.PY, "-c", SILENT, os.path.join(d.run_dir, "control.sock")], capture_output=True,
                           text=True, timeout=30)
        got = json.loads(r.stdout)
        assert got["dealer_closed_s"] is not None and 0.3 <= got["dealer_closed_s"] < 4, got
        assert got["raw_closed_s"] is not None and got["raw_closed_s"] < 4, got
        snap = helpers.stats_json(d.run_dir)
        # the client's connection is older than the silent ones: the pass that closed them
        # would have closed it too, had it not said HELLO
        assert snap["connections_expired"] == 2 and snap["connections_open"] == 1, snap
        assert c.stats()["clients"] == 1


def test_a_session_goes_with_its_connection_even_attached_and_a_reconnect_needs_hello(tmp_path):
    """A session is its connection's: once that closes (here without BYE, attached) the rank
    is released at once, and a new connection, under the same routing id or not, must say
    HELLO: nothing a peer chooses (its routing id) reaches another connection's session."""
    from sparsekv.proto import MsgType, decode, encode

    with daemon(tmp_path) as d:
        ctx = zmq.Context.instance()
        path = f"ipc://{os.path.join(d.run_dir, 'control.sock')}"

        def dealer():
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.ROUTING_ID, b"skv-reconnect-test")
            s.connect(path)
            return s

        def call(s, t, fields=None):
            s.send_multipart(encode(t, 1, fields))
            assert s.poll(5000), "no reply"
            return decode(s.recv_multipart())[0]

        first = dealer()
        assert call(first, MsgType.HELLO, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": "r"})["ok"]
        assert call(first, MsgType.ATTACH, {"engine": "e", "layout": helpers.layout().to_wire()})["ok"]
        assert helpers.stats_json(d.run_dir)["clients"] == 1
        first.close(0)
        helpers.wait_for(lambda: helpers.stats_json(d.run_dir)["clients"] == 0, timeout_s=3,
                         what="the attached session dropped with its connection")
        snap = helpers.stats_json(d.run_dir)
        assert snap["sessions_closed"] == 1 and snap["attached"] == 0, snap
        second = dealer()
        try:
            h = call(second, MsgType.STATS)
            assert h["ok"] is False and h["error"] == "NOT_HELLO", h
        finally:
            second.close(0)


def test_an_idle_session_not_attached_expires_and_an_attached_one_stays(tmp_path):
    with daemon(tmp_path, "--idle-timeout-s", "1", "--reap-interval-s", "0.1") as d:
        attached = Client(d.run_dir).connect()
        attached.attach(helpers.layout(), engine="e")  # (within 1 s of its HELLO: first, before the idle one)
        idle = Client(d.run_dir).connect()
        snap = helpers.wait_for(lambda: (x := helpers.stats_json(d.run_dir))["sessions_expired"] == 1 and x,
                                timeout_s=5, what="the idle session dropped")
        assert snap["clients"] == 1 and snap["attached"] == 1
        assert snap["connections_open"] == 2  # its connection stays (its libzmq would reconnect)
        time.sleep(1.2)
        assert attached.stats()["clients"] == 1  # idle past the timeout but attached: kept
        with pytest.raises(NotAttached) as e:  # the dropped one must connect again, and is told why
            idle.stats()
        assert e.value.code == ErrorCode.NOT_HELLO and "expired" in str(e.value) and "idle_timeout_s" in str(e.value)
        idle.close()
        attached.close()


