"""proto/cuda_ipc.open_mem_handle: the retry of a transient cudaErrorInvalidResourceHandle
(seen under MPS right after a process holding the memory was SIGKILLed), without a GPU:
CuPy's runtime is stood in for."""

import types

import pytest

from sparsekv.proto import cuda_ipc


class FakeError(Exception):
    def __init__(self, status):
        super().__init__(f"status {status}")
        self.status = status


def fake_cupy(results):
    """A cupy whose ipcOpenMemHandle returns or raises ``results`` in turn."""
    calls = []

    def open_handle(handle, flags):
        calls.append((handle, flags))
        r = results[len(calls) - 1]
        if isinstance(r, Exception):
            raise r
        return r

    runtime = types.SimpleNamespace(ipcOpenMemHandle=open_handle, CUDARuntimeError=FakeError,
                                    cudaIpcMemLazyEnablePeerAccess=1)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime)), calls


def test_an_invalid_handle_for_a_moment_is_opened_on_a_later_try(monkeypatch):
    cp, calls = fake_cupy([FakeError(400), FakeError(400), 0xABC])
    monkeypatch.setattr(cuda_ipc, "_cp", lambda: cp)
    naps = []
    assert cuda_ipc.open_mem_handle(b"h", retry_s=5.0, sleep=naps.append) == 0xABC
    assert len(calls) == 3 and calls[0] == (b"h", 1)
    assert naps == sorted(naps) and len(naps) == 2  # growing naps between tries
    assert cuda_ipc.last_retried_open["tries"] == 3  # what the soak reports


def test_other_errors_are_not_retried_and_the_invalid_handle_stands_past_the_deadline(monkeypatch):
    cp, calls = fake_cupy([FakeError(1)])
    monkeypatch.setattr(cuda_ipc, "_cp", lambda: cp)
    with pytest.raises(FakeError) as ei:
        cuda_ipc.open_mem_handle(b"h", retry_s=5.0, sleep=lambda s: None)
    assert ei.value.status == 1 and len(calls) == 1
    assert ei.value.open_tries == 1  # what it tried travels with the error
    cp, calls = fake_cupy([FakeError(400)] * 100)
    monkeypatch.setattr(cuda_ipc, "_cp", lambda: cp)
    with pytest.raises(FakeError) as ei:
        cuda_ipc.open_mem_handle(b"h", retry_s=0.0, sleep=lambda s: None)
    assert ei.value.status == 400 and len(calls) == 1 and ei.value.open_tries == 1
