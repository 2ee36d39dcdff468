"""examples/dsa_decode: the DSA-shaped model gives bit-identical outputs with its KV rows
local and with them in sparsekv (HostSwapIn), in process and through a daemon."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import helpers

torch = pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dsa_decode"


run = helpers.load_example("run")
# Tiny: 3 state rows, 24 host blocks of 16 rows; 6 requests of 4-60 prompt tokens and
# 3-10 new ones arrive over the first 13 steps, so requests leave, state rows and blocks
# are handed out again, and contexts pass top_k (the indexer really selects).
CFG = run.Config(num_layers=3, top_k=16)
RC = run.RunConfig(steps=20, requests=6, max_reqs=3, host_blocks=24, prompt=(4, 60), new_tokens=(3, 10), seed=3)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The model is tiny: with pytest-xdist's workers on few cores, torch's thread pools
    would fight over them (tens of seconds instead of one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def assert_exercised(res):
    """The run did what the comparison needs: reads that hit and miss, blocks reused."""
    assert res.reused_blocks > 0
    assert res.counts["hits"] > 0 and res.counts["misses"] > 0 and res.counts["out_of_range"] > 0
    assert sum(x.shape[0] for x in res.logits["sparsekv"]) > RC.steps  # more than one token a step


def test_local_and_sparsekv_outputs_are_bit_identical_in_process():
    lines = []
    res = run.run(CFG, RC, kv="both", transport="inproc", out=lines.append)
    assert_exercised(res)
    assert res.equal is True and res.max_abs_diff == 0.0
    assert len(lines) == RC.steps + 2 and all("equal" in x for x in lines[:RC.steps])
    assert lines[-1].startswith("outputs equal: local vs sparsekv over 20 steps, max abs diff 0")
    # Each mode alone (nothing shared but the seed) gives the same logits, bit for bit.
    local = run.run(CFG, RC, kv="local", out=lambda s: None)
    alone = run.run(CFG, RC, kv="sparsekv", transport="inproc", out=lambda s: None)
    for a, b, c in zip(local.logits["local"], alone.logits["sparsekv"], res.logits["local"], strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_local_and_sparsekv_outputs_are_bit_identical_through_a_private_daemon(daemon):
    cfg = run.Config(num_layers=4, top_k=16, layers_per_indexer=2)  # GLM-style groups: followers too
    res = run.run(cfg, RC, kv="both", transport="zmq", run_dir=daemon.run_dir, out=lambda s: None)
    assert_exercised(res)
    assert res.counts["batches"] == RC.steps * 2  # one top-k request per group and step
    assert res.equal is True and res.max_abs_diff == 0.0


def test_the_hot_region_inside_the_engines_kv_cache_beside_its_resident_blocks(daemon):
    """--slab engine: one engine-owned KV tensor per layer holds each request's newest
    block (written by the engine) and the hot blocks (gathered by the daemon); the model
    reads both through one index array, and its outputs equal all-local KV bit for bit."""
    cfg = run.Config(num_layers=4, top_k=16, layers_per_indexer=2)
    res = run.run(cfg, RC, kv="both", transport="zmq", run_dir=daemon.run_dir, out=lambda s: None, slab="engine")
    assert_exercised(res)
    assert res.resident_reads > 0  # rows read in place from resident blocks, never fetched
    assert res.equal is True and res.max_abs_diff == 0.0
    plain = run.run(cfg, RC, kv="sparsekv", transport="zmq", run_dir=daemon.run_dir, out=lambda s: None)
    assert plain.resident_reads is None
    assert res.counts["misses"] < plain.counts["misses"]  # the newest blocks cost no copy


def test_a_wrong_byte_in_a_resident_block_shows_as_different_outputs(daemon, monkeypatch):
    """The resident blocks are really read: one flipped byte in one of them changes the
    outputs (the host pool still holds the right row)."""
    real, calls = run.ResidentBlocks.append, []

    def corrupt_third(self, p, kv_rows):
        real(self, p, kv_rows)
        calls.append(1)
        if len(calls) == 3:
            s = next(iter(p.running))
            pos = int(p.positions[s])
            self.storage[0, s * self.bs + pos % self.bs, 1] ^= 0x40
    monkeypatch.setattr(run.ResidentBlocks, "append", corrupt_third)
    res = run.run(CFG, RC, kv="both", transport="zmq", run_dir=daemon.run_dir, out=lambda s: None, slab="engine")
    assert res.equal is False and res.max_abs_diff > 0


def test_engine_slab_needs_a_daemon():
    with pytest.raises(SystemExit, match="--transport zmq or doorbell"):
        run.run(CFG, RC, kv="sparsekv", transport="inproc", out=lambda s: None, slab="engine")


@pytest.mark.parametrize("args, words", [
    (["--steps", "-5"], "--steps must be >= 1"),
    (["--requests", "0"], "--requests must be >= 1"),  # it had printed "outputs equal" comparing nothing
    (["--layers-per-indexer", "0"], "--layers-per-indexer must be >= 1"),
    (["--layers", "2", "--layers-per-indexer", "3"], "is more than --layers 2"),
    (["--top-k", "100000"], "region_stride"),
    (["--run-dir", "/nonexistent"], "--run-dir names a daemon: add --transport zmq or doorbell"),
])
def test_the_example_refuses_a_bad_argument_in_one_line(capsys, args, words):
    """Found by an adversarial review: these gave tracebacks, or ran and claimed equality."""
    with pytest.raises(SystemExit) as e:
        run.main(args)
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_a_wrong_byte_in_the_pool_shows_as_different_outputs(monkeypatch):
    """The comparison is live: one flipped byte in one written row changes the outputs."""
    from sparsekv.embedded.inproc import InprocClient

    real, calls = InprocClient.write, []

    def corrupt_fourth_write(self, rows, data, layers=None):
        calls.append(len(rows))
        if len(calls) == 4:
            data = np.array(data)
            data[0, 0, 1] ^= 0x40  # a high bit of the first latent value of layer 0's row
        return real(self, rows, data, layers)

    monkeypatch.setattr(InprocClient, "write", corrupt_fourth_write)
    lines = []
    res = run.run(CFG, RC, kv="both", transport="inproc", out=lines.append)
    assert res.equal is False and res.max_abs_diff > 0
    assert "DIFFERENT" in "".join(lines) and lines[-1].startswith("outputs NOT equal")


def test_the_script_runs_and_exits_zero_when_equal():
    r = subprocess.run([sys.executable, str(EXAMPLE / "run.py"), "--steps", "6", "--layers", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == "outputs equal: local vs sparsekv over 6 steps, max abs diff 0"


@pytest.mark.cuda
def test_local_and_sparsekv_outputs_are_bit_identical_through_the_doorbell():
    """The model on the GPU, its KV served through the device handle (client/doorbell.py)."""
    cfg = run.Config(num_layers=4, top_k=16, layers_per_indexer=2, device="cuda:0")
    res = run.run(cfg, RC, kv="both", transport="doorbell", out=lambda s: None)
    assert res.reused_blocks > 0
    assert sum(x.shape[0] for x in res.logits["sparsekv"]) > RC.steps
    assert res.equal is True and res.max_abs_diff == 0.0


@pytest.mark.cuda
@pytest.mark.parametrize("slab", ["daemon", "engine"])
def test_local_and_sparsekv_outputs_are_bit_identical_through_zmq_on_the_gpu(slab):
    """The portable handle (HostSwapIn) over a cuda daemon: its indices made on the GPU
    from the reply's device slots (with the engine's resident blocks: on the host)."""
    cfg = run.Config(num_layers=4, top_k=16, layers_per_indexer=2, device="cuda:0")
    res = run.run(cfg, RC, kv="both", transport="zmq", out=lambda s: None, slab=slab)
    assert res.reused_blocks > 0 and res.counts["misses"] > 0
    assert res.equal is True and res.max_abs_diff == 0.0


@pytest.mark.cuda
def test_the_hot_region_inside_the_engines_kv_tensor_on_the_gpu():
    """--slab engine through the doorbell: the engine's KV cache is a torch tensor on the
    GPU, exported to the daemon, its hot blocks gathered into in place."""
    cfg = run.Config(num_layers=4, top_k=16, layers_per_indexer=2, device="cuda:0")
    res = run.run(cfg, RC, kv="both", transport="doorbell", out=lambda s: None, slab="engine")
    assert res.reused_blocks > 0 and res.resident_reads > 0
    assert res.equal is True and res.max_abs_diff == 0.0
