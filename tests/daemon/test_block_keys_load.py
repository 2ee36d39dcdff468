"""BLOCK_LOAD_KEYS (DESIGN §9): the daemon copies blocks' indexer keys straight into a
buffer of the engine. On the cpu backend (real sockets) the buffer is shared memory the
engine deposits: the bytes, the run-by-run copy, an engine restarted after a kill loading
the keys another committed, and every refusal, each before anything is copied. On the
cuda backend (marked ``cuda``) the buffer is a tensor on the engine's GPU, filled by the
daemon's copy stream behind the engine's fence, read by the engine's stream right after."""

import os
import threading

import numpy as np
import pytest

import helpers
from block_engine import BS, INDEX_BYTES, KEYS, LAY, Engine, attach_keys, keys_of, tokens
from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.client import BadRequest, Client, NotAttached
from sparsekv.client.engine_slab import EngineSlab
from sparsekv.daemon.engine import EngineSpace
from sparsekv.embedded.inproc import InprocClient
from sparsekv.proto import MsgType
from sparsekv.proto import fd_socket

BLOCK_BYTES = int(np.prod(KEYS))


@pytest.fixture
def daemon():
    with helpers.serving_daemon(4 << 20) as d:
        yield d


def loaded(buf: EngineSlab, n: int) -> np.ndarray:
    return buf.array[: n * BLOCK_BYTES].reshape(n, *KEYS)


@pytest.mark.parametrize("heavy_bytes", [0, 1 << 30], ids=["on_a_worker_thread", "on_the_loop"])
def test_keys_land_in_the_engines_buffer_in_list_order_one_copy_a_run(daemon, heavy_bytes, monkeypatch):
    daemon.block_requests.heavy_bytes = heavy_bytes
    threads = []
    copy = EngineSpace.copy_keys_to
    monkeypatch.setattr(EngineSpace, "copy_keys_to",
                        lambda self, *a: (threads.append(threading.current_thread()), copy(self, *a))[1])
    with Client(daemon.run_dir) as c:
        blocks = attach_keys(c)
        mine = blocks.alloc(6)
        blocks.write_keys(mine, keys_of(1, 6))
        order = mine[[3, 4, 5, 0, 1]]  # two runs of consecutive blocks
        buf = EngineSlab.shared_memory(8 * BLOCK_BYTES)
        reply = c._call(MsgType.BLOCK_LOAD_KEYS, {"dst": {"deposit": _deposit(daemon, buf), "offset": 0,
                                                          "bytes": buf.nbytes}}, {"blocks": order})[0]
        assert reply["bytes"] == 5 * BLOCK_BYTES and reply["copies"] == 2
        assert (loaded(buf, 5) == keys_of(1, 6)[[3, 4, 5, 0, 1]]).all()
        assert not buf.array[5 * BLOCK_BYTES:].any()  # nothing past the blocks loaded
        buf.array[:] = 0
        assert blocks.load_keys(mine[::-1], buf) == 6 * BLOCK_BYTES  # through the client's API
        assert (loaded(buf, 6) == keys_of(1, 6)[::-1]).all()
        assert helpers.stats_json(daemon.run_dir)["block_keys_bytes_loaded"] == 11 * BLOCK_BYTES
        assert not daemon.fd_server.deposits  # each load took its deposit
    assert len(threads) == 2 and all((t is daemon.thread) == bool(heavy_bytes) for t in threads)


def test_a_load_at_an_offset_fills_only_its_span(daemon):
    with Client(daemon.run_dir) as c:
        blocks = attach_keys(c)
        mine = blocks.alloc(2)
        blocks.write_keys(mine, keys_of(2, 2))
        buf = EngineSlab.shared_memory(4 * BLOCK_BYTES)
        c._call(MsgType.BLOCK_LOAD_KEYS, {"dst": {"deposit": _deposit(daemon, buf), "offset": BLOCK_BYTES,
                                                  "bytes": 2 * BLOCK_BYTES}}, {"blocks": mine})
        assert not buf.array[:BLOCK_BYTES].any() and not buf.array[3 * BLOCK_BYTES:].any()
        assert (buf.array[BLOCK_BYTES:3 * BLOCK_BYTES].reshape(2, *KEYS) == keys_of(2, 2)).all()


