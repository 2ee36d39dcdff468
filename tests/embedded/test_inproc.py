"""The in-process transport: same results and the same typed exceptions as the daemon
client, no daemon; its block store answers an engine's prefix requests as the daemon's."""

import numpy as np
import pytest

import helpers
from helpers import gen_pattern
from sparsekv.client import BadRequest, Client, NotAttached
from sparsekv.embedded.inproc import InprocClient
from sparsekv.proto import ErrorCode, Layout
from sparsekv.proto.positions import host_rows

LAYOUT = helpers.layout(num_layers=2, row_bytes=32, top_k=4, region_stride=8, max_reqs=2, host_rows=64,
                        staging_rows=4)


def test_inproc_gathers_written_rows_and_stages_blocks():
    with InprocClient() as c:
        att = c.attach(LAYOUT)
        helpers.fill(c, LAYOUT)
        c.step(0, [1, -1])
        r = c.topk(0, 1, [[3, 9, -1, 70], [1, 1, 1, 1]])
        assert r.misses.tolist() == [2, 0] and r.hits == 0 and r.out_of_range == 1
        assert helpers.bad_rows(att.slab, (1,), np.array([1, -1]), np.array([[3, 9, -1, 70], [1, 1, 1, 1]]),
                                r.slots, 64) == 0
        assert c.stage([8, 9, 10]) == 3 * 2 * 32
        assert np.array_equal(att.staging[0, :3], helpers.gen_pattern(0, [8, 9, 10], 32))


def test_inproc_raises_the_daemon_clients_typed_errors():
    with InprocClient() as c:
        with pytest.raises(NotAttached):
            c.step(0, [0])
        c.attach(LAYOUT)
        c.step(0, [0])
        with pytest.raises(BadRequest) as ei:
            c.topk(0, 0, [[4, 4, -1, -1]])
        assert ei.value.code == ErrorCode.DUPLICATE_IDS and "twice" in str(ei.value)
        with pytest.raises(BadRequest) as ei:
            c.step(1, [5])
        assert ei.value.code == ErrorCode.BAD_STATE_ROW


def test_inproc_refuses_other_backends():
    with pytest.raises(ValueError, match="backend 'cpu'"):
        InprocClient(backend="tpu")


def test_stage_of_rows_outside_the_pool_is_a_typed_error_as_through_the_daemon():
    import pytest

    from sparsekv.client import BadRequest
    from sparsekv.embedded.inproc import InprocClient
    from sparsekv.proto import Layout

    lay = Layout(num_layers=1, row_bytes=16, top_k=2, region_stride=2, max_reqs=1, host_rows=8, staging_rows=4)
    with InprocClient() as c:
        c.attach(lay)
        with pytest.raises(BadRequest, match=r"stage rows must lie in \[0, 8\)"):
            c.stage([8])


def _two_requests_sharing_a_prefix(c) -> tuple[int, int]:
    """The same engine code on any client: two requests whose prompts share 3 blocks;
    returns the second's hits and the wrong rows read through its block table."""
    lay = helpers.layout(host_rows=64, index_groups=((0, 1),))
    c.attach(lay, engine="m", block_size=4)
    prompts = [list(range(12)) + [100 + i] * 8 for i in range(2)]
    for prompt in prompts:
        keys = c.blocks.hashes(prompt)
        c.blocks.reserve(len(keys))
        hit = c.blocks.lookup(keys)
        new = c.blocks.alloc(len(keys) - hit.size)
        rows = c.blocks.rows(new)
        c.write(rows, np.stack([gen_pattern(layer, rows, lay.row_bytes) for layer in range(lay.num_layers)]))
        c.blocks.commit(new, keys[hit.size:])
    table = np.concatenate([hit, new])[None, :].astype(np.int32)
    bad = 0
    for step, p0 in enumerate(range(0, 20, 4)):  # every position, through the block table
        ids = host_rows(np.arange(p0, p0 + 4)[None, :], table, 4)
        c.step(step, np.array([0], np.int32), reset=np.array([True]))
        r = c.topk(step, 0, ids)
        bad += helpers.bad_rows(c.attachment.slab, (0, 1), [0], ids, r.slots, lay.host_rows)
    with pytest.raises(BadRequest, match="not in a block this client allocated"):
        c.write(c.blocks.rows(hit[:1]), np.zeros((lay.num_layers, 4, lay.row_bytes), np.uint8))
    return int(hit.size), bad


