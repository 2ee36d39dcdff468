"""Position traces (DESIGN §6, docs/TRACES.md): ``block_table`` + ``block_size`` make
``topk`` logical positions. Saving and loading them, host-row traces unchanged, the
generator's position and speculative rows, and replay on every transport mapping the
positions to host rows before the residency (counts and ``--verify`` on the mapped rows)."""

import hashlib
import json

import numpy as np
import pytest

import cli_inproc
import helpers
from sparsekv.bench import replay as replay_mod
from sparsekv.embedded.inproc import InprocClient
from sparsekv.bench.replay import DRIVERS, InprocDriver, replay
from sparsekv.client.results import TopkResult
from sparsekv.bench.synth import synth
from sparsekv.bench.trace import Trace, TraceError
from sparsekv.proto.positions import UNMAPPED

# A small position trace with every feature: shared prefixes, null blocks, stray
# positions of every kind, speculative rows, rewrites, padding.
POS = dict(steps=60, batch=6, top_k=12, region_stride=24, max_reqs=8, host_rows=4096, row_bytes=16, num_layers=2,
           overlap=0.7, context=90, lifetime=15, arrive=0.6, pad=0.1, invalidate=0.2, out_of_range=0.03,
           share_prefix=0.3, block_size=8, spec=0.4, seed=7)


@pytest.fixture(scope="module")
def pos_trace():
    return synth(**POS)


def host_row_copy(trace: Trace) -> Trace:
    """The same trace in host rows: topk = host_topk(t) for every t (UNMAPPED kept as -2)."""
    topk = np.stack([trace.host_topk(t) for t in range(trace.steps)])
    return Trace(topk, trace.state_rows, trace.reset, trace.invalidate, trace.region_stride, trace.host_rows,
                 trace.max_reqs, trace.row_bytes, trace.num_layers).check()


def small_position_trace(positions, table, block_size=4, state_rows=None, host_rows=64, region_stride=8):
    """A handmade position trace: one batch row on state row 0; ``positions`` [steps, k],
    ``table`` [steps, max_blocks]."""
    positions = np.asarray(positions, np.int32)
    steps, k = positions.shape
    table = np.asarray(table, np.int32).reshape(steps, 1, -1)
    rows = np.zeros((steps, 1), np.int32) if state_rows is None else np.asarray(state_rows, np.int32)
    reset = np.zeros((steps, 1), bool)
    reset[0] = True
    return Trace(positions[:, None, :], rows, reset, np.full((steps, 1, 1), -1, np.int32), region_stride,
                 host_rows, 4, 16, 1, block_table=table,
                 block_size=block_size).check()


# -- the format ---------------------------------------------------------------------------
def test_position_trace_round_trips(tmp_path, pos_trace):
    path = str(tmp_path / "p.npz")
    pos_trace.save(path)
    z = np.load(path)
    assert z["block_table"].dtype == np.int32 and z["block_table"].shape[:2] == (60, 6)
    assert int(z["block_size"]) == 8
    back = Trace.load(path)
    assert back.positional and back.block_size == 8
    for name in ("topk", "state_rows", "reset", "invalidate", "block_table"):
        np.testing.assert_array_equal(getattr(back, name), getattr(pos_trace, name))
    for t in (0, 30, 59):
        np.testing.assert_array_equal(back.host_topk(t), pos_trace.host_topk(t))


def test_host_row_trace_round_trips_without_block_table(tmp_path):
    tr = synth(steps=5, batch=2, top_k=4, region_stride=8, max_reqs=4, host_rows=256, seed=3)
    assert not tr.positional and tr.block_table is None and tr.block_size == 0
    path = str(tmp_path / "h.npz")
    tr.save(path)
    assert not {"block_table", "block_size"} & set(np.load(path).files)  # a host-row trace has neither entry
    back = Trace.load(path)
    assert back.block_table is None and back.block_size == 0
    np.testing.assert_array_equal(back.host_topk(2), tr.topk[2])


