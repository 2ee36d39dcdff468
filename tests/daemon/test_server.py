"""The daemon's request handling in process (Daemon.handle, no sockets): every error gets
a reply with its code and a message, counted by code; the client registry (attach,
detach, engines and their pool ranges); reaping of dead clients; a rank's asynchronous
error answering its next request; receive / reply times in every reply."""

import os
import subprocess
import sys
import time

import msgpack
import numpy as np
import psutil
import pytest

import helpers
from helpers import request
from sparsekv.daemon import server as server_mod
from sparsekv.daemon.residency.base import ResidencyError
from sparsekv.daemon.server import Daemon
from sparsekv.proto import ERROR_HINTS, PROTOCOL_VERSION, ErrorCode, MsgType, decode, encode

MiB = 1 << 20


def hello(dm, ident=b"A", pid=None, rank=0):
    """HELLO; with ``pid``, from a connection the kernel says is process ``pid``'s."""
    h, _ = request(dm, ident, MsgType.HELLO, {"pid": pid or os.getpid(), "rank": rank, "device": "cpu", "name": "t"},
                   req_id=11, peer=None if pid is None else helpers.peer(pid))
    assert h["ok"], h
    return h


def attach(dm, ident=b"A", engine="e", **kw):
    return request(dm, ident, MsgType.ATTACH, {"engine": engine, "layout": helpers.layout(**kw).to_wire()})[0]


def assert_error(h, code: ErrorCode, words: str = ""):
    assert h["ok"] is False, h
    assert (h["code"], h["error"]) == (int(code), code.name)
    assert words in h["msg"]
    assert ERROR_HINTS[code] in h["msg"]  # the message says what to do


def test_hello_replies_with_daemon_facts(dm):
    h = hello(dm)
    assert h["version"] == PROTOCOL_VERSION and h["daemon_pid"] == os.getpid()
    assert h["backend"] == "cpu" and h["client_id"] == 1 and h["id"] == 11 and h["t"] == MsgType.HELLO


def test_any_request_before_hello_is_not_hello(dm):
    assert_error(request(dm, b"A", MsgType.STATS)[0], ErrorCode.NOT_HELLO)


def test_wrong_protocol_version_is_bad_version_naming_both(dm):
    frames = [bytes(f) for f in encode(MsgType.HELLO, 5, {"pid": 1, "rank": 0, "device": "cpu", "name": ""})]
    head = msgpack.unpackb(frames[0])
    head["v"] = PROTOCOL_VERSION + 1
    h, _ = decode(dm.handle(b"A", [msgpack.packb(head)]))
    assert_error(h, ErrorCode.BAD_VERSION, f"version {PROTOCOL_VERSION + 1}, this daemon speaks {PROTOCOL_VERSION}")
    assert h["id"] == 5 and h["t"] == MsgType.HELLO  # the reply still finds its request
    assert not dm.sessions


def test_unknown_message_type(dm):
    hello(dm)
    assert_error(request(dm, b"A", 99)[0], ErrorCode.UNKNOWN_TYPE, "unknown message type 99")


@pytest.mark.parametrize("fields, words", [
    ({"rank": -1}, "rank must be in [0, 65536)"),
    ({"rank": 1 << 20}, "rank must be in [0, 65536)"),
    ({"device": 5}, "device must be a string"),
    ({"device": "x" * 129}, "device must be a string of at most 128"),
    ({"name": ["n"]}, "name must be a string"),
    ({"name": "engine-0\nsparsekvd: forged log line"}, "name must be text without control characters"),
    ({"name": "a\tb"}, "name must be text without control characters"),
    ({"device": "cuda:0\u2028x"}, "device must be text without control characters"),
    ({"name": "decode-\u202eed"}, "name must be text without control characters, tabs, line breaks or bidi"),
    ({"name": "a\u2066b\u2069"}, "name must be text without control characters, tabs, line breaks or bidi"),
])
def test_a_hello_with_a_rank_or_a_device_out_of_bounds_is_bad_argument(dm, fields, words):
    h, _ = request(dm, b"A", MsgType.HELLO, {"pid": 1, "rank": 0, "device": "cpu", "name": "", **fields})
    assert_error(h, ErrorCode.BAD_ARGUMENT, words)


def test_a_topk_begin_that_is_not_a_bool_is_bad_argument(dm):
    """Seen (an adversarial review): ``begin: 1`` was taken as no begin, silently."""
    hello(dm)
    attach(dm)
    h, _ = request(dm, b"A", MsgType.TOPK, {"step": 0, "group": 0, "begin": 1},
                   {"topk": np.zeros((1, 4), np.int32), "state_rows": np.zeros(1, np.int32)})
    assert_error(h, ErrorCode.BAD_ARGUMENT, "begin must be true or false, got 1")


