"""What the client refuses before it sends anything (found by an adversarial review of the
client): ids that are floats or bools (a cast truncated them: scores passed for indices
resolved as rows), ids outside int32 (wrapped: row 2**32 + 5 wrote row 5), data that is
not bytes (value-cast), a write larger than one frame whose data and rows differ (its
first parts were written before the refusal), block counts that are floats. Each a
BadRequest naming the argument; nothing written."""

import os

import numpy as np
import pytest

from sparsekv.bench.verify import pattern
from sparsekv.client import BadRequest, Client, DaemonUnavailable
from sparsekv.client import tensors as tensors_mod
from sparsekv.proto import LIMITS, ErrorCode, Layout

LAY = Layout(num_layers=2, row_bytes=4096, top_k=4, region_stride=8, max_reqs=2, host_rows=8192,
             index_groups=((0,), (1,))).validate()


@pytest.fixture
def c(module_daemon):
    with Client(module_daemon.run_dir, name="arguments") as c:
        c.attach(LAY, engine="arguments")
        yield c


@pytest.mark.parametrize("ids, words", [
    (np.array([[0.9, 1.0, 2.0, 3.0]]), "topk must hold integers, got float64"),
    (np.array([[True, False, True, False]]), "topk must hold integers, got bool"),
    (np.array([[2**32 + 1, 1, 2, 3]], np.int64), "topk holds 4294967297, outside int32"),
])
def test_a_topk_of_floats_bools_or_wide_ids_is_refused(c, ids, words):
    c.step(0, [0])
    with pytest.raises(BadRequest, match=words):
        c.topk(0, 0, ids)


def test_state_rows_and_invalidations_must_be_integers(c):
    with pytest.raises(BadRequest, match="state_rows must hold integers"):
        c.step(0, [0.9])
    with pytest.raises(BadRequest, match="invalidate must hold integers"):
        c.step(0, [0], invalidate=[[1.5]])


def test_a_step_number_a_request_cannot_carry_is_refused_by_step_itself(c):
    """Found by an integrator's review: step(2**64) returned, and the next call (another
    step's TOPK) raised, naming neither."""
    for step in (1 << 64, -(1 << 63) - 1):
        with pytest.raises(BadRequest, match=rf"step {step} is outside what a request can carry"):
            c.step(step, [0])
    c.step((1 << 64) - 1, [0])  # the edges are carried
    c.step(-(1 << 63), [0])
    c.flush()


def test_a_write_to_a_row_past_int32_or_of_data_not_bytes_writes_nothing(c):
    with pytest.raises(BadRequest, match="rows holds 4294967301, outside int32"):
        c.write(np.array([2**32 + 5], np.int64), np.ones((2, 1, 4096), np.uint8))
    with pytest.raises(BadRequest, match="data must be uint8"):
        c.write(np.array([5]), np.ones((2, 1, 4096), np.int16))
    c.write(np.array([5]), pattern(0, np.array([5]), 4096)[None].repeat(2, 0))
    c.step(1, [0], reset=[True])
    res = c.topk(1, 0, np.array([[5, -1, -1, -1]], np.int32))
    got = c.attachment.slab[0, 0, res.slots[0, 0]]
    np.testing.assert_array_equal(got, pattern(0, np.array([5]), 4096)[0])  # row 5 is what was written to it


def test_a_write_of_several_frames_whose_data_and_rows_differ_writes_no_part(c):
    rows = np.arange(6000)
    data = np.full((2, 8000, 4096), 7, np.uint8)  # 64 MiB: several frames, 2000 rows too many
    with pytest.raises(BadRequest, match=r"data must be \[2, 6000, row_bytes\] for 6000 rows, got \[2, 8000, 4096\]"):
        c.write(rows, data)
    c.step(0, [0], reset=[True])
    res = c.topk(0, 0, np.array([[0, 1, 2, 3]], np.int32))
    assert not c.attachment.slab[0, 0, res.slots[0]].any()  # seen: the first 4096 rows written (7s)


@pytest.mark.parametrize("case", ["row past the pool", "negative row", "layer past the layout", "layer twice",
                                  "row_bytes"])