def test_a_trace_file_without_a_block_table_loads_as_host_rows(tmp_path):
    rng = np.random.default_rng(0)
    topk = np.stack([rng.permutation(64)[:4] for _ in range(6)]).reshape(3, 2, 4).astype(np.int32)
    path = tmp_path / "rows.npz"
    np.savez(path, topk=topk, state_rows=np.array([[0, 1]] * 3, np.int32), reset=np.zeros((3, 2), bool),
             invalidate=np.full((3, 2, 1), -1, np.int32), region_stride=8, host_rows=64, max_reqs=4, row_bytes=16,
             num_layers=1)
    tr = Trace.load(str(path))
    assert tr.block_table is None and tr.block_size == 0 and not tr.positional
    for t in range(3):
        np.testing.assert_array_equal(tr.host_topk(t), topk[t])
    assert tr.to_host_rows() is tr


def test_host_topk_maps_through_the_steps_table():
    tr = small_position_trace([[0, 5, 8, -1], [1, 2, 3, 4]], [[3, -1], [3, 9]])
    np.testing.assert_array_equal(tr.host_topk(0), [[12, UNMAPPED, UNMAPPED, UNMAPPED]])
    np.testing.assert_array_equal(tr.host_topk(1), [[13, 14, 15, 36]])
    assert tr.host_topk(0).dtype == np.int32


def _arrays(**over):
    a = dict(topk=np.zeros((2, 1, 4), np.int32), state_rows=np.zeros((2, 1), np.int32),
             reset=np.ones((2, 1), bool), invalidate=np.full((2, 1, 1), -1, np.int32), region_stride=8,
             host_rows=64, max_reqs=4, row_bytes=16, num_layers=1, block_table=np.zeros((2, 1, 3), np.int32),
             block_size=4)
    a.update(over)
    return {k: v for k, v in a.items() if v is not None}


@pytest.mark.parametrize(
    "over, words",
    [
        (dict(block_size=None), "block_table alone"),
        (dict(block_table=None), "block_size alone"),
        (dict(block_size=0), "block_size 0"),
        (dict(block_size=-4), "block_size -4"),
        (dict(block_table=np.zeros((2, 2, 3), np.int32)), "block_table must be [2, 1, max_blocks]"),
        (dict(block_table=np.zeros((2, 1), np.int32)), "block_table must be [2, 1, max_blocks]"),
        (dict(block_table=np.zeros((2, 1, 3), np.float32)), "block_table must hold integers"),
        (dict(block_table=np.full((2, 1, 3), -2, np.int32)), "block -2"),
        (dict(block_table=np.full((2, 1, 3), 16, np.int32)), "names host block 16, but host_rows 64 holds 16 whole"),
        (dict(block_size=5, block_table=np.full((2, 1, 3), 12, np.int32)), "holds 12 whole blocks of block_size 5"),
    ],
)
def test_a_bad_position_trace_file_is_refused(tmp_path, over, words):
    path = tmp_path / "bad.npz"
    np.savez(path, **_arrays(**over))
    with pytest.raises(TraceError) as ei:
        Trace.load(str(path))
    assert words in str(ei.value)


def test_check_wants_both_or_neither():
    a = _arrays()
    del a["block_table"], a["block_size"]
    with pytest.raises(TraceError, match="block_size 4 given without a block_table"):
        Trace(**a, block_size=4).check()
    with pytest.raises(TraceError, match="block_table given with block_size 0"):
        Trace(**a, block_table=np.zeros((2, 1, 3), np.int32)).check()
    Trace(**a, block_table=np.zeros((2, 1, 3), np.int32), block_size=4).check()  # both: fine


def test_the_cli_refuses_a_bad_position_trace_in_one_line(tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, **_arrays(block_table=np.full((2, 1, 3), 16, np.int32)))
    r = cli_inproc.run("replay", path, "--out", tmp_path / "r.npz")
    assert r.returncode == 2 and r.stderr.startswith("sparsekv replay: ") and "Traceback" not in r.stderr
    assert "names host block 16" in r.stderr


