"""``max_store_blocks_total``: the blocks of every engine's block store together are capped,
because each block costs the daemon memory of its own (the store's arrays) whatever its
rows' size, so engines of tiny rows kept for their cached blocks cannot grow the daemon
without bound. A new store past the cap is POOL_FULL before anything is allocated, unless
engines kept for their cached blocks yield (the longest kept first, only as many as
needed); an engine with a rank never yields; an engine without a store is not counted."""

import numpy as np
import pytest

import helpers
from helpers import registry_attach as attach
from sparsekv.client import Client, PoolFull
from sparsekv.daemon.backends import CpuBackend
from sparsekv.daemon.config import Config
from sparsekv.daemon.pool import HostPool
from sparsekv.daemon.registry import EngineRegistry
from sparsekv.proto import ErrorCode, ProtocolError

MiB = 1 << 20
LAY = helpers.layout(host_rows=4096)  # one 2 MiB range each
BS = 4
BLOCKS = LAY.host_rows // BS  # 1024 blocks a store


@pytest.fixture
def reg(tmp_path):
    pool = HostPool(16 * MiB, threads=1)
    backend = CpuBackend(str(tmp_path), shm_dir=str(tmp_path))
    yield EngineRegistry(pool, backend, max_store_blocks_total=3 * BLOCKS)
    backend.close()
    pool.close()


def keep(reg, client: int, name: str) -> None:
    """Engine ``name`` with a store, kept for one cached block with no rank."""
    attach(reg, client, 0, "cpu", name, LAY, block_size=BS)
    store = reg.space(name).blocks
    store.open(client, 0)
    store.commit(client, store.alloc(client, 1), np.full((1, 2), client, dtype=np.int64))
    reg.detach(client, name)
    assert name in reg


def test_a_store_past_the_cap_is_pool_full_before_anything_is_allocated(reg):
    for i, name in enumerate("abc"):
        attach(reg, i, 0, "cpu", name, LAY, block_size=BS)
    assert reg.store_blocks == 3 * BLOCKS
    used = reg.pool.used_bytes
    with pytest.raises(ProtocolError, match=rf"{4 * BLOCKS} blocks \(max_store_blocks_total {3 * BLOCKS}") as e:
        attach(reg, 9, 0, "cpu", "d", LAY, block_size=BS)
    assert e.value.code == ErrorCode.POOL_FULL
    assert "d" not in reg and reg.pool.used_bytes == used
    attach(reg, 9, 0, "cpu", "plain", LAY)  # no store: not counted
    assert reg.store_blocks == 3 * BLOCKS
    reg.detach(0, "a")
    attach(reg, 10, 0, "cpu", "d", LAY, block_size=BS)  # a's store gone: room
    assert reg.store_blocks == 3 * BLOCKS


def test_kept_engines_yield_longest_kept_first_and_only_as_many_as_needed(reg):
    keep(reg, 1, "old")
    keep(reg, 2, "newer")
    attach(reg, 3, 0, "cpu", "busy", LAY, block_size=BS)
    assert reg.make_room(LAY.pool_bytes, None, BLOCKS) == ["old"]
    assert "newer" in reg and "busy" in reg
    attach(reg, 4, 0, "cpu", "second", LAY, block_size=BS)
    assert reg.store_blocks == 3 * BLOCKS


def test_when_all_kept_engines_would_not_do_nothing_is_released(reg):
    keep(reg, 1, "old")
    attach(reg, 2, 0, "cpu", "busy", LAY, block_size=BS)
    attach(reg, 3, 0, "cpu", "busy2", LAY, block_size=BS)
    with pytest.raises(ProtocolError, match="max_store_blocks_total") as e:
        reg.make_room(LAY.pool_bytes, None, 2 * BLOCKS)  # old's 1024 blocks are not enough
    assert e.value.code == ErrorCode.POOL_FULL
    assert "old" in reg and reg.space("old").blocks.cached_blocks == 1
    assert reg.make_room(LAY.pool_bytes, None, 0) == []  # no store: no cap


def test_the_daemon_takes_the_cap_from_its_config_and_refuses_past_it():
    assert Config().max_store_blocks_total == 1 << 23
    with helpers.serving_daemon(8 * MiB) as d:
        d.engines.max_store_blocks_total = BLOCKS + BLOCKS // 2  # as daemon/main.py sets it from Config
        with Client(d.run_dir) as a, Client(d.run_dir) as b:
            a.attach(LAY, engine="a", block_size=BS)
            with pytest.raises(PoolFull, match="max_store_blocks_total 1536"):
                b.attach(LAY, engine="b", block_size=BS)
            b.attach(LAY, engine="b", block_size=4 * BS)  # 256 blocks: fits
            assert d.engines.store_blocks == BLOCKS + BLOCKS // 4
