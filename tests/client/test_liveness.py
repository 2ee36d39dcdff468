"""A client learns within seconds that its daemon is gone, and says what happened: the
daemon's process exited (kill -9), it was restarted (a new socket), nobody listens on a
socket left behind (connection refused), this user may not connect (permission denied);
a new Client against a new daemon on the same run dir works at once. ``Client.close()``
says goodbye (BYE): the daemon forgets the session, so a process may open and close
clients for ever without filling ``max_clients``."""

import contextlib
import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

import helpers
from sparsekv.client import BadRequest, Client, DaemonUnavailable
from sparsekv.client import tensors as tensors_mod
from sparsekv.client import connection as connection_mod
from sparsekv.proto import LIMITS


def start(run_dir, *args) -> subprocess.Popen:
    """A daemon on ``run_dir``, serving when this returns (its stats socket answers)."""
    p = subprocess.Popen([helpers.PY, "-m", "sparsekv.daemon.main", "--backend", "cpu", "--run-dir", run_dir,
                          "--pool-size", "16MiB", "--shm-dir", run_dir, *args],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def serving():
        assert p.poll() is None, "the daemon exited"
        try:
            return helpers.stats_json(run_dir)["pid"] == p.pid
        except (OSError, ValueError):
            return False

    helpers.wait_for(serving, 30, what="the daemon to serve")
    return p


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
    p.wait()


@contextlib.contextmanager
def stopped(p: subprocess.Popen):
    """The daemon stopped (SIGSTOP) for the block's time: it reads nothing, answers nothing."""
    os.kill(p.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(p.pid, signal.SIGCONT)


def one_layer(row_bytes: int, host_rows: int):
    from sparsekv.proto import Layout

    return Layout(num_layers=1, row_bytes=row_bytes, top_k=4, region_stride=8, max_reqs=2, host_rows=host_rows,
                  index_groups=[[0]])


@pytest.fixture
def run_dir():
    with helpers.short_tmpdir() as d:
        yield d


def test_killed_daemon_is_noticed_within_seconds_and_a_new_one_serves_at_once(run_dir):
    p = start(run_dir)
    try:
        c = Client(run_dir, timeout_s=30).connect()
        c.attach(helpers.layout())
        os.kill(p.pid, signal.SIGSTOP)  # the next request waits for a reply
        threading.Timer(0.5, os.kill, (p.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable) as ei:
            c.stats()  # the daemon dies while this waits; it is not reaped (a zombie)
        took = time.monotonic() - t0 - 0.5
        assert took < 3.0, took
        assert f"sparsekvd is gone (pid {p.pid} exited)" in str(ei.value) and "INTERNAL" not in str(ei.value)
        assert "create a new Client" in str(ei.value)
        with pytest.raises(DaemonUnavailable, match="is gone"):  # and from now on, at once
            c.step(1, [0])
            c.flush()
        p.wait()
        p = start(run_dir)  # the socket the dead one left is replaced
        t0 = time.monotonic()
        with Client(run_dir, timeout_s=5) as c2:
            c2.attach(helpers.layout())
            assert c2.stats()["attached"] == 1
        assert time.monotonic() - t0 < 2.0
        t0 = time.monotonic()
        c.close()  # the old client closes quietly and at once
        assert time.monotonic() - t0 < 0.5
    finally:
        stop(p)


def test_a_large_write_a_stopped_daemon_does_not_read_raises_daemon_unavailable(run_dir):
    """A 32 MiB WRITE while the daemon is stopped: after ``timeout_s`` without progress the
    client cuts the connection and raises DaemonUnavailable. Seen (an adversarial review):
    a bare ValueError (the ending write unregistered the fd of the socket it had just
    closed); only the next request raised the typed error."""
    p = start(run_dir, "--pool-size", "64MiB")
    try:
        with Client(run_dir, timeout_s=30) as c:
            c.attach(one_layer(4096, 8192))
            c.timeout_s = 1  # from here on (a loaded machine's attach may take longer)
            with stopped(p), pytest.raises(DaemonUnavailable, match="read none of a request"):
                c.write(np.arange(8192, dtype=np.int64), np.ones((1, 8192, 4096), np.uint8))
    finally:
        stop(p)


def test_a_reply_that_does_not_come_in_time_ends_the_session(run_dir):
    """Found by a review of the client: after timeout_s the client raised DaemonUnavailable
    yet kept the connection, so once the daemon went on the request had run and the next
    ones were served: 'unavailable' meant nothing the caller could rely on. It ends the
    session now, as for a lost daemon: every later request raises it too."""
    p = start(run_dir, "--pool-size", "64MiB")
    lay = one_layer(64, 64)
    try:
        with Client(run_dir, timeout_s=30) as c:
            c.attach(lay)
            c.timeout_s = 1  # from here on (a loaded machine's attach may take longer)
            c.step(0, [0])
            with stopped(p), pytest.raises(DaemonUnavailable, match=r"no reply .* within 1 s .*create a new Client"):
                c.topk(0, 0, [[1, 2, 3, 4]])
            with pytest.raises(DaemonUnavailable, match="within 1 s"):
                c.stats()
        with Client(run_dir, timeout_s=5) as c2:  # a new client is served
            c2.attach(lay, engine="after")
            c2.step(0, [0])
            assert c2.topk(0, 0, [[1, 2, 3, 4]]).misses.tolist() == [4]
            deadline = time.monotonic() + 5
            while c2.stats()["attached"] != 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            st = c2.stats()
            assert st["attached"] == 1 and st["sessions_closed"] >= 1  # the first rank was dropped
    finally:
        stop(p)


@pytest.fixture
def lost(run_dir):
    """A daemon subprocess and a client of it (timeout 1 s) attached to engine "lost",
    for tests that lose the session by stopping the daemon past the timeout."""
    p = start(run_dir, "--pool-size", "64MiB")
    try:
        c = Client(run_dir, timeout_s=30).connect()
        try:
            c.attach(one_layer(64, 64), engine="lost")
            c.timeout_s = 1  # from here on (a loaded machine's attach may take longer)
            yield p, c
        finally:
            c.close()
    finally:
        stop(p)


def serves_again(c: Client) -> None:
    """``c`` connects again and serves a new attachment as a fresh client would."""
    c.connect()
    assert c.attachment is None and c._blocks is None
    c.attach(one_layer(64, 64), engine="again")
    c.step(0, [0])
    c.flush()
    assert c.topk(0, 0, [[1, 2, 3, 4]]).misses.tolist() == [4]
    c.flush()


def test_a_reply_read_before_a_timeout_is_still_answered_and_a_new_connect_starts_clean(lost):
    """Found by a review of the timeout change: the reply of an earlier pipelined request,
    read while the client waited for a later one, was thrown away with the connection
    (its wait said "no reply"); and a connect() after the lost session kept the old
    attachment (its requests NOT_ATTACHED)."""
    p, c = lost
    c.step(0, [0])
    p1 = c.submit_topk(0, 0, [[1, 2, 3, 4]])
    time.sleep(0.5)  # its reply waits in the socket
    with stopped(p):
        p2 = c.submit_topk(0, 0, [[5, 6, 7, 8]])
        with pytest.raises(DaemonUnavailable, match="within 1 s"):
            p2.wait()
    assert p1.wait().misses.tolist() == [4]  # it ran, and its reply had come
    serves_again(c)


def test_a_lost_sessions_step_error_is_still_raised_and_a_reconnect_starts_clean(lost):
    """Found by a review: a refused STEP whose error reply was read before the session was
    lost was never raised (a top-k of the refused step returned slots)."""
    p, c = lost
    c.step(1, [5])  # max_reqs 2: refused ...
    p1 = c.submit_topk(1, 0, [[1, 2, 3, 4]], state_rows=[0])  # ... sent alone, deferred
    time.sleep(0.5)  # both replies wait in the socket
    with stopped(p):
        with pytest.raises(BadRequest, match="BAD_STATE_ROW"):
            c.stats()  # the STEP's refusal, read from the socket: the STATS is not sent
        with pytest.raises(DaemonUnavailable, match="within 1 s"):
            c.stats()
    assert p1.wait().slots.shape == (1, 4)  # its own reply (state rows of its own), read before the loss
    with pytest.raises(DaemonUnavailable, match="within 1 s"):
        c.flush()  # the session is gone, whatever is deferred
    serves_again(c)


def test_a_write_held_back_behind_a_step_sent_alone_says_it_was_not_sent(lost):
    """Found by an integrator's walkthrough: a WRITE waiting for the reply to a STEP sent
    alone (the daemon stopped) raised "the request may have run", which was the STEP's."""
    p, c = lost
    c.step(0, [0])
    with stopped(p):  # before the STEP goes: its reply cannot have come
        c.submit_topk(0, 0, [[1, 2, 3, 4]], state_rows=[0])  # the STEP goes alone, not waited for
        with pytest.raises(DaemonUnavailable, match=r"within 1 s .*; this WRITE was not sent: it waited for the "
                                                     r"reply to a STEP sent before it"):
            c.write([0], np.zeros((1, 1, 64), np.uint8))
    serves_again(c)


def test_an_error_dropped_unread_in_a_lost_session_does_not_reach_the_next(lost):
    """Found by the same review: its id stayed deferred across connect(), and flush()
    raised "made on an earlier connection" for the rest of the new session."""
    p, c = lost
    c.step(0, [0])
    c.topk(0, 0, [[1, 2, 3, 4]])
    pend = c.submit_topk(0, 7, [[1, 2, 3, 4]])  # group 7: refused
    time.sleep(0.5)
    with stopped(p), pytest.raises(DaemonUnavailable):
        c.stats()
    del pend  # dropped unread: its error would be raised by the next request
    serves_again(c)


def test_restarted_daemon_is_noticed_by_its_socket(run_dir, monkeypatch):
    p = start(run_dir)
    try:
        c = Client(run_dir, timeout_s=30).connect()
        c._daemon_pid = 0  # as from another pid namespace: only the socket tells
        stop(p)
        p = start(run_dir)
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable) as ei:
            c.stats()  # the new daemon does not know this connection: no reply
        assert time.monotonic() - t0 < 3.0
        assert "sparsekvd restarted" in str(ei.value)
    finally:
        stop(p)


def test_a_restart_between_the_attach_reply_and_the_memory_fetch_is_daemon_unavailable(run_dir, monkeypatch):
    """Found by an adversarial review: a daemon killed and restarted after the ATTACH's
    reply and before the client fetched the rank's descriptors: the new daemon knew no
    such token, and the attach raised PermissionDenied, which an engine takes as final.
    It is the lost daemon's DaemonUnavailable, as for any request to it."""
    from sparsekv.client import client as client_mod

    procs = [start(run_dir)]
    real = client_mod.fetch_fds

    def restarted_first(*a, **kw):
        stop(procs[0])
        procs.append(start(run_dir))
        return real(*a, **kw)

    monkeypatch.setattr(client_mod, "fetch_fds", restarted_first)
    try:
        c = Client(run_dir, timeout_s=5).connect()
        with pytest.raises(DaemonUnavailable, match="sparsekvd is gone .* could not fetch the rank's memory"):
            c.attach(helpers.layout(), engine="race")
        monkeypatch.undo()
        with Client(run_dir, timeout_s=5) as c2:  # the new daemon serves
            c2.attach(helpers.layout(), engine="race")
    finally:
        for p in procs:
            stop(p)


def test_a_socket_renamed_to_busy_and_back_between_two_looks_is_not_a_dead_daemon(run_dir, monkeypatch):
    """The daemon renames control.sock <-> control.sock.busy while it holds off new
    connections: a look at both names can miss both. The liveness check (and a doorbell
    handle's watcher, which releases the engine's stream for good on it) must not call
    that gone."""
    p = start(run_dir)
    try:
        c = Client(run_dir, timeout_s=30).connect()
        c._daemon_pid = 0  # as from another pid namespace: only the socket tells
        real_stat, misses = os.stat, {"n": 2}

        def racing_stat(path, *a, **kw):
            if str(path).startswith(c.control_path) and misses["n"] > 0:
                misses["n"] -= 1  # control.sock, then control.sock.busy: both "missing"
                raise FileNotFoundError(path)
            return real_stat(path, *a, **kw)

        monkeypatch.setattr(connection_mod.os, "stat", racing_stat)
        assert c._check_daemon() is None
        assert misses["n"] == 0
        misses["n"] = 10**6  # really gone: every look misses
        assert "its socket" in c._check_daemon() and "was removed" in c._check_daemon()
        monkeypatch.undo()
        c.close()
    finally:
        stop(p)


def test_a_socket_nobody_listens_on_is_connection_refused_at_once(run_dir):
    p = start(run_dir)
    stop(p)  # kill -9 leaves control.sock behind
    assert os.path.exists(os.path.join(run_dir, "control.sock"))
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailable) as ei:
        Client(run_dir, timeout_s=30).connect()
    assert time.monotonic() - t0 < 1.0
    assert "connection refused" in str(ei.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_a_socket_this_user_may_not_use_is_permission_denied(run_dir):
    os.chmod(run_dir, 0o755)  # others may enter; the socket itself is 0660 root:root
    p = start(run_dir)
    try:
        path = os.path.join(run_dir, "control.sock")
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # as nobody, with this process's imports already loaded
            try:
                os.setgid(65534)
                os.setuid(65534)
                connection_mod.open_wire(path, run_dir, 5)[0].close()
                msg = "connected"
            except DaemonUnavailable as e:
                msg = str(e)
            except BaseException as e:  # noqa: BLE001
                msg = repr(e)
            os.write(w, msg.encode())
            os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        msg = os.read(r, 4096).decode()
        os.close(r)
        assert msg.startswith(f"permission denied on {path}"), msg
    finally:
        stop(p)


def test_close_says_goodbye_so_clients_never_fill_max_clients(run_dir):
    p = start(run_dir, "--max-clients", "4")
    try:
        lay = helpers.layout()
        for i in range(24):
            if i % 2:
                with Client(run_dir, name=f"with-{i}") as c:
                    c.attach(lay, engine=f"e{i % 3}")
            else:
                c = Client(run_dir, name=f"plain-{i}").connect()
                if i % 4 == 0:
                    c.attach(lay)
                c.close()
        with Client(run_dir) as c:
            stats = c.stats()
            assert stats["clients"] == 1 and stats["attached"] == 0 and stats["engines"] == 0
            assert stats["pool_used_bytes"] == 0
    finally:
        stop(p)


def test_close_without_a_daemon_returns_at_once(run_dir):
    p = start(run_dir)
    c = Client(run_dir, timeout_s=30).connect()
    os.kill(p.pid, signal.SIGSTOP)  # alive but silent: the goodbye gets no answer
    try:
        t0 = time.monotonic()
        c.close()
        assert time.monotonic() - t0 < 1.0
    finally:
        stop(p)


def test_a_write_larger_than_one_frame_is_split(run_dir, monkeypatch):
    p = start(run_dir)
    try:
        with Client(run_dir, timeout_s=10) as c:
            lay = helpers.layout(host_rows=64, row_bytes=32)
            c.attach(lay)
            rows = np.arange(64, dtype=np.int32)
            data = np.stack([helpers.gen_pattern(layer, rows, 32) for layer in range(2)])
            # A frame limit of 10 rows (of both layers): seven WRITEs, the same result.
            monkeypatch.setattr(tensors_mod, "LIMITS", LIMITS.__class__(max_frame_bytes=10 * 2 * 32))
            out = c.write(rows, data)
            assert out["bytes"] == data.nbytes
            c.step(0, [0])
            r = c.topk(0, 0, [[3, 40, 63, 11]])
            slab = c.attachment.slab
            assert helpers.bad_rows(slab, (0,), np.array([0]), np.array([[3, 40, 63, 11]]), r.slots, 64) == 0
            # An array no split can shrink is refused here, not dropped by the daemon.
            monkeypatch.setattr(connection_mod, "LIMITS", LIMITS.__class__(max_frame_bytes=8))
            with pytest.raises(Exception, match="exceeds the frame limit"):
                c.step(1, [0, 1, 2])
                c.flush()
            monkeypatch.setattr(connection_mod, "LIMITS", LIMITS.__class__(max_message_bytes=8))
            with pytest.raises(Exception, match="in one request; split it"):
                c.step(1, [0, 1, 2])
                c.flush()
    finally:
        stop(p)