def test_inproc_block_store_answers_as_the_daemons():
    with InprocClient() as c:
        inproc = _two_requests_sharing_a_prefix(c)
    with helpers.serving_daemon(4 << 20) as d, Client(d.run_dir) as c:
        daemon = _two_requests_sharing_a_prefix(c)
    assert inproc == daemon == (3, 0)


def test_inproc_refuses_a_tp_group():
    with InprocClient() as c:
        with pytest.raises(BadRequest, match="the in-process engine is one rank of its own"):
            c.attach(Layout(num_layers=1, row_bytes=16, top_k=2, region_stride=2, max_reqs=1, host_rows=8), tp_size=2)


def test_a_lookup_answers_an_array_of_the_callers_own():
    """In process the store answers a chain looked up again from its memo: the caller still
    gets an array of its own, which it may write without changing later answers."""
    with InprocClient() as c:
        c.attach(helpers.layout(host_rows=64), engine="m", block_size=4)
        keys = c.blocks.hashes(np.arange(16))
        blocks = c.blocks.alloc(4)
        c.blocks.commit(blocks, keys)
        first = c.blocks.lookup(keys)
        first[:] = 99
        again = c.blocks.lookup(keys)
        assert again.tolist() == blocks.tolist() and again is not first


def test_requests_the_daemon_refuses_are_refused_in_process_and_by_the_client_alike(module_daemon):
    """Found by a differential review of the two paths: in process a 0-d group indexed a
    copy of the residency state (rows gathered, state kept: later hits on slots holding
    other rows), a second attach zeroed the engine, a batch past max_batch and an empty
    layers list were taken; the client cast reset (2, NaN, 0.5 became resets), step and
    group (1.9 became 1)."""
    with InprocClient() as c, Client(module_daemon.run_dir, name="parity") as d:
        att = c.attach(LAYOUT)
        d.attach(LAYOUT, engine="parity")
        for x in (c, d):
            helpers.fill(x, LAYOUT)
        with pytest.raises(BadRequest) as ei:
            c.attach(LAYOUT)
        assert ei.value.code == ErrorCode.ALREADY_ATTACHED
        assert np.array_equal(c._space.pool[0, 5], gen_pattern(0, [5], 32)[0])  # the rows stayed
        res = {}
        for name, x in (("inproc", c), ("daemon", d)):
            x.step(0, [1])
            x.topk(0, np.array(1), [[10, 11, 12, 13]])  # an integer, as a 0-d array
            x.step(1, [1])
            r = x.topk(1, np.int64(1), [[1, 2, 3, 4]])
            res[name] = (r.hits, np.asarray(r.misses).tolist())
            for bad in (1.9, True, "1"):
                with pytest.raises(BadRequest, match="group must be an integer"):
                    x.topk(1, bad, [[1, 2, 3, 4]])
            with pytest.raises(BadRequest, match="step must be an integer"):
                x.step(1.9, [1])
            for reset in ([2], [np.nan], [0.5]):
                with pytest.raises(BadRequest, match="reset must be bool"):
                    x.step(2, [1], reset=reset)
                    x.topk(2, 1, [[1, 2, 3, 4]])  # the client sends its step with the top-k
            with pytest.raises(BadRequest) as ei:
                x.step(3, [0, 1, -1])  # max_batch 2
                x.topk(3, 0, [[1, 2, 3, 4]] * 3)
            assert ei.value.code == ErrorCode.TOO_LARGE
            with pytest.raises(BadRequest, match="non-empty list"):
                x.write(np.array([5], np.int32), np.zeros((0, 1, 32), np.uint8), layers=[])
        assert res["inproc"] == res["daemon"] == (0, [4])  # new rows: nothing of step 0's hit them
        for x in (c, d):  # read-only on both paths (the client's are views of the reply)
            r = x.topk(1, 1, [[1, 2, 3, 4]])
            for a in (r.slots, r.misses):
                with pytest.raises(ValueError, match="read-only"):
                    a[0] = 7
        assert helpers.bad_rows(att.slab, (1,), np.array([1]), np.array([[1, 2, 3, 4]]),
                                c.topk(1, 1, [[1, 2, 3, 4]]).slots, 64) == 0


