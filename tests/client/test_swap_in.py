"""HostSwapIn, the portable engine handle: logical positions -> indices into kv(layer),
on a case worked out by hand (DESIGN §4 residency, §6 position rule), through the
in-process client and through a private daemon."""

import inspect
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from sparsekv.bench.verify import fill_pool, pattern
from sparsekv.client import BadRequest, Client, NotAttached, SparseKVError
from sparsekv.client.doorbell import DoorbellSwapIn
from sparsekv.client.swap_in import HostSwapIn, SwapInHandle
from sparsekv.embedded.inproc import InprocClient
from sparsekv.embedded.inproc_cuda import InprocSwapIn
from sparsekv.proto import ErrorCode, Layout

# Layers 0 and 1 share one index group (leader 0); layer 2 is a group of its own.
# region_stride 8 = 2 tokens of top_k 4 per request; max_batch 8 for those tokens.
LAYOUT = Layout(num_layers=3, row_bytes=16, top_k=4, region_stride=8, max_reqs=3, host_rows=64,
                index_groups=((0, 1), (2,)), max_batch=8).validate()
BS = 4  # block size
# Host block of each logical block, one row per request state row (-1 = null block).
TABLE = np.array([[5, -1, 2],
                  [0, 7, -1],
                  [3, 1, 4]])
REQS = np.array([0, 1, 1, -1])  # two tokens of request 1, one padding token
POS = np.array([[9, 5, 1, 12],   # req 0: row 2*4+1=9 | null block | row 5*4+1=21 | past the table
                [0, 6, -3, 2],   # req 1: row 0 | row 7*4+2=30 | negative | row 2
                [6, 4, 1, 8],    # req 1: row 30 (hit of the token above) | row 28 | row 1 | null block
                [0, 1, 2, 3]])   # padding token: nothing
HOST = np.array([[9, -1, 21, -1],
                 [0, 30, -1, 2],
                 [30, 28, 1, -1],
                 [-1, -1, -1, -1]])
# Fresh regions, LRU 0..7: req 0's misses take slots 0, 1 (region 0 starts at row 0);
# req 1's first token takes 0, 1, 2 (region at row 8), its second token hits row 30 in
# slot 1 and its misses take the oldest evictable slots, 3 and 4.
WANT = np.array([[0, -1, 1, -1],
                 [8, 9, -1, 10],
                 [9, 11, 12, -1],
                 [-1, -1, -1, -1]], dtype=np.int32)
WANT_COUNTS = np.array([2, 3, 3, 0], dtype=np.int32)


@pytest.fixture(params=["inproc", "zmq"])
def client(request):
    if request.param == "inproc":
        with InprocClient() as c:
            c.attach(LAYOUT)
            yield c
    else:
        d = request.getfixturevalue("module_daemon")  # each test attaches a fresh engine
        with Client(d.run_dir, name="swap-in-test") as c:
            c.attach(LAYOUT)
            yield c


def rows_match(h, layer, idx, host):
    """Every index >= 0 reads the host pool row it stands for (the verify pattern)."""
    ok = idx >= 0
    got = h.kv(layer)[idx[ok]]
    return np.array_equal(got, pattern(layer, host[ok], LAYOUT.row_bytes))


def test_positions_map_to_the_hand_worked_indices_and_rows(client):
    fill_pool(client, LAYOUT)
    h = HostSwapIn(client)
    h.begin_step([0, 1, -1], reset=[True, True, False])
    idx, counts = h.swap_in(REQS, TABLE, POS, layer=0, block_size=BS, return_valid_counts=True)
    assert idx.dtype == np.int32 and counts.dtype == np.int32
    assert idx.tolist() == WANT.tolist() and counts.tolist() == WANT_COUNTS.tolist()
    assert rows_match(h, 0, idx, HOST)
    # The follower reuses the leader's slots (no request) and reads its own layer's rows.
    assert h.swap_in(REQS, TABLE, POS, layer=1, block_size=BS).tolist() == WANT.tolist()
    assert h.counts["batches"] == 1
    assert rows_match(h, 1, WANT, HOST)
    # Layer 2 leads its own group: a request of its own, the same slots on fresh regions.
    assert h.swap_in(REQS, TABLE, POS, layer=2, block_size=BS).tolist() == WANT.tolist()
    assert rows_match(h, 2, WANT, HOST)
    assert h.counts == {"batches": 2, "hits": 2, "misses": 14, "out_of_range": 8}
    h.check()


