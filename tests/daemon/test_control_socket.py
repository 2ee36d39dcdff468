"""The control socket of a real daemon: malformed frames and a wrong protocol version sent
from a raw ZeroMQ DEALER get a clear error reply, counted by code, while another attached
client keeps working with correct bytes."""

import os

import msgpack
import numpy as np
import pytest
import zmq

import helpers
from sparsekv.client import Client, NotAttached
from sparsekv.proto import PROTOCOL_VERSION, ErrorCode, MsgType, decode

LAYOUT = helpers.layout(num_layers=2, row_bytes=32, top_k=4, region_stride=8, max_reqs=2, host_rows=128)


@pytest.fixture
def good(daemon):
    """An attached client with the pattern in the pool; ``check(t)`` runs one step and
    asserts every hot byte."""
    c = Client(daemon.run_dir, rank=0, name="good", timeout_s=10).connect()
    att = c.attach(LAYOUT, engine="good")
    helpers.fill(c, LAYOUT)
    rng = np.random.default_rng(5)

    def check(t):
        topk = np.stack([rng.choice(np.arange(64 * b, 64 * b + 64), 4, replace=False) for b in range(2)])
        topk = topk.astype(np.int32)
        c.step(t, [0, 1])
        for g in range(2):
            r = c.topk(t, g, topk)
            assert helpers.bad_rows(att.slab, LAYOUT.groups[g], np.array([0, 1]), topk, r.slots, 128) == 0
            assert (r.slots[topk >= 0] >= 0).all()

    check.client = c
    yield check
    c.close()


