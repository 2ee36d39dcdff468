"""The block store through a serving daemon (cpu backend, real sockets; one test on the
cuda backend, marked ``cuda``), with engines in
processes of their own (tests/block_engine.py) where processes matter: two engines of one
uid share blocks and read them in place through their block tables; an engine killed and
started again finds its blocks; another uid cannot attach the namespace. Then eviction
order, zeroing, read-only cached blocks and admission (reserve, POOL_EXHAUSTED, the
per-uid quota) from a client in the test's process."""

import ctypes
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import cli_inproc
import helpers
from block_engine import BS, INDEX_BYTES, LAY, Engine, tokens
from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.client import BadRequest, Client, LayoutMismatch, NotAttached, PoolExhausted, QuotaExceeded
from sparsekv.proto import LIMITS, ErrorCode, MsgType

@pytest.fixture
def daemon():
    with helpers.serving_daemon(4 << 20) as d:
        yield d


def test_two_engines_of_one_uid_share_blocks_and_read_them_in_place(daemon):
    a, b = Engine(daemon.run_dir), Engine(daemon.run_dir)
    try:
        prompt = tokens(1, 6)
        first = a("prefill", tokens=prompt)
        assert first["hit"] == 0 and len(first["table"]) == 6
        written = helpers.stats_json(daemon.run_dir)["rows_written"]
        second = b("prefill", tokens=prompt + tokens(2, 2))  # the shared prompt, then its own
        assert second["hit"] == 6 and second["table"][:6] == first["table"]
        assert b("verify", tokens=prompt + tokens(2, 2), table=second["table"]) == {"bad": 0}
        stats = helpers.stats_json(daemon.run_dir)
        assert stats["rows_written"] - written == 2 * BS * LAY.num_layers  # only b's own two blocks
        assert stats["block_hits"] == 6 and stats["block_hit_tokens"] == 6 * BS
    finally:
        a.close()
        b.close()


def test_an_engine_killed_and_started_again_finds_its_blocks(daemon):
    prompt = tokens(3, 8)
    a = Engine(daemon.run_dir)
    table = a("prefill", tokens=prompt)["table"]
    a.kill()  # pins and all: released when the daemon sees the process gone
    helpers.wait_for(lambda: not daemon.engines.space("m").ranks, what="the killed engine's rank released")
    assert "m" in daemon.engines  # kept: it caches blocks
    again = Engine(daemon.run_dir)
    try:
        got = again("prefill", tokens=prompt)
        assert (got["hit"], got["table"]) == (8, table)
        assert again("verify", tokens=prompt, table=table) == {"bad": 0}
    finally:
        again.close()


