"""``sparsekv replay --slab engine``: the hot rows in a buffer the replaying process owns
(bench/replay.py ``EngineRows``, an engine-owned slab with guard rows around the hot
blocks). The result equals the in-process replay, every hot row verifies, and no byte
outside the hot rows changes."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from sparsekv.bench.replay import EngineRows, replay
from sparsekv.bench.synth import synth

BASE = dict(steps=30, batch=6, top_k=128, region_stride=256, max_reqs=10, host_rows=10 * 2048, num_layers=2,
            context=1200, lifetime=12, overlap=0.7, invalidate=0.2, out_of_range=0.01, seed=4)


@pytest.mark.parametrize("kw", [{}, {"block_size": 16, "spec": 0.3}])
def test_replay_into_an_engine_owned_slab_equals_inproc_and_keeps_the_guards(kw):
    trace = synth(**{**BASE, **kw})
    want, want_res = replay(trace, transport="inproc", backend="cpu")
    got, got_res = replay(trace, transport="zmq", backend="cpu", verify=True, slab="engine")
    np.testing.assert_array_equal(got_res["slots"], want_res["slots"])
    np.testing.assert_array_equal(got_res["misses"], want_res["misses"])
    assert got["slab"] == "engine" and got["mismatched_rows"] == 0 and got["guard_bytes_changed"] == 0
    assert got["bytes_moved"] > 0 and (got["hits"], got["out_of_range"]) == (want["hits"], want["out_of_range"])


def test_the_guard_count_sees_bytes_outside_the_hot_rows_only():
    lay = synth(**BASE).layout()
    rows = EngineRows(lay, "cpu")
    a, rb = rows.slab.array, lay.row_bytes
    try:
        assert rows.guard_changed() == 0
        # A hot row's byte (the daemon's to write), found through the geometry the daemon
        # gets: the replay's view of the hot rows reads that very byte.
        off = int(rows.geometry.row_offsets(lay, 1, [3 * lay.region_stride + 7])[0]) + 5
        a[off] ^= 0xFF
        assert rows.hot()[1, 3, np.array([7])][0, 5] == a[off]
        assert rows.guard_changed() == 0
        a[0] ^= 0xFF  # layer 0's first guard block
        a[rows.layer_bytes + rows.hot_base // rows.block * rows.block_stride + rows.block * rb] ^= 0xFF  # a gap row
        a[-1] ^= 0xFF  # the tail
        assert rows.guard_changed() == 3
        assert rows.hot().shape == (lay.num_layers, lay.max_reqs, lay.region_stride, lay.row_bytes)
        assert rows.geometry.block_stride == (rows.block + 1) * rb  # blocks with gaps: strided gathers
        assert rows.hot_base == 2 * rows.block and rows.geometry.buffer_bytes == rows.slab.nbytes
    finally:
        rows.slab.close()


def test_the_command_line_replays_into_an_engine_slab(tmp_path):
    trace = synth(**{**BASE, "steps": 8})
    path = tmp_path / "t.npz"
    trace.save(str(path))
    r = subprocess.run([sys.executable, "-m", "sparsekv.cli.main", "replay", str(path), "--out", str(tmp_path / "r.npz"),
                        "--transport", "zmq", "--slab", "engine", "--verify"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.splitlines()[-1])
    assert summary["slab"] == "engine" and summary["mismatched_rows"] == 0 and summary["guard_bytes_changed"] == 0


def test_an_engine_slab_needs_a_daemon():
    with pytest.raises(ValueError, match="--transport zmq or doorbell"):
        replay(synth(**{**BASE, "steps": 2}), transport="inproc", slab="engine")
    with pytest.raises(ValueError, match="unknown slab"):
        replay(synth(**{**BASE, "steps": 2}), transport="zmq", slab="mine")
