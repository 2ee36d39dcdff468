"""Device wait (``Client(device_wait=True)``): a zmq TOPK returns once sent, the rank's
stream waits on the GPU for the entry's done word, the reply is read later. The logic
around it on the CPU (a fake cuda attachment: what is sent, what is kept, when errors
surface, what is released when the daemon is gone); the GPU tests are in
tests/daemon/test_cuda_backend.py."""

import threading
import time

import numpy as np
import pytest

import helpers
from helpers import request
from sparsekv.client import BadRequest, Client, DaemonUnavailable
from sparsekv.client.client import Ready
from sparsekv.client.device_wait import DeviceWaitWatch
from sparsekv.client.results import AttachmentCaps
from sparsekv.proto import ErrorCode, MsgType

LAYOUT = helpers.layout(num_layers=1, row_bytes=32, top_k=4, region_stride=8, max_reqs=2, host_rows=64)
IDS = np.array([[0, 1, 2, 3]], np.int32)


class FakeAttachment:
    """What Client asks of a cuda attachment on the device-wait path; records the calls."""

    layout = LAYOUT

    def __init__(self, done_words=True, blocks=True):
        self.caps = AttachmentCaps(device=True, step_blocks=blocks, done_words=done_words)
        self.calls, self.released = [], []
        self._n = {}

    def next_entry(self):
        return 0

    def next_fence(self):
        return None

    def record_fence(self):
        return None

    def write_blocks(self, e, step, group, rows, topk, begin, still_there, timeout_s):
        self.calls.append(("write", e, step))
        return e

    def next_done(self, e):
        self._n[e] = self._n.get(e, 0) + 1
        return self._n[e]

    def result_after(self, e, batch, k, done):
        self.calls.append(("wait_on_device", e, done))
        return ("result", e, done)

    def result(self, e, batch, k):
        return ("after_reply", e)

    def release_done(self):
        self.released.append(dict(self._n))  # every entry used, at its last value
        return len(self._n)


def fake_client(done_words=True, device_wait=True):
    c = Client("/nonexistent", device="cuda:0", device_wait=device_wait)
    c.attachment = FakeAttachment(done_words)
    c._step_rows = (0, np.array([0], np.int32))
    sent = []

    def send(msg_type, fields=None, arrays=None):
        sent.append((msg_type, dict(fields or {})))
        return len(sent)

    c._send = send
    c._receive_arrived = lambda: None
    c._daemon_dead = lambda: None  # (the watcher would find no daemon at /nonexistent)
    return c, sent


def test_a_device_wait_topk_sends_its_done_value_and_returns_without_a_reply():
    c, sent = fake_client()
    try:
        p = c.submit_topk(0, 0, IDS)
        assert isinstance(p, Ready) and p.wait() == ("result", 0, 1)
        assert sent[-1][0] == MsgType.TOPK and sent[-1][1]["done"] == 1 and sent[-1][1]["block"] == 0
        assert c.attachment.calls[-1] == ("wait_on_device", 0, 1)
        assert c._deferred == [1]
        assert any(isinstance(h, DeviceWaitWatch) for h in c._handles)  # the watcher runs
        c.submit_topk(0, 0, IDS)
        assert sent[-1][1]["done"] == 2  # the entry's count grows
        assert sum(isinstance(h, DeviceWaitWatch) for h in c._handles) == 1
    finally:
        c._close_handles()


@pytest.mark.parametrize("device_wait,done_words", [(False, True), (True, False)])
def test_without_device_wait_or_done_words_the_topk_waits_for_its_reply(device_wait, done_words):
    c, sent = fake_client(done_words, device_wait)
    p = c.submit_topk(0, 0, IDS)
    assert not isinstance(p, Ready) and "done" not in sent[-1][1]
    assert c._deferred == [] and not c._handles
    # An earlier request's error is not raised early on the reply path either.
    c._replies[1] = ({"id": 1, "ok": False, "code": int(ErrorCode.BAD_ARGUMENT), "msg": "later"}, {})
    c._deferred.append(1)
    c.submit_topk(0, 0, IDS)
    assert 1 in c._deferred


