"""In-process transport: the daemon's residency engine and mover in the caller's process,
with the methods and results of :class:`~sparsekv.client.Client` (baselines, tests, a
library), ``stats()`` included: the daemon's counters of this one rank. With
``attach(..., block_size=n)`` its ``blocks`` is a block store (DESIGN §9) of this process
alone (with ``index_bytes``, and an indexer keys plane): prefix reuse within it, nothing
shared, nothing kept past ``close``.
"""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np

from sparsekv.daemon.blocks.contract import BlockError
from sparsekv.daemon.block_requests import alloc_counted, block_array, block_count, commit_counted, count_hits
from sparsekv.daemon.blocks.store import BlockStore
from sparsekv.daemon.engine import EngineSpace, RankState
from sparsekv.daemon.residency.base import ResidencyError, whole_arg
from sparsekv.daemon.residency.cpu import CpuMover, CpuResidency
from sparsekv.daemon.stats import Stats
from sparsekv.proto import ErrorCode, Layout, MsgType, ProtocolError
from sparsekv.proto.args import engine_name, whole_number
from sparsekv.proto.blocks import KeysPlane, check_store

from sparsekv.client.blocks import Blocks, block_store
from sparsekv.client.client import Attachment
from sparsekv.client.errors import error_for
from sparsekv.client.results import TopkResult
from sparsekv.client.tensors import check_layout, check_prefetch