def test_undecodable_request_is_bad_frame(dm):
    h, _ = decode(dm.handle(b"A", [b"\xc1"]))
    assert_error(h, ErrorCode.BAD_FRAME, "not msgpack")
    assert (h["t"], h["id"]) == (0, 0)


def test_missing_fields_and_unexpected_arrays_are_bad_argument(dm):
    assert_error(request(dm, b"A", MsgType.HELLO, {"pid": 1})[0], ErrorCode.BAD_ARGUMENT, "'device'")
    hello(dm)
    attach(dm)
    h, _ = request(dm, b"A", MsgType.STEP, {"step": 0}, {"state_rows": np.zeros(1, np.int32), "junk": np.zeros(1)})
    assert_error(h, ErrorCode.BAD_ARGUMENT, "takes no array(s) ['junk']")
    assert_error(request(dm, b"A", MsgType.STEP, {"step": 0})[0], ErrorCode.BAD_ARGUMENT, "needs the state_rows array")
    h, _ = request(dm, b"A", MsgType.STEP, {"step": "0"}, {"state_rows": np.zeros(1, np.int32)})
    assert_error(h, ErrorCode.BAD_ARGUMENT, "field 'step' must be an integer")


@pytest.mark.parametrize("pid", [0, -4, 2**40, 2**63, "x"])
def test_hello_pid_field_is_ignored_even_when_impossible(dm, pid):
    # The session's pid is the kernel's (none here: an in-process call, so pid 0, never
    # reaped); what the client claims changes nothing, and cannot break the reaper.
    h, _ = request(dm, b"A", MsgType.HELLO, {"pid": pid, "rank": 0, "device": "cpu", "name": ""})
    assert h["ok"], h
    assert dm.sessions[b"A"].pid == 0 and dm.sessions[b"A"].verified is False
    assert dm.sessions.reap_dead() == 0


def test_requests_before_attach_are_not_attached(dm):
    hello(dm)
    for t, arrays in ((MsgType.STEP, {"state_rows": np.zeros(1, np.int32)}),
                      (MsgType.TOPK, {"topk": np.zeros((1, 4), np.int32)}),
                      (MsgType.WRITE, {"rows": np.zeros(1, np.int32), "data": np.zeros((2, 1, 32), np.uint8)}),
                      (MsgType.STAGE, {"rows": np.zeros(1, np.int32)})):
        h, _ = request(dm, b"A", t, {"step": 0, "group": 0, "layers": None}, arrays)
        assert_error(h, ErrorCode.NOT_ATTACHED, "has not attached")


def test_attach_twice_is_already_attached(dm):
    hello(dm)
    assert attach(dm)["ok"]
    assert_error(attach(dm), ErrorCode.ALREADY_ATTACHED, "attached to engine 'e'")


def test_bad_layout_names_the_field(dm):
    hello(dm)
    wire = helpers.layout().to_wire()
    wire["row_bytes"] = 0
    h, _ = request(dm, b"A", MsgType.ATTACH, {"engine": "e", "layout": wire})
    assert_error(h, ErrorCode.BAD_LAYOUT, "row_bytes must be a positive integer")
    assert_error(request(dm, b"A", MsgType.ATTACH, {"engine": "e", "layout": 7})[0], ErrorCode.BAD_LAYOUT, "map")
    assert_error(request(dm, b"A", MsgType.ATTACH, {"engine": "", "layout": wire})[0], ErrorCode.BAD_ARGUMENT, "engine")
    for not_a_name in (5, b"x", ["e"]):  # seen: str() of it became the engine's name
        assert_error(request(dm, b"A", MsgType.ATTACH, {"engine": not_a_name, "layout": wire})[0],
                     ErrorCode.BAD_ARGUMENT, "engine must be a name")
    assert dm.pool.used_bytes == 0


def test_second_rank_with_another_layout_is_layout_mismatch(dm):
    hello(dm, b"A")
    hello(dm, b"B", rank=1)
    assert attach(dm, b"A")["ok"]
    assert_error(attach(dm, b"B", top_k=2), ErrorCode.LAYOUT_MISMATCH, "engine 'e' is attached with")
    assert attach(dm, b"B", engine="other", top_k=2)["ok"]  # another engine may differ
    assert len(dm.engines) == 2


def test_layout_that_does_not_fit_the_pool_is_pool_full(dm):
    hello(dm)
    h = attach(dm, host_rows=2**20, row_bytes=16, num_layers=1)  # 16 MiB > 8 MiB pool
    assert_error(h, ErrorCode.POOL_FULL, "no free range of 16MiB")
    assert dm.pool.used_bytes == 0 and not dm.engines
    assert attach(dm)["ok"]  # and the client may try again with a smaller one