class FencedAttachment(FakeAttachment):
    """Two fence events, taken in turn; eight ring entries. Recording an event asserts
    that the request that carried it last has its reply."""

    def __init__(self, client, blocks=True):
        super().__init__(blocks=blocks)
        self.client = client
        self.next, self.recorded, self.entries = 0, [], 0

    def next_entry(self):
        self.entries += 1
        return (self.entries - 1) % 8

    def next_fence(self):
        return self.next

    def record_fence(self):
        k, self.next = self.next, (self.next + 1) % 2
        assert self.client._fence_requests.get(k) not in self.client._sent, f"event {k} recorded under a wait"
        self.recorded.append(k)
        return k


@pytest.mark.parametrize("blocks", [True, False])
def test_a_fence_event_is_recorded_again_only_after_the_reply_of_the_request_that_carried_it(blocks):
    """With device wait the host does not wait for replies, so it could record a fence
    event again before the daemon's stream took its wait on the last record (a wait on the
    newer record would wait for the engine's work, which waits for the daemon): first
    the reply of the request that carried it, before the request consumes anything. Top-k
    batches in step blocks and as arrays alike."""
    c, sent = fake_client()
    c.attachment = FencedAttachment(c, blocks)
    real_send, waited = c._send, []

    def send(msg_type, fields=None, arrays=None):
        req = real_send(msg_type, fields, arrays)
        c._sent[req] = (msg_type, 0)  # unanswered until _receive_until
        return req

    def receive_until(req):
        waited.append(req)
        c._sent.pop(req, None)

    c._send, c._receive_until = send, receive_until
    try:
        for _ in range(5):
            c.submit_topk(0, 0, IDS)
        assert [f["fence"] for _, f in sent] == [0, 1, 0, 1, 0]
        assert waited == [1, 2, 3]  # request 3 reuses request 1's event, 4 request 2's, 5 request 3's
        c._sent.pop(4)  # answered meanwhile: no wait
        c.submit_topk(0, 0, IDS)
        assert waited == [1, 2, 3]
    finally:
        c._close_handles()


def test_an_earlier_device_wait_error_is_raised_before_the_next_topk_is_sent():
    c, sent = fake_client()
    try:
        c.submit_topk(0, 0, IDS)
        c._replies[1] = ({"id": 1, "ok": False, "code": int(ErrorCode.BAD_ARGUMENT), "msg": "bad fence"}, {})
        n = len(sent)
        with pytest.raises(BadRequest, match="bad fence"):
            c.submit_topk(0, 0, IDS)
        assert len(sent) == n  # not sent
    finally:
        c._close_handles()


def test_a_lost_daemon_releases_every_entry_used_at_its_last_value_unless_its_process_lives():
    """A reply does not mean the work ran (the daemon may die after sending it): every
    entry a device-wait TOPK used is released, at its last value; but not while the
    daemon's process lives (its stream would still set the words: a release would race)."""
    c, _ = fake_client()
    try:
        c.submit_topk(0, 0, IDS)
        c.submit_topk(0, 0, IDS)
        c._replies[1] = ({"id": 1, "ok": True}, {})  # the first one was answered
        c._process_alive = lambda: True
        c._release_device_waits()
        assert c.attachment.released == []
        assert c._daemon_dead() is None  # the watcher's check: alive is not gone
        c._process_alive = lambda: None  # cannot see it: the socket decides
        c._sock = type("S", (), {"close": lambda self, linger=0: None})()
        with pytest.raises(DaemonUnavailable):
            c._lost("sparsekvd is gone (test)")
        assert c.attachment.released == [{0: 2}]
    finally:
        c._close_handles()


def test_the_daemon_releases_a_failed_device_wait_of_its_own_process_only_with_an_int_block_and_done():
    """release_device_wait: the rank's release gets (block, done, fence) of a TOPK;
    nothing for another type, a bad block or done, a rank without releases; never raises."""
    from types import SimpleNamespace

    from sparsekv.daemon.engine_requests import release_device_wait

    calls = []
    state = SimpleNamespace(release_topk_block=lambda *a: calls.append(a))
    s = SimpleNamespace(state=state)
    topk = int(MsgType.TOPK)
    release_device_wait(s, {"t": topk, "block": 2, "done": 9, "fence": 1})
    release_device_wait(s, {"t": topk, "block": 2, "done": 10, "fence": "x"})
    for bad in ({"t": int(MsgType.STEP), "block": 2, "done": 9}, {"t": topk, "block": "2", "done": 9},
                {"t": topk, "block": 2, "done": -1}, {"t": topk, "block": 2, "done": True}):
        release_device_wait(s, bad)
    release_device_wait(SimpleNamespace(state=None), {"t": topk, "block": 2, "done": 9})
    state.release_topk_block = lambda *a: 1 / 0
    release_device_wait(s, {"t": topk, "block": 2, "done": 9})  # logged, not raised
    assert calls == [(2, 9, 1), (2, 10, None)]


