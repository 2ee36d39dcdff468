"""In-process transport: the daemon's residency engine and mover in the caller's process,
with the methods and results of :class:`~sparsekv.client.Client` (baselines, tests, a library).
"""

from __future__ import annotations

import contextlib

import numpy as np

from sparsekv.daemon.engine import EngineSpace, RankState
from sparsekv.daemon.residency.base import ResidencyError
from sparsekv.daemon.residency.cpu import CpuMover, CpuResidency
from sparsekv.proto import ErrorCode, Layout

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
        self._space: EngineSpace | None = None
        self._state = None

    def __enter__(self) -> "InprocClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def connect(self) -> "InprocClient":
        return self

    def close(self) -> None:
        self.attachment = None
        self._space = self._state = None

    def attach(self, layout: Layout, engine: str = "default") -> Attachment:
        layout.validate()
        pool = np.zeros((layout.num_layers, layout.host_rows, layout.row_bytes), dtype=np.uint8)
        slab = np.zeros((layout.num_layers, layout.max_reqs, layout.region_stride, layout.row_bytes), np.uint8)
        staging = np.zeros((layout.num_layers, layout.staging_rows, layout.row_bytes), np.uint8) if layout.staging_rows else None
        self._space = EngineSpace(engine, layout, pool)
        self._state = RankState(self.rank, "cpu", CpuResidency(layout), CpuMover(layout, pool, slab, staging), slab, staging)
        self._space.ranks[0] = self._state
        self.attachment = Attachment(layout, engine, slab, staging)
        return self.attachment

    def detach(self) -> None:
        self.close()

    def step(self, step: int, state_rows, reset=None, invalidate=None) -> None:
        with _errors():
            self._need().begin_step(step, state_rows, reset, invalidate)

    def topk(self, step: int, group: int, topk, state_rows=None) -> TopkResult:
        with _errors():
            res, _ = self._need().topk(step, group, topk, state_rows)
        return TopkResult(res.slots, res.misses, res.hits, res.out_of_range)

    def flush(self) -> None:
        """Nothing is deferred here: every call raises its own error (as ``Client.flush``)."""

    def write(self, rows, data, layers=None) -> dict:
        with _errors():
            self._need()
            nbytes, dropped = self._space.write(layers, rows, data)
        return {"bytes": nbytes, "invalidated": dropped}

    def write_staged(self, rows, layers=None) -> dict:
        with _errors():
            st = self._need()
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


@contextlib.contextmanager
def _errors():
    """Raise the same typed exceptions as the daemon client."""
    try:
        yield
    except ResidencyError as e:
        raise error_for(int(ErrorCode[e.code]), str(e)) from None