def test_later_steps_hit_honour_reset_and_invalidate_and_refuse_a_follower_first(client):
    fill_pool(client, LAYOUT)
    h = HostSwapIn(client)
    h.begin_step([0, 1, -1], reset=[True, True, False])
    h.swap_in(REQS, TABLE, POS, layer=0, block_size=BS)
    with pytest.raises(BadRequest, match=r"step 0 is not complete \(groups \[1\] not rung, layers 1-2 without"):
        h.begin_step([0, 1, -1])  # layers 1 and 2 were not called: the device handle would hang or read stale rows
    h.finish_step()
    h.begin_step([0, 1, -1])
    with pytest.raises(BadRequest, match=r"layer 1 follows layer 0 in index group 0.*step 1.*layer 0 first") as ei:
        h.swap_in(REQS, TABLE, POS, layer=1, block_size=BS)
    assert ei.value.code == ErrorCode.BAD_ARGUMENT
    before = dict(h.counts)
    assert h.swap_in(REQS, TABLE, POS, layer=0, block_size=BS).tolist() == WANT.tolist()
    assert h.counts["misses"] == before["misses"] and h.counts["hits"] == before["hits"] + 8  # all 8 hit
    assert h.swap_in(REQS, TABLE, POS, layer=1, block_size=BS).tolist() == WANT.tolist()
    # Request 0 leaves; a new request takes its state row (reset) with blocks 2 and 6,
    # whose rows 24..27 are rewritten first. Request 1 goes on; its row 28 is declared
    # rewritten (invalidate), so its slot 3 is emptied in place (LRU order unchanged).
    table = TABLE.copy()
    table[0] = [2, 6, -1]
    new_rows = np.arange(24, 28)
    client.write(new_rows, np.stack([pattern(ly, new_rows, 16) ^ 0x5A for ly in range(3)]))
    h.finish_step()  # layer 2 (group 1) was not called
    h.begin_step([0, 1], reset=[True, False], invalidate=[[-1], [28]])
    idx = h.swap_in(REQS[:3], table, POS[:3], layer=0, block_size=BS)
    # new req 0: 9 -> null block | 5 -> row 6*4+1=25 | 1 -> row 2*4+1=9 | past the table:
    # misses into slots 0, 1 of its fresh region. Req 1: row 28 misses into the oldest
    # evictable slot, 5 (without the invalidate it would hit slot 3: index 11).
    assert idx.tolist() == [[-1, 0, 1, -1], [8, 9, -1, 10], [9, 13, 12, -1]]
    assert np.array_equal(h.kv(0)[0], pattern(0, [25], 16)[0] ^ 0x5A)  # the rewritten bytes
    host = np.array([[-1, 25, 9, -1], HOST[1], HOST[2]])
    ok = (idx >= 0) & (host != 25)
    assert np.array_equal(h.kv(0)[idx[ok]], pattern(0, host[ok], 16))


def test_out_arrays_are_filled_and_returned(client):
    h = HostSwapIn(client)
    h.begin_step([0, 1, -1], reset=[True, True, False])
    out = np.full((4, 4), 77, dtype=np.int32)
    vc = np.full(4, 77, dtype=np.int32)
    got, got_vc = h.swap_in(REQS, TABLE, POS, layer=0, block_size=BS, return_valid_counts=True,
                            attention_indices_out=out, valid_counts_out=vc)
    assert got is out and got_vc is vc
    assert out.tolist() == WANT.tolist() and vc.tolist() == WANT_COUNTS.tolist()
    with pytest.raises(BadRequest, match=r"attention_indices_out must have shape \(4, 4\)"):
        h.swap_in(REQS, TABLE, POS, layer=1, block_size=BS, attention_indices_out=np.zeros((4, 3), np.int32))
    with pytest.raises(BadRequest, match="attention_indices_out must be an int32"):
        h.swap_in(REQS, TABLE, POS, layer=1, block_size=BS, attention_indices_out=np.zeros((4, 4), np.int64))


