"""The cuda rank's transports by kind (no GPU needed: nothing here reaches CuPy), and the
layering that keeps daemon/cuda below daemon/backends.py."""

import ast
import pathlib

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