class InprocClient:
    """One rank with its own host pool (NumPy backend). Its counters (:meth:`stats`) are the
    daemon's, counted alike over what this rank ran since the client was made."""

    def __init__(self, rank: int = 0, backend: str = "cpu"):
        if backend != "cpu":
            raise ValueError(f"inproc transport supports backend 'cpu' here, not {backend!r}")
        self.rank = rank
        self.info = {"backend": backend, "devices": ["cpu"]}
        self.attachment: Attachment | None = None
        self._blocks: Blocks | None = None
        self._space: EngineSpace | None = None
        self._state = None
        self._stats = Stats()

    def __enter__(self) -> "InprocClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def connect(self) -> "InprocClient":
        return self

    @property
    def blocks(self) -> Blocks:
        """The attached engine's block store, as the client's (NotAttached without one)."""
        return block_store(self._blocks, self.attachment is not None)

    def close(self) -> None:
        if self._blocks is not None:  # a handle kept past detach: NOT_ATTACHED, as the client's
            self._blocks.close()
        self.attachment = self._blocks = None
        self._space = self._state = None

    def stats(self) -> dict:
        """The daemon's STATS snapshot of this one rank: every counter of ``sparsekv stats``
        (steps, hits, misses, rows and bytes moved and written, block store requests,
        requests and errors by code, the top-k's handling time: call to return), and the
        engine's gauges (``per_engine``) while attached. Where the paths differ: here each
        call is a request that runs (and counts) at once, and every refused call is an
        error; a :class:`~sparsekv.client.Client` sends its step with its next top-k (one
        request; a refused top-k and its step both did not run), and refuses bad
        arguments itself, so its daemon never counts them."""
        space = self._space
        engines = {}
        if space is not None:
            lay = space.layout
            engines[space.name] = {"ranks": 1, "pool_bytes": space.range_bytes, "slab_bytes": lay.slab_bytes,
                                   "tp_size": 1, "tp_lag": 0,
                                   **({"blocks": space.blocks.gauges()} if space.blocks is not None else {})}
        return self._stats.snapshot({}, {
            **self.info, "transport": "inproc", "clients": 1, "attached": int(space is not None),
            "engines": len(engines), "pool_bytes": space.range_bytes if space is not None else 0,
            "per_engine": engines, "pid": os.getpid()})

    def attach(self, layout: Layout, engine: str = "default", block_size: int = 0, index_bytes: int = 0,
               prefetch: bool = False, tp_size: int = 1) -> Attachment:
        with _errors(self._stats):
            if self._state is not None:  # as the daemon: a second attach would start the engine anew, its rows gone
                raise ProtocolError(ErrorCode.ALREADY_ATTACHED, f"attached to engine {self._space.name!r} already; "
                                    "detach first")
        check_layout(layout)  # as the client: before anything is counted or made
        check_prefetch(prefetch)
        with _errors(self._stats, counted=True):
            try:
                engine = engine_name(engine)
                tp_size = whole_number("tp_size", tp_size)
                block_size = whole_number("block_size", block_size)
                index_bytes = whole_number("index_bytes", index_bytes)
            except ValueError as e:
                raise ProtocolError(ErrorCode.BAD_ARGUMENT, str(e)) from None
            if tp_size != 1:
                raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"tp_size {tp_size}: the in-process engine is one rank "
                                    "of its own; a TP group's ranks attach to a daemon (Client)")
            block_size, index_bytes = check_store(layout, block_size, index_bytes)
        pool = np.zeros((layout.num_layers, layout.host_rows, layout.row_bytes), dtype=np.uint8)
        slab = np.zeros((layout.num_layers, layout.max_reqs, layout.region_stride, layout.row_bytes), np.uint8)
        staging = np.zeros((layout.num_layers, layout.staging_rows, layout.row_bytes), np.uint8) if layout.staging_rows else None
        self._space = EngineSpace(engine, layout, pool)
        self._state = RankState(self.rank, "cpu", CpuResidency(layout), CpuMover(layout, pool, slab, staging), slab, staging)
        self._space.ranks[0] = self._state
        self._state.prefetch = bool(prefetch)
        if block_size:
            self._space.block_size = block_size
            self._space.blocks = BlockStore(layout.host_rows // block_size, self._space.zero_blocks)
            self._space.blocks.open(0, os.getuid())
            self._blocks = Blocks(self._block_call, engine, block_size, layout.num_layers, index_bytes)
        if index_bytes:
            self._space.keys_plane = plane = KeysPlane.of(layout, block_size, index_bytes)
            self._space.keys = np.zeros(plane.shape, np.uint8)
        self.attachment = Attachment(layout, engine, slab, staging)
        return self.attachment

    def _block_call(self, kind: MsgType, fields=None, arrays=None):
        """A BLOCK_* request on this process's store, answered as the daemon would (``Blocks`` calls it)."""
        a, h = arrays or {}, fields or {}
        space = self._space
        store = space.blocks  # (a handle exists only with a store, and ends at detach: Blocks.close)
        add = self._stats.add  # counted as the daemon's block_requests.py counts them
        with _errors(self._stats):  # the daemon's checks of the fields and arrays first (block_requests.py)
            if kind == MsgType.BLOCK_RESERVE:
                n = store.reserve(0, block_count(h, signed=True))
                return {**store.gauges(), "reserved": n}, {}
            if kind == MsgType.BLOCK_ALLOC:
                return {}, {"blocks": alloc_counted(store, self._stats, 0, block_count(h))}
            if kind == MsgType.BLOCK_COMMIT:
                return {}, {"held": commit_counted(store, self._stats, 0, block_array(a, "blocks"),
                                                   block_array(a, "hashes"))}
            if kind == MsgType.BLOCK_LOOKUP:
                found = store.lookup(0, block_array(a, "hashes"))
                count_hits(self._stats.c, space, found.size)
                return {}, {"blocks": found}
            if kind == MsgType.BLOCK_WRITE_KEYS:
                keys = block_array(a, "keys")
                nbytes = space.copy_keys_in(space.check_keys_write(0, block_array(a, "blocks"), keys), keys)
                add(block_keys_bytes_written=nbytes)
                return {"bytes": nbytes}, {}
            if kind == MsgType.BLOCK_READ_KEYS:
                keys = space.copy_keys_out(space.check_keys_read(0, block_array(a, "blocks")))
                add(block_keys_bytes_read=keys.nbytes)
                return {}, {"keys": keys}
            store.release(0, block_array(a, "blocks"))
            return {}, {}

    def _own_blocks(self, rows) -> None:
        """With a block store, a write names rows (checked) of this process's own blocks only."""
        if self._space.blocks is not None:
            self._space.blocks.writable(0, rows, self._space.block_size)

    def detach(self) -> None:
        self._stats.c["requests"] += 1
        self.close()

    def step(self, step: int, state_rows, reset=None, invalidate=None) -> None:
        with _errors(self._stats):
            st = self._need()
            step = whole_arg("step", step, carried=True)  # as the client, whose requests carry no more
            st.begin_step(step, state_rows, reset, invalidate)
            self._stats.add(steps=1, **st.prefetch_outcomes())

    def topk(self, step: int, group: int, topk, state_rows=None) -> TopkResult:
        t0 = time.perf_counter()
        with _errors(self._stats):
            st = self._need()
            step, group = whole_arg("step", step), whole_arg("group", group)  # as RankState.topk
            fields, arrays, deltas = st.serve_topk(step, group, topk, state_rows)
            self._stats.add(**deltas)
            if st.pending_prefetch is not None:  # in process: at once (the same rows either way)
                self._stats.add(**st.run_prefetch())
        self._stats.latency(time.perf_counter() - t0)
        return TopkResult(_read_only(arrays["slots"]), _read_only(arrays["misses"]), fields["hits"],
                          fields["out_of_range"])

    def flush(self) -> None:
        """Nothing is deferred here: every call raises its own error (as ``Client.flush``)."""

    def write(self, rows, data, layers=None) -> dict:
        with _errors(self._stats):
            st = self._need()
            layers, rows, data = self._space.check_write(layers, rows, data)  # as the daemon: these first
            self._own_blocks(rows)
            nbytes, dropped = self._space.write(layers, rows, data, checked=True)
            self._wrote(st, nbytes, dropped)
        return {"bytes": nbytes, "invalidated": dropped}

    def write_staged(self, rows, layers=None) -> dict:
        with _errors(self._stats):
            st = self._need()
            layers, rows = self._space.check_staged(st, layers, rows)  # as the daemon: these first
            self._own_blocks(rows)
            nbytes, dropped = st.write_staged(self._space, layers, rows)
            self._wrote(st, nbytes, dropped)
        return {"bytes": nbytes, "invalidated": dropped}

    def _wrote(self, st, nbytes: int, dropped: int) -> None:
        """A write's counters, as the daemon's: its rows and bytes, the hot copies it
        dropped, and the prefetched rows those were (wasted)."""
        self._stats.add(rows_written=nbytes // self._space.layout.row_bytes, bytes_written=nbytes,
                        hot_invalidated=dropped, **st.prefetch_outcomes())

    def stage(self, rows, layers=None) -> int:
        with _errors(self._stats):
            st = self._need()
            nbytes = st.stage(rows, layers)
            self._stats.add(rows_staged=nbytes // self._space.layout.row_bytes)
            return nbytes

    def _need(self):
        if self._state is None:
            raise ResidencyError("NOT_ATTACHED", "attach a layout first")
        return self._state


def _read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view, as the daemon client's results (views of the reply's frames)."""
    v = a.view()
    v.flags.writeable = False
    return v


@contextlib.contextmanager
def _errors(stats: Stats, counted: bool = False):
    """One request: raise the same typed exceptions as the daemon client, and count the
    request (unless ``counted`` already) and its error by code, as the daemon does."""
    if not counted:
        stats.c["requests"] += 1
    try:
        yield
    except ResidencyError as e:
        stats.error(e.code)
        raise error_for(int(ErrorCode[e.code]), str(e)) from None
    except BlockError as e:
        stats.error(e.code)
        raise error_for(int(ErrorCode[e.code]), str(e), e.detail) from None
    except ProtocolError as e:
        stats.error(ErrorCode(e.code).name)
        raise error_for(int(e.code), e.args[0], e.detail) from None