def test_a_write_of_several_frames_the_daemon_would_refuse_in_a_later_part_writes_no_part(c, case):
    """Found by a review of the client: each part was checked by the daemon alone, so a
    write whose last row lay past the pool wrote its first 32 MiB before the refusal."""
    rows, layers, width = np.arange(8192), None, 4096
    if case == "row past the pool":
        rows[-1] = 20000
    elif case == "negative row":
        rows[-1] = -3
    elif case == "layer past the layout":
        layers = [0, 2]
    elif case == "layer twice":
        layers = [0, 0]
    else:
        width = 4080
    data = np.full((2, 8192, width), 7, np.uint8)  # 64 MiB: several frames
    with pytest.raises(BadRequest) as ei:
        c.write(rows, data, layers=layers)
    assert ei.value.code == 9  # BAD_ARGUMENT
    c.step(0, [0], reset=[True])
    res = c.topk(0, 0, np.array([[0, 1, 2, 3]], np.int32))
    assert not c.attachment.slab[0, 0, res.slots[0]].any()  # nothing of the refused write


def test_a_write_of_several_frames_refused_for_a_block_not_its_own_says_what_it_wrote(module_daemon):
    """With a block store, a part may be refused for rows outside the writer's own blocks,
    which the client cannot check first: the error says how many rows went in before it
    (``written_rows``), all into the writer's own blocks."""
    lay = Layout(num_layers=1, row_bytes=4096, top_k=4, region_stride=8, max_reqs=2, host_rows=16384,
                 index_groups=((0,),)).validate()
    with Client(module_daemon.run_dir, name="arguments-parts") as c:
        c.attach(lay, engine="arguments-parts", block_size=4096)
        mine = c.blocks.alloc(2)
        rows = c.blocks.rows(mine).reshape(-1)  # 8192 rows of its own blocks
        theirs = (set(range(4)) - {int(b) for b in mine}).pop()  # a block it did not allocate
        rows = np.concatenate([rows, np.arange(theirs * 4096, theirs * 4096 + 4096, dtype=np.int32)])
        data = np.full((1, rows.size, 4096), 7, np.uint8)  # 48 MiB: two parts of 8192 rows, then one
        with pytest.raises(BadRequest, match="the write's first 8192 rows, its parts before this one, were written") \
                as ei:
            c.write(rows, data)
        assert ei.value.written_rows == 8192
        c.blocks.release(mine)


def test_a_lost_daemon_during_a_large_write_claims_no_rows_written(monkeypatch):
    """After DaemonUnavailable a part sent may or may not have run (and a restart loses
    the rows): the error says nothing of rows written. A refused part's error does."""
    monkeypatch.setattr(tensors_mod, "LIMITS", LIMITS.__class__(max_frame_bytes=10 * 32))
    rows, data = np.arange(40, dtype=np.int32), np.zeros((1, 40, 32), np.uint8)
    for error, claim in ((DaemonUnavailable("no reply from sparsekvd"), None),
                         (BadRequest("a block not yours", ErrorCode.BAD_ARGUMENT), 20)):
        calls = []

        def call(kind, fields, arrays):
            calls.append(arrays["rows"].size)
            if len(calls) == 3:
                raise error
            return {"bytes": arrays["data"].nbytes}, {}

        with pytest.raises(type(error)) as ei:
            tensors_mod.write_in_parts(call, None, [0], rows, data)
        assert calls == [10, 10, 10] and getattr(ei.value, "written_rows", None) == claim
        assert ("first 20 rows" in str(ei.value)) == (claim is not None)


def test_an_earlier_steps_error_comes_before_any_part_of_a_large_write(c):
    """Found by a review: a STEP made before the write was sent with its first part, whose
    call then raised the STEP's error, its part written and written_rows 0."""
    c.step(0, [0, 1, 2])  # batch 3 > max_reqs 2: only the daemon refuses it
    rows = np.arange(6000, dtype=np.int32)
    with pytest.raises(Exception, match="batch of 3 rows exceeds max_batch 2") as ei:
        c.write(rows, np.full((2, 6000, 4096), 9, np.uint8))  # 48 MiB: two parts
    assert not hasattr(ei.value, "written_rows")
    c.step(1, [0], reset=[True])
    res = c.topk(1, 0, np.array([[0, 1, 2, 3]], np.int32))
    assert not c.attachment.slab[0, 0, res.slots[0]].any()  # no part was written


