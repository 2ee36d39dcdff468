"""The indexer keys plane (DESIGN §9) under a hostile or dying engine, through a serving
daemon (cpu backend, real sockets): an engine process killed while its keys are copied on
a worker thread leaves nothing of them for the next holder of its blocks, and the
engine's other rank waits and goes on; a session dropped during another's keys read is
zeroed at once and the read stays whole; random requests of two engines' sessions (ids
out of range, negative, named twice, others' and cached blocks, whole detaches) against
the reference model, every keys byte read checked and the other engine's keys untouched;
connections not reading their keys replies (xfail: they get another engine's connection
closed); a read of more blocks than a request holds is split; the in-process engine
refuses what the daemon refuses at attach; the planes of odd layouts start on a page and
share no byte with rows or other engines."""

import dataclasses
import os
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import helpers
import zmtp_peer
from block_engine import BS, INDEX_BYTES, KEYS, LAY, Engine, tokens
from helpers import request
from sparsekv.client import BadRequest, Client
from sparsekv.daemon.blocks.contract import BlockError, BlockStoreModel, UidLedger
from sparsekv.daemon.engine import EngineSpace
from sparsekv.embedded.inproc import InprocClient
from sparsekv.proto import LIMITS, ErrorCode, MsgType, encode

N_BLOCKS = LAY.host_rows // BS


def test_an_engine_killed_while_its_keys_are_copied_leaves_zeros_and_the_other_rank_goes_on(monkeypatch):
    entered, gate = threading.Event(), threading.Event()
    copy = EngineSpace.copy_keys_in

    def held_copy(self, ids, keys):  # the worker thread's copy, held until the engine is dead
        entered.set()
        assert gate.wait(20)
        return copy(self, ids, keys)

    monkeypatch.setattr(EngineSpace, "copy_keys_in", held_copy)
    with helpers.serving_daemon(4 << 20) as daemon, Client(daemon.run_dir) as keeper:
        daemon.block_requests.heavy_bytes = 0  # every keys copy on a worker thread
        keeper.attach(LAY, engine="m", block_size=BS, index_bytes=INDEX_BYTES)  # keeps the engine alive
        victim = Engine(daemon.run_dir, index_bytes=INDEX_BYTES)
        cid = victim.hello["client_id"]
        victim.p.stdin.write('{"op": "prefill", "tokens": %s}\n' % tokens(3, N_BLOCKS - 1))
        victim.p.stdin.flush()
        assert entered.wait(20), "the keys copy never started"
        victim.kill()
        helpers.wait_for(lambda: all(s.client_id != cid for s in list(daemon.sessions.values())),
                         what="the killed engine's session reaped")
        got = {}
        t = threading.Thread(target=lambda: got.update(blocks=keeper.blocks.alloc(N_BLOCKS)))
        t.start()  # waits for the engine, held by the copy
        t.join(0.3)
        assert t.is_alive() and not got, "a request of the engine ran while its keys were being copied"
        gate.set()
        t.join(20)
        assert sorted(got["blocks"].tolist()) == list(range(N_BLOCKS))  # every block, the victim's included
        assert not keeper.blocks.read_keys(got["blocks"]).any(), "a block handed out again holds a dead engine's keys"
        assert not daemon.engines.space("m").pool.any()


# -- random requests of two engines' sessions against the model ---------------------------------
ENGINES = {b"A": "m", b"B": "m", b"C": "n"}  # two sessions of engine m, one of engine n
SESSION_OF = {b"A": 0, b"B": 1, b"C": 0}  # the model's session numbers, per engine


def pattern(stamp: int, n: int) -> np.ndarray:
    """Keys (uint8 [n, *KEYS]) whose every block is stamped: block i of a write holds
    bytes derived from ``stamp * 64 + i``, never all zeros."""
    out = np.empty((n, *KEYS), np.uint8)
    for i in range(n):
        out[i] = np.random.default_rng(stamp * 64 + i).integers(1, 256, KEYS, dtype=np.uint8)
    return out