def test_attach_arguments_are_checked_alike_in_process_and_through_the_client(module_daemon):
    """Found by the differential review: in process attach took a NumPy block size
    (AttributeError), a float one, any engine name, a store past max_store_blocks; the
    client cast block_size and tp_size (1.9 became 1) and an integer msgpack cannot carry
    raised its OverflowError."""
    big = helpers.layout(host_rows=(1 << 21) * 2 + 2)  # host_rows // 1 > max_store_blocks
    cases = [  # (attach's keywords, layout, the message's start)
        ({"block_size": 1.9}, LAYOUT, "block_size must be an integer"),
        ({"block_size": True}, LAYOUT, "block_size must be an integer"),
        ({"block_size": LAYOUT.host_rows + 1}, LAYOUT, r"block_size must be in \[1, host_rows=64\]"),
        ({"block_size": 4, "index_bytes": 2.0}, LAYOUT, "index_bytes must be an integer"),
        ({"index_bytes": 8}, LAYOUT, "index_bytes needs a block_size"),
        ({"engine": ""}, LAYOUT, "engine must be a name of 1..128 characters"),
        ({"engine": "x" * 129}, LAYOUT, "engine must be a name of 1..128 characters"),
        ({"engine": 7}, LAYOUT, "engine must be a name of 1..128 characters"),
        # A name the operator's tables would print as two lines (or a forged row), or as none:
        ({"engine": "e\tforged\n99"}, LAYOUT, "engine must be a name without control characters"),
        ({"engine": "e\u2028f"}, LAYOUT, "engine must be a name without control characters"),
        ({"engine": "e\x85"}, LAYOUT, "engine must be a name without control characters"),
        ({"engine": "prod\u202edoc"}, LAYOUT, "engine must be a name without control characters, tabs, line breaks or "
                                                "bidi controls"),
        ({"engine": "-"}, LAYOUT, "engine must not be \"-\""),
        ({"tp_size": 1.0}, LAYOUT, "tp_size must be an integer"),
        ({"block_size": 1}, big, "a block store of 4194306 blocks"),
    ]
    with Client(module_daemon.run_dir, name="attach-parity") as d:
        for kw, lay, msg in cases:
            for x in (InprocClient(), d):
                with pytest.raises(BadRequest, match=msg) as ei:
                    x.attach(lay, **{"engine": "attach-parity", **kw})
                assert ei.value.code == ErrorCode.BAD_ARGUMENT, (kw, x)
        with InprocClient() as c:
            c.attach(LAYOUT, engine="m", block_size=np.int64(4), index_bytes=np.int32(8))
            assert c.blocks.block_size == 4 and c._space.keys_plane.index_bytes == 8
        d.attach(LAYOUT, engine="attach-parity")
        for x in (InprocClient(), d):
            if x is not d:
                x.attach(LAYOUT, engine="step-parity")
            with pytest.raises(BadRequest, match=r"step \d+ is outside what a request can carry") as ei:
                x.step(2**70, [0])  # refused here, not by the top-k that would carry it
            assert ei.value.code == ErrorCode.BAD_ARGUMENT
        d.step(0, [0])  # the connection serves on
        assert d.topk(0, 0, [[1, 2, 3, 4]]).misses.tolist() == [4]


def test_block_requests_are_checked_alike_in_process_and_through_the_client(module_daemon):
    """In process a count past the request limit (max_blocks) was POOL_EXHAUSTED, and an
    alloc of -5 had its own message: both paths now check with the daemon's block_count."""
    lay = helpers.layout(host_rows=64)
    with Client(module_daemon.run_dir, name="block-parity") as d, InprocClient() as c:
        for x in (c, d):
            x.attach(lay, engine="block-parity", block_size=4)
        for n, what in ((10**6, "reserve"), (-(10**6), "reserve"), (10**6, "alloc"), (-5, "alloc"),
                        (2**63, "alloc")):
            for x in (c, d):
                with pytest.raises(BadRequest, match=r"n must be an integer in \[") as ei:
                    getattr(x.blocks, what)(n)
                assert ei.value.code == ErrorCode.BAD_ARGUMENT, (n, what, x)
        assert c.blocks.alloc(2).tolist() == d.blocks.alloc(2).tolist() == [0, 1]  # both stores serve on