def _one_request_on_two_rows(second_table):
    """Step 1 has state row 2 on batch rows 0 and 1 (a speculative row), row 1 with ``second_table``."""
    table = np.zeros((2, 2, 3), np.int32)
    table[1, 1] = second_table
    return _arrays(topk=np.zeros((2, 2, 4), np.int32), state_rows=np.array([[2, -1], [2, 2]], np.int32),
                   reset=np.array([[True, False], [False, False]]), invalidate=np.full((2, 2, 1), -1, np.int32),
                   block_table=table)


def test_the_rows_of_one_request_must_share_its_block_table(tmp_path):
    path = tmp_path / "t.npz"
    np.savez(path, **_one_request_on_two_rows([0, 0, 0]))
    assert Trace.load(str(path)).steps == 2  # the same table on both rows: fine
    np.savez(path, **_one_request_on_two_rows([0, 5, 0]))
    with pytest.raises(TraceError, match=r"step 1: batch rows 0 and 1 are one request \(state row 2\) but carry "
                                         r"different block tables; a request's rows share its table"):
        Trace.load(str(path))
    r = cli_inproc.run("replay", path, "--out", tmp_path / "r.npz")
    assert r.returncode == 2 and "step 1: batch rows 0 and 1" in r.stderr and "Traceback" not in r.stderr


def test_the_shared_tables_are_compared_a_chunk_at_a_time(monkeypatch):
    """One pair of rows a chunk (found by an adversarial review: two copies of every pair's
    table rows at once took 2.7x the memory the load counts): a difference in the last
    chunk is still found, and equal tables pass."""
    from sparsekv.bench import trace as trace_mod

    monkeypatch.setattr(trace_mod, "TABLE_CHUNK_BYTES", 1)
    steps, batch = 3, 4
    table = np.zeros((steps, batch, 3), np.int32)
    tr = Trace(topk=np.zeros((steps, batch, 4), np.int32), state_rows=np.full((steps, batch), 1, np.int32),
               reset=np.zeros((steps, batch), bool), invalidate=np.full((steps, batch, 1), -1, np.int32),
               region_stride=16, host_rows=64, max_reqs=2, row_bytes=8, num_layers=1, block_table=table,
               block_size=4)
    tr.check()  # 9 pairs, 9 chunks, all equal
    table[2, 3, 2] = 5  # the last pair's second row
    with pytest.raises(TraceError, match=r"step 2: batch rows 2 and 3 are one request \(state row 1\)"):
        tr.check()


# -- the generator --------------------------------------------------------------------------
def _digest(tr: Trace) -> str:
    h = hashlib.sha256()
    for a in (tr.topk, tr.state_rows, tr.reset, tr.invalidate):
        h.update(np.ascontiguousarray(a).tobytes())
        h.update(str(a.dtype).encode() + str(a.shape).encode())
    return h.hexdigest()


def test_host_row_synth_output_is_fixed_for_a_seed():
    """block_size 0, spec 0: position and speculative options draw no random numbers, so a
    seed's host-row trace stays the same (a pinned digest)."""
    tr = synth(steps=40, batch=3, top_k=5, region_stride=20, max_reqs=4, host_rows=512, context=40, lifetime=8,
               arrive=0.7, pad=0.2, invalidate=0.3, out_of_range=0.05, share_prefix=0.5, overlap=0.0, seed=0)
    assert tr.block_table is None
    assert _digest(tr) == "566934bbc3d11ae4d2c9a8a7ccbb08a82c582037345d04764aa84ca970d92360"


def _live_rows(tr):
    for t in range(tr.steps):
        for b in np.flatnonzero(tr.state_rows[t] >= 0):
            yield t, int(b)


