"""A cuda rank's host-side wait for a daemon's GPU work (client/cuda_attach.py
``_wait_event``) is never unbounded: a dead daemon's event may never complete, so the
wait asks whether the daemon is still there and gives up with DaemonUnavailable. Runs
without a GPU (the event is a stand-in)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from sparsekv.client import cuda_attach
from sparsekv.client.errors import DaemonUnavailable


def attachment(done):
    return SimpleNamespace(_events=SimpleNamespace(done=done))


def test_an_event_that_never_completes_ends_in_daemon_unavailable_once_the_daemon_is_gone():
    checks = []

    def still_there():
        checks.append(time.monotonic())
        if len(checks) == 2:
            raise DaemonUnavailable("sparsekvd is gone (pid 1 exited)")

    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailable, match="gone"):
        cuda_attach.CudaAttachment._wait_event(attachment(lambda e: False), 3, still_there)
    assert len(checks) == 2
    assert checks[0] - t0 >= cuda_attach.EVENT_CHECK_S * 0.9  # asked once a slice, not in a busy loop
    assert checks[1] - checks[0] >= cuda_attach.EVENT_CHECK_S * 0.9


def test_an_event_that_completes_returns_without_asking():
    polls = []

    def done(e):
        polls.append(e)
        return len(polls) >= 5

    cuda_attach.CudaAttachment._wait_event(attachment(done), 7, lambda: pytest.fail("asked while the event was done"))
    assert polls == [7] * 5