def test_empty_lists_are_taken_alike_in_process_and_through_the_client(module_daemon):
    """An empty Python list is a float64 array to NumPy: the client took it (no value to
    cast), in process it was 'must hold integers'."""
    with Client(module_daemon.run_dir, name="empty-parity") as d, InprocClient() as c:
        for x in (c, d):
            x.attach(LAYOUT, engine="empty-parity")
            x.step(0, [])
            r = x.topk(0, 0, np.zeros((0, 4), np.int32))
            assert r.slots.shape == (0, 4) and r.misses.shape == (0,)
            x.step(1, [0], invalidate=[[]])
            assert x.stage([]) == 0
            assert x.write_staged([])["bytes"] == 0
            assert x.write([], np.zeros((LAYOUT.num_layers, 0, LAYOUT.row_bytes), np.uint8))["bytes"] == 0


def test_review_findings_on_names_resets_wide_integers_and_kept_block_handles(module_daemon):
    """From a review of the parity fixes: the client named the first nested field
    (``index_groups`` of the layout) for any integer too wide to send; a str enum as the
    engine's name was refused in process and taken through the daemon, a name UTF-8
    cannot encode taken in process and a raw UnicodeEncodeError through the client;
    ``reset=[]`` was refused; a ``blocks`` kept past detach raised AttributeError in
    process (NOT_ATTACHED through the daemon)."""
    import enum

    from sparsekv.client import NotAttached
    from sparsekv.client.connection import _too_wide

    assert _too_wide({"layout": {"index_groups": []}, "blocks": {"block_size": 2**70}}) == "block_size"
    assert _too_wide({"meta": {"a": 1}, "n": 2**64}) == "n"
    assert _too_wide({"x": [1, [2, -(2**63) - 1]]}) == "x"
    assert _too_wide({"a": True, "big": enum.IntEnum("Big", {"X": 2**64}).X}) == "big"

    class Name(str, enum.Enum):
        A = "review-parity"

    with Client(module_daemon.run_dir, name="review-parity") as d, InprocClient() as c:
        with pytest.raises(BadRequest, match="tp_size holds an integer outside"):
            d.attach(LAYOUT, engine="review-parity", tp_size=2**70)
        for x in (c, d):
            with pytest.raises(BadRequest, match="UTF-8") as ei:
                x.attach(LAYOUT, engine="bad\ud800")
            assert ei.value.code == ErrorCode.BAD_ARGUMENT
            x.attach(LAYOUT, engine=Name.A, block_size=4)
            assert x.attachment.engine == "review-parity" and type(x.attachment.engine) is str  # not "Name.A"
            x.step(0, [], reset=[])
            assert x.topk(0, 0, np.zeros((0, 4), np.int32)).slots.shape == (0, 4)
            kept = x.blocks
            x.detach()
            with pytest.raises(NotAttached):
                kept.alloc(1)
            # a second review: the kept handle reached the next engine (or, in process
            # without a store, raised AttributeError)
            for again in ({}, {"block_size": 4}):
                x.attach(LAYOUT, engine="review-parity-next", **again)
                with pytest.raises(NotAttached, match="attachment that has ended"):
                    kept.alloc(1)
                x.detach()


COUNTED = ("steps", "topk_batches", "hits", "misses", "rows_moved", "bytes_moved", "out_of_range", "prefetched",
           "prefetch_hits", "prefetch_wasted", "rows_written", "bytes_written", "hot_invalidated", "rows_staged",
           "block_lookups", "block_hits", "block_hit_tokens", "block_hit_bytes", "block_commits",
           "block_evictions", "block_keys_bytes_written", "block_keys_bytes_read", "errors")