def test_bad_calls_raise_typed_errors_that_name_the_mistake(client):
    with InprocClient() as bare:
        with pytest.raises(NotAttached, match="attach"):
            HostSwapIn(bare)
    h = HostSwapIn(client)
    with pytest.raises(BadRequest, match="swap_in before begin_step"):
        h.swap_in(REQS, TABLE, POS, layer=0, block_size=BS)
    h.begin_step([0, 1, -1], reset=[True, True, False])

    def refused(match, code=ErrorCode.BAD_ARGUMENT, reqs=REQS, table=TABLE, pos=POS, layer=0):
        with pytest.raises(BadRequest, match=match) as ei:
            h.swap_in(reqs, table, pos, layer=layer, block_size=BS)
        assert ei.value.code == code

    refused(r"layer 3 out of range \[0, 3\)", layer=3)
    refused("token 0 belongs to request 2, which is not among this step's state rows", ErrorCode.BAD_STATE_ROW,
            reqs=np.array([2, 1, 1, -1]))
    refused("outside \\[-1, max_reqs=3\\)", ErrorCode.BAD_STATE_ROW, reqs=np.array([3, 1, 1, -1]))
    refused(r"block_table has 1 row\(s\); request 1 has none", table=TABLE[:1])
    refused("logical_topk_indices has 5 columns, layout top_k is 4", pos=np.zeros((4, 5), np.int64))
    refused("logical_topk_indices must hold integers", pos=POS.astype(np.float32))
    refused(r"logical_topk_indices must be \[tokens=3, k\]", reqs=REQS[:3])
    # Three tokens of request 1 exceed its region (2 tokens of top_k 4): the daemon says so.
    refused("state row 1 appears 3 times", reqs=np.array([0, 1, 1, 1]))
    with pytest.raises(BadRequest, match="layer 3"):
        h.kv(3)
    h.swap_in(REQS, TABLE, POS, layer=0, block_size=BS)
    refused("layer 1 reuses the top-k of its leader layer 0, so it must pass the same tokens",
            reqs=np.array([0, 1, -1, 1]), layer=1)
    h.close()
    h.close()
    with pytest.raises(NotAttached, match="closed"):  # typed, as the README says (it was INTERNAL)
        h.swap_in(REQS, TABLE, POS, layer=0, block_size=BS)
    assert client.attachment is not None  # the handle leaves the client to its owner


def test_a_step_of_arrays_numpy_cannot_read_or_a_cast_would_change_is_refused(client):
    """Found by a review of the day's argument fixes: the handle's begin_step let NumPy's
    bare ValueError out for a ragged list, and cast reset (0.5 and NaN began new requests)."""
    h = HostSwapIn(client)
    for kw, words in (({"state_rows": [[0], [0, 1]]}, "state_rows must be an array"),
                      ({"state_rows": [0, 1], "reset": [[True], [True, False]]}, "reset must be an array"),
                      ({"state_rows": [0, 1], "reset": [0.5, np.nan]}, "reset must be bool"),
                      ({"state_rows": [0, 1], "reset": [2, 0]}, "reset must be bool"),
                      ({"state_rows": [0, 1], "invalidate": [[1], [2, 3]]}, "invalidate must be an array")):
        with pytest.raises(BadRequest, match=words) as ei:
            h.begin_step(**kw)
        assert ei.value.code == ErrorCode.BAD_ARGUMENT
    h.begin_step([0, 1], reset=[True, False])  # the handle serves on


def test_check_raises_a_refused_step_through_either_transport(client):
    h = HostSwapIn(client)
    with pytest.raises(BadRequest) as ei:
        # In process the step raises at once; the zmq client sends it without waiting
        # (it rides on the next request) and check() waits for its reply.
        h.begin_step([5])
        h.check()
    assert ei.value.code == ErrorCode.BAD_STATE_ROW
    with pytest.raises(BadRequest, match="the last begin_step, or its step's first swap_in, failed"):
        h.swap_in(REQS, TABLE, POS, layer=0, block_size=BS)  # the refused step was not begun: nothing to serve
    h.begin_step([0, 1, -1])
    h.check()  # nothing refused since