@pytest.fixture
def raw(daemon):
    """A bare DEALER on the control socket: ``send(frames) -> decoded reply header``."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"ipc://{os.path.join(daemon.run_dir, 'control.sock')}")

    def send(frames):
        s.send_multipart(frames)
        assert s.poll(10_000), "no reply from the daemon"
        header, _ = decode(s.recv_multipart())
        return header

    yield send
    s.close(0)
    ctx.term()


def head(**kw) -> bytes:
    h = {"v": PROTOCOL_VERSION, "t": int(MsgType.HELLO), "id": 1, "pid": os.getpid(), "rank": 9,
         "device": "cpu", "name": "raw"}
    h.update(kw)
    return msgpack.packb(h)


BAD_MESSAGES = [
    ("not msgpack", [b"\xc1garbage"], "BAD_FRAME"),
    ("empty frame", [b""], "BAD_FRAME"),
    ("header not a map", [msgpack.packb([1, 2, 3])], "BAD_FRAME"),
    ("missing id", [msgpack.packb({"v": PROTOCOL_VERSION, "t": 1})], "BAD_FRAME"),
    ("arrays count mismatch", [head(arrays=[["a", "int32", [2]]])], "BAD_FRAME"),
    ("bad dtype", [head(arrays=[["a", "complex64", [1]]]), b"\0" * 8], "BAD_FRAME"),
    ("size mismatch", [head(arrays=[["a", "int32", [3]]]), b"\0" * 8], "BAD_FRAME"),
    ("too many frames", [head()] + [b""] * 16, "TOO_LARGE"),
    ("header too large", [head(name="x" * 70_000)], "TOO_LARGE"),
    ("wrong protocol version", [head(v=PROTOCOL_VERSION + 7)], "BAD_VERSION"),
    ("unknown type", [head(t=77)], "UNKNOWN_TYPE"),
    ("step before hello", [head(t=int(MsgType.STEP), step=0)], "NOT_HELLO"),
]


def test_malformed_frames_get_clear_errors_while_another_client_keeps_working(daemon, good, raw):
    good(0)
    expected = {}
    for t, (what, frames, code) in enumerate(BAD_MESSAGES, start=1):
        h = raw(frames)
        assert h["ok"] is False, what
        assert h["error"] == code and h["code"] == int(ErrorCode[code]), (what, h)
        assert h["msg"].strip(), what
        expected[code] = expected.get(code, 0) + 1
        good(t)  # the attached client is unaffected, bytes and all
    stats = helpers.stats_json(daemon.run_dir)
    assert stats["errors_by_code"] == expected
    assert stats["errors"] == len(BAD_MESSAGES)
    prom = helpers.stats_query(daemon.run_dir, "prometheus")
    for code, n in expected.items():
        assert f'sparsekv_errors_total{{code="{code}"}} {float(n)}' in prom.splitlines()


def test_wrong_version_message_names_both_versions(raw):
    h = raw([head(v=PROTOCOL_VERSION + 1)])
    assert h["error"] == "BAD_VERSION"
    assert f"version {PROTOCOL_VERSION + 1}" in h["msg"] and f"speaks {PROTOCOL_VERSION}" in h["msg"]
    assert "upgrade" in h["msg"]  # says what to do


def test_raw_client_can_recover_after_errors(daemon, raw):
    assert raw([b"\xc1"])["error"] == "BAD_FRAME"
    h = raw([head()])
    assert h["ok"] and h["version"] == PROTOCOL_VERSION
    assert "raw" in helpers.stats_query(daemon.run_dir, "clients")


def test_client_library_raises_typed_errors_with_the_daemons_message(daemon):
    with Client(daemon.run_dir, timeout_s=10) as c:
        with pytest.raises(NotAttached) as ei:
            c.step(0, [0])
            c.stats()  # a step's error may be raised by the next wait
        assert ei.value.code == ErrorCode.NOT_ATTACHED and "attach a layout" in str(ei.value)
        c.attach(LAYOUT)
        c.step(0, [0])
        with pytest.raises(Exception) as ei:
            c.topk(0, 0, [[5, 6, 5, -1]])
        assert type(ei.value).__name__ == "BadRequest" and ei.value.code == ErrorCode.DUPLICATE_IDS
        assert "same host row twice" in str(ei.value)
        c.step(0, [0])  # the refused TOPK ran neither itself nor the STEP riding on it
        r = c.topk(0, 0, [[5, 6, 7, -1]])  # the connection is still good
        assert r.misses.tolist() == [3]


def test_client_pipelines_requests_and_matches_replies(daemon):
    with Client(daemon.run_dir, timeout_s=10) as c:
        c.attach(LAYOUT)
        helpers.fill(c, LAYOUT)
        c.step(0, [0, 1])
        pend = [c.submit_topk(0, g, [[1, 2, 3, 4], [70, 71, -1, -1]]) for g in (1, 0)]
        res = [p.wait() for p in reversed(pend)]  # collected out of order
        for g, r in enumerate(res):
            assert r.misses.tolist() == [4, 2]
            assert helpers.bad_rows(c.attachment.slab, LAYOUT.groups[g], np.array([0, 1]),
                                    np.array([[1, 2, 3, 4], [70, 71, -1, -1]]), r.slots, 128) == 0


def test_client_without_daemon_says_where_it_looked(tmp_path):
    from sparsekv.client import DaemonUnavailable

    with pytest.raises(DaemonUnavailable) as ei:
        Client(str(tmp_path)).connect()
    assert "control.sock" in str(ei.value) and str(tmp_path) in str(ei.value)


def test_control_socket_appears_only_once_it_accepts_connections(tmp_path):
    """A client that connects the moment control.sock appears is accepted: the daemon
    binds under a private name and renames the socket into place after listen() (a
    connect in the gap between bind and listen was refused: a flaky CI failure)."""
    import socket
    import stat
    import subprocess
    import sys
    import time

    for attempt in range(3):
        run_dir = tmp_path / f"run{attempt}"
        run_dir.mkdir()
        path = str(run_dir / "control.sock")
        proc = subprocess.Popen([sys.executable, "-m", "sparsekv.daemon.main", "--run-dir", str(run_dir),
                                 "--backend", "cpu", "--pool-size", "16MiB"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(path):  # no sleep: catch the first instant it exists
                assert proc.poll() is None and time.monotonic() < deadline, "daemon did not start"
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o660  # its mode was set before it appeared
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)  # ConnectionRefusedError here was the bug
            finally:
                s.close()
            assert not os.path.exists(path + ".new")
        finally:
            proc.terminate()
            proc.wait(timeout=20)
