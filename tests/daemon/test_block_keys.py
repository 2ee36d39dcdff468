"""The indexer keys plane of the block store (DESIGN §9) through a serving daemon (cpu
backend, real sockets): engines in processes of their own (tests/block_engine.py) read the
keys another one committed, across a kill and a restart; the plane's place in the range
and its accounting; then every refusal (another session's blocks, a cached block's keys,
wrong sizes, the limits at ATTACH and per request) and the zeroing, from clients in the
test's process; and the in-process engine's store."""

import dataclasses
import json
import threading

import numpy as np
import pytest

import cli_inproc
import helpers
from block_engine import BS, INDEX_BYTES, KEYS, LAY, Engine, attach_keys, keys_of, tokens
from sparsekv.client import BadRequest, Client, LayoutMismatch, PoolFull, QuotaExceeded
from sparsekv.daemon import engine_blocks as daemon_engine_blocks
from sparsekv.daemon.engine import EngineSpace
from sparsekv.embedded.inproc import InprocClient
from sparsekv.proto import LIMITS, ErrorCode, Limits, MsgType
from sparsekv.proto.blocks import KEYS_ALIGN_BYTES, MAX_INDEX_BYTES, KeysPlane



@pytest.fixture
def daemon():
    with helpers.serving_daemon(4 << 20) as d:
        yield d


def test_a_restarted_engine_reads_the_keys_another_engine_committed(daemon):
    prompt = tokens(7, 5)
    a = Engine(daemon.run_dir, index_bytes=INDEX_BYTES)
    table = a("prefill", tokens=prompt)["table"]
    assert a("verify", tokens=prompt, table=table) == {"bad": 0, "bad_keys": 0}
    a.kill()  # pins and all
    helpers.wait_for(lambda: not daemon.engines.space("m").ranks, what="the killed engine's rank released")
    b, c = Engine(daemon.run_dir, index_bytes=INDEX_BYTES), Engine(daemon.run_dir, index_bytes=INDEX_BYTES)
    try:
        longer = prompt + tokens(8, 1)
        for e, hit in ((b, 5), (c, 6)):  # a restarted engine, then a second one beside it (b's block too)
            got = e("prefill", tokens=longer)
            assert got["hit"] == hit and got["table"][:5] == table
            assert e("verify", tokens=longer, table=got["table"]) == {"bad": 0, "bad_keys": 0}
        stats = helpers.stats_json(daemon.run_dir)
        block_bytes = LAY.num_layers * BS * INDEX_BYTES
        assert stats["block_keys_bytes_written"] == (5 + 1) * block_bytes  # a's blocks, then b's own
        assert stats["block_keys_bytes_read"] == (5 + 6 + 6) * block_bytes
    finally:
        b.close()
        c.close()


