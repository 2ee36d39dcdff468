"""A doorbell handle's watcher learns that its rank's TP group stopped from the stop word's
host copy in the blocks file (a plain load): a CUDA call from its thread while the engine
captures a CUDA graph in global mode (torch's default) would break that capture, as a
copy of the device word once did in ``bench serve``."""

from __future__ import annotations

import types

import numpy as np

from sparsekv.client.doorbell import DoorbellSwapIn


def _handle(mirror):
    h = object.__new__(DoorbellSwapIn)
    h.att = types.SimpleNamespace(stop_mirror=mirror)
    return h


def test_the_watcher_reads_the_stop_words_host_copy(monkeypatch):
    import sys

    # Any CuPy use from the watcher's check fails this test.
    monkeypatch.setitem(sys.modules, "cupy", None)
    word = np.zeros(1, np.int32)
    h = _handle(word)
    assert h._stopped() is False
    word[0] = 1
    assert h._stopped() is True


def test_a_rank_without_a_host_copy_is_never_stopped(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cupy", None)
    assert _handle(None)._stopped() is False
