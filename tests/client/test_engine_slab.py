"""An engine-owned hot slab on the cpu backend (issue "The hot slab inside the engine's KV
cache"): the engine's own shared memory holds its paged KV cache; the daemon gathers into
the hot blocks the geometry names and nothing else; one index array reads resident and
hot rows alike, with the same bytes as a daemon-owned slab would give."""

import os

import numpy as np
import pytest

from sparsekv.client import BadRequest, Client
from sparsekv.client.engine_slab import EngineSlab
from sparsekv.client.swap_in import HostSwapIn
from sparsekv.bench.verify import fill_pool, pattern
from sparsekv.proto import ErrorCode, Layout
from sparsekv.proto.slab import SlabGeometry

BS = 4  # the engine's block size
LAY = Layout(num_layers=3, row_bytes=32, top_k=4, region_stride=8, max_reqs=3, host_rows=64,
             index_groups=((0, 1), (2,)), max_batch=4).validate()
HOT_BLOCKS = LAY.max_reqs * LAY.region_stride // BS  # 6 blocks of 4 rows per layer
RESIDENT_BLOCKS = 5
GUARD = 0xA5


def engine_cache(block_stride=BS * 32):
    """The engine's KV cache: per layer [RESIDENT_BLOCKS + HOT_BLOCKS] blocks at
    block_stride, 64 guard bytes before each layer and after the last; the hot region is
    the blocks from RESIDENT_BLOCKS on. Resident block b of layer l holds the engine's own
    rows (a pattern of its own)."""
    blocks = RESIDENT_BLOCKS + HOT_BLOCKS
    layer_span = 64 + blocks * block_stride
    nbytes = LAY.num_layers * layer_span + 64
    kv = EngineSlab.shared_memory(nbytes)
    kv.array[:] = GUARD
    bases = [64 + layer * layer_span for layer in range(LAY.num_layers)]
    geo = SlabGeometry.paged(LAY, bases, first_block=RESIDENT_BLOCKS, block_size=BS, block_stride=block_stride,
                             buffer_bytes=nbytes)
    return kv.with_geometry(geo), bases


def own_rows(layer, rows):
    return pattern(layer + 100, rows, LAY.row_bytes)  # what the engine keeps in its resident blocks


