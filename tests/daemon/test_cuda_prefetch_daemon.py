"""Prefetch on the cuda backend through a daemon: every group's slots and misses, and the
prefetch counters, equal the cpu backend's for the same program (its prefetch contract,
DESIGN §4), and every row served holds its host row's bytes; through TOPK messages (zmq)
through the doorbell handle (the step graph), and in process (``InprocSwapIn``). Three index groups: group 1 gets group
0's rows ahead, group 2 group 1's, group 0 none."""

import numpy as np
import pytest

from prefetch_program import GROUPS, PF_KEYS, layout, program, reference
from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.bench.verify import count_mismatches, fill_pool, pattern as fill_pattern
from sparsekv.client import Client
from sparsekv.embedded.inproc_cuda import InprocSwapIn

ARENA = ["--device-arena-size", "1GiB"]


@pytest.fixture
def cuda_daemon():
    lay = layout()
    with PrivateDaemon(pool_bytes=lay.pool_bytes + (8 << 20), backend="cuda", extra_args=ARENA) as d:
        yield d


@pytest.mark.cuda
def test_topk_messages_with_prefetch_serve_the_cpu_backends_slots_and_rows(cuda_daemon):
    lay = layout()
    plan = program(lay, 12, seed=1)
    want, counters = reference(lay, plan)
    with Client(cuda_daemon.run_dir, name="pf", device="cuda:0") as c:
        att = c.attach(lay, engine="pf", prefetch=True)
        fill_pool(c, lay)
        for t, (state, reset, per_group) in enumerate(plan):
            c.step(t, state, reset)
            for g, rows in enumerate(per_group):
                slots, misses = c.topk(t, g, rows).host()
                np.testing.assert_array_equal(slots, want[t][g][0], err_msg=f"step {t} group {g}")
                np.testing.assert_array_equal(misses, want[t][g][1], err_msg=f"step {t} group {g}")
                assert count_mismatches(att.slab, GROUPS[g], state, rows, slots, lay.host_rows) == 0
        s = c.stats()  # the last TOPK (group 2, no prefetch after it) copied the counters out before its event
    assert {k: s[k] for k in PF_KEYS} == counters


def drive_handle(h, lay, plan, want) -> None:
    """Every step of ``plan`` through a doorbell-style handle: each layer's indices are
    the cpu backend's and point at their host rows' bytes; each group's misses too."""
    import torch

    S = lay.region_stride

    def dev(a):
        return torch.as_tensor(np.ascontiguousarray(a)).cuda()

    for t, (state, reset, per_group) in enumerate(plan):
        h.begin_step(dev(state), dev(reset))
        for g, layers in enumerate(lay.groups):
            slots, _ = want[t][g]
            exp = np.where((slots >= 0) & (state[:, None] >= 0), state[:, None] * S + slots, -1)
            for layer in layers:
                idx = h.swap_in(dev(state), None, dev(per_group[g]), layer=layer)
                torch.cuda.synchronize()
                idx = idx.cpu().numpy()
                np.testing.assert_array_equal(idx, exp, err_msg=f"step {t} layer {layer}")
                ok = idx >= 0
                got = h.kv(layer)[torch.as_tensor(idx[ok]).long().cuda()].cpu().numpy()
                np.testing.assert_array_equal(got, fill_pattern(layer, per_group[g][ok], lay.row_bytes))
            np.testing.assert_array_equal(h.misses(g)[: len(state)].cpu().numpy(), want[t][g][1])
        h.check()


@pytest.mark.cuda
def test_the_doorbell_step_graph_with_prefetch_serves_the_cpu_backends_slots_and_rows(cuda_daemon):
    lay = layout()
    plan = program(lay, 12, seed=2)
    want, counters = reference(lay, plan)
    with Client(cuda_daemon.run_dir, name="pf-db", device="cuda:0") as c:
        c.attach(lay, engine="pfdb", transport="doorbell", prefetch=True)
        fill_pool(c, lay)
        h = c.doorbell_handle()
        try:
            drive_handle(h, lay, plan, want)
            s = c.stats()  # every step's counters are in the pinned mirror once its last ready word was consumed
        finally:
            h.close()
    assert {k: s[k] for k in PF_KEYS} == counters


@pytest.mark.cuda
def test_the_in_process_engine_with_prefetch_serves_the_cpu_backends_slots_and_rows():
    lay = layout()
    plan = program(lay, 12, seed=4)
    want, counters = reference(lay, plan)
    h = InprocSwapIn(lay, prefetch=True)
    try:
        for layer in range(lay.num_layers):
            h.pool[layer] = fill_pattern(layer, np.arange(lay.host_rows), lay.row_bytes)
        drive_handle(h, lay, plan, want)
        c = h.counters()
    finally:
        h.close()
    assert {k: c[k] for k in PF_KEYS} == counters


@pytest.mark.cuda
def test_the_in_process_prefetch_forks_and_joins_inside_one_captured_step():
    """The in-process handle runs the prefetch on a stream of its own, forked after a
    group's last gather and joined before the next resolve: a whole step captured as one
    CUDA graph holds both ends, and its replays serve the cpu backend's slots and rows
    step after step (step 0 eagerly, the rest by replay with the inputs copied in)."""
    import torch

    lay = layout()
    plan = program(lay, 10, seed=6)
    want, counters = reference(lay, plan)
    S = lay.region_stride
    h = InprocSwapIn(lay, prefetch=True)
    try:
        for layer in range(lay.num_layers):
            h.pool[layer] = fill_pattern(layer, np.arange(lay.host_rows), lay.row_bytes)
        state, reset, per_group = plan[0]
        st, rs = torch.as_tensor(state).cuda(), torch.as_tensor(reset).cuda()
        rows = [torch.as_tensor(r).cuda() for r in per_group]
        out = [torch.empty((len(state), lay.top_k), dtype=torch.int32, device="cuda") for _ in range(lay.num_layers)]

        def step():
            h.begin_step(st, rs)
            for g, layers in enumerate(lay.groups):
                for layer in layers:
                    h.swap_in(st, None, rows[g], layer=layer, attention_indices_out=out[layer])

        step()  # step 0 eagerly (the kernels loaded before the capture)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for t, (state, reset, per_group) in enumerate(plan):
            if t:
                st.copy_(torch.as_tensor(state))
                rs.copy_(torch.as_tensor(reset))
                for g, r in enumerate(per_group):
                    rows[g].copy_(torch.as_tensor(r))
                graph.replay()
            torch.cuda.synchronize()
            for g, layers in enumerate(lay.groups):
                slots = want[t][g][0]
                exp = np.where((slots >= 0) & (state[:, None] >= 0), state[:, None] * S + slots, -1)
                for layer in layers:
                    idx = out[layer].cpu().numpy()
                    np.testing.assert_array_equal(idx, exp, err_msg=f"step {t} layer {layer}")
                    ok = idx >= 0
                    got = h.kv(layer)[torch.as_tensor(idx[ok]).long().cuda()].cpu().numpy()
                    np.testing.assert_array_equal(got, fill_pattern(layer, per_group[g][ok], lay.row_bytes))
        h.check()
        c = h.counters()
    finally:
        torch.cuda.synchronize()
        h.close()
    assert {k: c[k] for k in PF_KEYS} == counters
