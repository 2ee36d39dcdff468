"""Synthetic traces (bench/synth.py) replayed in process must give exactly the
slots and misses of the same trace driven through the reference model."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import helpers
from sparsekv.bench.replay import replay
from sparsekv.bench.synth import synth
from sparsekv.bench.trace import Trace, TraceError
from sparsekv.embedded.inproc import InprocClient


def assert_matches_reference(trace: Trace, verify: bool = False) -> dict:
    summary, result = replay(trace, transport="inproc", verify=verify)
    want_slots, want_misses = helpers.reference_replay(trace)
    assert result["slots"].shape == trace.topk.shape and result["slots"].dtype == np.int32
    assert result["misses"].shape == trace.topk.shape[:2] and result["misses"].dtype == np.int32
    np.testing.assert_array_equal(result["slots"], want_slots)
    np.testing.assert_array_equal(result["misses"], want_misses)
    assert summary["misses"] == int(want_misses.sum())
    return summary


def test_long_synthetic_trace_matches_reference_model():
    trace = synth(steps=160, batch=6, top_k=24, region_stride=48, max_reqs=10, host_rows=4000, row_bytes=16,
                  num_layers=1, overlap=0.7, context=200, lifetime=20, arrive=0.6, pad=0.15, invalidate=0.2,
                  out_of_range=0.01, share_prefix=0.3, seed=11)
    # the trace exercises every clause: arrivals, padding, rewrites, bad ids, hits and misses
    assert trace.reset.sum() > 10 and (trace.state_rows < 0).sum() > 10
    assert (trace.invalidate >= 0).sum() > 10
    assert ((trace.topk < -1) | (trace.topk >= trace.host_rows))[trace.state_rows >= 0].sum() > 10
    summary = assert_matches_reference(trace, verify=True)
    assert summary["hits"] > 0 and summary["misses"] > 0
    assert summary["out_of_range"] > 0
    assert summary["mismatched_rows"] == 0


@settings(max_examples=helpers.examples(25, 500), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    top_k=st.integers(2, 12),
    extra=st.integers(0, 12),
    overlap=st.floats(0.0, 1.0),
    pad=st.floats(0.0, 0.5),
    invalidate=st.floats(0.0, 0.8),
    share_prefix=st.floats(0.0, 1.0),
    out_of_range=st.sampled_from([0.0, 0.05]),
)
def test_synthetic_traces_match_reference_model(seed, top_k, extra, overlap, pad, invalidate, share_prefix,
                                                out_of_range):
    trace = synth(steps=25, batch=3, top_k=top_k, region_stride=top_k + extra, max_reqs=4, host_rows=512,
                  row_bytes=16, num_layers=1, overlap=overlap, context=40, lifetime=8, arrive=0.7, pad=pad,
                  invalidate=invalidate, out_of_range=out_of_range, share_prefix=share_prefix, seed=seed)
    assert_matches_reference(trace)


def test_trace_save_load_round_trip(tmp_path):
    trace = synth(steps=5, batch=2, top_k=4, region_stride=8, max_reqs=4, host_rows=256, num_layers=3, seed=3)
    path = str(tmp_path / "t.npz")
    trace.save(path)
    back = Trace.load(path)
    for name in ("topk", "state_rows", "reset", "invalidate"):
        np.testing.assert_array_equal(getattr(back, name), getattr(trace, name))
    assert (back.region_stride, back.host_rows, back.max_reqs, back.row_bytes, back.num_layers) == (8, 256, 4, 656, 3)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(batch=5, max_reqs=4), "batch 5 exceeds max_reqs 4"),
        (dict(host_rows=16, max_reqs=4, top_k=4), "rows per request"),
        (dict(region_stride=2, top_k=4), "region_stride"),
    ],
)
def test_synth_rejects_impossible_parameters(kw, words):
    params = dict(steps=2, batch=2, top_k=4, region_stride=8, max_reqs=4, host_rows=256)
    params.update(kw)
    with pytest.raises(TraceError) as ei:
        synth(**params)
    assert words in str(ei.value)


def test_cpu_backend_takes_rows_of_any_size_through_both_transports():
    """Only the cuda backend needs 16-byte multiples; the cpu backend serves a 100-byte row."""
    tr = synth(steps=20, batch=4, top_k=16, region_stride=32, max_reqs=8, host_rows=8 * 512,
               row_bytes=100, num_layers=2, context=300, seed=3)
    a, ra = replay(tr, transport="inproc", verify=True)
    b, rb = replay(tr, transport="zmq", verify=True)
    assert a["mismatched_rows"] == 0 and b["mismatched_rows"] == 0
    assert (ra["slots"] == rb["slots"]).all() and (ra["misses"] == rb["misses"]).all()


def test_replay_with_prefetch_serves_right_rows_and_group_0_as_without():
    """``--prefetch``: group 0's slots and misses are those of a replay without it (a
    prefetch fills the next group only); group 1 misses fewer than group 0 does on the same
    sequence of rows, every row verified, both transports alike."""
    tr = synth(steps=40, batch=4, top_k=16, region_stride=32, max_reqs=8, host_rows=4096, row_bytes=16,
               num_layers=1, overlap=0.8, context=300, pad=0.1, invalidate=0.1, seed=5)
    plain, rp = replay(tr, transport="inproc", verify=True)
    for transport in ("inproc", "zmq"):
        got, r = replay(tr, transport=transport, verify=True, prefetch=True)
        assert got["mismatched_rows"] == 0 and got["prefetch"] is True
        assert (r["slots"] == rp["slots"]).all() and (r["misses"] == rp["misses"]).all()
        assert 0 < got["next_group_misses"] < plain["misses"]
        assert got["next_group_hits"] > plain["hits"]


def test_replay_with_prefetch_misses_less_in_group_1_than_the_same_schedule_without(monkeypatch):
    """The comparison above holds without any prefetch (group 1 sees the trace one step
    ahead, which it misses less on anyway): here the same two-group schedule with the
    rank attached without prefetch misses more."""
    tr = synth(steps=40, batch=4, top_k=16, region_stride=32, max_reqs=8, host_rows=4096, row_bytes=16,
               num_layers=1, overlap=0.8, context=300, pad=0.1, invalidate=0.1, seed=5)
    on, _ = replay(tr, transport="inproc", verify=True, prefetch=True)
    attach = InprocClient.attach
    monkeypatch.setattr(InprocClient, "attach", lambda self, layout, engine, prefetch: attach(self, layout, engine))
    off, _ = replay(tr, transport="inproc", verify=True, prefetch=True)
    assert on["mismatched_rows"] == off["mismatched_rows"] == 0
    assert on["next_group_misses"] < off["next_group_misses"]


@pytest.mark.cuda
@pytest.mark.parametrize("transport,block_size", [("zmq", 0), ("doorbell", 0), ("doorbell", 16)])
def test_replay_with_prefetch_on_the_cuda_backend_serves_what_the_cpu_backend_serves(transport, block_size):
    """``sparsekv replay --prefetch --backend cuda --verify``: group 0's slots and misses,
    and group 1's misses and hits (what the prefetch left it), equal the cpu backend's;
    no row served is wrong in either group."""
    tr = synth(steps=60, batch=8, top_k=64, region_stride=128, max_reqs=12, host_rows=1 << 14, row_bytes=656,
               num_layers=2, overlap=0.8, context=600, pad=0.1, invalidate=0.1, seed=7, block_size=block_size)
    want, rw = replay(tr, transport="inproc", verify=True, prefetch=True)
    got, r = replay(tr, transport=transport, backend="cuda", verify=True, prefetch=True)
    assert got["mismatched_rows"] == 0 and want["mismatched_rows"] == 0
    np.testing.assert_array_equal(r["slots"], rw["slots"])
    np.testing.assert_array_equal(r["misses"], rw["misses"])
    assert (got["next_group_misses"], got["next_group_hits"]) == (want["next_group_misses"], want["next_group_hits"])
    assert got["next_group_hits"] > 0


def test_inproc_replay_refuses_a_layout_past_the_ram_available_before_allocating(monkeypatch):
    """The in-process attach is the replay's one host-memory check: the trace's pool and
    rank (its ``total``, counted once) against the RAM available, refused before
    allocating as a TraceError (the CLI's exit 2, as for every trace too large)."""
    import psutil

    from sparsekv.daemon.residency.base import rank_bytes

    trace = synth(steps=4, batch=2, top_k=8, region_stride=16, max_reqs=4, host_rows=256, row_bytes=16,
                  num_layers=2, seed=1)
    layout = trace.layout()
    need = layout.pool_bytes + rank_bytes(layout)["total"]
    real = psutil.virtual_memory()

    def available(room):
        return lambda: real._replace(available=room)

    monkeypatch.setattr(psutil, "virtual_memory", available(need - 1))
    with pytest.raises(TraceError, match="needs more host memory than this machine has: .* GiB available"):
        replay(trace, transport="inproc")
    monkeypatch.setattr(psutil, "virtual_memory", available(need))  # exactly enough: it runs
    summary, _ = replay(trace, transport="inproc")
    assert summary["steps"] == trace.steps
