"""Backends: where a rank's hot slab lives and which residency/mover implement it.

``cpu``: slabs are anonymous shared memory (memfds) that the client maps, having got the
descriptor over the fd socket (``proto/fd_socket.py``); NumPy residency and mover.
``cuda``: slabs are ``cudaMalloc`` allocations exported through CUDA IPC handles;
residency and mover are the kernels of ``csrc/`` (see ``residency/cuda/``).
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import mmap
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass

import numpy as np
import psutil

from .cuda.backend import CudaBackend
from .engine import Backend, EngineSpace, RankState
from .memfd import new_memfd, remove_stale, run_dir_tag
from .residency.base import ResidencyError
from .residency.cpu import CpuMover, CpuResidency

log = logging.getLogger("sparsekv.backend")


@dataclass
class _ShmSlab:
    fd: int  # kept while the rank lives: the fd socket hands it to the rank's client (-1: none)
    mm: mmap.mmap | None
    engine_fd: int = -1  # an engine-owned slab's descriptor (deposited by the client)
    engine_mm: mmap.mmap | None = None
    engine_file: tuple[int, int] | None = None  # its memfd's (st_dev, st_ino): one rank's slab at a time


def map_engine_slab(fd: int, geometry) -> mmap.mmap:
    """Map an engine-owned slab the client deposited: a memfd of at least ``buffer_bytes``,
    sealed against shrinking (SIGBUS). Raises ResidencyError naming what is wrong."""
    return map_engine_memory(fd, geometry.buffer_bytes, "slab", "its geometry says buffer_bytes")


def map_engine_memory(fd: int, nbytes: int, what: str = "buffer", need: str = "it needs") -> mmap.mmap:
    """Map ``nbytes`` of a memfd an engine deposited (its slab, or the buffer a keys load
    copies into), sealed against shrinking (SIGBUS). Raises ResidencyError naming what is wrong."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise ResidencyError("BAD_ARGUMENT", f"the engine's {what} must be a memfd (os.memfd_create with "
                             "MFD_ALLOW_SEALING), sealed with F_SEAL_SHRINK") from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise ResidencyError("BAD_ARGUMENT", f"the engine's {what} memfd must be sealed against shrinking "
                             "(fcntl F_ADD_SEALS F_SEAL_SHRINK) before it is deposited")
    if seals & (fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)):
        raise ResidencyError("BAD_ARGUMENT", f"the engine's {what} memfd is sealed against writes "
                             "(F_SEAL_WRITE or F_SEAL_FUTURE_WRITE): the daemon writes into it")
    size = os.fstat(fd).st_size
    if size < nbytes:
        raise ResidencyError("BAD_ARGUMENT", f"the engine's {what} memfd has {size} bytes, {need} {nbytes}")
    try:
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        raise ResidencyError("BAD_ARGUMENT", f"the engine's {what} memfd cannot be mapped for writing: {e}") from None


