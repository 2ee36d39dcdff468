"""In-process transport: the daemon's residency engine and mover in the caller's process,
with the methods and results of :class:`~sparsekv.client.Client` (baselines, tests, a library).
With ``attach(..., block_size=n)`` its ``blocks`` is a block store (DESIGN §9) of this
process alone (with ``index_bytes``, and an indexer keys plane): prefix reuse within it,
nothing shared, nothing kept past ``close``.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

from sparsekv.daemon.blocks.contract import BlockError
from sparsekv.daemon.block_requests import block_array, block_count
from sparsekv.daemon.blocks.store import BlockStore
from sparsekv.daemon.engine import EngineSpace, RankState, host_rows_arg
from sparsekv.daemon.residency.base import ResidencyError
from sparsekv.daemon.residency.cpu import CpuMover, CpuResidency
from sparsekv.proto import ErrorCode, Layout, MsgType, ProtocolError
from sparsekv.proto.args import engine_name, whole_number
from sparsekv.proto.blocks import KeysPlane, check_store

from sparsekv.client.blocks import Blocks
from sparsekv.client.client import Attachment
from sparsekv.client.errors import error_for
from sparsekv.client.results import TopkResult


class InprocClient:
    """One rank with its own host pool (NumPy backend)."""

    def __init__(self, rank: int = 0, backend: str = "cpu"):
        if backend != "cpu":
            raise ValueError(f"inproc transport supports backend 'cpu' here, not {backend!r}")
        self.rank = rank
        self.info = {"backend": backend, "devices": ["cpu"]}
        self.attachment: Attachment | None = None
        self.blocks: Blocks | None = None
        self._space: EngineSpace | None = None
        self._state = None

    def __enter__(self) -> "InprocClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def connect(self) -> "InprocClient":
        return self

    def close(self) -> None:
        if self.blocks is not None:  # a handle kept past detach: NOT_ATTACHED, as the client's
            self.blocks.close()
        self.attachment = self.blocks = None
        self._space = self._state = None

    def attach(self, layout: Layout, engine: str = "default", block_size: int = 0, index_bytes: int = 0,
               prefetch: bool = False, tp_size: int = 1) -> Attachment:
        if self._state is not None:  # as the daemon: a second attach would start the engine anew, its rows gone
            raise error_for(int(ErrorCode.ALREADY_ATTACHED), f"attached to engine {self._space.name!r} already; "
                            "detach first")
        layout.validate()
        with _errors():
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
            self.blocks = Blocks(self._block_call, engine, block_size, layout.num_layers, index_bytes)
        if index_bytes:
            self._space.keys_plane = plane = KeysPlane.of(layout, block_size, index_bytes)
            self._space.keys = np.zeros(plane.shape, np.uint8)
        self.attachment = Attachment(layout, engine, slab, staging)
        return self.attachment

    def _block_call(self, kind: MsgType, fields=None, arrays=None):
        """A BLOCK_* request on this process's store, answered as the daemon would (``Blocks`` calls it)."""
        a, h = arrays or {}, fields or {}
        store = self._space.blocks  # (a handle exists only with a store, and ends at detach: Blocks.close)
        with _errors():  # the daemon's checks of the fields and arrays first (block_requests.py)
            if kind == MsgType.BLOCK_RESERVE:
                n = store.reserve(0, block_count(h, signed=True))
                return {**store.gauges(), "reserved": n}, {}
            if kind == MsgType.BLOCK_ALLOC:
                return {}, {"blocks": store.alloc(0, block_count(h))}
            if kind == MsgType.BLOCK_COMMIT:
                return {}, {"held": store.commit(0, block_array(a, "blocks"), block_array(a, "hashes"))}
            if kind == MsgType.BLOCK_LOOKUP:
                return {}, {"blocks": store.lookup(0, block_array(a, "hashes"))}
            space = self._space
            if kind == MsgType.BLOCK_WRITE_KEYS:
                keys = block_array(a, "keys")
                return {"bytes": space.copy_keys_in(space.check_keys_write(0, block_array(a, "blocks"), keys), keys)}, {}
            if kind == MsgType.BLOCK_READ_KEYS:
                return {}, {"keys": space.copy_keys_out(space.check_keys_read(0, block_array(a, "blocks")))}
            store.release(0, block_array(a, "blocks"))
            return {}, {}

    def _own_blocks(self, rows) -> None:
        """With a block store, a write names rows of this process's own blocks only."""
        if self._space.blocks is not None:
            self._space.blocks.writable(0, host_rows_arg(self._space.layout, rows, "write"), self._space.block_size)

    def detach(self) -> None:
        self.close()

    def step(self, step: int, state_rows, reset=None, invalidate=None) -> None:
        with _errors():
            self._need().begin_step(step, state_rows, reset, invalidate)

    def topk(self, step: int, group: int, topk, state_rows=None) -> TopkResult:
        with _errors():
            st = self._need()
            res, _ = st.topk(step, group, topk, state_rows)
            if st.pending_prefetch is not None:  # in process: at once (the same rows either way)
                st.run_prefetch()
        return TopkResult(_read_only(res.slots), _read_only(res.misses), res.hits, res.out_of_range)

    def flush(self) -> None:
        """Nothing is deferred here: every call raises its own error (as ``Client.flush``)."""

    def write(self, rows, data, layers=None) -> dict:
        with _errors():
            self._need()
            self._own_blocks(rows)
            nbytes, dropped = self._space.write(layers, rows, data)
        return {"bytes": nbytes, "invalidated": dropped}

    def write_staged(self, rows, layers=None) -> dict:
        with _errors():
            st = self._need()
            self._own_blocks(rows)
            nbytes, dropped = self._space.write_staged(st, layers, rows)
        return {"bytes": nbytes, "invalidated": dropped}

    def stage(self, rows, layers=None) -> int:
        with _errors():
            st = self._need()
            return st.stage(rows, layers)

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
def _errors():
    """Raise the same typed exceptions as the daemon client."""
    try:
        yield
    except ResidencyError as e:
        raise error_for(int(ErrorCode[e.code]), str(e)) from None
    except BlockError as e:
        raise error_for(int(ErrorCode[e.code]), str(e), e.detail) from None
    except ProtocolError as e:
        raise error_for(int(e.code), e.args[0], e.detail) from None
