"""The engine's polling ``skv_db_indices`` (csrc/handle.cu) in the emulator, with a second
thread playing the daemon or the handle's watcher while the kernel polls: it waits for
the ready word, reads the slots only after it, ends on the dead word too; and which
launches poll (client/doorbell.py: one block, a few tokens)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

import cpu_kernels
from sparsekv.client.doorbell import POLL_TOKENS, DoorbellSwapIn
from test_kernels_on_cpu import _positions_case


def _launch_polling(slots, req, topk, resident, table_rows, bs, dead, out, ready, arrivals):
    return cpu_kernels.start(cpu_kernels.db_indices, 1, 32, slots, req, topk, resident, table_rows, bs, 64, 1000,
                             50_000, dead, out, clear=ready, arrivals=arrivals)


def _finish(t, ready):
    cpu_kernels.finish(t, ready, "skv_db_indices still polls a set ready word")


def test_the_polling_indices_read_the_slots_the_daemon_wrote_before_the_word():
    rng = np.random.default_rng(3)
    req, table, resident, topk, bs = _positions_case(rng)
    tokens, k = topk.shape
    old = rng.integers(-1, 64, size=(8, k)).astype(np.int32)
    new = rng.integers(-1, 64, size=(8, k)).astype(np.int32)
    want = np.full((tokens, k), -9, np.int32)
    cpu_kernels.db_indices(1, 32, new, req, topk, resident, table.shape[0], bs, 64, 1000, 50_000,
                           np.zeros(1, np.int32), want)
    slots = old.copy()
    ready, arrivals, dead = np.zeros(1, np.uint32), np.zeros(1, np.uint32), np.zeros(1, np.int32)
    out = np.full((tokens, k), -9, np.int32)
    t = _launch_polling(slots, req, topk, resident, table.shape[0], bs, dead, out, ready, arrivals)
    time.sleep(0.05)
    assert t.is_alive() and (out == -9).all(), "the kernel went on before the ready word was set"
    slots[:] = new  # the daemon's resolve, then its gather's ready word
    ready[0] = 1
    _finish(t, ready)
    np.testing.assert_array_equal(out, want)
    assert ready.tolist() == [0] and arrivals.tolist() == [0]


def test_the_dead_word_ends_the_poll_and_gives_minus_one_everywhere():
    """The watcher sets the dead word before the ready words it releases; a poll that sees
    the dead word alone ends too (a handle closed before its ready words were set)."""
    rng = np.random.default_rng(4)
    req, table, resident, topk, bs = _positions_case(rng)
    tokens, k = topk.shape
    slots = rng.integers(0, 64, size=(8, k)).astype(np.int32)
    ready, arrivals, dead = np.zeros(1, np.uint32), np.zeros(1, np.uint32), np.zeros(1, np.int32)
    out = np.full((tokens, k), -9, np.int32)
    t = _launch_polling(slots, req, topk, resident, table.shape[0], bs, dead, out, ready, arrivals)
    time.sleep(0.05)
    assert t.is_alive()
    dead[0] = 1
    _finish(t, ready)
    assert (out == -1).all() and arrivals.tolist() == [0]


@pytest.mark.parametrize("tokens", [0, 1, POLL_TOKENS, POLL_TOKENS + 1, 64])
def test_only_a_few_tokens_poll_and_the_rest_wait_on_the_stream(tokens):
    """The doorbell handle's choice: up to POLL_TOKENS tokens skv_db_indices polls (the
    layer's counter; swap_in launches it with one block), beyond the stream waits."""
    counters = np.zeros(3, np.uint32)
    h = object.__new__(DoorbellSwapIn)  # no GPU: only the choice is used
    h._idx_arrivals = SimpleNamespace(data=SimpleNamespace(ptr=counters.ctypes.data))
    got = h._poller(2, tokens)
    assert got == (counters.ctypes.data + 8 if tokens <= POLL_TOKENS else 0)