def test_the_watcher_releases_once_the_daemon_is_gone_until_closed():
    answers = [None, None, "gone (test)"]
    released = threading.Event()
    calls = []

    def check():
        return answers.pop(0) if answers else "gone again"

    def release():
        calls.append(len(answers))
        if len(calls) >= 3:
            released.set()

    w = DeviceWaitWatch(check, release, interval_s=0.001)
    assert released.wait(5)  # again and again: a wait enqueued meanwhile is released too
    w.close()
    n = len(calls)
    time.sleep(0.02)
    assert len(calls) == n and set(calls) == {0} and w.gone == "gone (test)"  # only after "gone"; none after close
    idle = DeviceWaitWatch(lambda: None, lambda: calls.append(-1), interval_s=0.001)
    time.sleep(0.01)
    idle.close()
    assert not idle._thread.is_alive() and -1 not in calls and idle.gone is None


def test_a_request_after_the_watcher_found_the_daemon_gone_raises_and_is_not_sent():
    c, sent = fake_client()
    c.submit_topk(0, 0, IDS)
    watch = next(h for h in c._handles if isinstance(h, DeviceWaitWatch))
    watch.close()
    watch.gone = "sparsekvd is gone (test)"
    c._sock = type("S", (), {"close": lambda self, linger=0: None})()
    c._process_alive = lambda: False
    n = len(sent)
    with pytest.raises(DaemonUnavailable, match="gone"):
        c.submit_topk(0, 0, IDS)
    assert len(sent) == n and c.attachment.released == [{0: 1}]


def test_the_environment_turns_device_wait_on(monkeypatch):
    monkeypatch.setenv("SPARSEKV_CLIENT_DEVICE_WAIT", "1")
    assert Client("/nonexistent", device="cuda:0").device_wait is True
    assert Client("/nonexistent", device="cuda:0", device_wait=False).device_wait is False
    monkeypatch.delenv("SPARSEKV_CLIENT_DEVICE_WAIT")
    assert Client("/nonexistent", device="cuda:0").device_wait is False


def test_the_daemon_checks_done_and_a_cpu_rank_refuses_block_topks_and_serves_on(tmp_path):
    """A TOPK's ``done`` must be a uint32 (BAD_ARGUMENT naming it, never INTERNAL); a cpu
    rank has no client-written blocks (BAD_ARGUMENT) and nothing to release; the session
    serves on. (In process: Daemon.handle, as tests/daemon/test_fuzz_requests.py does.)"""
    import os

    with helpers.inproc_daemon(tmp_path) as dm:
        assert request(dm, b"D", MsgType.HELLO, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": "dw"})[0]["ok"]
        assert request(dm, b"D", MsgType.ATTACH, {"engine": "dw", "layout": LAYOUT.to_wire()})[0]["ok"]
        for bad in ("1", 2**32, -1, True, 1.5):
            h, _ = request(dm, b"D", MsgType.TOPK, {"step": 0, "group": 0, "block": 0, "done": bad})
            assert not h["ok"] and h["code"] == ErrorCode.BAD_ARGUMENT and "done must be an integer" in h["msg"]
        h, _ = request(dm, b"D", MsgType.TOPK, {"step": 0, "group": 0, "block": 0, "done": 7})
        assert not h["ok"] and h["code"] == ErrorCode.BAD_ARGUMENT and "cuda only" in h["msg"]
        assert request(dm, b"D", MsgType.STEP, {"step": 0}, {"state_rows": np.array([0], np.int32)})[0]["ok"]
        h, a = request(dm, b"D", MsgType.TOPK, {"step": 0, "group": 0}, {"topk": IDS})
        assert h["ok"] and int(a["misses"][0]) == 4