def test_block_counts_and_ids_must_be_integers(module_daemon):
    with Client(module_daemon.run_dir, name="arguments-blocks") as c:
        c.attach(Layout(num_layers=1, row_bytes=16, top_k=4, region_stride=8, max_reqs=2, host_rows=64,
                        index_groups=((0,),)).validate(), engine="arguments-blocks", block_size=4)
        with pytest.raises(BadRequest, match="n must be an integer"):
            c.blocks.reserve(1.7)
        with pytest.raises(BadRequest, match="n must be an integer"):
            c.blocks.alloc(True)
        with pytest.raises(BadRequest, match="blocks must hold integers"):
            c.blocks.rows([0.9])
        with pytest.raises(BadRequest, match="outside int32"):
            c.blocks.rows([2**31])
        with pytest.raises(BadRequest, match="are not host rows"):
            c.blocks.rows([2**30])


def test_connect_twice_timeouts_and_read_only_out_arrays_are_refused_plainly(module_daemon):
    """Seen (the same review): a second ``connect()`` opened a new session over the first
    (its requests then timed out); ``timeout_s`` None / inf / -1 raised TypeError /
    OverflowError / ValueError from deep inside; a read-only ``attention_indices_out``
    raised a ValueError after the request ran (its retry was then refused)."""
    from sparsekv.client import SparseKVError
    from sparsekv.client.swap_in import HostSwapIn

    for bad in (None, float("inf"), -1, float("nan"), True):
        with pytest.raises(BadRequest, match="timeout_s must be a number of seconds"):
            Client(module_daemon.run_dir, timeout_s=bad)
    with Client(module_daemon.run_dir, name="arguments-twice") as c:
        with pytest.raises(BadRequest, match="connected already") as e:
            c.connect()
        assert e.value.code == ErrorCode.BAD_ARGUMENT
        c.stats()  # the first session serves on
        lay = Layout(num_layers=1, row_bytes=16, top_k=4, region_stride=8, max_reqs=2, host_rows=64,
                     index_groups=((0,),)).validate()
        c.attach(lay, engine="arguments-out")
        h = HostSwapIn(c)
        h.begin_step(np.array([0], np.int32))
        out = np.zeros((1, 4), np.int32)
        out.flags.writeable = False
        args = (np.array([0]), np.array([[0, 1, 2, 3]]), np.array([[0, 1, 2, 3]]))
        with pytest.raises(BadRequest, match="attention_indices_out is read-only"):
            h.swap_in(*args, layer=0, block_size=4, attention_indices_out=out)
        assert h.swap_in(*args, layer=0, block_size=4).shape == (1, 4)  # the layer was not used up


def test_an_error_of_a_step_not_waited_for_says_whose_it_is(c):
    """A STEP sent alone is not waited for: its refusal comes with the next request's
    reply. Seen (the same review): the error read as the later request's own."""
    c.step(0, [0, 9])  # state row 9 of 2: refused
    c.step(1, [0])  # sends step 0's STEP alone
    with pytest.raises(BadRequest, match=r"state row 9 .*\(the reply to an earlier STEP not waited for"):
        c.write(np.array([5]), np.zeros((2, 1, 4096), np.uint8))
    c.step(2, [0])
    with pytest.raises(BadRequest):  # step 3's refused STEP, raised by step 4's topk in its place
        c.step(3, [0, 9])
        c.step(4, [0])
        c.topk(4, 0, np.array([[1, 2, 3, 4]], np.int32))
    c.stats()
    assert not c._replies  # no reply is kept for nobody (the write's and the topk's)


def test_replies_of_requests_dropped_unwaited_are_not_kept(c):
    """``submit_topk`` results dropped without ``wait()``: their replies go (2,000 of them
    kept ~3 MB for the client's life, seen in the review); an error among them is raised
    by the next request, as a deferred request's."""
    c.step(0, [0])
    for _ in range(200):
        c.submit_topk(0, 0, np.array([[1, 2, 3, 4]], np.int32))
    c.stats()  # every reply has arrived by its own
    assert len(c._replies) == 0 and not c._abandoned
    c.submit_topk(0, 0, np.array([[1, 1, 2, 3]], np.int32))  # duplicate ids: refused
    with pytest.raises(BadRequest, match="DUPLICATE_IDS|names the same host row twice"):
        c.stats()
    assert len(c._replies) == 0