def test_a_step_refused_at_its_first_swap_in_is_not_served_on_a_retry(client):
    """Found by an adversarial review: over zmq a refused STEP (here its invalidate) is
    raised at the step's first swap_in; a retried swap_in then ran without it, serving
    as hits the rows of the last step that the step had reset. The step ends there: swap_in
    refuses until the next begin_step, which serves as asked."""
    fill_pool(client, LAYOUT)
    h = HostSwapIn(client)
    h.begin_step([0, 1, -1], reset=[True, True, False])
    h.swap_in(REQS, TABLE, POS, layer=0, block_size=BS)
    h.swap_in(REQS, TABLE, POS, layer=1, block_size=BS)
    h.swap_in(REQS, TABLE, POS, layer=2, block_size=BS)
    with pytest.raises(BadRequest, match="invalidate holds 64"):
        h.begin_step([0, 1, -1], reset=[True, True, False], invalidate=[[64], [-1], [-1]])
        h.swap_in(REQS, TABLE, POS, layer=0, block_size=BS)  # (zmq: the STEP's refusal comes here)
    with pytest.raises(BadRequest, match="the last begin_step, or its step's first swap_in, failed"):
        h.swap_in(REQS, TABLE, POS, layer=0, block_size=BS)
    h.begin_step([0, 1, -1], reset=[True, True, False])  # no finish_step needed: the step ended
    idx = h.swap_in(REQS, TABLE, POS, layer=0, block_size=BS)
    assert np.array_equal(idx, WANT) and rows_match(h, 0, idx, HOST)  # regions reset: misses, as at first


def test_a_steps_arrays_reused_before_its_first_swap_in_change_nothing(client):
    """Found by an adversarial review: over zmq the STEP goes with the step's first
    request, and it held the caller's arrays: state rows rewritten in between made the
    daemon reset another request's region."""
    fill_pool(client, LAYOUT)

    def two_steps(reuse: bool):
        h = HostSwapIn(client)
        h.begin_step([0, 1, -1], reset=[True, True, False])
        h.swap_in(REQS, TABLE, POS, layer=0, block_size=BS)
        h.finish_step()
        rows, reset = np.array([0, 1, -1], np.int32), np.array([True, False, False])
        h.begin_step(rows, reset=reset)  # request 0 starts again: its region is emptied
        if reuse:  # the engine fills its buffers for the next step early
            rows[:], reset[:] = [2, 1, -1], [False, False, False]
        idx = h.swap_in(REQS, TABLE, POS, layer=0, block_size=BS)
        h.finish_step()
        return idx, dict(h.counts)

    idx, counts = two_steps(reuse=True)
    want_idx, want_counts = two_steps(reuse=False)
    assert np.array_equal(idx, want_idx) and counts == want_counts
    assert np.array_equal(idx[0], WANT[0])  # request 0 missed again: reset as asked


def test_arguments_a_cast_would_change_are_refused(client):
    """Found by an adversarial review: ``block_size`` 4.5, "4" or True was taken as 4 or 1;
    a negative ``hot_base`` gave negative indices; a ``resident_block_table`` without an
    engine slab pointed into the daemon's hot rows (another request's), and one past
    int64 wrapped to small indices."""
    h = HostSwapIn(client)
    h.begin_step([0, 1, -1], reset=[True, True, False])
    for bs in (4.5, "4", True):
        with pytest.raises(BadRequest, match="block_size must be an integer") as ei:
            h.swap_in(REQS, TABLE, POS, layer=0, block_size=bs)
        assert ei.value.code == ErrorCode.BAD_ARGUMENT
    with pytest.raises(BadRequest, match="resident_block_table needs an engine-owned slab"):
        h.swap_in(REQS, TABLE, POS, layer=0, block_size=BS, resident_block_table=np.full((3, 4), -1))
    for base in (-4, 2.0, True):
        with pytest.raises(BadRequest, match="hot_base must be an integer in"):
            HostSwapIn(client, hot_base=base)
    with pytest.raises(BadRequest, match="resident_base must be an integer in"):
        HostSwapIn(client, resident_base=-1)
    with pytest.raises(BadRequest, match="layer True out of range"):
        h.swap_in(REQS, TABLE, POS, layer=True, block_size=BS)
    idx = h.swap_in(REQS, TABLE, POS, layer=0, block_size=np.int64(BS))  # a NumPy integer is one
    assert np.array_equal(idx, WANT)


