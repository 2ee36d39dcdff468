"""The cuda rank's transports by kind (no GPU needed: nothing here reaches CuPy), and the
layering that keeps daemon/cuda below daemon/backends.py."""

import ast
import pathlib
from types import SimpleNamespace

import numpy as np
import pytest

from sparsekv.daemon import backends
from sparsekv.daemon.cuda.doorbell import DoorbellTransport
from sparsekv.daemon.cuda.rank import CudaRankState
from sparsekv.daemon.cuda.transport import DeviceTransport, MessageTransport, ZmqTransport
from sparsekv.daemon.engine import Backend
from sparsekv.daemon.residency.base import ResidencyError

DAEMON = pathlib.Path(backends.__file__).parent


def test_each_transport_implements_all_of_its_kind():
    assert issubclass(ZmqTransport, MessageTransport) and not issubclass(ZmqTransport, DeviceTransport)
    assert issubclass(DoorbellTransport, DeviceTransport) and not issubclass(DoorbellTransport, MessageTransport)
    assert ZmqTransport.__abstractmethods__ == DoorbellTransport.__abstractmethods__ == frozenset()
    for message_only in ("step", "topk", "topk_block", "release_entry"):
        assert not hasattr(DoorbellTransport, message_only)
    assert issubclass(backends.CpuBackend, Backend) and backends.CpuBackend.__abstractmethods__ == frozenset()


def test_a_doorbell_rank_refuses_step_and_topk_messages_and_answers_no_request_with_its_errors():
    rank = CudaRankState.__new__(CudaRankState)  # no GPU: only what runs before any device work
    rank.transport = DoorbellTransport.__new__(DoorbellTransport)
    rank.fence_events, rank.step, rank.state_rows = None, 0, np.zeros(1, np.int32)
    rank.residency = SimpleNamespace(layout=SimpleNamespace(max_reqs=1, max_batch=1))  # (begin_step's checks)
    assert rank.device_driven
    for send in (lambda: rank.begin_step(0, np.zeros(1, np.int32)),
                 lambda: rank.serve_topk(0, 0, np.zeros((1, 2), np.int32)),
                 lambda: rank.serve_topk_block(0, 0, 0, True)):
        with pytest.raises(ResidencyError, match="doorbell transport: its steps come from its engine's stream") as e:
            send()
        assert e.value.code == "BAD_ARGUMENT"
    assert rank.take_error() is None  # its engine reads them (the handle's check())


def test_nothing_under_daemon_cuda_imports_the_backends_module():
    for path in sorted((DAEMON / "cuda").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                named = f"{'.' * node.level}{node.module or ''}"
                assert named not in ("..backends", "sparsekv.daemon.backends"), f"{path.name} imports {named}"


@pytest.mark.parametrize("prefetch", [False, True])
def test_the_doorbell_step_marks_each_groups_slots_with_its_first_gather_only(monkeypatch, prefetch):
    """The step graph's order (``_enqueue_step``, recorded with stand-ins): each group's
    first gather marks the TOPK block's slots written (D_SLOTS, which the engine's polling
    skv_db_indices makes its indices at), its other layers' gathers do not; a group's
    first gather follows its resolve, and only that one is launched programmatically (the
    last group's has the counters' copy between them)."""


    from sparsekv.daemon.cuda import doorbell

    monkeypatch.setattr(doorbell, "wait32", lambda *a: None)
    monkeypatch.setattr(doorbell, "write32", lambda *a: None)
    calls = []

    class Step:
        residency = SimpleNamespace(launch_begin_step=lambda *a: calls.append(("begin",)))

        def enqueue_resolve(self, t, slots, misses, stream, clear=0):
            calls.append(("resolve", t))

        def enqueue_stats_out(self, stream):
            calls.append(("stats",))

        def enqueue_gather(self, t, misses, stream, group_layers=None, ready=0, arrivals=0, after_resolve=False,
                           mark_slots=False):
            calls.append(("gather", t, group_layers, after_resolve, mark_slots))

        def enqueue_prefetch(self, t, stream, stats_out=True):
            calls.append(("prefetch", t))

    groups = [[0, 1], [2], [3, 4, 5]]
    tr = DoorbellTransport.__new__(DoorbellTransport)
    tr.dstep = Step()
    tr.layout = SimpleNamespace(groups=groups, num_groups=3)
    step = SimpleNamespace(desc=0, rows=0, aux=0, payload=0)
    tr.buffers = SimpleNamespace(db_step=step, err=0, max_batch=4, db_topk=["t0", "t1", "t2"], db_slots=[0] * 3,
                                 db_misses=[0] * 3, db_layers=[f"L{i}" for i in range(6)], prefetch=prefetch)
    tr._bell_step, tr._bells, tr._ready = 1, [2, 3, 4], list(range(10, 16))
    tr._arrivals = SimpleNamespace(data=SimpleNamespace(ptr=1000))
    tr._enqueue_step(SimpleNamespace(ptr=0))
    gathers = [c for c in calls if c[0] == "gather"]
    assert [(c[1], c[2], c[4]) for c in gathers] == [
        ("t0", "L0", True), ("t0", "L1", False), ("t1", "L2", True), ("t2", "L3", True), ("t2", "L4", False),
        ("t2", "L5", False)]
    assert [c[3] for c in gathers] == [True, False, True, False, False, False]
    for g, t in enumerate(["t0", "t1", "t2"]):
        at = calls.index(("resolve", t))
        assert calls[at + 1 + (g == 2)][:2] == ("gather", t)  # the last group: the counters' copy between
    assert (("prefetch", "t0") in calls) == prefetch and ("prefetch", "t2") not in calls


@pytest.mark.parametrize("member", [False, True])
def test_the_attach_reply_says_whether_only_this_gpu_waits_on_the_bells(member):
    """A doorbell rank's export (its attach reply) says ``bells_local`` unless the rank is
    one of a TP group, whose leader's stream waits on every member's bells: the engine's
    skv_db_topk rings after a device-scope fence only where it is true."""


    rank = CudaRankState.__new__(CudaRankState)
    rank.tp_member = member
    rank.worker = SimpleNamespace(ordinal=0, bus_id="0000:00:00.0")
    rank.events = SimpleNamespace(handles=[])
    rank.residency = SimpleNamespace(inv_cap=8)
    rank.buffers = SimpleNamespace(export=lambda *a: {"doorbell": {"bells": [1]}})
    out = rank.export()
    assert out["doorbell"]["bells_local"] is (not member) and out["doorbell"]["inv_cap"] == 8