@pytest.mark.parametrize("bad", [-1, 1 << 32, "0", 1.0, True])
def test_owner_uid_must_be_a_uid(module_daemon, bad):
    with Client(module_daemon.run_dir, name="owner") as c:
        with pytest.raises(BadRequest, match="owner_uid must be a uid"):
            c.attach(LAY, engine="owner", owner_uid=bad)
        c.attach(LAY, engine="owner", owner_uid=os.getuid())  # its own engine, named as such


def test_layers_must_be_integers_in_every_call_that_takes_them(c):
    """``Client`` cast layers with int(): layer 1.9 wrote layer 1, True layer 1."""
    rows = np.arange(2, dtype=np.int32)
    data = np.zeros((1, 2, LAY.row_bytes), np.uint8)
    for bad in ([1.9], [True], np.array(0)):
        with pytest.raises(BadRequest, match="layer numbers"):
            c.write(rows, data, layers=bad)
        with pytest.raises(BadRequest, match="layer numbers"):
            c.stage(rows, layers=bad)
        with pytest.raises(BadRequest, match="layer numbers"):
            c.write_staged(rows, layers=bad)
    c.write(rows, data, layers=np.array([1], np.int64))  # NumPy integers are layer numbers


def test_a_second_doorbell_handle_of_a_rank_is_refused_until_the_first_is_closed(monkeypatch, tmp_path):
    """Two handles would ring the rank's bells each with its own count: the daemon's stream
    would wait for ever. (The handle itself is faked: its refusal is the client's.)"""
    import threading

    from sparsekv.client import client as client_mod

    class FakeHandle:
        def __init__(self, client, **kw):
            self._closed = threading.Event()

        @property
        def closed(self):
            return self._closed.is_set()

        def close(self):
            self._closed.set()

    monkeypatch.setattr(client_mod, "DoorbellSwapIn", FakeHandle)
    c = Client(str(tmp_path))
    h = c.doorbell_handle()
    with pytest.raises(BadRequest, match="this rank has a doorbell handle already") as e:
        c.doorbell_handle()
    assert e.value.code == ErrorCode.BAD_ARGUMENT
    h.close()
    c.doorbell_handle().close()


def test_a_write_naming_a_row_twice_is_refused_whole(c, monkeypatch):
    """Two copies into one host row in one write: which one lands (or, on the GPU's
    parallel copies, a row torn between them) would be nobody's choice. Refused by the
    daemon (one request) and by the client before the first part of a split write."""
    c.write([5], np.full((2, 1, 4096), 1, np.uint8))
    for rows in ([5, 6, 5], [7, 5, 5]):
        with pytest.raises(BadRequest, match="names host row 5 more than once") as ei:
            c.write(rows, np.full((2, 3, 4096), 2, np.uint8))
        assert ei.value.code == ErrorCode.BAD_ARGUMENT
    c.step(0, [0], reset=[True])
    res = c.topk(0, 0, np.array([[5, 6, 7, 8]], np.int32))
    assert (c.attachment.slab[0, 0, res.slots[0, 0]] == 1).all() and not c.attachment.slab[0, 0, res.slots[0, 1:]].any()
    calls = []
    monkeypatch.setattr(tensors_mod, "LIMITS", LIMITS.__class__(max_frame_bytes=10 * 32))
    with pytest.raises(BadRequest, match="names host row 3 more than once"):  # in two parts: the client's check
        tensors_mod.write_in_parts(lambda *a: calls.append(a), None, [0], np.r_[np.arange(20), 3].astype(np.int32),
                                   np.zeros((1, 21, 32), np.uint8))
    assert calls == []


def test_repeated_finds_the_smallest_value_named_twice():
    from sparsekv.proto.args import repeated
    assert repeated(np.array([], np.int32)) is None and repeated(np.array([4], np.int32)) is None
    assert repeated(np.arange(10, dtype=np.int32)) is None and repeated(np.array([3, 1, 2], np.int32)) is None
    assert repeated(np.array([9, 2, 9, 2], np.int32)) == 2 and repeated(np.array([1, 1], np.int32)) == 1