@pytest.mark.parametrize("block_stride", [BS * 32, BS * 32 + 48])
def test_hot_rows_land_in_the_engines_blocks_and_one_index_array_reads_resident_and_hot(daemon, block_stride):
    kv, bases = engine_cache(block_stride)
    c = Client(daemon.run_dir, name="engine-slab").connect()
    try:
        att = c.attach(LAY, engine="own", slab=kv)
        assert att.slab is None and att.engine_slab.array is kv.array and att.engine_slab.geometry is kv.geometry
        fill_pool(c, LAY)
        h = HostSwapIn(c, hot_base=RESIDENT_BLOCKS * BS)
        linear = block_stride == BS * 32
        # The engine's resident blocks 0..4 of every layer: its own rows.
        for layer in range(LAY.num_layers):
            rows = h.kv(layer)
            for b in range(RESIDENT_BLOCKS):
                for j in range(BS):
                    if linear:
                        rows[b * BS + j] = own_rows(layer, [b * BS + j])[0]
                    else:
                        rows[b, j] = own_rows(layer, [b * BS + j])[0]
        before = kv.array.copy()
        # Requests 0 and 1: 4 logical blocks each, host blocks from the table; request 1's
        # logical block 3 is still resident in the engine's block 2.
        table = np.array([[0, 5, 9, 14], [3, 7, 11, 2], [-1, -1, -1, -1]], np.int32)
        resident = np.full((3, 4), -1, np.int32)
        resident[1, 3] = 2
        reqs = np.array([0, 1, 1, -1], np.int32)
        pos = np.array([[0, 5, 9, 14], [1, 13, 6, 2], [15, 12, 4, 8], [0, 1, 2, 3]], np.int32)
        h.begin_step([0, 1], reset=[True, True])
        got = {}
        for layer in range(LAY.num_layers):
            got[layer] = h.swap_in(reqs, table, pos, layer=layer, block_size=BS, resident_block_table=resident)
        for layer in range(LAY.num_layers):
            idx = got[layer]
            for t in range(4):
                for j in range(4):
                    p, r = int(pos[t, j]), int(reqs[t])
                    i = int(idx[t, j])
                    if r < 0:
                        assert i == -1
                        continue
                    if resident[r, p // BS] >= 0:
                        assert i == int(resident[r, p // BS]) * BS + p % BS  # the engine's own row
                        want = own_rows(layer, [i])[0]
                    else:
                        assert i >= RESIDENT_BLOCKS * BS  # a hot row, inside the engine's hot blocks
                        want = pattern(layer, [int(table[r, p // BS]) * BS + p % BS], LAY.row_bytes)[0]
                    row = h.kv(layer)[i] if linear else h.kv(layer)[i // BS, i % BS]
                    assert np.array_equal(row, want), (layer, t, j)
        # Nothing outside the hot blocks changed: guards, gaps, resident blocks.
        hot = np.zeros(kv.nbytes, bool)
        geo = kv.geometry
        for layer in range(LAY.num_layers):
            for hr in range(LAY.max_reqs * LAY.region_stride):
                off = int(geo.row_offsets(LAY, layer, [hr])[0])
                hot[off: off + LAY.row_bytes] = True
        assert np.array_equal(kv.array[~hot], before[~hot])
        assert not np.array_equal(kv.array[hot], before[hot])
    finally:
        c.close()
        kv.close()


def _served_rows_match(c):
    """One step of request 0 over rows 0..3 of every layer: each index reads its host row."""
    h = HostSwapIn(c, hot_base=RESIDENT_BLOCKS * BS)
    table = np.array([[0, 1, 2, 3], [-1] * 4, [-1] * 4], np.int32)
    h.begin_step([0], reset=[True])
    for layer in range(LAY.num_layers):
        idx = h.swap_in(np.array([0], np.int32), table, np.array([[0, 1, 2, 3]], np.int32), layer=layer,
                        block_size=BS)
        rows = h.kv(layer)
        got = np.stack([rows[i] if rows.ndim == 2 else rows[i // BS, i % BS] for i in idx[0]])
        if not np.array_equal(got, pattern(layer, np.arange(4), LAY.row_bytes)):
            return False
    return True


def test_one_engine_slab_serves_one_rank_at_a_time(daemon):
    """Found by an adversarial review: the same engine slab attached by two ranks (or two
    engines) was taken twice, and one rank's gathers overwrote the other's hot rows: rank
    0 read rank 1's rows, counted as hits. The second attach is refused; once the first
    rank detaches, the slab may serve another."""
    kv, _ = engine_cache()
    a, b = Client(daemon.run_dir, rank=0, name="a").connect(), Client(daemon.run_dir, rank=1, name="b").connect()
    try:
        a.attach(LAY, engine="shared-slab", slab=kv)
        fill_pool(a, LAY)
        for other, engine in ((b, "shared-slab"), (b, "another")):
            with pytest.raises(BadRequest, match="already the slab of client") as ei:
                other.attach(LAY, engine=engine, slab=kv)
            assert ei.value.code == ErrorCode.BAD_ARGUMENT and other.attachment is None
        assert _served_rows_match(a)
        a.detach()
        b.attach(LAY, engine="another", slab=kv)
        fill_pool(b, LAY)
        assert _served_rows_match(b)
    finally:
        a.close()
        b.close()
        kv.close()


def test_a_geometry_given_after_attach_moves_no_index_of_the_attached_rank(daemon):
    """Found by an adversarial review: ``with_geometry`` on the attached slab changed the
    geometry a later HostSwapIn read by, while the daemon gathered into the one given at
    attach: its indices read guard bytes and shifted rows."""
    kv, bases = engine_cache()
    c = Client(daemon.run_dir, name="regeometry").connect()
    try:
        c.attach(LAY, engine="regeometry", slab=kv)
        fill_pool(c, LAY)
        kv.with_geometry(SlabGeometry.paged(LAY, [b + 64 for b in bases], first_block=RESIDENT_BLOCKS,
                                            block_size=BS, block_stride=BS * 32, buffer_bytes=kv.nbytes))
        assert _served_rows_match(c)  # the handle reads the rows the daemon gathered into
    finally:
        c.close()
        kv.close()


def test_a_resident_block_past_int32_indices_is_refused(daemon):
    kv, _ = engine_cache()
    c = Client(daemon.run_dir, name="resident-range").connect()
    try:
        c.attach(LAY, engine="resident-range", slab=kv)
        h = HostSwapIn(c, hot_base=RESIDENT_BLOCKS * BS)
        h.begin_step([0], reset=[True])
        table = np.array([[0, 1, 2, 3], [-1] * 4, [-1] * 4], np.int32)
        for bad in (2 ** 62, -2):
            resident = np.full((3, 4), -1, np.int64)
            resident[0, 0] = bad
            with pytest.raises(BadRequest, match="resident_block_table holds a block outside"):
                h.swap_in(np.array([0], np.int32), table, np.array([[0, 1, 2, 3]], np.int32), layer=0,
                          block_size=BS, resident_block_table=resident)
    finally:
        c.close()
        kv.close()


def test_another_process_cannot_attach_with_an_engines_deposit(daemon):
    """The deposit id is bound to the process that deposited it."""
    import multiprocessing as mp

    from sparsekv.proto import fd_socket

    kv, _ = engine_cache()
    dep = fd_socket.deposit_fd(os.path.join(daemon.run_dir, fd_socket.FD_SOCKET), kv.fd)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_attach_with, args=(daemon.run_dir, dep, kv.geometry.to_wire(), q))
    p.start()
    p.join(60)
    code, msg = q.get(timeout=5)
    assert code == int(ErrorCode.PERMISSION_DENIED), msg
    assert "another process" in msg
    # The rightful process still can.
    c = Client(daemon.run_dir).connect()
    try:
        from sparsekv.proto import MsgType

        reply, _ = c._call(MsgType.ATTACH, {"engine": "e", "layout": LAY.to_wire(),
                                            "slab": {"deposit": dep, "geometry": kv.geometry.to_wire()}})
        assert reply["handles"]["engine_slab"]
    finally:
        c.close()
        kv.close()


def _attach_with(run_dir, dep, geometry, q):
    from sparsekv.client import Client
    from sparsekv.client.errors import SparseKVError
    from sparsekv.proto import MsgType

    c = Client(run_dir).connect()
    try:
        c._call(MsgType.ATTACH, {"engine": "e", "layout": LAY.to_wire(), "slab": {"deposit": dep,
                                                                                   "geometry": geometry}})
        q.put((0, "attached"))
    except SparseKVError as e:
        q.put((int(e.code), str(e)))
    finally:
        c.close()


def test_bad_engine_slabs_are_refused_clearly_and_the_daemon_serves_on(daemon):
    c = Client(daemon.run_dir).connect()
    try:
        kv, bases = engine_cache()
        small = EngineSlab.shared_memory(1024)
        with pytest.raises(BadRequest, match="exceed the buffer"):
            small.with_geometry(kv.geometry)
        with pytest.raises(BadRequest, match="no geometry"):
            c.attach(LAY, slab=EngineSlab.shared_memory(4096))
        overlapping = SlabGeometry((0, 64, 128), BS, BS * 32, kv.nbytes)
        with pytest.raises(BadRequest, match="overlap") as e:
            c.attach(LAY, slab=EngineSlab.shared_memory(kv.nbytes).with_geometry(overlapping))
        assert e.value.code == ErrorCode.BAD_LAYOUT
        from sparsekv.proto import MsgType

        with pytest.raises(BadRequest, match="unknown or expired slab deposit"):
            c._call(MsgType.ATTACH, {"engine": "e", "layout": LAY.to_wire(),
                                     "slab": {"deposit": "00" * 16, "geometry": kv.geometry.to_wire()}})
        with pytest.raises(BadRequest, match="slab"):
            c._call(MsgType.ATTACH, {"engine": "e", "layout": LAY.to_wire(), "slab": 7})
        # An unsealed memfd could be shrunk under the daemon's writes: refused.
        fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
        os.ftruncate(fd, kv.nbytes)
        from sparsekv.proto import fd_socket

        dep = fd_socket.deposit_fd(os.path.join(daemon.run_dir, fd_socket.FD_SOCKET), fd)
        os.close(fd)
        with pytest.raises(BadRequest, match="sealed against shrinking"):
            c._call(MsgType.ATTACH, {"engine": "e", "layout": LAY.to_wire(),
                                     "slab": {"deposit": dep, "geometry": kv.geometry.to_wire()}})
        # Nothing of the refusals stayed: a normal attach of the engine works.
        att = c.attach(LAY, engine="e", slab=kv)
        assert att.engine_slab.array is kv.array
        kv.close()
    finally:
        c.close()


def test_a_geometry_whose_offsets_wrap_is_refused_by_the_daemon_and_it_serves_on(daemon):
    """A client that skips its own check (a raw ATTACH) with a block stride of 2**63 - d:
    the daemon's check once let it through (int64 starts wrapped), and the gather then wrote
    before the engine's buffer (the daemon died of SIGSEGV, or another uid's hot rows were
    overwritten). Refused as BAD_LAYOUT; a normal engine attaches and is served after it."""
    from sparsekv.proto import MsgType, fd_socket

    lay = Layout(num_layers=1, row_bytes=64, top_k=4, region_stride=4, max_reqs=3, host_rows=64,
                 max_batch=3).validate()
    d = 1 << 20
    evil = SlabGeometry((d,), 4, (1 << 63) - d, d + 4 * 64)
    buf = EngineSlab.shared_memory(evil.buffer_bytes)
    c = Client(daemon.run_dir).connect()
    try:
        dep = fd_socket.deposit_fd(os.path.join(daemon.run_dir, fd_socket.FD_SOCKET), buf.fd)
        with pytest.raises(BadRequest, match="block_stride .* must be in") as e:
            c._call(MsgType.ATTACH, {"engine": "evil", "layout": lay.to_wire(),
                                     "slab": {"deposit": dep, "geometry": evil.to_wire()}})
        assert e.value.code == ErrorCode.BAD_LAYOUT
        kv, _ = engine_cache()
        c.attach(LAY, engine="e", slab=kv)
        fill_pool(c, LAY)
        c.step(0, np.array([0], np.int32), reset=np.array([True]))
        res = c.topk(0, 0, np.array([[1, 2, 3, 4]], np.int32))
        assert res.misses.tolist() == [4]
        kv.close()
    finally:
        c.close()
        buf.close()