def test_an_attach_refused_by_its_checks_releases_no_kept_engine(daemon):
    """A kept namespace (its engine gone, its blocks cached), then an attach of a new engine
    as large as the pool that its checks refuse (rank 5 of a TP group of 2): the namespace
    must stay. Seen (an adversarial review): kept engines were released to make room
    before the attach's own checks ran, so any uid's refused attach wiped them."""
    prompt = tokens(3, 4)
    a = Engine(daemon.run_dir)
    table = a("prefill", tokens=prompt)["table"]
    a.close()
    helpers.wait_for(lambda: not daemon.engines.space("m").ranks, what="the engine's rank released")
    big = type(LAY)(**{**LAY.__dict__, "host_rows": (4 << 20) // (LAY.num_layers * LAY.row_bytes)}).validate()  # the pool
    with Client(daemon.run_dir, rank=5) as c:
        with pytest.raises(BadRequest, match="not a rank of a TP group of 2"):
            c.attach(big, engine="big", tp_size=2)
    assert "m" in daemon.engines and "big" not in daemon.engines
    again = Engine(daemon.run_dir)
    try:
        assert again("prefill", tokens=prompt)["table"] == table  # every block found again
    finally:
        again.close()


def test_an_engine_without_cached_blocks_gives_its_range_back(daemon):
    a = Engine(daemon.run_dir)
    a("alloc", n=3)
    a.close()
    helpers.wait_for(lambda: "m" not in daemon.engines, what="the engine released")
    assert daemon.pool.used_bytes == 0


@pytest.mark.skipif(helpers.why_not_other_users() is not None, reason=str(helpers.why_not_other_users()))
def test_another_uid_cannot_attach_the_namespace(daemon):
    helpers.open_to_other_users(daemon.run_dir)
    a = Engine(daemon.run_dir)
    try:
        a("prefill", tokens=tokens(4, 2))
        other = Engine(daemon.run_dir, as_user=helpers.as_user(4321))
        assert other.hello["err"] == "PERMISSION_DENIED"
        other.close()
    finally:
        a.close()


def commit(c: Client, seed: int, n: int):
    keys = c.blocks.hashes(tokens(seed, n))
    blocks = c.blocks.alloc(n)
    c.write(c.blocks.rows(blocks), np.full((LAY.num_layers, n * BS, LAY.row_bytes), seed, np.uint8))
    assert (c.blocks.commit(blocks, keys) == blocks).all()
    return keys, blocks


def test_eviction_is_lru_of_unpinned_blocks_zeroed_and_cached_blocks_are_read_only(daemon):
    with Client(daemon.run_dir) as c:
        c.attach(LAY, engine="m", block_size=BS)
        prompts = [commit(c, seed, 4) for seed in (10, 11, 12, 13)]  # every block cached, pinned
        for i in (2, 0, 3):
            c.blocks.release(prompts[i][1])
        with pytest.raises(PoolExhausted):
            c.blocks.alloc(13)  # prompt 1 is pinned: never evicted
        got = c.blocks.alloc(8)
        assert got.tolist() == [*prompts[2][1], *prompts[0][1]]  # least recently unpinned first
        pool = daemon.engines.space("m").pool
        assert not pool[:, c.blocks.rows(got)].any()  # zeroed before reuse
        assert c.blocks.lookup(prompts[2][0]).size == 0
        assert c.blocks.lookup(prompts[3][0]).tolist() == prompts[3][1].tolist()
        with pytest.raises(BadRequest, match="not in a block this client allocated"):
            c.write(c.blocks.rows(prompts[1][1][:1]), np.zeros((LAY.num_layers, BS, LAY.row_bytes), np.uint8))
        assert (pool[:, c.blocks.rows(prompts[1][1])] == 11).all()
        assert helpers.stats_json(daemon.run_dir)["block_evictions"] == 8


def test_block_ids_of_another_shape_are_refused_before_anything_is_sent(daemon):
    """Found by an adversarial review: release([[b]]) was flattened and released b."""
    with Client(daemon.run_dir) as c:
        c.attach(LAY, engine="shapes", block_size=BS)
        got = c.blocks.alloc(2)
        with pytest.raises(BadRequest, match=r"blocks must be block ids \[n\], got shape \[1, 2\]"):
            c.blocks.release(got.reshape(1, 2))
        c.blocks.release(got[0])  # one id: a block of its own
        c.blocks.release(got[1:])


def test_reserve_is_granted_or_pool_exhausted_with_the_figures(daemon):
    with Client(daemon.run_dir) as a, Client(daemon.run_dir) as b:
        a.attach(LAY, engine="m", block_size=BS)
        b.attach(LAY, engine="m", block_size=BS)
        keys, blocks = commit(a, 20, 10)
        a.blocks.release(blocks[:2])  # two evictable
        assert a.blocks.reserve(1)["reserved"] == 1
        got = b.blocks.reserve(6)
        assert (got["reserved"], got["reserved_total"], got["free"], got["evictable"]) == (6, 7, 6, 2)
        a.blocks.reserve(-1)
        assert b.blocks.reserve(1)["reserved"] == 7
        with pytest.raises(PoolExhausted) as e:
            a.blocks.reserve(2)
        assert (e.value.wanted, e.value.free, e.value.evictable, e.value.reserved) == (2, 6, 2, 7)
        assert a.blocks.lookup(keys[:2]).size == 1  # the second would take a promised block
        assert b.blocks.alloc(7).size == 7  # the promise holds
        assert b.blocks.reserve(0)["reserved"] == 0


def test_the_per_uid_block_quota():
    """max_blocks_per_uid counts a uid's private, reserved and pinned blocks: blocks a
    client committed and still pins count (allocating and committing again cannot pin more
    than the quota), another client of the uid looks up no further than the room left, and
    a release gives the room back."""
    with helpers.serving_daemon(4 << 20, max_blocks_per_uid=6) as d, Client(d.run_dir) as c, \
            Client(d.run_dir) as other:
        c.attach(LAY, engine="m", block_size=BS)
        other.attach(LAY, engine="m", block_size=BS)
        held = c.blocks.alloc(4)
        with pytest.raises(QuotaExceeded, match="max_blocks_per_uid 6"):
            c.blocks.reserve(3)
        assert c.blocks.reserve(2)["reserved"] == 2
        c.blocks.reserve(-2)
        c.blocks.release(held)
        keys, blocks = commit(c, 20, 3)
        commit(c, 21, 3)  # 6 blocks cached, each pinned by its committer
        with pytest.raises(QuotaExceeded, match="max_blocks_per_uid 6"):
            c.blocks.alloc(1)
        assert other.blocks.lookup(keys).size == 0
        c.blocks.release(blocks[1:])
        assert (other.blocks.lookup(keys) == blocks[:2]).all()  # room for two


def test_a_request_sharing_a_prefix_its_client_pins_is_admitted_up_to_the_quota():
    """The admission the docs give (look the prompt up, then reserve and allocate what it
    missed; tests/block_engine.py's "request"): under max_blocks_per_uid 10, a second
    request sharing the 6 blocks the first still pins is admitted with 2 blocks of its own
    (8 held), a third that would need 3 more is refused, and the hits it pinned are given
    back (a fourth needing 2 fits). Reserving before the lookup counted the shared prefix
    twice (6 pinned + 8 reserved) and refused the second."""
    with helpers.serving_daemon(4 << 20, max_blocks_per_uid=10) as d:
        a = Engine(d.run_dir)
        try:
            assert a("request", tokens=tokens(3, 6), release=False)["hit"] == 0
            got = a("request", tokens=tokens(3, 6) + tokens(4, 2), release=False)
            assert got.get("hit") == 6 and got.get("bad") == 0, got
            got = a("request", tokens=tokens(3, 6) + tokens(5, 3), release=False)
            assert got.get("err") == "QUOTA_EXCEEDED", got
            got = a("request", tokens=tokens(3, 6) + tokens(6, 2), release=False)
            assert got.get("hit") == 6 and got.get("bad") == 0, got
        finally:
            a.close()


def test_block_requests_need_a_store_and_valid_arguments(daemon):
    with Client(daemon.run_dir) as c:
        c.attach(LAY, engine="plain")
        with pytest.raises(NotAttached, match="its engine has no block store"):
            c.blocks.alloc(1)  # (a typed error, not None: found by an adversarial review)
        with Client(daemon.run_dir) as other:
            with pytest.raises(LayoutMismatch, match="no block store"):
                other.attach(LAY, engine="plain", block_size=BS)
    with Client(daemon.run_dir) as c:
        c.attach(LAY, engine="m", block_size=BS)
        with pytest.raises(BadRequest, match="blocks must lie in"):
            c.blocks.release([99])
        with pytest.raises(BadRequest, match="hashes must be int64"):
            c.blocks.lookup(np.zeros((2, 3), np.int64))


def test_a_chain_looked_up_again_is_sent_as_its_token_and_another_clients_token_is_refused(daemon):
    """A client's second lookup of a chain (and of the chain with more hashes after it)
    sends the token the first reply gave and only the hashes that follow: the same blocks,
    pinned as often, counted as lookups. Another client naming that token is answered
    ``resend`` with nothing pinned; a token that is not an int, BAD_ARGUMENT; a chain and
    the hashes after it over max_blocks, TOO_LARGE."""
    with Client(daemon.run_dir) as c, Client(daemon.run_dir) as other:
        c.attach(LAY, engine="m", block_size=BS)
        other.attach(LAY, engine="m", block_size=BS)
        keys, blocks = commit(c, 30, 6)
        sent = []
        call = c.blocks._call

        def spy(kind, fields=None, arrays=None):
            if kind == MsgType.BLOCK_LOOKUP:
                sent.append(((fields or {}).get("chain"), arrays["hashes"].shape[0] if arrays else None))
            return call(kind, fields, arrays)

        c.blocks._call = spy
        first = c.blocks.lookup(keys)
        again = c.blocks.lookup(keys)
        token = sent[1][0]
        assert sent == [(None, 6), (token, None)] and token is not None  # the token alone
        assert first.tolist() == again.tolist() == blocks.tolist()
        store = daemon.engines.space("m").blocks
        assert store.pins[blocks].tolist() == [3] * 6  # the commit's pin and two lookups
        fields, arrays = c._call(MsgType.BLOCK_LOOKUP, {"chain": token})  # the token alone: one frame each way
        assert fields == {"chain": token, "head": 6} and not arrays
        c.blocks.release(blocks)
        more, more_blocks = commit(c, 31, 2)
        both = c.blocks.lookup(np.concatenate([keys, more]))
        assert sent[2] == (token, 2) and both.tolist() == blocks.tolist() + more_blocks.tolist()
        stats = helpers.stats_json(daemon.run_dir)
        assert stats["block_lookups"] == 4 and stats["block_hits"] == 6 + 6 + 6 + 8
        assert stats["block_chain_lookups"] == 3 and stats["block_chain_resends"] == 0
        fields, arrays = other._call(MsgType.BLOCK_LOOKUP, {"chain": token}, {"hashes": np.zeros((0, 2), np.int64)})
        assert fields == {"resend": True} and not arrays
        assert helpers.stats_json(daemon.run_dir)["block_chain_resends"] == 1
        assert store.pins[blocks].tolist() == [4] * 6
        with pytest.raises(BadRequest, match="chain must be a token"):
            c._call(MsgType.BLOCK_LOOKUP, {"chain": "1"}, {"hashes": np.zeros((0, 2), np.int64)})
        with pytest.raises(BadRequest, match="exceeds 65536 blocks a request") as e:
            c._call(MsgType.BLOCK_LOOKUP, {"chain": token}, {"hashes": np.zeros((LIMITS.max_blocks, 2), np.int64)})
        assert e.value.code == ErrorCode.TOO_LARGE


def test_sparsekv_blocks_lists_the_stores_by_engine(daemon):
    with Client(daemon.run_dir) as c:
        c.attach(LAY, engine="m", block_size=BS)
        commit(c, 30, 3)
        c.blocks.alloc(2)
        c.blocks.reserve(4)
        r = cli_inproc.run("blocks", "--json", "--run-dir", daemon.run_dir)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [{"engine": "m", "owner_uid": os.getuid(), "block_size": BS, "index_bytes": 0, "ranks": 1,
                                     "blocks": 16, "free": 11, "cached": 3, "referenced": 3, "evictable": 0,
                                     "private": 2, "reserved_total": 4}]


def test_block_counters_and_gauges_in_the_metrics(daemon):
    with Client(daemon.run_dir) as c:
        c.attach(LAY, engine="m", block_size=BS)
        keys, blocks = commit(c, 40, 2)
        c.blocks.release(blocks)
        c.blocks.lookup(keys)
        text = helpers.stats_query(daemon.run_dir, "prometheus")
        table = helpers.stats_query(daemon.run_dir, "stats")
    assert 'sparsekv_engine_blocks{engine="m",state="cached"} 2.0' in text
    assert 'sparsekv_engine_blocks{engine="m",state="referenced"} 2.0' in text
    assert "sparsekv_block_commits_total 2.0" in text and "sparsekv_block_hits_total 2.0" in text
    assert "2 cached (2 referenced), 14 free, 0 private, 0 reserved of 16" in table


def test_a_namespace_kept_with_no_engine_yields_its_range_to_a_new_engine(daemon):
    with Client(daemon.run_dir) as c:
        c.attach(LAY, engine="m", block_size=BS)
        commit(c, 50, 2)
    assert "m" in daemon.engines  # kept for its blocks: the pool (4 MiB) has room for one more range
    with Client(daemon.run_dir) as x, Client(daemon.run_dir) as y:
        x.attach(LAY, engine="x")
        y.attach(LAY, engine="y")  # no room but the kept namespace's
        assert "m" not in daemon.engines
    with Client(daemon.run_dir) as c:
        c.attach(LAY, engine="m", block_size=BS)
        assert c.blocks.lookup(c.blocks.hashes(tokens(50, 2))).size == 0  # a new, empty store


@pytest.mark.cuda
def test_engines_on_the_gpu_share_blocks_and_a_restarted_one_finds_them():
    """The cuda backend: ranks on cuda:0, the daemon's slabs in its device arena; zeroing
    and the hot copies dropped go through the cuda ranks; the indexer keys plane (host
    memory, the same code as on cpu) read back by the restarted engine."""
    with PrivateDaemon(pool_bytes=8 << 20, backend="cuda", extra_args=["--device-arena-size", "2GiB"]) as d:
        a = Engine(d.run_dir, device="cuda:0", index_bytes=INDEX_BYTES)
        prompt = tokens(5, 6)
        first = a("prefill", tokens=prompt)
        assert a("verify", tokens=prompt, table=first["table"]) == {"bad": 0, "bad_keys": 0}
        a.kill()
        b = Engine(d.run_dir, device="cuda:0", index_bytes=INDEX_BYTES)
        try:
            longer = prompt + tokens(6, 2)
            got = b("prefill", tokens=longer)
            assert got["hit"] == 6 and got["table"][:6] == first["table"]
            assert b("verify", tokens=longer, table=got["table"]) == {"bad": 0, "bad_keys": 0}
            b("release", blocks=got["table"])
            # Every block, once the killed engine's pins are gone: the cached ones evicted, zeroed.
            got = helpers.wait_for(lambda: (r := b("alloc", n=16)).get("blocks") and r, what="the killed rank reaped")
            assert sorted(got["blocks"]) == list(range(16))
        finally:
            b.close()


BLOCKS_QUERY = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(5)
s.connect(sys.argv[1] + "/stats.sock")
s.sendall(sys.argv[2].encode() + b"\n")
out = b""
while b := s.recv(65536):
    out += b
sys.stdout.write(out.decode())
"""


@pytest.mark.skipif(helpers.why_not_other_users() is not None, reason=str(helpers.why_not_other_users()))
def test_the_blocks_listing_shows_another_uids_stores_to_root_only(daemon):
    with Client(daemon.run_dir) as c:
        c.attach(LAY, engine="m", block_size=BS)
        helpers.open_to_other_users(daemon.run_dir, "stats.sock")

        def seen(uid=None):
            r = subprocess.run([*helpers.as_user(uid), sys.executable, "-c", BLOCKS_QUERY, daemon.run_dir, "blocks"],
                               capture_output=True, text=True, timeout=30, cwd="/tmp")
            assert r.returncode == 0, r.stderr
            return [line.split("\t")[0] for line in r.stdout.splitlines()[1:]]

        assert seen() == ["m"]  # root
        assert seen(4321) == []  # not its own


STATS_QUERY = r"""
import json, socket, sys
from sparsekv.client import Client


def ask(command: bytes) -> str:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(sys.argv[1] + "/stats.sock")
    s.sendall(command + b"\n")
    out = b""
    while b := s.recv(65536):
        out += b
    return out.decode()


with Client(sys.argv[1], name="nosy", timeout_s=5) as c:
    control = c.stats()
labelled = sorted({line.split('engine="')[1].split('"')[0] for line in ask(b"prometheus").splitlines()
                   if 'engine="' in line})
print(json.dumps([sorted(json.loads(ask(b"json"))["per_engine"]), sorted(control["per_engine"]), labelled]))
"""


@pytest.mark.skipif(helpers.why_not_other_users() is not None, reason=str(helpers.why_not_other_users()))
def test_the_stats_snapshot_shows_another_uids_engines_to_root_only(daemon):
    """``json`` and ``prometheus`` on the stats socket and STATS on the control socket name
    another uid's engine (and its block gauges) to root only. Seen (an adversarial review):
    every uid got every engine's name, ranks, sizes and block gauges, which ``blocks`` hid."""
    with Client(daemon.run_dir) as c:
        c.attach(LAY, engine="m", block_size=BS)
        helpers.open_to_other_users(daemon.run_dir, "stats.sock", "control.sock")

        def seen(uid=None):
            r = subprocess.run([*helpers.as_user(uid), sys.executable, "-c", STATS_QUERY, daemon.run_dir],
                               capture_output=True, text=True, timeout=30, cwd="/tmp")
            assert r.returncode == 0, r.stderr
            return json.loads(r.stdout.splitlines()[-1])

        assert seen() == [["m"], ["m"], ["m"]]  # root
        assert seen(4321) == [[], [], []]  # seen: [["m"], ["m"], ["m"]]


def test_what_the_caller_writes_into_a_lookups_array_never_changes_a_later_answer(daemon):
    """The client keeps the blocks of a chain a reply named for its next lookups: its own
    copy, so that a caller writing the array it got (a torch tensor over it, here ctypes)
    changes nothing the client answers later."""
    with Client(daemon.run_dir) as c:
        c.attach(LAY, engine="m", block_size=BS)
        keys, blocks = commit(c, 50, 4)
        first = c.blocks.lookup(keys)
        ctypes.memset(first.ctypes.data, 0x7F, first.nbytes)
        assert c.blocks.lookup(keys).tolist() == blocks.tolist()
