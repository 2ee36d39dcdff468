"""examples/dsa_decode/prefix.py: requests sharing a system prompt, served from the block
store by an engine process that is SIGKILLed mid-run and restarted, give outputs equal bit
for bit to a run without the store; the prompt is prefilled once across the restart, and
the daemon's block counters agree with the engines' counts."""

import functools

import numpy as np
import pytest

import helpers
from sparsekv.client.blocks import Blocks

torch = pytest.importorskip("torch")

prefix = helpers.load_example("prefix")
CFG = prefix.Config(num_layers=3, top_k=16)
# 6 requests, 3 state rows: a system prompt of 4 blocks of 8 tokens and tails of 1-20; the
# first engine serves 5 steps, then requests are in flight (and some done, some waiting).
PC = prefix.PrefixConfig(requests=6, system_blocks=4, tail=(1, 20), new_tokens=(3, 8), max_reqs=3, block_size=8,
                         host_blocks=48, kill_at=5, seed=5)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """A tiny model: with pytest-xdist's workers on few cores, torch's thread pools would
    fight over them (the engine processes take the same count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def check_counts(res, pc=PC):
    """What the engines counted, against each other and against the daemon."""
    S = pc.system_tokens
    no_store, store = res.lifetimes["no_store"], res.lifetimes["store"]
    killed, restarted = store
    assert killed["killed"] and killed["in_flight"] > 0 and restarted["admitted"] > killed["in_flight"]
    # Both runs admitted the same requests in each lifetime; the store only changes who
    # prefills: what it served was not prefilled.
    for a, b in zip(no_store, store, strict=True):
        assert a["admitted"] == b["admitted"] and a["cached"] == 0
        assert b["prefilled"] + b["cached"] == a["prefilled"]
    admissions = sum(c["admitted"] for c in store)
    assert sum(c["prefilled_system"] for c in no_store) == S * admissions
    # The system prompt prefilled once in all: by the first request of the killed engine.
    assert [c["prefilled_system"] for c in store] == [S, 0]
    assert killed["cached"] >= S * (killed["admitted"] - 1) and restarted["cached"] >= S * restarted["admitted"]
    # The restarted engine holds no indexer keys of blocks it did not write: it reads those
    # of every block it found from the store's keys plane (the killed one wrote them all).
    assert killed["index_keys_read"] == 0 and restarted["index_keys_read"] >= S
    cached = sum(c["cached"] for c in store)
    keys_bytes = CFG.num_layers * prefix.index_bytes(CFG)  # one position's, every layer
    assert res.block_counters["block_keys_bytes_read"] == keys_bytes * sum(c["index_keys_read"] for c in store)
    assert res.block_counters["block_keys_bytes_written"] == keys_bytes * pc.block_size * res.block_counters["block_commits"]
    assert res.block_counters["block_lookups"] == admissions == sum(c["lookups"] for c in store)
    assert res.block_counters["block_hit_tokens"] == cached
    assert res.block_counters["block_hits"] * pc.block_size == cached


def test_a_shared_prompt_across_a_killed_engine_equals_a_run_without_the_store(daemon):
    lines = []
    res = prefix.run(CFG, PC, transport="zmq", run_dir=daemon.run_dir, out=lines.append)
    assert res.equal is True
    assert sorted(res.outputs["store"]) == list(range(PC.requests))
    assert len({o["digest"] for o in res.outputs["store"].values()}) == PC.requests  # each request its own
    check_counts(res)
    admissions = sum(c["admitted"] for c in res.lifetimes["store"])  # requests in flight at the kill: twice
    assert admissions > PC.requests
    assert lines[-2] == f"system prompt prefilled {admissions} times without the store, 1 with it (across the restart)"
    assert lines[-1].startswith("outputs equal, bit for bit: 6 of 6 requests")
    # Once the daemon has reaped the killed engine: nothing pinned or private is left, and
    # the prompt's blocks stay cached for the next engine.
    blocks = helpers.wait_for(lambda: (b := helpers.stats_json(daemon.run_dir)["per_engine"][prefix.namespace(CFG)]["blocks"])
                              ["referenced"] == b["private"] == 0 and b, what="the killed engine reaped")
    assert blocks["cached"] >= PC.system_blocks


def serve_once(model, run_dir, engine, block_size):
    """The example's requests through one engine of the zmq transport (``block_size`` 0: no
    store): each request's output by its number, and the engine's counts."""
    outputs = {}
    with prefix.sparsekv_engine(model, PC.run_config(), "zmq", run_dir, engine=engine, block_size=block_size,
                                index_bytes=prefix.index_bytes(CFG) if block_size else 0) as e:
        counts = prefix.serve(e, PC, prefix.make_requests(PC, CFG.vocab), out=lambda d: outputs.update({d["done"]: d}))
    return outputs, counts


def test_the_comparison_sees_the_store_hand_out_wrong_blocks(daemon, monkeypatch):
    """The comparison is live: a lookup whose blocks come back in the wrong order (the
    right rows, at the wrong positions) changes the outputs of the requests that hit."""
    serve = functools.partial(serve_once, prefix.DsaModel(CFG), daemon.run_dir)

    want, _ = serve("dsa-no-store", 0)
    lookup = Blocks.lookup
    monkeypatch.setattr(Blocks, "lookup", lambda self, hashes: lookup(self, hashes)[::-1].copy())
    got, counts = serve("dsa-store", PC.block_size)
    assert counts["cached"] >= PC.system_tokens * (PC.requests - 1)
    assert all(got[i]["digest"] != want[i]["digest"] for i in range(1, PC.requests))


def test_a_new_engine_reads_the_indexer_keys_it_needs_from_the_store(daemon, monkeypatch):
    """An engine attached again to a namespace another lifetime filled reads every hit's
    indexer keys from the store (none computed again): equal outputs with them, others
    where the store would hand out zeros instead."""
    serve = functools.partial(serve_once, prefix.DsaModel(CFG), daemon.run_dir)

    want, _ = serve("dsa-no-store", 0)
    serve("dsa-keys", PC.block_size)  # fills the store; its blocks stay cached after it detaches
    got, counts = serve("dsa-keys", PC.block_size)
    assert counts["prefilled_system"] == 0 and counts["index_keys_read"] >= PC.system_tokens
    assert got == want
    monkeypatch.setattr(Blocks, "read_keys", lambda self, blocks: np.zeros((len(blocks), *self.keys_shape), np.uint8))
    got, _ = serve("dsa-keys", PC.block_size)
    assert all(got[i]["digest"] != want[i]["digest"] for i in range(PC.requests))


@pytest.mark.cuda
@pytest.mark.parametrize("transport", ["doorbell", "zmq"])
def test_a_shared_prompt_across_a_killed_engine_on_the_gpu(transport):
    """The model on cuda:0, a private cuda daemon: the device handle or the portable one."""
    cfg = prefix.Config(num_layers=3, top_k=16, device="cuda:0")
    res = prefix.run(cfg, PC, transport=transport, out=lambda s: None)
    assert res.equal is True
    check_counts(res)