def test_the_plane_lies_after_the_rows_block_major_and_goes_with_the_range(daemon):
    with Client(daemon.run_dir) as c:
        blocks = attach_keys(c)
        space = daemon.engines.space("m")
        plane = KeysPlane.of(LAY, BS, INDEX_BYTES)
        assert plane.offset == -(-LAY.pool_bytes // KEYS_ALIGN_BYTES) * KEYS_ALIGN_BYTES
        assert space.keys.shape == (16, *KEYS) and space.range_bytes == plane.offset + 16 * plane.block_bytes
        pool = daemon.pool.array
        base = space.pool_offset + plane.offset
        [b] = blocks.alloc(1)
        blocks.write_keys([b], keys_of(1, 1))
        chunk = pool[base + b * plane.block_bytes: base + (b + 1) * plane.block_bytes]  # one block: one chunk
        assert (chunk == keys_of(1, 1).reshape(-1)).all()
        assert helpers.stats_json(daemon.run_dir)["per_engine"]["m"]["pool_bytes"] == space.range_bytes
    helpers.wait_for(lambda: "m" not in daemon.engines, what="the engine released")
    assert daemon.pool.used_bytes == 0


@pytest.mark.parametrize("heavy_bytes", [0, 1 << 30], ids=["on_a_worker_thread", "on_the_loop"])
def test_keys_round_trip_whether_copied_on_a_worker_or_on_the_loop(daemon, heavy_bytes, monkeypatch):
    daemon.block_requests.heavy_bytes = heavy_bytes
    threads = []
    for name in ("copy_keys_in", "copy_keys_out"):
        copy = getattr(EngineSpace, name)
        monkeypatch.setattr(EngineSpace, name, lambda self, *a, copy=copy: (threads.append(threading.current_thread()),
                                                                             copy(self, *a))[1])
    with Client(daemon.run_dir) as c, Client(daemon.run_dir) as other:
        blocks = attach_keys(c)
        attach_keys(other)
        mine = blocks.alloc(3)
        assert blocks.write_keys(mine, keys_of(11, 3)) == 3 * np.prod(KEYS)
        with pytest.raises(BadRequest, match="not private"):  # refused before any copy
            other.blocks.write_keys(mine, keys_of(12, 3))
        assert (blocks.read_keys(mine[::-1]) == keys_of(11, 3)[::-1]).all()
        assert other.blocks.alloc(1).size == 1  # the engine's requests go on after the copies
    assert len(threads) == 2 and all((t is daemon.thread) == bool(heavy_bytes) for t in threads)


def test_keys_are_written_only_into_the_writers_private_blocks(daemon):
    with Client(daemon.run_dir) as a, Client(daemon.run_dir) as b:
        ka, kb = attach_keys(a), attach_keys(b)
        mine = ka.alloc(2)
        with pytest.raises(BadRequest, match="not private to this session"):
            kb.write_keys(mine[:1], keys_of(1, 1))  # another client's block
        with pytest.raises(BadRequest, match="neither pinned by nor private"):
            kb.read_keys(mine[:1])
        with pytest.raises(BadRequest, match="not private to this session"):
            ka.write_keys([mine[0], 15], keys_of(2, 2))  # one of them is nobody's: all or nothing
        assert not ka.read_keys(mine[:1]).any()
        with pytest.raises(BadRequest, match="distinct"):
            ka.write_keys([mine[0], mine[0]], keys_of(2, 2))
        assert ka.write_keys(mine, keys_of(3, 2)) == 2 * np.prod(KEYS)
        keys = ka.hashes(tokens(9, 2))
        ka.commit(mine, keys)
        with pytest.raises(BadRequest, match="a cached block's keys are read-only"):
            ka.write_keys(mine[:1], keys_of(4, 1))
        with pytest.raises(BadRequest, match="neither pinned by nor private"):
            kb.read_keys(mine)  # cached, not pinned by b
        assert (kb.lookup(keys) == mine).all()
        assert (kb.read_keys(mine) == keys_of(3, 2)).all()


def test_keys_of_the_wrong_size_or_type_are_refused_before_anything_is_written(daemon):
    with Client(daemon.run_dir) as c:
        blocks = attach_keys(c)
        mine = blocks.alloc(2)
        for bad in (keys_of(1, 1), keys_of(1, 2)[:, :, :, :-1], np.zeros((2, BS, INDEX_BYTES * LAY.num_layers), np.uint8)):
            with pytest.raises(BadRequest, match="keys must be uint8"):
                blocks.write_keys(mine, bad)
        with pytest.raises(BadRequest, match="keys must be uint8"):  # the daemon's check, past the client's
            c._call(MsgType.BLOCK_WRITE_KEYS, arrays={"blocks": mine, "keys": keys_of(1, 2).view(np.float32)})
        with pytest.raises(BadRequest, match="keys must be uint8"):
            blocks.write_keys(mine, keys_of(1, 2).view(np.float32))  # the client's
        with pytest.raises(BadRequest, match="needs the keys array"):
            c._call(MsgType.BLOCK_WRITE_KEYS, arrays={"blocks": mine})
        assert not blocks.read_keys(mine).any()
        assert helpers.stats_json(daemon.run_dir)["block_keys_bytes_written"] == 0


def test_keys_requests_over_the_byte_limit_are_too_large_and_reads_are_split(daemon, monkeypatch):
    with Client(daemon.run_dir) as c:
        blocks = attach_keys(c)
        mine = blocks.alloc(5)
        block_bytes = int(np.prod(KEYS))
        blocks.write_keys(mine, keys_of(5, 5))
        monkeypatch.setattr(daemon_engine_blocks, "LIMITS", Limits(max_keys_bytes=2 * block_bytes))
        with pytest.raises(BadRequest, match="at most 2 blocks") as e:
            c._call(MsgType.BLOCK_READ_KEYS, arrays={"blocks": mine[:3]})
        assert e.value.code == ErrorCode.TOO_LARGE
        with pytest.raises(BadRequest, match="at most 2 blocks"):
            c._call(MsgType.BLOCK_WRITE_KEYS, arrays={"blocks": mine[:3], "keys": keys_of(6, 3)})
        monkeypatch.setattr("sparsekv.client.blocks.LIMITS", Limits(max_keys_bytes=2 * block_bytes))
        requests = helpers.stats_json(daemon.run_dir)["requests"]
        assert (blocks.read_keys(mine) == keys_of(5, 5)).all()  # in 3 requests of at most 2 blocks
        assert helpers.stats_json(daemon.run_dir)["requests"] - requests == 3
        with pytest.raises(BadRequest, match="at most 2 blocks a call") as e:
            blocks.write_keys(mine[:3], keys_of(6, 3))
        assert e.value.code == ErrorCode.TOO_LARGE
    assert LIMITS.max_keys_bytes == 32 << 20


def test_keys_are_zeroed_when_their_block_is_freed_or_evicted(daemon):
    with Client(daemon.run_dir) as c:
        blocks = attach_keys(c)
        mine = blocks.alloc(16)  # the whole store
        blocks.write_keys(mine, keys_of(7, 16))
        keys = blocks.hashes(tokens(10, 1))
        blocks.commit(mine[:1], keys)
        blocks.release(mine)  # 15 freed, one cached and evictable
        plane = daemon.engines.space("m").keys
        assert not plane[mine[1:]].any() and (plane[mine[0]] == keys_of(7, 16)[0]).all()
        got = blocks.alloc(16)  # evicts it
        assert not blocks.read_keys(got).any() and blocks.lookup(keys).size == 0


def test_attach_checks_the_keys_plane_before_allocating(daemon):
    with Client(daemon.run_dir) as c:
        with pytest.raises(BadRequest, match="index_bytes needs a block_size"):
            c.attach(LAY, engine="m", index_bytes=INDEX_BYTES)
        for bad in (-1, MAX_INDEX_BYTES + 1, 1.5):
            with pytest.raises(BadRequest, match="index_bytes must be an integer"):
                c._call(MsgType.ATTACH, {"engine": "m", "layout": LAY.to_wire(),
                                         "blocks": {"block_size": BS, "index_bytes": bad}})
        big = dataclasses.replace(LAY, host_rows=64 * 1024)
        with pytest.raises(BadRequest, match="one block's indexer keys .* exceed"):
            c.attach(big, engine="m", block_size=1024, index_bytes=MAX_INDEX_BYTES)
        with pytest.raises(PoolFull, match="exceeds the whole pool of 4MiB"):  # 8 MiB of keys, a 4 MiB pool
            c.attach(LAY, engine="m", block_size=BS, index_bytes=MAX_INDEX_BYTES)
        assert "m" not in daemon.engines and daemon.pool.used_bytes == 0
        attach_keys(c, engine="m")
        with Client(daemon.run_dir) as other:
            with pytest.raises(LayoutMismatch, match="indexer keys of 12 bytes"):
                other.attach(LAY, engine="m", block_size=BS, index_bytes=16)
            with pytest.raises(LayoutMismatch, match="asked for none"):
                other.attach(LAY, engine="m", block_size=BS)
        with Client(daemon.run_dir) as plain:
            plain.attach(LAY, engine="plain", block_size=BS)
            with pytest.raises(BadRequest, match="attached without index_bytes"):
                plain.blocks.read_keys([0])
            with pytest.raises(BadRequest, match="has no indexer keys plane"):
                plain._call(MsgType.BLOCK_READ_KEYS, arrays={"blocks": np.zeros(1, np.int32)})


def test_the_keys_plane_counts_against_the_uid_pool_quota():
    plane = KeysPlane.of(LAY, BS, 16 << 10)
    quota = 2 << 20  # one 2 MiB range: the rows fit, rows + 16 KiB of keys a position do not
    assert LAY.pool_bytes <= quota < plane.end
    with helpers.serving_daemon(8 << 20, max_pool_bytes_per_uid=quota) as d, Client(d.run_dir) as c:
        with pytest.raises(QuotaExceeded, match="max_pool_bytes_per_uid"):
            c.attach(LAY, engine="m", block_size=BS, index_bytes=16 << 10)
        assert d.pool.used_bytes == 0
        attach_keys(c, engine="m", index_bytes=16)


def test_the_keys_counters_in_the_metrics_and_the_plane_in_the_listing(daemon):
    with Client(daemon.run_dir) as c:
        blocks = attach_keys(c)
        mine = blocks.alloc(2)
        blocks.write_keys(mine, keys_of(1, 2))
        blocks.read_keys(mine[:1])
        text = helpers.stats_query(daemon.run_dir, "prometheus")
        r = cli_inproc.run("blocks", "--json", "--run-dir", daemon.run_dir)
    assert r.returncode == 0, r.stderr
    assert [(e["block_size"], e["index_bytes"]) for e in json.loads(r.stdout)] == [(BS, INDEX_BYTES)]
    n = int(np.prod(KEYS))
    assert f"sparsekv_block_keys_bytes_written_total {2 * n}.0" in text
    assert f"sparsekv_block_keys_bytes_read_total {n}.0" in text


def test_the_in_process_store_has_the_same_keys_plane():
    with InprocClient() as c:
        blocks = attach_keys(c)
        mine = blocks.alloc(2)
        blocks.write_keys(mine, keys_of(1, 2))
        blocks.commit(mine, blocks.hashes(tokens(1, 2)))
        with pytest.raises(BadRequest, match="a cached block's keys are read-only"):
            blocks.write_keys(mine[:1], keys_of(2, 1))
        blocks.release(mine)
        hit = blocks.lookup(blocks.hashes(tokens(1, 2)))
        assert (blocks.read_keys(hit) == keys_of(1, 2)).all()
        with pytest.raises(BadRequest, match="neither pinned"):
            blocks.read_keys([5])