def hello_attach(dm, ident: bytes) -> None:
    for kind, fields in ((MsgType.HELLO, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": ident.decode()}),
                         (MsgType.ATTACH, {"engine": ENGINES[ident], "layout": LAY.to_wire(),
                                           "blocks": {"block_size": BS, "index_bytes": INDEX_BYTES}})):
        h, _ = request(dm, ident, kind, fields)
        assert h["ok"], h


ids = st.integers(-3, N_BLOCKS + 2) | st.sampled_from([2**31 - 1, -(2**31)])
ops = st.tuples(st.sampled_from(sorted(ENGINES)),
                st.sampled_from(["alloc", "commit", "lookup", "release", "write_keys", "read_keys", "detach"]),
                st.lists(ids, max_size=4), st.integers(0, 4), st.booleans())


@given(st.lists(ops, min_size=1, max_size=40))
@settings(max_examples=helpers.examples(40, 1000), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_keys_requests_of_sessions_and_engines_agree_with_the_model(tmp_path_factory, steps):
    """Every keys read that succeeds returns exactly what the model says its blocks hold
    (never another request's bytes), every refusal is a typed BAD_ARGUMENT where the model
    refuses too, and engine n's keys are never touched by engine m's sessions."""
    with helpers.inproc_daemon(tmp_path_factory.mktemp("keys"), max_clients=4) as dm:
        models = {e: BlockStoreModel(N_BLOCKS, UidLedger(1 << 20)) for e in set(ENGINES.values())}
        for ident in ENGINES:
            hello_attach(dm, ident)
            models[ENGINES[ident]].open(SESSION_OF[ident], os.getuid())
        stamps = {e: [0] * N_BLOCKS for e in models}  # the stamp of what each block's keys hold (0: zeros)
        hashes = {}  # hash number -> int64 [2]
        for stamp, (ident, op, blocks, n, own) in enumerate(steps, start=1):
            engine, session = ENGINES[ident], SESSION_OF[ident]
            model = models[engine]
            if own:  # mostly blocks the session holds, so that requests get past the checks
                held = sorted(b for b, s in model.private.items() if s == session) + \
                    sorted(b for b, p in model.pins.items() if p.get(session))
                blocks = [held[i % len(held)] for i in blocks] if held else blocks
            arr = np.asarray(blocks, np.int32)
            if op == "alloc":
                want = _model(model.alloc, session, n)
                h, a = request(dm, ident, MsgType.BLOCK_ALLOC, {"n": n})
            elif op in ("commit", "lookup"):
                keys = [hashes.setdefault((engine, stamp % 5 + i), np.array([stamp % 5 + i, 7], np.int64))
                        for i in range(len(blocks) if op == "commit" else n)]
                kb = [k.tobytes() for k in keys]
                if op == "commit":
                    want = _model(model.commit, session, blocks, kb)
                    h, a = request(dm, ident, MsgType.BLOCK_COMMIT, {}, {"blocks": arr, "hashes": np.stack(keys) if keys
                                                                        else np.zeros((0, 2), np.int64)})
                else:
                    want = _model(model.lookup, session, kb)
                    h, a = request(dm, ident, MsgType.BLOCK_LOOKUP, {}, {"hashes": np.stack(keys) if keys else
                                                                          np.zeros((0, 2), np.int64)})
            elif op == "release":
                want = _model(model.release, session, blocks)
                h, a = request(dm, ident, MsgType.BLOCK_RELEASE, {}, {"blocks": arr})
            elif op == "write_keys":
                want = _model(model.write_keys, session, blocks, [stamp] * len(blocks))
                h, a = request(dm, ident, MsgType.BLOCK_WRITE_KEYS, {}, {"blocks": arr, "keys": pattern(stamp, arr.size)})
            elif op == "read_keys":
                want = _model(model.read_keys, session, blocks)
                h, a = request(dm, ident, MsgType.BLOCK_READ_KEYS, {}, {"blocks": arr})
            else:  # detach and attach again: everything the session held released
                model.close(session)
                model.open(session, os.getuid())
                h, _ = request(dm, ident, MsgType.DETACH)
                assert h["ok"], h
                hello_attach(dm, ident)
                want = h = None
            if want is not None:
                assert h["ok"] == (want[0] == "ok"), (op, blocks, want, h)
                if not h["ok"]:
                    assert h["code"] == ErrorCode[want[1]], (op, blocks, want, h)
            if h and h["ok"]:
                if op in ("alloc", "lookup"):
                    assert a["blocks"].tolist() == list(want[1]), (op, a, want)
                if op == "write_keys":
                    for i, b in enumerate(blocks):
                        stamps[engine][b] = stamp * 64 + i
                if op == "read_keys":
                    for b, got in zip(blocks, a["keys"]):
                        assert (got == _expected(stamps[engine][b])).all(), f"block {b} of engine {engine}: wrong keys"
            for b in range(N_BLOCKS):  # zeroed with its block: the model's free blocks hold zeros
                if b in model.free():
                    stamps[engine][b] = 0
            for e, space in ((e, dm.engines.space(e)) for e in models):
                for b in range(N_BLOCKS):
                    assert (space.keys[b] == _expected(stamps[e][b])).all(), f"engine {e} block {b}: keys not as the model"


def _model(fn, *args):
    try:
        return "ok", fn(*args)
    except BlockError as e:
        return "err", e.code


def _expected(stamp: int) -> np.ndarray:
    if not stamp:
        return np.zeros(KEYS, np.uint8)
    return np.random.default_rng(stamp).integers(1, 256, KEYS, dtype=np.uint8)


# -- the in-process engine ------------------------------------------------------------------
def test_the_in_process_engine_refuses_keys_a_request_cannot_carry_as_the_daemon_does():
    big = dataclasses.replace(LAY, host_rows=1024)  # one block of 1024 positions x 2 layers x 64 KiB: 128 MiB
    with InprocClient() as c:
        with pytest.raises(BadRequest, match="exceed") as e:
            c.attach(big, engine="m", block_size=1024, index_bytes=1 << 16)
        assert e.value.code == ErrorCode.BAD_ARGUMENT
    for bad in (1.5, True):
        with InprocClient() as c, pytest.raises(BadRequest, match="index_bytes must") as e:
            c.attach(LAY, engine="m", block_size=BS, index_bytes=bad)
    assert LIMITS.max_keys_bytes < 2 * 1024 * (1 << 16)


# -- replies a hostile engine does not read -------------------------------------------------
def test_an_engine_not_reading_its_keys_replies_does_not_get_others_disconnected():
    """Two connections queue ~124 MiB of keys replies they never read; a reading engine's
    6 MiB reply then passes the total: the heaviest non-reader is closed, not the reader."""
    with helpers.serving_daemon(16 << 20) as daemon, Client(daemon.run_dir, timeout_s=2) as good:
        good.attach(LAY, engine="m", block_size=BS, index_bytes=INDEX_BYTES)
        [b] = good.blocks.alloc(1)
        hostile = []
        for i in range(2):  # two connections of one hostile engine, each under MAX_OUT_BYTES (64 MiB)
            s = zmtp_peer.raw_peer(os.path.join(daemon.run_dir, "control.sock"), rcvbuf=4096)
            assert zmtp_peer.hello(s, f"h{i}")["ok"]
            zmtp_peer.send_message(s, *encode(MsgType.ATTACH, 2, {"engine": "h", "layout": LAY.to_wire(), "blocks": {
                "block_size": BS, "index_bytes": 1 << 16}}))
            assert zmtp_peer.read_reply(s)["ok"]
            zmtp_peer.send_message(s, *encode(MsgType.BLOCK_ALLOC, 3, {"n": 1}))  # block i; its reply left unread
            for req in (4, 5):  # 31 MiB of keys each (one block of 512 KiB, 62 times), never read
                zmtp_peer.send_message(s, *encode(MsgType.BLOCK_READ_KEYS, req, {}, {"blocks": np.full(62, i, np.int32)}))
            hostile.append(s)
        outboxes = daemon.control._outboxes
        helpers.wait_for(lambda: outboxes.total > 120 << 20, what="the hostile replies queued")
        good.blocks.write_keys([b], np.ones((1, *KEYS), np.uint8))
        big = np.full(LIMITS.max_blocks, b, np.int32)  # 6 MiB of keys
        assert (good.blocks.read_keys(big) == 1).all()  # the reply passes the total: a hostile connection goes
        assert outboxes.total < 100 << 20
        helpers.wait_for(lambda: daemon.control.counts["not_reading"] >= 1, what="a hostile connection closed")
        assert good.stats()["clients"] >= 1  # the reader is still attached and served
        for s in hostile:
            s.close()


def test_a_read_of_more_blocks_than_a_request_holds_is_split_too():
    with helpers.serving_daemon(4 << 20) as daemon, Client(daemon.run_dir) as c:
        c.attach(LAY, engine="m", block_size=BS, index_bytes=INDEX_BYTES)  # 96 bytes a block: the block count binds
        [b] = c.blocks.alloc(1)
        c.blocks.write_keys([b], np.full((1, *KEYS), 7, np.uint8))
        requests = helpers.stats_json(daemon.run_dir)["requests"]
        assert (c.blocks.read_keys(np.full(LIMITS.max_blocks + 1, b)) == 7).all()
        assert helpers.stats_json(daemon.run_dir)["requests"] - requests == 2  # of at most max_blocks each


def test_a_session_of_the_engine_dropped_during_a_keys_read_is_zeroed_and_the_read_is_whole(monkeypatch):
    entered, gate = threading.Event(), threading.Event()
    copy = EngineSpace.copy_keys_out

    def held_copy(self, ids):  # the worker thread's copy, held while another session goes
        entered.set()
        assert gate.wait(20)
        return copy(self, ids)

    monkeypatch.setattr(EngineSpace, "copy_keys_out", held_copy)
    with helpers.serving_daemon(4 << 20) as daemon, Client(daemon.run_dir) as reader, Client(daemon.run_dir) as victim:
        daemon.block_requests.heavy_bytes = 0  # every keys copy on a worker thread
        reader.attach(LAY, engine="m", block_size=BS, index_bytes=INDEX_BYTES)
        blocks = reader.blocks
        mine = blocks.alloc(2)
        blocks.write_keys(mine, pattern(5, 2))
        victim.attach(LAY, engine="m", block_size=BS, index_bytes=INDEX_BYTES)
        theirs = victim.blocks.alloc(3)
        victim.blocks.write_keys(theirs, pattern(6, 3))
        got = {}
        t = threading.Thread(target=lambda: got.update(keys=blocks.read_keys(np.repeat(mine, 4))))
        t.start()
        assert entered.wait(20)
        victim._drop_socket()  # gone without BYE: its session is dropped now, during the read
        helpers.wait_for(lambda: len(daemon.engines.space("m").ranks) == 1, what="the dropped session detached")
        keys = daemon.engines.space("m").keys
        assert not keys[theirs].any()  # its private blocks freed and zeroed at once
        gate.set()
        t.join(20)
        assert (got["keys"] == np.repeat(pattern(5, 2), 4, axis=0)).all()
        assert (blocks.alloc(3) == theirs).all() and not blocks.read_keys(theirs).any()


# -- where the plane lies -------------------------------------------------------------------
def test_planes_of_odd_layouts_are_page_aligned_and_overlap_no_rows_nor_other_engines(tmp_path):
    rng = np.random.default_rng(3)
    with helpers.inproc_daemon(tmp_path, max_clients=8, pool_bytes=64 << 20) as dm:
        spaces = []
        for e in range(6):  # odd row sizes, layer counts, host rows, block sizes and key bytes
            lay = helpers.layout(num_layers=int(rng.integers(1, 6)), row_bytes=16 * int(rng.integers(1, 9)), top_k=1,
                                 region_stride=1, max_reqs=1, host_rows=int(rng.integers(1, 300)))
            bs, ib = int(rng.integers(1, lay.host_rows + 1)), int(rng.integers(1, 300))
            ident = b"E%d" % e
            for kind, fields in ((MsgType.HELLO, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": "x"}),
                                 (MsgType.ATTACH, {"engine": f"e{e}", "layout": lay.to_wire(),
                                                   "blocks": {"block_size": bs, "index_bytes": ib}})):
                assert request(dm, ident, kind, fields)[0]["ok"]
            space = dm.engines.space(f"e{e}")
            assert space.keys.ctypes.data % 4096 == 0, (lay, bs, ib)
            assert space.keys.ctypes.data - space.pool.ctypes.data >= lay.pool_bytes
            assert space.keys.shape == (lay.host_rows // bs, lay.num_layers, bs, ib)
            spaces.append(space)
        for space in spaces:
            space.keys[:] = 0xFF
            space.pool[:] = 0xEE
        assert np.count_nonzero(dm.pool.array) == sum(s.keys.size + s.pool.size for s in spaces)  # nothing shared
        for space in spaces:
            space.keys[:] = 0
            space.pool[:] = 0


@pytest.mark.parametrize("msg_type", [MsgType.BLOCK_READ_KEYS, MsgType.BLOCK_WRITE_KEYS, MsgType.BLOCK_RELEASE,
                                      MsgType.BLOCK_COMMIT])
def test_a_scalar_blocks_array_is_a_bad_argument_not_an_internal_error(tmp_path, msg_type):
    """A 0-d ``blocks`` (wire shape ``[]``; the client library never sends one) reached
    len() in the keys requests: INTERNAL and a traceback each time. Refused for every
    block request that takes the array."""
    import msgpack

    from sparsekv.proto import PROTOCOL_VERSION

    with helpers.inproc_daemon(tmp_path, pool_bytes=16 << 20) as dm:
        assert request(dm, b"a", MsgType.HELLO, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": "t"},
                       peer=helpers.peer(os.getpid()))[0]["ok"]
        h = request(dm, b"a", MsgType.ATTACH, {"engine": "e", "layout": LAY.to_wire(),
                                               "blocks": {"block_size": BS, "index_bytes": INDEX_BYTES}})[0]
        assert h["ok"], h
        assert request(dm, b"a", MsgType.BLOCK_ALLOC, {"n": 1})[0]["ok"]
        arrays = [["blocks", "int32", []]]
        frames = [np.int32(0).tobytes()]
        if msg_type == MsgType.BLOCK_WRITE_KEYS:
            shape = [1, LAY.num_layers, BS, INDEX_BYTES]
            arrays.append(["keys", "uint8", shape])
            frames.append(bytes(int(np.prod(shape))))
        if msg_type == MsgType.BLOCK_COMMIT:
            arrays.append(["hashes", "uint8", [1, 16]])
            frames.append(bytes(16))
        head = msgpack.packb({"v": PROTOCOL_VERSION, "t": int(msg_type), "id": 7, "arrays": arrays}, use_bin_type=True)
        from sparsekv.proto.frames import decode

        reply, _ = decode([bytes(f) for f in dm.handle(b"a", [head, *frames])])
        assert reply["ok"] is False and reply["code"] == int(ErrorCode.BAD_ARGUMENT), reply
        assert "blocks must be an array" in reply["msg"], reply
        assert dm.snapshot()["errors_by_code"].get("INTERNAL", 0) == 0