def test_a_restarted_engine_loads_the_keys_another_engine_committed(daemon):
    prompt = tokens(7, 5)
    a = Engine(daemon.run_dir, index_bytes=INDEX_BYTES)
    table = a("prefill", tokens=prompt)["table"]
    assert a("load_keys", tokens=prompt, table=table) == {"bad_keys": 0}  # its own private-then-pinned blocks
    a.kill()
    helpers.wait_for(lambda: not daemon.engines.space("m").ranks, what="the killed engine's rank released")
    b = Engine(daemon.run_dir, index_bytes=INDEX_BYTES)
    try:
        got = b("prefill", tokens=prompt)
        assert got["hit"] == 5 and got["table"] == table
        assert b("load_keys", tokens=prompt, table=table) == {"bad_keys": 0}
    finally:
        b.close()


def test_only_blocks_the_loader_may_read_are_loaded(daemon):
    with Client(daemon.run_dir) as a, Client(daemon.run_dir) as b:
        ka, kb = attach_keys(a), attach_keys(b)
        mine = ka.alloc(2)
        ka.write_keys(mine, keys_of(3, 2))
        buf = EngineSlab.shared_memory(2 * BLOCK_BYTES)
        with pytest.raises(BadRequest, match="neither pinned by nor private"):
            kb.load_keys(mine, buf)  # another client's private blocks
        keys = ka.hashes(tokens(9, 2))
        ka.commit(mine, keys)
        with pytest.raises(BadRequest, match="neither pinned by nor private"):
            kb.load_keys(mine, buf)  # cached, not pinned by b
        with pytest.raises(BadRequest, match="must lie in"):
            ka.load_keys([16], buf)  # no such block
        assert not buf.array.any() and not daemon.fd_server.deposits  # nothing copied, no deposit left
        assert (kb.lookup(keys) == mine).all()
        kb.load_keys(mine, buf)
        assert (loaded(buf, 2) == keys_of(3, 2)).all()


def test_a_load_that_names_a_block_twice_is_refused_and_copies_nothing(daemon):
    """Each block once: seen, one 32 MiB block named 65,536 times made one request copy
    2 TiB on a worker thread every engine shares (found by an adversarial review)."""
    with Client(daemon.run_dir) as c:
        k = attach_keys(c)
        b = k.alloc(2)
        k.write_keys(b, keys_of(5, 2))
        buf = EngineSlab.shared_memory(3 * BLOCK_BYTES)
        with pytest.raises(BadRequest, match="names a block more than once"):
            k.load_keys([int(b[0]), int(b[1]), int(b[0])], buf)
        assert not buf.array.any() and not daemon.fd_server.deposits
        k.load_keys(b, buf)
        assert (loaded(buf, 2) == keys_of(5, 2)).all()