def test_kv_is_a_view_of_the_attached_slab(client):
    h = HostSwapIn(client)
    slab = client.attachment.slab
    for layer in range(LAYOUT.num_layers):
        kv = h.kv(layer)
        assert kv.shape == (LAYOUT.max_reqs * LAYOUT.region_stride, LAYOUT.row_bytes) and kv.dtype == np.uint8
        assert np.shares_memory(kv, slab[layer])
        kv[2 * LAYOUT.region_stride + 5] = 200 + layer  # region of state row 2, slot 5
        assert (slab[layer, 2, 5] == 200 + layer).all()


def test_a_handle_of_a_rank_that_detached_refuses_to_serve(client):
    """A handle made before ``detach`` (then ``attach`` again) must not serve the new rank
    from the old slab's views. Seen (an adversarial review): begin_step and swap_in ran,
    the top-k went to the new rank and ``kv`` read the old slab: other rows, no error."""
    h = HostSwapIn(client)
    client.detach()
    client.attach(LAYOUT)
    with pytest.raises(NotAttached, match="rank was detached"):
        h.begin_step(np.array([0], np.int32))
    with pytest.raises(NotAttached, match="closed"):  # and from then on, closed
        h.kv(0)
    h2 = HostSwapIn(client)
    client.detach()
    with pytest.raises(NotAttached, match="rank was detached"):
        h2.kv(0)
    client.attach(LAYOUT)
    fresh = HostSwapIn(client)
    assert np.shares_memory(fresh.kv(0), client.attachment.slab[0])