def test_too_many_clients(dm):
    for i in range(3):
        hello(dm, bytes([65 + i]))
    h, _ = request(dm, b"Z", MsgType.HELLO, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": ""})
    assert_error(h, ErrorCode.TOO_MANY_CLIENTS, "max 3")


def test_zero_dimensional_state_rows_is_bad_argument_not_internal(dm):
    hello(dm)
    attach(dm)
    head = {"v": PROTOCOL_VERSION, "t": int(MsgType.STEP), "id": 3, "step": 0, "arrays": [["state_rows", "int32", []]]}
    h, _ = decode(dm.handle(b"A", [msgpack.packb(head), np.int32(0).tobytes()]))
    assert_error(h, ErrorCode.BAD_ARGUMENT, "state_rows must have 1 dimension")


def test_batch_larger_than_the_limit_is_too_large(dm):
    hello(dm)
    attach(dm)
    h, _ = request(dm, b"A", MsgType.STEP, {"step": 0}, {"state_rows": np.full(4097, -1, np.int32)})
    assert_error(h, ErrorCode.TOO_LARGE, "4097")


def test_duplicate_ids_over_the_wire(dm):
    hello(dm)
    attach(dm)
    assert request(dm, b"A", MsgType.STEP, {"step": 0}, {"state_rows": np.array([0], np.int32)})[0]["ok"]
    h, _ = request(dm, b"A", MsgType.TOPK, {"step": 0, "group": 0}, {"topk": np.array([[3, 4, 3, -1]], np.int32)})
    assert_error(h, ErrorCode.DUPLICATE_IDS, "same host row twice")
    assert (dm.sessions[b"A"].state.residency.owner == -1).all()


def test_errors_and_requests_are_counted_by_code(dm):
    request(dm, b"A", MsgType.STATS)
    dm.handle(b"A", [b"\xc1"])
    dm.handle(b"A", [b"\xc1"])
    hello(dm)
    snap = request(dm, b"A", MsgType.STATS)[0]["stats"]
    assert snap["errors_by_code"] == {"NOT_HELLO": 1, "BAD_FRAME": 2}
    assert snap["errors"] == 3
    assert snap["requests"] == 4  # the STATS being answered is counted after its snapshot


def test_handler_bug_is_internal_and_the_daemon_keeps_serving(dm, monkeypatch):
    hello(dm)

    def boom(*a):
        raise KeyError("oops")

    monkeypatch.setitem(dm.handlers, MsgType.DETACH, boom)
    assert_error(request(dm, b"A", MsgType.DETACH)[0], ErrorCode.INTERNAL, "KeyError")
    assert request(dm, b"A", MsgType.STATS)[0]["ok"]


def test_handlers_must_match_the_declared_protocol(tmp_path, monkeypatch):
    declared = {k: v for k, v in server_mod.REQUESTS.items() if k != MsgType.STATS}
    monkeypatch.setattr(server_mod, "REQUESTS", declared)
    with pytest.raises(RuntimeError, match="do not match proto.REQUESTS"):
        Daemon(str(tmp_path), None, None)


def test_last_rank_detaching_frees_the_engine_and_its_slab(dm, tmp_path):
    hello(dm, b"A")
    hello(dm, b"B", rank=1)
    attach(dm, b"A")
    attach(dm, b"B")
    assert dm.pool.used_bytes > 0 and len(helpers.shm_slabs(str(tmp_path), str(tmp_path))) == 2
    assert request(dm, b"A", MsgType.DETACH)[0]["was_attached"] is True
    assert "e" in dm.engines and dm.pool.used_bytes > 0
    request(dm, b"B", MsgType.DETACH)
    assert not dm.engines and dm.pool.used_bytes == 0
    assert helpers.shm_slabs(str(tmp_path), str(tmp_path)) == []
    assert request(dm, b"B", MsgType.DETACH)[0]["was_attached"] is False


def test_hello_again_on_one_connection_is_already_attached_until_detached(dm):
    hello(dm)
    attach(dm)
    used = dm.pool.used_bytes
    # A second HELLO must not silently throw the attached rank away.
    h, _ = request(dm, b"A", MsgType.HELLO, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": "t"})
    assert_error(h, ErrorCode.ALREADY_ATTACHED, "attached to engine 'e'; send DETACH before HELLO again")
    assert dm.sessions[b"A"].client_id == 1 and dm.sessions[b"A"].state is not None
    assert "e" in dm.engines and dm.pool.used_bytes == used
    # Once detached, HELLO again is a reconnect: a new session, a new client id.
    assert request(dm, b"A", MsgType.DETACH)[0]["was_attached"] is True
    h = hello(dm)
    assert h["client_id"] == 2 and len(dm.sessions) == 1
    assert not dm.engines and dm.pool.used_bytes == 0


@pytest.mark.parametrize("reap", [True, False], ids=["exited", "zombie"])
def test_reap_dead_detaches_clients_whose_process_is_gone(dm, tmp_path, reap):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        hello(dm, b"live", pid=live.pid)
        attach(dm, b"live", engine="keep")
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        hello(dm, b"dead", pid=proc.pid)
        attach(dm, b"dead", engine="gone")
        used = dm.pool.used_bytes
        proc.kill()
        if reap:
            proc.wait()
        else:
            helpers.wait_for(lambda: psutil.Process(proc.pid).status() == "zombie", what="zombie")
        assert dm.sessions.reap_dead() == 1
        assert set(dm.sessions) == {b"live"} and set(dm.engines) == {"keep"}
        assert dm.pool.used_bytes < used
        assert len(helpers.shm_slabs(str(tmp_path), str(tmp_path))) == 1
        assert dm.sessions.reap_dead() == 0
        proc.wait()
    finally:
        live.kill()
        live.wait()


def test_async_error_of_a_rank_answers_the_next_rank_request_which_does_not_run(dm, monkeypatch):
    hello(dm)
    attach(dm)
    assert request(dm, b"A", MsgType.STEP, {"step": 0}, {"state_rows": np.array([0], np.int32)})[0]["ok"]
    st = dm.sessions[b"A"].state
    pending = [ResidencyError("BAD_ARGUMENT", "top-k id 99 of an earlier batch was out of range (seen on the GPU)")]
    monkeypatch.setattr(st, "take_error", lambda: pending.pop() if pending else None)
    topk = {"topk": np.array([[1, 2, 3, 4]], np.int32)}
    assert request(dm, b"A", MsgType.STATS)[0]["ok"]  # not a rank request: the error waits
    assert pending
    h, _ = request(dm, b"A", MsgType.TOPK, {"step": 0, "group": 0}, topk)
    assert_error(h, ErrorCode.BAD_ARGUMENT, "top-k id 99")
    assert (st.residency.owner == -1).all()  # the TOPK did not run
    snap = dm.snapshot()
    assert snap["async_errors"] == 1 and snap["errors_by_code"] == {"BAD_ARGUMENT": 1} and snap["topk_batches"] == 0
    h, a = request(dm, b"A", MsgType.TOPK, {"step": 0, "group": 0}, topk)  # the error was taken once
    assert h["ok"] and h["hits"] == 0 and (a["slots"] >= 0).all()
    snap = dm.snapshot()
    assert snap["async_errors"] == 1 and snap["errors"] == 1 and snap["topk_batches"] == 1


def test_cpu_rank_has_no_async_error(dm):
    hello(dm)
    attach(dm)
    assert dm.sessions[b"A"].state.take_error() is None


def test_every_reply_carries_daemon_receive_and_reply_times(dm):
    def times(ident, msg_type, fields=None, arrays=None):
        tr = time.perf_counter_ns()
        frames = [bytes(f) for f in encode(msg_type, 3, fields, arrays)]
        h, _ = decode([bytes(f) for f in dm.handle(ident, frames, tr)])
        assert h["tr"] == tr and tr <= h["tx"] <= time.perf_counter_ns(), h
        return h

    assert_error(times(b"A", MsgType.STATS), ErrorCode.NOT_HELLO)  # error replies too
    tr = time.perf_counter_ns()
    h, _ = decode(dm.handle(b"A", [b"\xc1"], tr))
    assert h["ok"] is False and h["tr"] == tr <= h["tx"]
    # optional header fields the daemon does not know (the client's "ts") are accepted
    h = times(b"A", MsgType.HELLO, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": "t",
                                    "ts": time.perf_counter_ns(), "later_field": [1, 2]})
    assert h["ok"]
    assert times(b"A", MsgType.STATS)["ok"]
    h = request(dm, b"A", MsgType.STATS)[0]  # handle() without a receive time takes its own
    assert h["tr"] <= h["tx"]


def test_a_request_that_cannot_be_decoded_is_answered_under_its_own_id(dm):
    """An array of a dtype the wire refuses (block ids as uint64): BAD_FRAME under the
    request's id, so its client gets the error. Seen: under id 0, which no client waits
    for (the caller waited out its timeout and reported the daemon gone)."""
    hello(dm)
    h, _ = request(dm, b"A", MsgType.BLOCK_RELEASE, {}, {"blocks": np.zeros(1, np.uint64)}, req_id=77)
    assert_error(h, ErrorCode.BAD_FRAME, "uint64")
    assert (h["id"], h["t"]) == (77, int(MsgType.BLOCK_RELEASE))