def test_a_bad_destination_is_refused_before_anything_is_deposited_or_copied(daemon):
    with Client(daemon.run_dir) as c:
        blocks = attach_keys(c)
        mine = blocks.alloc(2)
        blocks.write_keys(mine, keys_of(4, 2))
        small = EngineSlab.shared_memory(2 * BLOCK_BYTES - 1)
        with pytest.raises(BadRequest, match=f"take {2 * BLOCK_BYTES} bytes; dst has {2 * BLOCK_BYTES - 1}"):
            blocks.load_keys(mine, small)
        with pytest.raises(BadRequest, match="shared memory"):
            blocks.load_keys(mine, np.zeros(2 * BLOCK_BYTES, np.uint8))  # not an engine's shared buffer
        assert not daemon.fd_server.deposits and not small.array.any()
        buf = EngineSlab.shared_memory(2 * BLOCK_BYTES)

        def refused(dst, match, blocks_=mine):
            with pytest.raises(BadRequest, match=match):
                c._call(MsgType.BLOCK_LOAD_KEYS, {"dst": dst}, {"blocks": blocks_})
            assert not buf.array.any() and not daemon.fd_server.deposits

        # The daemon's own checks, past the client's: the size it is told, then the memfd's.
        refused({"deposit": _deposit(daemon, buf), "offset": 0, "bytes": BLOCK_BYTES}, "the destination has")
        refused({"deposit": _deposit(daemon, buf), "offset": 1, "bytes": 2 * BLOCK_BYTES}, "memfd has")
        refused({"deposit": _deposit(daemon, small), "offset": 0, "bytes": 2 * BLOCK_BYTES}, "memfd has")
        unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
        os.ftruncate(unsealed, 2 * BLOCK_BYTES)
        dep = fd_socket.deposit_fd(os.path.join(daemon.run_dir, fd_socket.FD_SOCKET), unsealed)
        os.close(unsealed)
        refused({"deposit": dep, "offset": 0, "bytes": 2 * BLOCK_BYTES}, "sealed")
        refused({"deposit": "nope", "offset": 0, "bytes": 2 * BLOCK_BYTES}, "unknown or expired")
        refused({"ipc_handle": bytes(64), "bus_id": "0000:00:00.0", "offset": 0, "bytes": 2 * BLOCK_BYTES},
                "a deposited memfd")  # a cuda destination on a cpu rank
        for bad in (None, [1], {"offset": -1, "bytes": 8, "deposit": "x"}, {"offset": 0, "bytes": 0, "deposit": "x"},
                    {"offset": 0, "bytes": 8}, {"offset": 0, "bytes": 8, "deposit": "x", "ipc_handle": bytes(64)},
                    {"offset": 0, "bytes": 8, "ipc_handle": b"short", "bus_id": "x"}):
            refused(bad, "dst")
        with pytest.raises(BadRequest, match="needs the blocks array"):
            c._call(MsgType.BLOCK_LOAD_KEYS, {"dst": {"deposit": _deposit(daemon, buf), "offset": 0, "bytes": 8}})
        with pytest.raises(BadRequest, match="integers"):
            c._call(MsgType.BLOCK_LOAD_KEYS, {"dst": {"deposit": _deposit(daemon, buf), "offset": 0,
                                                      "bytes": buf.nbytes}},
                    {"blocks": np.zeros((1, 1), np.int32)})
        assert not buf.array.any() and not daemon.fd_server.deposits
        blocks.load_keys(mine, buf)  # the rank serves on
        assert (loaded(buf, 2) == keys_of(4, 2)).all()


def test_a_load_needs_a_keys_plane_an_attached_rank_and_a_daemon(daemon):
    buf = EngineSlab.shared_memory(BLOCK_BYTES)
    with Client(daemon.run_dir) as c:
        blocks = attach_keys(c, engine="plain", index_bytes=0)
        [b] = blocks.alloc(1)
        with pytest.raises(BadRequest, match="without index_bytes"):
            blocks.load_keys([b], buf)
        with pytest.raises(BadRequest, match="no indexer keys plane"):  # the daemon says so too
            c._call(MsgType.BLOCK_LOAD_KEYS, {"dst": {"deposit": _deposit(daemon, buf), "offset": 0,
                                                      "bytes": BLOCK_BYTES}}, {"blocks": np.array([b], np.int32)})
    with Client(daemon.run_dir) as c:
        with pytest.raises(NotAttached):
            c._call(MsgType.BLOCK_LOAD_KEYS, {"dst": {"deposit": "x", "offset": 0, "bytes": 8}},
                    {"blocks": np.zeros(1, np.int32)})
    c = InprocClient()
    c.attach(LAY, engine="m", block_size=BS, index_bytes=INDEX_BYTES)
    with pytest.raises(BadRequest, match="in process, use read_keys"):
        c.blocks.load_keys(c.blocks.alloc(1), buf)
    c.close()


def _deposit(daemon, buf: EngineSlab) -> str:
    return fd_socket.deposit_fd(os.path.join(daemon.run_dir, fd_socket.FD_SOCKET), buf.fd)


@pytest.mark.cuda
@pytest.mark.parametrize("pin_at_start", ["1", "0"], ids=["pool_pinned_at_start", "range_pinned_at_attach"])
def test_cuda_keys_load_into_the_engines_gpu_memory_ordered_by_events(pin_at_start):
    """The cuda backend: two engine processes on cuda:0 (fences); the second, after the
    first was killed, loads the committed keys into a tensor of its GPU and reads them on
    its stream right after the call (the event orders it): every byte equal, whether the
    whole pool was page-locked at start or only the engine's range (rows and keys plane)
    at its attach."""
    with PrivateDaemon(pool_bytes=8 << 20, backend="cuda", env=dict(os.environ, SPARSEKV_PIN_POOL_AT_START=pin_at_start),
                       extra_args=["--device-arena-size", "2GiB"]) as d:
        prompt = tokens(3, 6)
        a = Engine(d.run_dir, device="cuda:0", index_bytes=INDEX_BYTES)
        table = a("prefill", tokens=prompt)["table"]
        assert a("load_keys", tokens=prompt, table=table) == {"bad_keys": 0}
        a.kill()
        b = Engine(d.run_dir, device="cuda:0", index_bytes=INDEX_BYTES)
        try:
            got = b("prefill", tokens=prompt)
            assert got["hit"] == 6 and got["table"] == table
            for _ in range(3):  # the same buffer again: imported once
                assert b("load_keys", tokens=prompt, table=table) == {"bad_keys": 0}
            assert b("load_keys", tokens=prompt, table=table[::-1]) == {"bad_keys": 6 * LAY.num_layers * BS}
        finally:
            b.close()


