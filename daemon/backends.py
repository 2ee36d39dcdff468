"""Backends: where a rank's hot slab lives and which residency/mover implement it.

``cpu``: slabs are files in shared memory (``/dev/shm``) that the client maps; NumPy
residency and mover. ``cuda``: slabs are ``cudaMalloc`` allocations exported through CUDA
IPC handles; residency and mover are the kernels of ``csrc/`` (see ``residency/cuda.py``).
"""

from __future__ import annotations

import glob
import hashlib
import logging
import mmap
import os
from dataclasses import dataclass

import numpy as np

from .engine import EngineSpace, RankState
from .residency.base import ResidencyError
from .residency.cpu import CpuMover, CpuResidency

log = logging.getLogger("sparsekv.backend")


def run_dir_tag(run_dir: str) -> str:
    """Short stable tag of a run dir, so two daemons never touch each other's files."""
    return hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:10]


def remove_stale(prefix: str) -> None:
    """Remove files ``prefix*`` left by a daemon of this run dir that died; nobody can be
    using them (the caller made sure no daemon serves this run dir)."""
    for stale in glob.glob(prefix + "*"):
        log.warning("removing stale shared-memory file %s", stale)
        try:
            os.unlink(stale)
        except OSError:
            pass


@dataclass
class _ShmSlab:
    path: str
    mm: mmap.mmap


class CpuBackend:
    """NumPy backend: same semantics as cuda, real shared memory between processes."""

    name = "cpu"

    def __init__(self, run_dir: str, shm_dir: str = "/dev/shm"):
        self.devices = ["cpu"]
        self._prefix = os.path.join(shm_dir, f"sparsekv-{run_dir_tag(run_dir)}-")
        self._slabs: dict[int, _ShmSlab] = {}
        remove_stale(self._prefix)

    def describe(self) -> dict:
        return {"backend": self.name, "devices": self.devices}

    def new_rank(self, space: EngineSpace, client_id: int, rank: int, device: str,
                 fence_events=None) -> tuple[RankState, dict]:
        """A rank's state and what its client needs to map the slab. ``fence_events`` is
        for the cuda backend (the cpu client reads only after each reply)."""
        lay = space.layout
        path = f"{self._prefix}{client_id}"
        nbytes = lay.slab_bytes + lay.staging_bytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserve the pages now: a sparse file would let a later gather die of SIGBUS
            # when shared memory runs out; this fails here, with a clear error, instead.
            try:
                os.posix_fallocate(fd, 0, max(nbytes, 1))
            except OSError as e:
                raise ResidencyError(
                    "TOO_LARGE", f"cannot reserve a hot slab of {nbytes >> 20} MiB in {os.path.dirname(path)}: "
                    f"{e.strerror}; lower max_reqs, region_stride or num_layers, or enlarge {os.path.dirname(path)}"
                ) from None
            mm = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except Exception:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        slab, staging = lay.split_buffer(np.frombuffer(mm, dtype=np.uint8))
        self._slabs[client_id] = _ShmSlab(path, mm)
        state = RankState(
            rank=rank,
            device=device,
            residency=CpuResidency(lay),
            mover=CpuMover(lay, space.pool, slab, staging),
            slab=slab,
            staging=staging,
        )
        handles = {"kind": "shm", "path": path, "bytes": nbytes, "slab_bytes": lay.slab_bytes}
        return state, handles

    def release_rank(self, client_id: int) -> None:
        shm = self._slabs.pop(client_id, None)
        if shm is None:
            return
        try:
            os.unlink(shm.path)
        except FileNotFoundError:
            pass
        # The mapping itself goes away with the last view; clients keep theirs until they
        # unmap, which is safe with shared memory.

    def release_engine(self, space: EngineSpace) -> None:
        """The engine's last rank left (nothing is pinned on the cpu backend)."""

    def device_counters(self) -> dict:
        """Counters kept on devices (none: the cpu ranks report through each reply)."""
        return {}

    def close(self) -> None:
        for cid in list(self._slabs):
            self.release_rank(cid)


def make_backend(cfg, pool):
    """The backend ``cfg.backend`` names; ``auto`` picks cuda when a GPU and CuPy are
    usable, else cpu."""
    if cfg.backend in ("auto", "cuda"):
        reason = cuda_unavailable()
        if reason is None:
            from .cuda.backend import CudaBackend  # noqa: PLC0415 - needs cupy

            return CudaBackend(cfg, pool)
        if cfg.backend == "cuda":
            raise RuntimeError(f"--backend cuda: {reason}")
        log.info("no usable GPU (%s); using the cpu backend", reason)
    return CpuBackend(cfg.run_dir, cfg.shm_dir)


def cuda_unavailable() -> str | None:
    """None when CuPy sees a GPU, else why not."""
    try:
        import cupy  # noqa: PLC0415

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as e:  # noqa: BLE001 - import or driver errors alike
        return f"{type(e).__name__}: {e}"
    return None