def test_torch_in_torch_out_and_torch_out_arrays():
    torch = pytest.importorskip("torch")
    with InprocClient() as c:
        c.attach(LAYOUT)
        fill_pool(c, LAYOUT)
        h = HostSwapIn(c)
        h.begin_step(torch.tensor([0, 1, -1]), reset=torch.tensor([True, True, False]))
        idx, counts = h.swap_in(torch.from_numpy(REQS), torch.from_numpy(TABLE), torch.from_numpy(POS), layer=0,
                                block_size=BS, return_valid_counts=True)
        assert isinstance(idx, torch.Tensor) and idx.dtype == torch.int32 and counts.dtype == torch.int32
        assert idx.tolist() == WANT.tolist() and counts.tolist() == WANT_COUNTS.tolist()
        out, vc = torch.full((4, 4), 7, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
        got = h.swap_in(torch.from_numpy(REQS), torch.from_numpy(TABLE), torch.from_numpy(POS), layer=1,
                        block_size=BS, return_valid_counts=True, attention_indices_out=out, valid_counts_out=vc)
        assert got[0] is out and got[1] is vc and out.tolist() == WANT.tolist() and vc.tolist() == WANT_COUNTS.tolist()
        with pytest.raises(BadRequest, match="must be int32"):
            h.swap_in(torch.from_numpy(REQS), TABLE, POS, layer=1, block_size=BS,
                      attention_indices_out=torch.zeros((4, 4), dtype=torch.int64))
        # What an attention layer does with them: the rows of layer 1, as a tensor.
        kv = torch.as_tensor(h.kv(1))
        ok = idx >= 0
        assert torch.equal(kv[idx[ok].long()], torch.from_numpy(pattern(1, HOST[ok.numpy()], 16)))


class TensorReplies:
    """A client whose top-k replies hold torch tensors, as the cuda backend's do (views of
    the rank's result ring; here on the CPU): the handle makes the indices from them with
    torch, on the tensors' device, and never reads them back."""

    def __init__(self, client, torch):
        self._c, self._torch, self.replies = client, torch, []
        self.attachment = client.attachment

    def step(self, *a, **k):
        return self._c.step(*a, **k)

    def topk(self, *a, **k):
        from sparsekv.client.results import TopkResult

        res = self._c.topk(*a, **k)
        slots, misses = res.host()
        t = self._torch.from_numpy
        self.replies.append(t(np.array(slots, np.int32)))
        return TopkResult(self.replies[-1], t(np.array(misses, np.int32)), res.hits, res.out_of_range)


def test_tensor_replies_give_the_same_indices_counts_and_rows_made_with_torch(monkeypatch):
    """cuda's replies (tensors): with an input on the GPU (here: any tensor, on the CPU)
    the indices, valid counts, the follower's copy and the misses summed on the device
    equal the hand-worked case; with NumPy inputs the slots come to the host first (the
    host path), with the same results; every out kind."""
    torch = pytest.importorskip("torch")
    from sparsekv.client import swap_in as swap_in_mod

    monkeypatch.setattr(swap_in_mod, "on_gpu", swap_in_mod.is_torch)
    with InprocClient() as c:
        c.attach(LAYOUT)
        fill_pool(c, LAYOUT)
        proxy = TensorReplies(c, torch)
        h = HostSwapIn(proxy)
        h.begin_step([0, 1, -1], reset=[True, True, False])
        idx, vc = h.swap_in(torch.from_numpy(REQS), TABLE, POS, layer=0, block_size=BS, return_valid_counts=True)
        assert isinstance(idx, torch.Tensor) and idx.dtype == torch.int32 and vc.dtype == torch.int32
        assert idx.tolist() == WANT.tolist() and vc.tolist() == WANT_COUNTS.tolist()
        assert rows_match(h, 0, idx.numpy(), HOST)
        proxy.replies[0].fill_(-7)  # the ring entry is reused later: the follower has a copy of its own
        out = torch.full((4, 4), 5, dtype=torch.int32)
        assert h.swap_in(REQS, TABLE, POS, layer=1, block_size=BS, attention_indices_out=out) is out
        assert out.tolist() == WANT.tolist()
        idx = h.swap_in(REQS, TABLE, POS, layer=2, block_size=BS)  # NumPy in: the host path, NumPy out
        assert isinstance(idx, np.ndarray) and idx.dtype == np.int32 and idx.tolist() == WANT.tolist()
        assert rows_match(h, 2, idx, HOST)
        assert h.counts == {"batches": 2, "hits": 2, "misses": 14, "out_of_range": 8}
        h.begin_step([0, 1, -1])
        npout, npvc = np.zeros((4, 4), np.int32), np.zeros(4, np.int32)
        h.swap_in(REQS, TABLE, POS, layer=0, block_size=BS, attention_indices_out=npout, return_valid_counts=True,
                  valid_counts_out=npvc)
        assert npout.tolist() == WANT.tolist() and npvc.tolist() == WANT_COUNTS.tolist()
        assert h.counts["misses"] == 14  # all hit the second time


def fake_map_positions(mapped):
    """A stand-in for swap_in_kernels.map_positions (the kernel needs a GPU): checks what
    the kernel is given, maps by the host rule, records the call."""
    from sparsekv.proto.positions import UNMAPPED, host_rows

    torch = pytest.importorskip("torch")

    def map_positions(topk, table, block_size, reqs):
        assert all(isinstance(a, torch.Tensor) for a in (topk, table, reqs)) and reqs.dtype == torch.int32
        if topk.dtype not in (torch.int32, torch.int64) or table.dtype not in (torch.int32, torch.int64):
            return None
        mapped.append(1)
        r = reqs.numpy()
        inside = (r >= 0) & (r < table.shape[0])
        rows = host_rows(topk.numpy(), table.numpy(), block_size, table_rows=np.where(inside, r, -1))
        return torch.from_numpy(np.where(inside[:, None], rows, UNMAPPED).astype(np.int32))

    return map_positions


def test_a_top_k_on_the_gpu_is_mapped_there_and_only_the_rows_come_to_the_host(monkeypatch):
    """A top-k tensor on the GPU (here: any tensor) is mapped by the kernel on its device
    where CuPy is installed (here a stand-in), never by host_rows, with a block table
    either on the host or a tensor; the same indices as the hand-worked case. Its shape
    and type are checked in place, with the host path's errors. A top-k on the host, a
    dtype the kernel does not take, or no CuPy: the host path (host_rows)."""
    torch = pytest.importorskip("torch")
    from sparsekv.client import swap_in as swap_in_mod

    monkeypatch.setattr(swap_in_mod, "on_gpu", swap_in_mod.is_torch)
    monkeypatch.setattr(swap_in_mod.swap_in_kernels, "available", lambda: True)
    mapped, hosted = [], []
    real_host_rows = swap_in_mod.host_rows
    monkeypatch.setattr(swap_in_mod.swap_in_kernels, "map_positions", fake_map_positions(mapped))
    monkeypatch.setattr(swap_in_mod, "host_rows", lambda *a, **k: hosted.append(1) or real_host_rows(*a, **k))
    pos = torch.from_numpy(POS)
    with InprocClient() as c:
        c.attach(LAYOUT)
        fill_pool(c, LAYOUT)
        h = HostSwapIn(c)
        h.begin_step([0, 1, -1], reset=[True, True, False])
        idx = h.swap_in(REQS, TABLE, pos, layer=0, block_size=BS)
        assert mapped == [1] and hosted == [] and idx.tolist() == WANT.tolist()
        assert rows_match(h, 0, idx.numpy(), HOST)
        with pytest.raises(BadRequest, match=r"logical_topk_indices \(4, 3\) differ"):  # a follower's
            h.swap_in(REQS, TABLE, pos[:, :3], layer=1, block_size=BS)
        assert h.swap_in(torch.from_numpy(REQS), TABLE, pos, layer=1, block_size=BS).tolist() == WANT.tolist()
        idx = h.swap_in(torch.from_numpy(REQS), torch.from_numpy(TABLE), pos, layer=2, block_size=BS)
        assert mapped == [1, 1] and hosted == [] and idx.tolist() == WANT.tolist()
        h.begin_step([0, 1, -1])
        with pytest.raises(BadRequest, match="logical_topk_indices must have 2 dimension"):
            h.swap_in(REQS, TABLE, pos[None], layer=0, block_size=BS)
        with pytest.raises(BadRequest, match="logical_topk_indices must hold integers"):
            h.swap_in(REQS, TABLE, pos.float(), layer=0, block_size=BS)
        with pytest.raises(BadRequest, match="block_table must hold integers"):
            h.swap_in(REQS, torch.from_numpy(TABLE).float(), pos, layer=0, block_size=BS)
        assert mapped == [1, 1] and hosted == []
        with pytest.raises(BadRequest, match="block_size must be positive"):  # the host path names it
            h.swap_in(REQS, TABLE, pos, layer=0, block_size=np.int64(0))
        assert mapped == [1, 1] and hosted == [1]
        with pytest.raises(BadRequest, match="resident_block_table needs an engine-owned slab"):  # before any work
            h.swap_in(REQS, TABLE, pos, layer=0, block_size=BS, resident_block_table=np.full((3, 2), -1, np.int32))
        assert mapped == [1, 1] and hosted == [1]
        h.swap_in(REQS, TABLE, POS, layer=0, block_size=BS)  # a top-k on the host: the host path
        assert mapped == [1, 1] and hosted == [1, 1]
        h.swap_in(REQS, TABLE, pos.to(torch.int16), layer=1, block_size=BS)  # a follower: nothing mapped
        h.swap_in(REQS, TABLE, pos, layer=2, block_size=BS)  # a leader
        h.begin_step([0, 1, -1])
        idx = h.swap_in(REQS, TABLE, pos.to(torch.int16), layer=0, block_size=BS)  # no int16 kernel
        assert mapped == [1, 1, 1] and hosted == [1, 1, 1] and idx.tolist() == WANT.tolist()
        h.swap_in(REQS, TABLE, pos, layer=1, block_size=BS)
        h.swap_in(REQS, TABLE, pos, layer=2, block_size=BS)
        monkeypatch.setattr(swap_in_mod.swap_in_kernels, "available", lambda: False)
        h = HostSwapIn(c)  # no CuPy
        h.begin_step([0, 1, -1])
        assert h.swap_in(REQS, TABLE, pos, layer=0, block_size=BS).tolist() == WANT.tolist()
        assert mapped == [1, 1, 1, 1] and hosted == [1, 1, 1, 1]


def test_a_gpu_req_id_tensor_is_read_once_a_step_on_a_fenced_rank_even_in_inference_mode(monkeypatch):
    """On a rank with fence events a req_id_per_token tensor on the GPU (here: any tensor)
    is copied to the host at its first use in a step, again only when modified in place
    (its version counter) or in the next step; inference-mode tensors (no version
    counter, what serving engines run decode under) work alike. Without fences every
    leader copies it (that wait orders the daemon's reuse of a ring entry)."""
    torch = pytest.importorskip("torch")
    from sparsekv.client import swap_in as swap_in_mod

    monkeypatch.setattr(swap_in_mod, "on_gpu", swap_in_mod.is_torch)
    copied = []
    real_ints = swap_in_mod._ints
    monkeypatch.setattr(swap_in_mod, "_ints", lambda name, *a, **k: (copied.append(name) if name == "req_id_per_token"
                                                                     else None) or real_ints(name, *a, **k))
    with InprocClient() as c:
        c.attach(LAYOUT)
        fill_pool(c, LAYOUT)
        h = HostSwapIn(c)
        for fenced in (False, True):
            h._fenced = fenced  # (an in-process client has no fences: as a fenced cuda rank would)
            for mode in (torch.no_grad, torch.inference_mode):
                with mode():
                    reqs = torch.from_numpy(REQS.copy())
                    copied.clear()
                    h.begin_step([0, 1, -1], reset=[True, True, False])
                    for layer in range(LAYOUT.num_layers):
                        assert h.swap_in(reqs, TABLE, POS, layer=layer, block_size=BS).tolist() == WANT.tolist()
                    assert len(copied) == (1 if fenced else 3), (fenced, mode)
        h._fenced = True
        reqs = torch.from_numpy(REQS.copy())
        copied.clear()
        h.begin_step([0, 1, -1])
        h.swap_in(reqs, TABLE, POS, layer=0, block_size=BS)
        reqs.add_(0)  # in place: the version moves on
        h.swap_in(reqs, TABLE, POS, layer=1, block_size=BS)
        assert len(copied) == 2


def test_the_handle_imports_and_runs_without_torch(tmp_path):
    code = textwrap.dedent("""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "cupy"):
                    raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        sys.meta_path.insert(0, Block())
        import numpy as np
        from sparsekv.embedded.inproc import InprocClient
        from sparsekv.client.swap_in import HostSwapIn
        from sparsekv.proto import Layout
        with InprocClient() as c:
            c.attach(Layout(num_layers=1, row_bytes=16, top_k=2, region_stride=2, max_reqs=1, host_rows=8))
            h = HostSwapIn(c)
            h.begin_step([0])
            print(h.swap_in(np.array([0]), np.array([[1]]), np.array([[2, 0]]), layer=0, block_size=4).tolist())
        assert not {"torch", "cupy"} & set(sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "[[0, 1]]"


def test_a_failed_begin_step_leaves_no_step_to_swap_into():
    with InprocClient() as c:
        c.attach(LAYOUT)
        h = HostSwapIn(c)
        h.begin_step([0, 1, -1], reset=[True, True, False])
        h.swap_in(REQS, TABLE, POS, layer=0, block_size=BS)
        h.finish_step()
        with pytest.raises(BadRequest, match="state_rows must hold integers"):
            h.begin_step(np.array([0.0, 1.0]))
        with pytest.raises(BadRequest, match="the last begin_step, or its step's first swap_in, failed"):
            h.swap_in(REQS, TABLE, POS, layer=1, block_size=BS)  # not the last step's slots either
        h.begin_step([0, 1, -1])
        with pytest.raises(BadRequest, match="block_size must be positive"):
            h.swap_in(REQS, TABLE, POS, layer=0, block_size=0)


def test_every_handle_has_the_methods_of_the_swap_in_protocol():
    """HostSwapIn, the doorbell handle and the in-process one take the same arguments for
    every method of SwapInHandle: model code written against it runs on each."""
    want = {n: list(inspect.signature(f).parameters) for n, f in vars(SwapInHandle).items()
            if inspect.isfunction(f) and not n.startswith("_")}
    assert set(want) == {"begin_step", "finish_step", "swap_in", "kv", "check", "close"}
    for cls in (HostSwapIn, DoorbellSwapIn, InprocSwapIn):
        for name, params in want.items():
            assert list(inspect.signature(getattr(cls, name)).parameters) == params, (cls.__name__, name)