@pytest.mark.cuda
def test_cuda_a_load_waits_for_the_engines_stream_and_the_engine_reads_right_after():
    """Ordering both ways, in this process: the engine's stream is busy (a long kernel
    then a write of marker bytes into dst) when it asks for the load; the daemon's copies
    start after that work (they overwrite the marker), and a read enqueued right after
    load_keys sees the keys; the host never waited for the copies. Bad destinations (too
    small, another allocation's bounds, a rank without fences) are refused first."""
    import torch

    with PrivateDaemon(pool_bytes=64 << 20, backend="cuda", extra_args=["--device-arena-size", "2GiB"]) as d:
        with Client(d.run_dir, device="cuda:0") as plain:
            blocks = attach_keys(plain, engine="nofence")
            [b] = blocks.alloc(1)
            with pytest.raises(BadRequest, match="fence=True"):
                blocks.load_keys([b], torch.zeros(BLOCK_BYTES, dtype=torch.uint8, device="cuda:0"))
        with Client(d.run_dir, device="cuda:0") as c:
            c.attach(LAY, engine="m", block_size=BS, index_bytes=INDEX_BYTES, fence=True)
            blocks = c.blocks
            mine = blocks.alloc(16)
            want = keys_of(5, 16)
            blocks.write_keys(mine, want)
            dst = torch.zeros(16 * BLOCK_BYTES, dtype=torch.uint8, device="cuda:0")
            with pytest.raises(BadRequest, match="dst has"):
                blocks.load_keys(mine, dst[: 16 * BLOCK_BYTES - 1])
            with pytest.raises(BadRequest, match="contiguous torch tensor"):
                blocks.load_keys(mine, dst.cpu())
            s = torch.cuda.current_stream()
            for _ in range(5):
                torch.cuda._sleep(50_000_000)  # the engine's stream busy for a while
                dst.fill_(0xAB)  # then it writes dst: the load must come after
                blocks.load_keys(mine, dst)
                got = dst.clone()  # enqueued right after the call, on the same stream
                s.synchronize()
                assert (got.cpu().numpy().reshape(16, *KEYS) == want).all()
            view = dst[BLOCK_BYTES:]  # a view inside the same allocation: its offset goes along
            view.zero_()
            blocks.load_keys(mine[:3], view)
            assert (view[: 3 * BLOCK_BYTES].cpu().numpy().reshape(3, *KEYS) == want[:3]).all()
            # One allocation, one IPC handle every call (the daemon imports it once and allows
            # LIMITS.max_keys_targets of them: bench prefix loads 21 times into one buffer).
            assert len(c._keys_loader._targets) == 1
            assert helpers.stats_json(d.run_dir)["block_keys_bytes_loaded"] == (5 * 16 + 3) * BLOCK_BYTES


def test_a_load_after_a_refused_step_deposits_nothing(daemon):
    """Found by a review: a keys load held back by a refused STEP sent alone had deposited
    its buffer first; the daemon kept each deposit 60 s, and after 4 the process's next
    good load was refused (too many deposits)."""
    with Client(daemon.run_dir) as c:
        blocks = attach_keys(c)
        mine = blocks.alloc(1)
        blocks.write_keys(mine, keys_of(3, 1))
        buf = EngineSlab.shared_memory(BLOCK_BYTES)
        for step in range(5):
            c.step(step, [LAY.max_reqs])  # a bad state row, sent alone by the load
            with pytest.raises(BadRequest, match="BAD_STATE_ROW"):
                blocks.load_keys(mine, buf)
        assert blocks.load_keys(mine, buf) == BLOCK_BYTES
        assert (loaded(buf, 1) == keys_of(3, 1)).all()
