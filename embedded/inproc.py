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
import psutil

from sparsekv.daemon.blocks.contract import BlockError
from sparsekv.daemon.block_requests import alloc_counted, block_array, block_count, commit_counted, count_hits
from sparsekv.daemon.blocks.store import BlockStore
from sparsekv.daemon.engine import EngineSpace, RankState
from sparsekv.daemon.config import Config
from sparsekv.daemon.residency.base import ResidencyError, check_layout_limits, rank_bytes, whole_arg
from sparsekv.daemon.residency.cpu import CpuMover, CpuResidency
from sparsekv.daemon.stats import Stats
from sparsekv.proto import ErrorCode, Layout, MsgType, ProtocolError
from sparsekv.proto.args import engine_name, whole_number
from sparsekv.proto.blocks import KeysPlane, check_store

from sparsekv.client.blocks import Blocks, block_store
from sparsekv.client.client import Attachment
from sparsekv.client.errors import SparseKVError, error_for
from sparsekv.client.results import TopkResult
from sparsekv.client.tensors import check_layout, check_prefetch


class InprocClient:
    """One rank with its own host pool (NumPy backend). Its counters (:meth:`stats`) are the
    daemon's, counted alike over what this rank ran since the client was made.
    ``max_slab_bytes``: the most one attach may take besides its pool (hot slab, staging,
    residency state), as the daemon's setting of that name (default its default).

    As the daemon client's, a :meth:`step` is held until the next request: a :meth:`topk`
    of that step (without state rows of its own) carries it, and a top-k refused runs
    neither; any other request runs the step first, alone. After :meth:`close` every call
    but :meth:`connect` raises (NOT_HELLO), and a detached attachment's slab is gone."""

    def __init__(self, rank: int = 0, backend: str = "cpu", max_slab_bytes: int = Config.max_slab_bytes):
        if backend != "cpu":
            raise ValueError(f"inproc transport supports backend 'cpu' here, not {backend!r}")
        if type(max_slab_bytes) is not int or max_slab_bytes <= 0:
            raise ValueError(f"max_slab_bytes must be a positive integer, got {max_slab_bytes!r}")
        self.rank = rank
        self.max_slab_bytes = max_slab_bytes
        self._closed = False
        self._pending_step: tuple | None = None  # a step() not run yet: (step, state_rows, reset, invalidate)
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
        self._closed = False
        return self

    @property
    def blocks(self) -> Blocks:
        """The attached engine's block store, as the client's (NotAttached without one)."""
        return block_store(self._blocks, self.attachment is not None)

    def close(self) -> None:
        self._end_attachment()
        self._closed = True

    def _end_attachment(self) -> None:
        if self._blocks is not None:  # a handle kept past detach: NOT_ATTACHED, as the client's
            self._blocks.close()
        if self.attachment is not None:  # its slab and staging gone, as the daemon client's (unmapped)
            self.attachment.close()
        self.attachment = self._blocks = None
        self._space = self._state = None
        self._pending_step = None

    def _open(self) -> None:
        """Raise as the daemon client does once closed."""
        if self._closed:
            raise SparseKVError("client is not connected; call connect() or use it as a context manager",
                                ErrorCode.NOT_HELLO)

    def stats(self) -> dict:
        """The daemon's STATS snapshot of this one rank: every counter of ``sparsekv stats``
        (steps, hits, misses, rows and bytes moved and written, block store requests,
        requests and errors by code, the top-k's handling time: call to return), and the
        engine's gauges (``per_engine``) while attached. Where the paths differ: here every
        refused call is an error, where a :class:`~sparsekv.client.Client` refuses bad
        arguments itself, so that its daemon never counts them. A step held (:meth:`step`)
        runs first."""
        self._open()
        with _errors(self._stats, counted=True):
            self._settle()
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
        self._open()
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
            # As the daemon: the limits before anything is allocated; the pool, the
            # daemon's own there, is this process's memory here.
            check_layout_limits(layout, self.max_slab_bytes)
            need = layout.pool_bytes + rank_bytes(layout)["total"]
            avail = psutil.virtual_memory().available
            if need > avail:
                raise ProtocolError(ErrorCode.POOL_FULL, f"the layout's pool and rank take {need / 2**30:.1f} GiB; "
                                    f"this machine has {avail / 2**30:.1f} GiB available")
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
            self._settle()
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
        """Detach, after a step held (its error raised, as the daemon client raises it in
        place of the detach's reply; detached either way)."""
        self._open()
        try:
            with _errors(self._stats, counted=True):
                self._settle()
        finally:
            self._stats.c["requests"] += 1
            self._end_attachment()

    def step(self, step: int, state_rows, reset=None, invalidate=None) -> None:
        """Check and hold the step; the next request runs it (see the class)."""
        self._open()
        with _errors(self._stats):
            st = self._need()
            step = whole_arg("step", step, carried=True)  # as the client, whose requests carry no more
            checked = st.check_step(state_rows, reset, invalidate)
            self._settle()  # a step held before runs alone (as the client sends it)
            # Copies: the caller may reuse its arrays before the request that runs the step.
            self._pending_step = (step, *(None if a is None else np.array(a, copy=True) for a in checked))
        self._stats.c["requests"] -= 1  # counted when it runs: alone, or with its top-k

    def _settle(self, then=None) -> None:
        """Run the step held: alone (a request of its own), or carried by the top-k ``then``
        (``(group, top-k)``, checked first: refused, neither runs, as the daemon's STEP + TOPK)."""
        pending, self._pending_step = self._pending_step, None
        if pending is not None:
            self._stats.c["requests"] += then is None
            st = self._state
            st.begin_step(*pending, then=then)
            self._stats.add(steps=1, **st.prefetch_outcomes())

    def topk(self, step: int, group: int, topk, state_rows=None) -> TopkResult:
        self._open()
        t0 = time.perf_counter()
        with _errors(self._stats):
            st = self._need()
            step, group = whole_arg("step", step), whole_arg("group", group)  # as RankState.topk
            pending = self._pending_step
            carried = pending is not None and pending[0] == step and state_rows is None
            self._settle(then=(group, topk) if carried else None)
            fields, arrays, deltas = st.serve_topk(step, group, topk, state_rows)
            self._stats.add(**deltas)
            if st.pending_prefetch is not None:  # in process: at once (the same rows either way)
                self._stats.add(**st.run_prefetch())
        self._stats.latency(time.perf_counter() - t0)
        return TopkResult(_read_only(arrays["slots"]), _read_only(arrays["misses"]), fields["hits"],
                          fields["out_of_range"])

    def flush(self) -> None:
        """Run a step held (as ``Client.flush`` sends it), raising its error; nothing else
        is deferred here."""
        self._open()
        with _errors(self._stats, counted=True):
            self._settle()

    def write(self, rows, data, layers=None) -> dict:
        self._open()
        with _errors(self._stats):
            st = self._ready()
            layers, rows, data = self._space.check_write(layers, rows, data)  # as the daemon: these first
            self._own_blocks(rows)
            nbytes, dropped = self._space.write(layers, rows, data, checked=True)
            self._wrote(st, nbytes, dropped)
        return {"bytes": nbytes, "invalidated": dropped}

    def write_staged(self, rows, layers=None) -> dict:
        self._open()
        with _errors(self._stats):
            st = self._ready()
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
        self._open()
        with _errors(self._stats):
            st = self._ready()
            nbytes = st.stage(rows, layers)
            self._stats.add(rows_staged=nbytes // self._space.layout.row_bytes)
            return nbytes

    def _need(self):
        if self._state is None:
            raise ResidencyError("NOT_ATTACHED", "attach a layout first")
        return self._state

    def _ready(self):
        """The rank, attached, its held step run (a request other than a top-k)."""
        st = self._need()
        self._settle()
        return st


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