def _counted_workload(c) -> None:
    """Steps, top-k batches with prefetch, writes that drop hot copies, staging, block
    store requests that evict, key writes and reads, and two refused requests."""
    lay = helpers.layout(num_layers=2, host_rows=32, max_reqs=2, staging_rows=4, index_groups=((0,), (1,)))
    c.attach(lay, engine="counted", block_size=4, index_bytes=8, prefetch=True)
    c.blocks.reserve(8)
    blocks = c.blocks.alloc(8)  # every block: the engine writes only its own
    helpers.fill(c, lay)
    for step, cols in enumerate(([[1, 2, 3, 40]], [[1, 2, 5, 6]], [[7, 2, 5, -1]])):
        c.step(step, [0])
        for group in (0, 1):
            c.topk(step, group, cols)
    c.write(np.array([2, 5], np.int32), np.zeros((2, 2, lay.row_bytes), np.uint8))  # rows hot in the region
    c.stage([0, 1, 2])
    keys = c.blocks.hashes(np.arange(16))
    c.blocks.write_keys(blocks[:2], np.ones((2, 2, 4, 8), np.uint8))
    c.blocks.commit(blocks[:4], keys)
    c.blocks.read_keys(blocks[:1])
    c.blocks.release(blocks)
    assert c.blocks.lookup(keys).size == 4
    c.blocks.release(blocks[:4])
    c.blocks.reserve(8)
    c.blocks.alloc(8)  # every block again: the 4 cached ones evicted
    with pytest.raises(BadRequest):
        c.topk(2, 0, [[1, 1, 2, 3]])  # DUPLICATE_IDS, in a step begun
    with pytest.raises(BadRequest):
        c.step(4, [9])  # BAD_STATE_ROW
        c.topk(4, 0, [[1, 2, 3, 4]])  # the client sends its step with the top-k


def test_inproc_stats_count_what_the_daemons_count():
    """``InprocClient.stats()`` is the daemon's STATS of one rank: the same workload on
    both paths gives the same counters and errors by code."""
    with InprocClient() as c:
        _counted_workload(c)
        inproc = c.stats()
    with helpers.serving_daemon(4 << 20) as d, Client(d.run_dir) as c:
        _counted_workload(c)
        daemon = c.stats()
    assert {k: inproc[k] for k in COUNTED} == {k: daemon[k] for k in COUNTED}
    assert inproc["hits"] > 0 and inproc["prefetched"] > 0 and inproc["hot_invalidated"] > 0
    assert inproc["block_evictions"] == 4 and inproc["block_hits"] == 4
    assert inproc["errors_by_code"] == daemon["errors_by_code"] == {"DUPLICATE_IDS": 1, "BAD_STATE_ROW": 1}
    assert inproc["topk_latency_us"]["n"] == inproc["topk_batches"] == 6  # the refused one not (as the daemon)
    assert inproc["per_engine"]["counted"]["blocks"] == daemon["per_engine"]["counted"]["blocks"]
    assert inproc["hit_rate"] == daemon["hit_rate"] and inproc["transport"] == "inproc"


@pytest.mark.parametrize("call", ["topk", "stage", "write", "step"])
def test_a_ragged_list_is_a_bad_argument_in_process_as_through_the_client(call, module_daemon):
    """NumPy refuses a ragged list with a bare ValueError, which reached the caller of the
    in-process engine (found by a review of the one int32 rule); the client's is BadRequest."""
    ragged = [[1, 2], [3]]
    with InprocClient() as c, Client(module_daemon.run_dir, name="ragged") as d:
        for x in (c, d):
            x.attach(LAYOUT, engine="ragged")
            x.step(0, [0])
            x.topk(0, 0, [[1, 2, 3, 4]])
            with pytest.raises(BadRequest) as ei:
                if call == "topk":
                    x.topk(0, 1, ragged)
                elif call == "stage":
                    x.stage(ragged)
                elif call == "write":
                    x.write(ragged, np.zeros((2, 2, 32), np.uint8))
                else:
                    x.step(1, ragged)
                    x.topk(1, 0, [[1, 2, 3, 4]])  # the client sends its step with the top-k
            assert ei.value.code == ErrorCode.BAD_ARGUMENT and "must be an array of integers" in str(ei.value)
            x.detach()


