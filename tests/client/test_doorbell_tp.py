"""A TP group on the doorbell transport (daemon/cuda/tp_doorbell.py) on one GPU: two ranks
of one engine, each driving its own stream as an engine's ranks do, get the cpu backend's
indices through one resolve, and every row each rank's indices point at holds its host
row's bytes in that rank's own slab; a follower whose top-k row or step differs from the
leader's is refused there (indices -1, ``check()`` raises TP_MISMATCH) while the leader and
its other rows are served. All marked ``cuda``."""

from __future__ import annotations

import numpy as np
import pytest

from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.bench.verify import fill_pool
from sparsekv.client import Client
from sparsekv.client.errors import SparseKVError

from test_doorbell import ARENA, DAEMON_LOG, check_bytes, dev, layout, reference, steps

pytestmark = pytest.mark.cuda


def group(run_dir, lay, prefetch: bool = False):
    clients, handles = [], []
    try:
        for rank in (0, 1):
            c = Client(run_dir, rank=rank, name=f"tp-{rank}", device="cuda:0").connect()
            clients.append(c)
            c.attach(lay, engine="tp", transport="doorbell", tp_size=2, prefetch=prefetch)
        fill_pool(clients[0], lay)
        handles = [c.doorbell_handle() for c in clients]
        # the daemon says a TP member's bells are waited on by the leader: system-scope rings
        assert all(h._bells_local is False for h in handles)
    except BaseException:
        for c in clients:
            c.close()
        raise
    return clients, handles


def run(lay, plan, handles, streams, torch, alter=None, check=None):
    """Every step of ``plan`` on both ranks, each on its stream; ``alter(t, rank, group,
    arrays)`` may change what a rank sends; ``check(t, layer, indices)`` is called once
    the layer's rows are in (a slot's bytes hold its row only until a later step reuses
    the slot: bytes are checked there, not after the run). Returns per (step, layer) both
    ranks' indices."""
    out = []
    for t, (state, reset, inval, req, per_group, _table) in enumerate(plan):
        for r, (h, s) in enumerate(zip(handles, streams)):
            a = {"state": state, "reset": reset, "inval": inval}
            if alter:
                alter(t, r, None, a)
            with torch.cuda.stream(s):
                h.begin_step(dev(a["state"], torch), dev(a["reset"], torch), dev(a["inval"], torch))
        by_layer = {}
        for g, layers in enumerate(lay.groups):
            for layer in layers:
                got = []
                for r, (h, s) in enumerate(zip(handles, streams)):
                    a = {"topk": per_group[g].copy()}
                    if alter:
                        alter(t, r, g, a)
                    with torch.cuda.stream(s):
                        got.append(h.swap_in(dev(req, torch), None, dev(a["topk"], torch), layer=layer))
                torch.cuda.synchronize()
                by_layer[layer] = [x.cpu().numpy() for x in got]
                if check:
                    check(t, layer, by_layer[layer])
        out.append(by_layer)
    return out


@pytest.mark.parametrize("prefetch", [False, True])
def test_two_ranks_of_one_engine_resolve_once_and_each_slab_holds_the_rows(prefetch):
    import torch

    lay = layout(region_stride=160) if prefetch else layout()
    plan = steps(lay, 10, seed=5)
    want = reference(lay, plan, positions=False)
    with PrivateDaemon(pool_bytes=lay.pool_bytes + (8 << 20), backend="cuda", extra_args=ARENA,
                       log_path=DAEMON_LOG) as d:
        clients, handles = group(d.run_dir, lay, prefetch)
        try:
            streams = [torch.cuda.Stream(), torch.cuda.Stream()]

            def check(t, layer, got):
                i0, i1 = got
                exp, ids = want[t][layer]
                if not prefetch:  # (with prefetch the slots differ from the reference's, the rows do not)
                    np.testing.assert_array_equal(i0, exp, err_msg=f"rank 0 step {t} layer {layer}")
                np.testing.assert_array_equal(i1, i0, err_msg=f"rank 1 step {t} layer {layer}")
                np.testing.assert_array_equal(i0 >= 0, exp >= 0)
                for h, idx in zip(handles, (i0, i1)):
                    check_bytes(h, lay, idx, ids, layer, torch)

            got = run(lay, plan, handles, streams, torch, check=check)
            assert len(got) == len(plan)
            for h in handles:
                h.check()
        finally:
            for h in handles:
                h.close()
            for c in clients:
                c.close()