class CpuBackend(Backend):
    """NumPy backend: same semantics as cuda, real shared memory between processes."""

    name = "cpu"

    def __init__(self, run_dir: str, shm_dir: str = "/dev/shm"):
        self.devices = ["cpu"]
        self._name = f"sparsekv-{run_dir_tag(run_dir)}-"  # memfd names: <name><client id>
        self._slabs: dict[int, _ShmSlab] = {}
        self._lock = threading.Lock()  # _slabs: its engine slabs checked and added at once
        remove_stale(os.path.join(shm_dir, self._name))

    def describe(self) -> dict:
        return {"backend": self.name, "devices": self.devices}

    def failure(self) -> str | None:
        return None  # nothing of the cpu backend fails on its own

    def new_rank(self, space: EngineSpace, client_id: int, rank: int, device: str,
                 fence_events=None, engine_slab=None, prefetch: bool = False) -> tuple[RankState, dict]:
        """A rank's state and what its client needs to map the slab. ``engine_slab``: an
        engine-owned slab (a memfd this backend takes); the daemon then holds only staging.
        ``prefetch``: the rank prefetches (``RankState.prefetch``)."""
        state, handles = (self._engine_rank(space, client_id, rank, device, engine_slab) if engine_slab is not None
                          else self._own_rank(space, client_id, rank, device))
        state.prefetch = prefetch
        return state, handles

    def _own_rank(self, space: EngineSpace, client_id: int, rank: int, device: str):
        lay = space.layout
        nbytes = lay.slab_bytes + lay.staging_bytes
        # Its pages are reserved now (new_memfd), so running out of memory fails this
        # attach, not a later gather (SIGBUS).
        avail = psutil.virtual_memory().available
        fix = "lower max_reqs, region_stride or num_layers"
        if nbytes > avail:
            raise ResidencyError("TOO_LARGE", f"cannot reserve a hot slab of {nbytes >> 20} MiB: {avail >> 20} MiB "
                                 f"of memory available; {fix}")
        try:
            fd = new_memfd(f"{self._name}{client_id}", max(nbytes, 1))
        except OSError as e:
            raise ResidencyError("TOO_LARGE", f"cannot reserve a hot slab of {nbytes >> 20} MiB: {e.strerror}; "
                                 f"{fix}") from None
        try:
            mm = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        slab, staging = lay.split_buffer(np.frombuffer(mm, dtype=np.uint8))
        self._slabs[client_id] = _ShmSlab(fd, mm)
        state = RankState(rank=rank, device=device, residency=CpuResidency(lay),
                          mover=CpuMover(lay, space.pool, slab, staging), slab=slab, staging=staging)
        # "fd": the slab's name on the fd socket (the server adds the socket and the token).
        handles = {"kind": "shm", "fd": "slab", "bytes": nbytes, "slab_bytes": lay.slab_bytes}
        return state, handles

    def _engine_rank(self, space: EngineSpace, client_id: int, rank: int, device: str, engine_slab):
        lay, geo = space.layout, engine_slab.geometry
        fd, mm, shm = engine_slab.take_fd(), None, None
        try:
            st = os.fstat(fd)
            file = (st.st_dev, st.st_ino)
            engine_mm = map_engine_slab(fd, geo)
            nbytes = lay.staging_bytes
            staging = None
            if nbytes:
                shm = new_memfd(f"{self._name}{client_id}", nbytes)
                mm = mmap.mmap(shm, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                staging = np.frombuffer(mm, dtype=np.uint8).reshape(lay.staging_shape)
            with self._lock:  # (ranks are made on worker threads: two attaches may offer one memfd at once)
                other = next((cid for cid, s in self._slabs.items() if s.engine_file == file), None)
                if other is not None:  # both ranks' rows would be gathered into the same bytes
                    raise ResidencyError("BAD_ARGUMENT", f"this engine slab's memory is already the slab of client "
                                         f"{other}: each rank needs a slab of its own (another memfd)")
                self._slabs[client_id] = _ShmSlab(-1 if shm is None else shm, mm, fd, engine_mm, file)
        except BaseException as e:
            for f in (fd, shm):
                if f is not None:
                    os.close(f)
            if isinstance(e, OSError):
                raise ResidencyError("TOO_LARGE", f"cannot map the engine's slab or a staging buffer: {e.strerror}") \
                    from None
            raise
        buf = np.frombuffer(engine_mm, dtype=np.uint8)
        state = RankState(rank=rank, device=device, residency=CpuResidency(lay),
                          mover=CpuMover(lay, space.pool, buf, staging, geometry=geo), slab=buf, staging=staging)
        handles = {"kind": "shm", "engine_slab": True, "bytes": nbytes, "slab_bytes": 0}
        if shm is not None:
            handles["fd"] = "slab"  # the staging buffer (the server adds the socket and the token)
        return state, handles

    def share_fds(self, client_id: int) -> dict[str, int]:
        shm = self._slabs.get(client_id)
        return {} if shm is None or shm.fd < 0 else {"slab": shm.fd}

    def release_rank(self, client_id: int) -> None:
        shm = self._slabs.pop(client_id, None)
        if shm is None:
            return
        for fd in (shm.fd, shm.engine_fd):
            if fd >= 0:
                os.close(fd)
        # The memory goes with the last mapping: clients keep theirs until they unmap.

    def release_engine(self, space: EngineSpace, give_back) -> None:
        give_back()  # nothing is pinned on the cpu backend

    def device_counters(self) -> dict:
        return {}  # none: the cpu ranks report through each reply

    def close(self) -> None:
        for cid in list(self._slabs):
            self.release_rank(cid)


def make_backend(cfg, pool, pool_region=None):
    """The backend ``cfg.backend`` names.

    ``auto`` picks cuda when CuPy sees a GPU, and cpu when the machine has no NVIDIA GPU
    at all; a GPU that CuPy cannot use is an error, not a quiet fall back to cpu.
    ``pool_region``: the pool's :class:`~sparsekv.daemon.pinned.PinnedRegion` when it was
    page-locked at start (cuda; the caller keeps and closes it)."""
    if cfg.backend in ("auto", "cuda"):
        probe = cuda_probe()
        if probe[0] is None:
            return CudaBackend(cfg, pool, pool_region)
        why = backend_unusable(cfg.backend, probe)
        if why is not None:
            raise RuntimeError(why)
        log.info("no NVIDIA GPU on this machine; using the cpu backend")
    return CpuBackend(cfg.run_dir, cfg.shm_dir)


def backend_unusable(backend: str, probe: tuple[str | None, bool] | None = None, source: str = "") -> str | None:
    """Why the backend ``backend`` names cannot serve on this machine, or None: ``cuda``
    without a GPU CuPy can use, or ``auto`` on a machine whose NVIDIA GPU the cuda backend
    cannot use (``auto`` on a machine with no NVIDIA GPU serves from the cpu backend).
    ``probe``: ``cuda_probe()``'s answer when the caller has it; ``source``: where the
    setting came from (default, file, env, flag), named in the message."""
    if backend not in ("auto", "cuda"):
        return None
    reason, missing = probe if probe is not None else cuda_probe()
    if reason is None:
        return None
    fix = "install the cuda extra: pip install 'sparsekv[cuda]'" if missing else "check the driver and CUDA_VISIBLE_DEVICES"
    where = f"backend {backend}" + (f" ({source})" if source else "")
    if backend == "cuda":
        return f"{where}: {reason}; {fix}"
    gpu = gpu_present()
    if gpu is not None:
        return (f"{where}: this machine has an NVIDIA GPU ({gpu}) but the cuda backend cannot use it ({reason}); "
                f"{fix}, or set backend = \"cpu\" to serve from the cpu backend on purpose")
    return None


def cuda_unavailable() -> str | None:
    """None when CuPy sees a GPU, else why not."""
    return cuda_probe()[0]


def cuda_probe() -> tuple[str | None, bool]:
    """(why CuPy cannot use a GPU, or None; whether that is because CuPy is not installed:
    an installed CuPy whose import fails, e.g. on a driver library not loadable yet, is not)."""
    try:
        import cupy  # noqa: PLC0415
    except ImportError as e:
        if importlib.util.find_spec("cupy") is not None:
            return f"CuPy is installed but cannot be imported ({type(e).__name__}: {e})", False
        return f"CuPy is not installed ({type(e).__name__}: {e})", True
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device", False
    except Exception as e:  # noqa: BLE001 - driver and runtime errors alike
        return f"{type(e).__name__}: {e}", False
    return None, False


def gpu_present() -> str | None:
    """What shows that this machine has an NVIDIA GPU, or None. Asks the driver, not CuPy:
    ``/dev/nvidiactl``, or ``nvidia-smi -L`` listing a GPU."""
    if os.path.exists("/dev/nvidiactl"):
        return "/dev/nvidiactl exists"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode == 0 and "GPU" in r.stdout:
        return "nvidia-smi lists " + r.stdout.strip().splitlines()[0]
    return None