def test_arguments_numpy_cannot_read_or_of_another_type_are_bad_arguments_on_both_paths(module_daemon):
    """Found by a review of the client: a ragged list as write data, hashes, indexer keys or
    reset raised NumPy's bare ValueError; a layout that is no Layout an AttributeError;
    prefetch was taken for its truth value ("no" prefetched), and in process an array for it
    left the engine half attached (no attachment, yet every later attach ALREADY_ATTACHED)."""
    ragged = [[1, 2], [3]]
    lay = helpers.layout(host_rows=64)
    with InprocClient() as c, Client(module_daemon.run_dir, name="read") as d:
        for x in (c, d):
            for kw in ({"prefetch": "no"}, {"prefetch": np.array([1, 0])}, {"prefetch": 1}):
                with pytest.raises(BadRequest, match="prefetch must be True or False"):
                    x.attach(lay, engine="read", **kw)
            with pytest.raises(BadRequest, match="layout must be a sparsekv.proto.Layout, got dict"):
                x.attach({"num_layers": 2}, engine="read")
            x.attach(lay, engine="read", block_size=4, index_bytes=8, prefetch=np.bool_(False))
            x.blocks.reserve(1)
            mine = x.blocks.alloc(1)
            calls = {"data": lambda: x.write(x.blocks.rows(mine)[:2], ragged), "hashes": lambda: x.blocks.lookup(ragged),
                     "keys": lambda: x.blocks.write_keys(mine, ragged),
                     "reset": lambda: (x.step(0, [0, 1], reset=ragged), x.topk(0, 0, [[1, 2, 3, 4]] * 2))}
            for name, call in calls.items():
                with pytest.raises(BadRequest, match=f"{name} must be") as ei:
                    call()
                assert ei.value.code == ErrorCode.BAD_ARGUMENT, (name, x)
            x.detach()


@pytest.mark.parametrize("kw, words", [({"device": None}, "device must be 'cpu' or 'cuda:N', got None"),
                                       ({"device": "tpu"}, "device must be 'cpu' or 'cuda:N', got 'tpu'"),
                                       ({"spin_us": "x"}, "spin_us must be an integer"),
                                       ({"spin_us": -5}, "spin_us must be an integer"),
                                       ({"name": "rank 0\nsparsekvd: forged"}, "name must be text without control"),
                                       ({"name": "\ud800"}, "name must be text UTF-8 can encode"),
                                       ({"name": 7}, "name must be a string")])
def test_a_client_of_an_unknown_device_or_spin_is_refused_when_made(kw, words):
    """Found by the review: device=None raised AttributeError, "tpu" attached as a cpu rank;
    spin_us "x" raised ValueError, -5 was taken. A name with a line break went into the
    daemon's log and the operator's tables as lines of their own."""
    with pytest.raises(BadRequest, match=words):
        Client("/nonexistent", **kw)


@pytest.mark.parametrize("call", ["stage", "write_staged", "write", "step", "reset", "topk"])
def test_a_scalar_where_an_array_of_rows_goes_is_refused_on_both_paths(call, module_daemon):
    """Found by the review: the client sent a 0-d array as one row (stage(3) staged row 3),
    the in-process engine refused it: both refuse it now, BAD_ARGUMENT."""
    lay = helpers.layout(host_rows=64, staging_rows=4)
    with InprocClient() as c, Client(module_daemon.run_dir, name="scalar") as d:
        for x in (c, d):
            x.attach(lay, engine="scalar")
            calls = {"stage": lambda: x.stage(3), "write_staged": lambda: x.write_staged(40),
                     "write": lambda: x.write(5, np.zeros((2, 1, lay.row_bytes), np.uint8)),
                     "step": lambda: (x.step(0, 1), x.topk(0, 0, [[1, 2, 3, 4]])),
                     "reset": lambda: (x.step(0, [1], reset=True), x.topk(0, 0, [[1, 2, 3, 4]])),
                     "topk": lambda: (x.step(0, [1]), x.topk(0, 0, [1, 2, 3, 4]))}
            with pytest.raises(BadRequest, match=r"must have (1|2) dimension|reset must be \[batch\]") as ei:
                calls[call]()
            assert ei.value.code == ErrorCode.BAD_ARGUMENT
            x.detach()


def test_a_reset_or_invalidate_of_another_batch_is_refused_at_the_step_on_both_paths(module_daemon):
    """Found by a review: the client sent such a step, and its next top-k was refused for
    it (neither ran); in process the step was refused. Both refuse the step now."""
    with InprocClient() as c, Client(module_daemon.run_dir, name="batch") as d:
        for x in (c, d):
            x.attach(LAYOUT, engine="batch")
            with pytest.raises(BadRequest, match=r"reset must be \[batch\]=\(1,\), got \(0,\)"):
                x.step(3, [0], reset=[])
            with pytest.raises(BadRequest, match=r"invalidate must be \[batch, n\] with batch 1"):
                x.step(3, [0], invalidate=[[1], [2]])
            x.step(3, [0])
            assert x.topk(3, 0, [[1, 2, 3, 4]]).misses.tolist() == [4]
            x.detach()
