"""Client library against a scripted daemon (a bare ROUTER in a thread): a daemon of
another protocol version is refused with ProtocolMismatch, error replies become typed
exceptions carrying the daemon's message, a silent daemon times out clearly, every
request carries its send time ``ts``."""

import os
import threading
import time

import msgpack
import pytest
import zmq

import helpers
from sparsekv.client import (BadRequest, Client, DaemonUnavailable, LayoutMismatch, NotAttached, PoolFull,
                             ProtocolMismatch, SparseKVError)
from sparsekv.client.errors import error_for
from sparsekv.proto import PROTOCOL_VERSION, ErrorCode


class FakeDaemon:
    """Answers each request with ``reply(header) -> header dict`` (None: stay silent)."""

    def __init__(self, run_dir, reply):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"ipc://{os.path.join(run_dir, 'control.sock')}")
        self.reply, self.stop = reply, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, head, *_ = self.sock.recv_multipart()
            out = self.reply(msgpack.unpackb(head))
            if out is not None:
                self.sock.send_multipart([ident, msgpack.packb(out)])

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def fake():
    made = []

    def make(reply):
        d = helpers.short_tmpdir()
        run_dir = d.__enter__()
        made.append((FakeDaemon(run_dir, reply), d))
        return run_dir

    yield make
    for f, d in made:
        f.close()
        d.__exit__(None, None, None)


def test_daemon_of_another_protocol_version_is_refused(fake):
    run_dir = fake(lambda h: {"v": PROTOCOL_VERSION, "t": h["t"], "id": h["id"], "ok": True, "client_id": 1,
                              "version": PROTOCOL_VERSION + 1})
    with pytest.raises(ProtocolMismatch) as ei:
        Client(run_dir, timeout_s=5).connect()
    assert f"daemon speaks protocol {PROTOCOL_VERSION + 1}" in str(ei.value)


def test_error_reply_is_a_typed_exception_with_the_daemons_message(fake):
    def reply(h):
        if h["t"] == 1:
            return {"v": PROTOCOL_VERSION, "t": 1, "id": h["id"], "ok": True, "client_id": 1,
                    "version": PROTOCOL_VERSION}
        return {"v": PROTOCOL_VERSION, "t": h["t"], "id": h["id"], "ok": False, "code": int(ErrorCode.POOL_FULL),
                "error": "POOL_FULL", "msg": "host pool has no free range of 4GiB"}

    with Client(fake(reply), timeout_s=5) as c:
        with pytest.raises(PoolFull) as ei:
            c.attach(helpers.layout())
        assert ei.value.code == ErrorCode.POOL_FULL
        assert "no free range of 4GiB" in str(ei.value)


def test_every_request_carries_its_send_time_and_a_daemon_without_times_is_fine(fake):
    seen = []

    def reply(h):  # a daemon that sends no tr / tx: nothing is recorded, nothing breaks
        seen.append(h)
        return {"v": PROTOCOL_VERSION, "t": h["t"], "id": h["id"], "ok": True, "client_id": 1,
                "version": PROTOCOL_VERSION, "stats": {}}

    before = time.perf_counter_ns()
    with Client(fake(reply), timeout_s=5) as c:
        c.stats()
        assert c.timings == {} and not c._sent
    assert [h["t"] for h in seen] == [1, 8, 10]  # HELLO, STATS, BYE (close says goodbye)
    assert all(isinstance(h["ts"], int) and before <= h["ts"] <= time.perf_counter_ns() for h in seen)
    assert seen[0]["ts"] <= seen[1]["ts"]


def test_silent_daemon_times_out_with_daemon_unavailable(fake):
    run_dir = fake(lambda h: None)
    with pytest.raises(DaemonUnavailable) as ei:
        Client(run_dir, timeout_s=0.3).connect()
    assert "no reply" in str(ei.value) and run_dir in str(ei.value)


@pytest.mark.parametrize(
    "code, cls",
    [(ErrorCode.BAD_VERSION, ProtocolMismatch), (ErrorCode.LAYOUT_MISMATCH, LayoutMismatch),
     (ErrorCode.POOL_FULL, PoolFull), (ErrorCode.NOT_ATTACHED, NotAttached), (ErrorCode.NOT_HELLO, NotAttached),
     (ErrorCode.DUPLICATE_IDS, BadRequest), (ErrorCode.BAD_FRAME, BadRequest), (ErrorCode.INTERNAL, SparseKVError)],
)
def test_error_codes_map_to_exception_classes(code, cls):
    e = error_for(int(code), "why")
    assert type(e) is cls and e.code == code and str(e) == f"{code.name}: why"


def test_unknown_error_code_keeps_the_message():
    e = error_for(999, "from the future")
    assert isinstance(e, SparseKVError) and "999" in str(e) and "from the future" in str(e)
