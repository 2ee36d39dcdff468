"""The striped gather of a TP group on the doorbell (daemon/cuda/tp_doorbell.py), its
launches checked without a GPU: members whose movers record, in one log, what they are
asked to enqueue on the leader's stream. What the kernels do with those launches is checked
on a GPU (tests/client/test_doorbell_tp.py) and on the CPU emulator
(tests/csrc/test_stripes_on_cpu.py)."""

from __future__ import annotations

import types

import pytest

from sparsekv.daemon.cuda.tp_doorbell import TpDoorbellGroup

BLOCKS = 32


class Mover:
    def __init__(self, rank: int, log: list, blocks: int = BLOCKS, engine_owned: bool = False):
        self.rank, self.log, self.blocks, self.engine_owned = rank, log, blocks, engine_owned
        self.slab = f"slab{rank}"

    def slab_target(self, slab):
        return ("view of", self.rank, slab)

    def launch_gather(self, desc, rows, slots, misses, max_batch, stream, **kw):
        self.log.append((self.rank, "gather", None, kw))

    def launch_push(self, desc, rows, slots, misses, max_batch, stream, dst, **kw):
        self.log.append((self.rank, "push", dst, kw))


def ready(rank: int, layer: int) -> int:
    return 1000 * (rank + 1) + layer


def arrivals(rank: int, layer: int) -> int:
    return 50_000 * (rank + 1) + 4 * layer


def member(rank: int, log: list, **mover_kw):
    transport = types.SimpleNamespace(ready_addresses=[ready(rank, layer) for layer in range(4)],
                                      arrivals=types.SimpleNamespace(data=types.SimpleNamespace(ptr=arrivals(rank, 0))))
    return types.SimpleNamespace(mover=Mover(rank, log, **mover_kw), transport=transport,
                                 buffers=types.SimpleNamespace(db_layers=[f"layers{layer}" for layer in range(4)]))


def group_of(members) -> TpDoorbellGroup:
    g = TpDoorbellGroup(len(members), kernels=None)
    g.members = dict(enumerate(members))
    g._targets = g._stripe_targets()
    return g


@pytest.mark.parametrize("n", [2, 3])
def test_each_member_gathers_its_stripe_then_pushes_it_into_every_other_slab(n):
    """Member r: stripe r of n from the pool into its own slab; after every gather, the same
    stripe from its slab into each other member's slab (its own view of it). Every launch
    into member q's slab counts towards q's ready word and arrival counter of the layer,
    which wait for n grids: its gather and the n - 1 pushes into it."""
    log = []
    g = group_of([member(r, log) for r in range(n)])
    g._gather_layer(2, "desc", "rows", "slots", "misses", 8, "stream")
    gathers = [e for e in log if e[1] == "gather"]
    pushes = [e for e in log if e[1] == "push"]
    assert log == gathers + pushes  # one stream: every stripe is in its slab before a push reads it
    assert [r for r, *_ in gathers] == list(range(n))
    for r, _, _, kw in gathers:
        assert (kw["stripe"], kw["stripes"], kw["expect"]) == (r, n, n * BLOCKS)
        assert (kw["ready"], kw["arrivals"], kw["group_layers"]) == (ready(r, 2), arrivals(r, 2), "layers2")
    assert sorted((r, dst) for r, _, dst, _ in pushes) == sorted(
        (r, ("view of", r, f"slab{q}")) for r in range(n) for q in range(n) if q != r)
    into = {q: 1 for q in range(n)}  # its own gather
    for r, _, dst, kw in pushes:
        q = int(dst[2][len("slab"):])
        into[q] += 1
        assert (kw["stripe"], kw["stripes"], kw["expect"]) == (r, n, n * BLOCKS)
        assert (kw["ready"], kw["arrivals"]) == (ready(q, 2), arrivals(q, 2))
    assert into == {q: n for q in range(n)}
    # the leader's slab last: its last ready word set, its engine may rewrite the top-k block
    # (the descriptor every launch reads) while a launch after it would still read it
    last = [dst[2] for _, _, dst, _ in pushes[-(n - 1):]]
    assert last == ["slab0"] * (n - 1) and all(dst[2] != "slab0" for _, _, dst, _ in pushes[:-(n - 1)])


@pytest.mark.parametrize("why", ["engine_owned", "blocks"])
def test_an_engine_owned_slab_or_another_grid_makes_each_member_gather_the_whole_plan(why):
    """A push reads its source slab in the daemon's layout, and a ready word's count assumes
    one grid size: otherwise every member gathers the whole plan, its ready word after its
    own grid, the leader's last."""
    log = []
    other = member(1, log, engine_owned=True) if why == "engine_owned" else member(1, log, blocks=16)
    g = group_of([member(0, log), other])
    assert g._targets is None
    g._gather_layer(1, "desc", "rows", "slots", "misses", 8, "stream")
    assert [(r, kind) for r, kind, _, _ in log] == [(1, "gather"), (0, "gather")]  # the leader's last
    for r, _, _, kw in log:
        assert "stripe" not in kw and "expect" not in kw
        assert (kw["ready"], kw["arrivals"]) == (ready(r, 1), arrivals(r, 1))