def test_a_follower_row_that_differs_is_refused_and_the_rest_served():
    import torch

    lay = layout()
    plan = steps(lay, 6, seed=6)
    want = reference(lay, plan, positions=False)

    def alter(t, rank, g, a):
        if rank == 1 and t == 3 and g == 0:
            a["topk"][2, 5] = a["topk"][2, 5] + 1 if a["topk"][2, 5] >= 0 else 7  # one id of row 2
        if rank == 1 and t == 4 and g is None:
            a["reset"] = a["reset"].copy()
            a["reset"][3] = not a["reset"][3]  # its step differs: every row of that step refused

    with PrivateDaemon(pool_bytes=lay.pool_bytes + (8 << 20), backend="cuda", extra_args=ARENA,
                       log_path=DAEMON_LOG) as d:
        clients, handles = group(d.run_dir, lay)
        try:
            streams = [torch.cuda.Stream(), torch.cuda.Stream()]

            def check(t, layer, got):
                i0, i1 = got
                exp, ids = want[t][layer]
                np.testing.assert_array_equal(i0, exp, err_msg=f"the leader, step {t} layer {layer}")
                refused = np.zeros(exp.shape[0], bool)
                if t == 3 and layer in lay.groups[0]:
                    refused[2] = True
                if t == 4:
                    refused[: int((plan[t][0] >= -1).sum())] = True  # (the step's batch)
                assert (i1[refused] == -1).all(), (t, layer)
                np.testing.assert_array_equal(i1[~refused], exp[~refused], err_msg=f"step {t} layer {layer}")
                check_bytes(handles[1], lay, np.where(refused[:, None], -1, i1), ids, layer, torch)

            got = run(lay, plan, handles, streams, torch, alter, check=check)
            assert len(got) == len(plan)
            handles[0].check()
            with pytest.raises(SparseKVError, match="TP group"):
                handles[1].check()
        finally:
            for h in handles:
                h.close()
            for c in clients:
                c.close()


def test_a_rank_that_leaves_stops_the_group_and_the_other_ranks_get_minus_one_and_an_error():
    """Rank 1 closes after some steps: the daemon sets every member's stop word before it
    drains the group's stream, so rank 0's indices are -1 from then on (never another
    step's slots), its stream is released (its next steps finish), and check() raises
    TpLag naming the group."""
    import time

    import torch

    from sparsekv.client.errors import TpLag

    lay = layout()
    plan = steps(lay, 8, seed=7)
    with PrivateDaemon(pool_bytes=lay.pool_bytes + (8 << 20), backend="cuda", extra_args=ARENA,
                       log_path=DAEMON_LOG) as d:
        clients, handles = group(d.run_dir, lay)
        try:
            streams = [torch.cuda.Stream(), torch.cuda.Stream()]
            run(lay, plan[:3], handles, streams, torch)
            handles[1].close()
            clients[1].close()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    handles[0].check()
                except TpLag:
                    break
                time.sleep(0.05)
            else:
                pytest.fail("rank 0 was not told that its TP group stopped")
            h, s = handles[0], streams[0]
            for state, reset, inval, req, per_group, _table in plan[3:6]:
                with torch.cuda.stream(s):
                    h.begin_step(dev(state, torch), dev(reset, torch), dev(inval, torch))
                    for g, layers in enumerate(lay.groups):
                        for layer in layers:
                            idx = h.swap_in(dev(req, torch), None, dev(per_group[g], torch), layer=layer)
                            s.synchronize()  # released: never waits for ever
                            assert (idx.cpu().numpy() == -1).all(), layer
        finally:
            for h in handles:
                h.close()
            for c in clients:
                c.close()