def test_position_synth_writes_positions_blocks_nulls_strays_and_spec_rows(pos_trace):
    tr = pos_trace
    bs, width = tr.block_size, tr.block_table.shape[2]
    assert tr.positional and bs == 8 and width == 4096 // 8 // 8
    host = tr.to_host_rows().topk
    live = tr.state_rows >= 0
    assert (tr.topk[live] != host[live]).mean() > 0.9  # positions, not host rows
    on_null = negative = past = 0
    null_inside = 0
    for t, b in _live_rows(tr):
        table, pos, rows = tr.block_table[t, b], tr.topk[t, b], host[t, b]
        used = np.flatnonzero(table >= 0)
        null_inside += int((table[: used.max()] < 0).sum()) if used.size else 0
        ok = rows >= 0
        assert len(set(rows[ok])) == ok.sum(), (t, b)  # host rows unique within a row
        assert len(set(table[used])) == used.size  # no block twice in a table
        negative += int((pos < 0).sum())
        past += int((pos >= width * bs).sum())
        inside = (pos >= 0) & (pos < width * bs)
        on_null += int((table[pos[inside] // bs] < 0).sum())
        assert ((rows == UNMAPPED) == ~ok).all()  # every column maps to a row of the pool or to UNMAPPED
        assert (rows[ok] < tr.host_rows).all()
    assert null_inside > 20 and on_null > 0 and negative > 0 and past > 0
    # speculative rows: one state row on two batch rows, same table, other top-k
    spec = 0
    for t in range(tr.steps):
        rows = tr.state_rows[t]
        for s in np.unique(rows[rows >= 0]):
            bs_ = np.flatnonzero(rows == s)
            assert bs_.size <= 2
            if bs_.size == 2:
                spec += 1
                np.testing.assert_array_equal(tr.block_table[t, bs_[0]], tr.block_table[t, bs_[1]])
                assert not np.array_equal(tr.topk[t, bs_[0]], tr.topk[t, bs_[1]])
    assert spec > 5


def test_requests_own_their_blocks_unless_they_share_a_prefix():
    tr = synth(**{**POS, "share_prefix": 0.0})
    width = tr.block_table.shape[2]
    for t in range(tr.steps):
        owner = {}
        for b in np.flatnonzero(tr.state_rows[t] >= 0):
            s = int(tr.state_rows[t, b])
            blocks = tr.block_table[t, b][tr.block_table[t, b] >= 0]
            assert (blocks // width == s).all()  # from its state row's own range
            for blk in blocks.tolist():
                assert owner.setdefault(blk, s) == s  # no block held by two requests
    # blocks are not laid out in order (a real allocator's free list)
    t, b = next((t, b) for t, b in _live_rows(tr) if (tr.block_table[t, b] >= 0).sum() > 4)
    blocks = tr.block_table[t, b][tr.block_table[t, b] >= 0]
    assert (np.diff(blocks) != 1).any()


def test_shared_prefixes_share_whole_blocks():
    tr = synth(**{**POS, "share_prefix": 1.0, "spec": 0.0})
    shared = 0
    for t in range(tr.steps):
        seen = {}
        for b in np.flatnonzero(tr.state_rows[t] >= 0):
            for blk in tr.block_table[t, b][tr.block_table[t, b] >= 0].tolist():
                if blk in seen and seen[blk] != int(tr.state_rows[t, b]):
                    shared += 1
                seen[blk] = int(tr.state_rows[t, b])
    assert shared > 0


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(spec=0.5, top_k=8, region_stride=15), "spec needs region_stride >= 2 * top_k"),
        (dict(spec=1.5), "spec is a probability"),
        (dict(block_size=-1), "block_size must be >= 0"),
        (dict(block_size=4, host_rows=32, max_reqs=4), "host_rows 32 gives 2 blocks of 4 (8 rows per request)"),
    ],
)
def test_synth_refuses_impossible_position_parameters(kw, words):
    params = dict(steps=2, batch=2, top_k=8, region_stride=16, max_reqs=4, host_rows=4096)
    params.update(kw)
    with pytest.raises(TraceError) as ei:
        synth(**params)
    assert words in str(ei.value)


def test_spec_rows_work_on_host_row_traces_too():
    tr = synth(**{**POS, "block_size": 0})
    assert tr.block_table is None
    doubled = sum(int((np.bincount(r[r >= 0]) == 2).sum()) for r in tr.state_rows)
    assert doubled > 10
    summary = _assert_matches_reference(tr)
    assert summary["hits"] > 0


# -- replay ---------------------------------------------------------------------------------
def _assert_matches_reference(trace: Trace) -> dict:
    summary, result = replay(trace, transport="inproc", verify=True)
    slots, misses = helpers.reference_replay(trace.to_host_rows())
    np.testing.assert_array_equal(result["slots"], slots)
    np.testing.assert_array_equal(result["misses"], misses)
    assert summary["mismatched_rows"] == 0
    return summary


def test_position_replay_equals_the_host_row_replay_and_the_reference(pos_trace):
    a, ra = replay(pos_trace, transport="inproc", verify=True)
    b, rb = replay(host_row_copy(pos_trace), transport="inproc", verify=True)
    np.testing.assert_array_equal(ra["slots"], rb["slots"])
    np.testing.assert_array_equal(ra["misses"], rb["misses"])
    for key in ("hits", "misses", "out_of_range", "rows_moved"):
        assert a[key] == b[key], key
    assert a["hits"] > 0 and a["misses"] > 0 and a["out_of_range"] > 0
    assert a["mismatched_rows"] == 0 and b["mismatched_rows"] == 0
    slots, misses = helpers.reference_replay(host_row_copy(pos_trace))
    np.testing.assert_array_equal(ra["slots"], slots)
    np.testing.assert_array_equal(ra["misses"], misses)


def test_null_block_past_table_and_negative_columns_are_out_of_range_not_misses():
    # table: logical block 0 -> host block 3 (rows 12..15), block 1 null; 8 positions in all
    tr = small_position_trace([[0, 5, 8, -1], [0, 6, 9, -3]], [[3, -1], [3, -1]])
    s, r = replay(tr, transport="inproc", verify=True)
    np.testing.assert_array_equal(r["misses"], [[1], [0]])  # only position 0 (row 12) is fetched, once
    assert (r["slots"][:, 0, 1:] == -1).all() and (r["slots"][:, 0, 0] >= 0).all()
    assert s["out_of_range"] == 6 and s["hits"] == 1 and s["misses"] == 1
    assert s["mismatched_rows"] == 0


def test_position_minus_one_is_counted_unlike_host_row_minus_one():
    tr = small_position_trace([[0, -1, 1, 2]], [[3, 4]])
    assert replay(tr, transport="inproc")[0]["out_of_range"] == 1
    assert replay(host_row_copy(tr), transport="inproc")[0]["out_of_range"] == 1  # -2 after mapping
    hr = Trace(np.array([[[12, -1, 13, 14]]], np.int32), tr.state_rows, tr.reset, tr.invalidate, 8, 64, 4, 16, 1)
    assert replay(hr, transport="inproc")[0]["out_of_range"] == 0


def test_verify_checks_the_mapped_rows(pos_trace):
    """A replay that sent the mapped rows but checked the raw positions (or the other way
    round) would find wrong bytes: the pattern differs for every row."""
    s, _ = replay(pos_trace, transport="inproc", verify=True)
    assert s["mismatched_rows"] == 0
    wrong = Trace(pos_trace.topk, pos_trace.state_rows, pos_trace.reset, pos_trace.invalidate,
                  pos_trace.region_stride, pos_trace.host_rows, pos_trace.max_reqs, pos_trace.row_bytes,
                  pos_trace.num_layers, block_table=np.where(pos_trace.block_table >= 0,
                                                             (pos_trace.block_table + 1) % 512, -1).astype(np.int32),
                  block_size=8)

    class Mixed(InprocDriver):  # sends rows of another table, so the slab holds other rows
        def run_step(self, t):
            tr, self.trace = self.trace, wrong
            try:
                return super().run_step(t)
            finally:
                self.trace = tr

    DRIVERS["mixed"] = Mixed
    try:
        s, _ = replay(pos_trace, transport="mixed", verify=True)
    finally:
        del DRIVERS["mixed"]
    assert s["mismatched_rows"] > 100


def test_counts_derived_by_the_loop_use_the_mapped_rows(pos_trace, monkeypatch):
    """The cuda path reports no hits / out_of_range; the loop derives them from the
    mapped rows and must get what the cpu residency counts."""
    want, _ = replay(pos_trace, transport="inproc")
    real = InprocClient.topk

    def topk_without_counts(self, *a, **kw):
        r = real(self, *a, **kw)
        return TopkResult(r.slots, r.misses, None, None)

    monkeypatch.setattr(InprocClient, "topk", topk_without_counts)
    got, _ = replay(pos_trace, transport="inproc")
    assert (got["hits"], got["out_of_range"], got["misses"]) == (want["hits"], want["out_of_range"], want["misses"])
    assert got["out_of_range"] > 0


def test_a_new_driver_plugs_in_without_touching_the_loop(pos_trace):
    calls = []

    class Counting(InprocDriver):
        def run_step(self, t):
            calls.append(t)
            return super().run_step(t)

    DRIVERS["counting"] = Counting
    try:
        s, r = replay(pos_trace, transport="counting", verify=True)
    finally:
        del DRIVERS["counting"]
    assert calls == list(range(pos_trace.steps)) and s["transport"] == "counting" and s["mismatched_rows"] == 0
    assert set(DRIVERS) == {"inproc", "zmq", "doorbell"}
    with pytest.raises(ValueError, match="doorbell transport"):
        replay(pos_trace, transport="doorbell")
    with pytest.raises(ValueError, match="unknown transport 'pigeon'; use inproc or zmq"):
        replay(pos_trace, transport="pigeon")


def test_a_bad_position_batch_names_its_step():
    # two positions of one row on the same host row: a table naming one block twice
    tr = small_position_trace([[0, 1, 2, 3], [0, 4, 1, 2]], [[3, 3], [3, 3]])
    with pytest.raises(replay_mod.BadRequest, match="step 1: top-k row 0 names the same host row twice"):
        replay(tr, transport="inproc")


def test_zmq_private_daemon_verifies_a_position_trace_and_equals_inproc():
    tr = synth(**{**POS, "steps": 25})
    z, rz = replay(tr, transport="zmq", verify=True)
    i, ri = replay(tr, transport="inproc", verify=True)
    assert z["mismatched_rows"] == 0 and z["verified"] is True
    np.testing.assert_array_equal(rz["slots"], ri["slots"])
    np.testing.assert_array_equal(rz["misses"], ri["misses"])
    for key in ("hits", "misses", "out_of_range"):
        assert z[key] == i[key], key
    assert z["out_of_range"] > 0 and z["hits"] > 0


def test_cli_synth_and_replay_of_a_position_trace(tmp_path):
    path = tmp_path / "p.npz"
    r = cli_inproc.run("trace", "synth", "--out", path, "--steps", 20, "--batch", 4, "--top-k", 8,
                       "--region-stride", 16, "--max-reqs", 6, "--host-rows", 3072, "--row-bytes", 16,
                       "--context", 60, "--lifetime", 10, "--out-of-range", 0.05, "--block-size", 16,
                       "--spec", 0.5, "--seed", 2)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["block_size"] == 16
    tr = Trace.load(str(path))
    assert tr.block_size == 16 and tr.block_table.shape == (20, 4, 3072 // 16 // 6)
    assert any((np.bincount(rows[rows >= 0]) == 2).any() for rows in tr.state_rows)  # --spec reached synth
    results = {}
    for transport in ("inproc", "zmq"):
        out = tmp_path / f"{transport}.npz"
        r = cli_inproc.run("replay", path, "--out", out, "--transport", transport, "--verify")
        assert r.returncode == 0, r.stderr
        s = json.loads(r.stdout.strip().splitlines()[-1])
        assert s["mismatched_rows"] == 0 and s["out_of_range"] > 0
        results[transport] = (s, np.load(out))
    np.testing.assert_array_equal(results["inproc"][1]["slots"], results["zmq"][1]["slots"])
    assert results["inproc"][0]["hits"] == results["zmq"][0]["hits"]


def test_cli_synth_refuses_spec_without_room(tmp_path):
    r = cli_inproc.run("trace", "synth", "--out", tmp_path / "t.npz", "--top-k", 16, "--region-stride", 24,
                       "--spec", 0.2)
    assert r.returncode == 2 and "spec needs region_stride >= 2 * top_k" in r.stderr
    assert not (tmp_path / "t.npz").exists()
