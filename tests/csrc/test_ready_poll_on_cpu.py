"""The engine's polling ``skv_db_indices`` (csrc/handle.cu) in the emulator, with a second
thread playing the daemon or the handle's watcher while the kernel polls: it waits for
the ready word, reads the slots only after it (or after the TOPK block's D_SLOTS word,
then still waits for the ready word), ends on the dead word too; and which launches poll
(client/doorbell.py: one block, a few tokens)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

import cpu_kernels
from sparsekv.client.doorbell import POLL_TOKENS, DoorbellSwapIn
from test_kernels_on_cpu import _positions_case


def _launch_polling(slots, req, topk, resident, table_rows, bs, dead, out, ready, arrivals, slots_ready=None,
                    valid=None):
    return cpu_kernels.start(cpu_kernels.db_indices, 1, 32, slots, req, topk, resident, table_rows, bs, 64, 1000,
                             50_000, dead, out, valid=valid, clear=ready, arrivals=arrivals, slots_ready=slots_ready)


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


def _wait_until(cond, what: str, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.005)


def test_with_the_slots_word_the_indices_are_made_before_the_rows_and_the_kernel_ends_after_them():
    """The daemon's first gather sets the TOPK block's D_SLOTS word once the resolve's slots
    are written: the polling kernel makes the indices then (the rows still crossing PCIe),
    and ends only once the ready word is set, which it consumes as before."""
    rng = np.random.default_rng(5)
    req, table, resident, topk, bs = _positions_case(rng)
    tokens, k = topk.shape
    old = rng.integers(-1, 64, size=(8, k)).astype(np.int32)
    new = rng.integers(-1, 64, size=(8, k)).astype(np.int32)
    want, want_valid = np.full((tokens, k), -9, np.int32), np.full(tokens, -9, np.int32)
    cpu_kernels.db_indices(1, 32, new, req, topk, resident, table.shape[0], bs, 64, 1000, 50_000,
                           np.zeros(1, np.int32), want, valid=want_valid)
    slots = old.copy()
    ready, arrivals, dead = np.zeros(1, np.uint32), np.zeros(1, np.uint32), np.zeros(1, np.int32)
    word = np.zeros(1, np.int32)
    out, valid = np.full((tokens, k), -9, np.int32), np.full(tokens, -9, np.int32)
    t = _launch_polling(slots, req, topk, resident, table.shape[0], bs, dead, out, ready, arrivals, word, valid)
    time.sleep(0.05)
    assert t.is_alive() and (out == -9).all(), "the kernel went on before either word was set"
    slots[:] = new  # the daemon's resolve, then its gather's D_SLOTS word
    word[0] = 1
    _wait_until(lambda: (out == want).all() and (valid == want_valid).all(),
                "the indices were not made once the slots word was set")
    time.sleep(0.05)
    assert t.is_alive(), "the kernel ended before the ready word (the rows) was set"
    ready[0] = 1
    _finish(t, ready)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(valid, want_valid)
    assert ready.tolist() == [0] and arrivals.tolist() == [0] and word.tolist() == [1]


def test_a_daemon_that_never_sets_the_slots_word_leaves_the_plain_wait():
    """A daemon without the word (an older one, a TP group's ranks) sets the ready word
    alone: the kernel then reads the slots after it, as without the word."""
    rng = np.random.default_rng(6)
    req, table, resident, topk, bs = _positions_case(rng)
    tokens, k = topk.shape
    new = rng.integers(-1, 64, size=(8, k)).astype(np.int32)
    want = np.full((tokens, k), -9, np.int32)
    cpu_kernels.db_indices(1, 32, new, req, topk, resident, table.shape[0], bs, 64, 1000, 50_000,
                           np.zeros(1, np.int32), want)
    slots = np.full((8, k), -1, np.int32)
    ready, arrivals, dead, word = (np.zeros(1, np.uint32), np.zeros(1, np.uint32), np.zeros(1, np.int32),
                                   np.zeros(1, np.int32))
    out = np.full((tokens, k), -9, np.int32)
    t = _launch_polling(slots, req, topk, resident, table.shape[0], bs, dead, out, ready, arrivals, word)
    time.sleep(0.05)
    assert t.is_alive() and (out == -9).all()
    slots[:] = new
    ready[0] = 1
    _finish(t, ready)
    np.testing.assert_array_equal(out, want)
    assert ready.tolist() == [0] and arrivals.tolist() == [0]


def test_the_daemon_gone_after_the_slots_word_turns_the_indices_made_back_to_minus_one():
    """Indices made from the slots, then the dead word set while the kernel waits for the
    rows (which never come): every index is -1 and every count 0 after all."""
    rng = np.random.default_rng(7)
    req, table, resident, topk, bs = _positions_case(rng)
    tokens, k = topk.shape
    slots = rng.integers(0, 64, size=(8, k)).astype(np.int32)
    ready, arrivals, dead, word = (np.zeros(1, np.uint32), np.zeros(1, np.uint32), np.zeros(1, np.int32),
                                   np.ones(1, np.int32))
    out, valid = np.full((tokens, k), -9, np.int32), np.full(tokens, -9, np.int32)
    t = _launch_polling(slots, req, topk, resident, table.shape[0], bs, dead, out, ready, arrivals, word, valid)
    _wait_until(lambda: (out != -9).all(), "the indices were not made from the slots")
    assert (out >= 0).any() and t.is_alive()
    dead[0] = 1
    _finish(t, ready)
    assert (out == -1).all() and (valid == 0).all() and arrivals.tolist() == [0]


@pytest.mark.parametrize("tokens", [0, 1, POLL_TOKENS, POLL_TOKENS + 1, 64])
def test_only_a_few_tokens_poll_and_the_rest_wait_on_the_stream(tokens):
    """The doorbell handle's choice: up to POLL_TOKENS tokens skv_db_indices polls (the
    layer's counter; swap_in launches it with one block), beyond the stream waits."""
    counters = np.zeros(3, np.uint32)
    h = object.__new__(DoorbellSwapIn)  # no GPU: only the choice is used
    h._idx_arrivals = SimpleNamespace(data=SimpleNamespace(ptr=counters.ctypes.data))
    got = h._poller(2, tokens)
    assert got == (counters.ctypes.data + 8 if tokens <= POLL_TOKENS else 0)


def test_a_polling_launch_names_the_groups_slots_word_and_a_stream_wait_none():
    """The doorbell handle gives the kernel the group's TOPK block's D_SLOTS word only where
    the kernel polls with tokens to index (a skipped layer's wait of no token: none)."""
    from sparsekv.proto.step_block import D_SLOTS

    h = object.__new__(DoorbellSwapIn)
    h._topk_blocks = [4096, 8192]
    assert h._slots_word(1) == 8192 + 4 * D_SLOTS
    h._slots = [1 << 20, 2 << 20]
    h.layout = SimpleNamespace(top_k=8, region_stride=16)
    h.hot_base = h.resident_base = 0
    h._dead = SimpleNamespace(data=SimpleNamespace(ptr=64))
    h._stopped_word = 0
    h._readys = [128, 132, 136]
    for tokens, arrivals, want in ((1, 999, 8192 + 4 * D_SLOTS), (9, 0, 0), (0, 999, 0)):
        args = h._indices_args(1, 2, tokens, 0, 0, 8, 0, 0, 4, 1, 0, 0, arrivals)
        assert args[-1] == want and args[-2] == arrivals and args[-3] == 136
