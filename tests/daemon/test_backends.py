"""CpuBackend: one anonymous shared-memory slab (a sealed memfd, named after the run dir
in /proc only) per attached rank, closed on release and close; stale files of this run
dir (an older daemon's, killed) removed from shm_dir at start, other run dirs' files left
alone."""

import fcntl
import mmap
import os

import numpy as np
import pytest

import helpers
from sparsekv.daemon.backends import CpuBackend, run_dir_tag
from sparsekv.daemon.engine import EngineSpace


def space(**kw):
    lay = helpers.layout(**kw)
    return EngineSpace("e", lay, np.zeros((lay.num_layers, lay.host_rows, lay.row_bytes), np.uint8))


def test_run_dir_tag_is_stable_and_distinct(tmp_path):
    assert run_dir_tag(str(tmp_path)) == run_dir_tag(str(tmp_path) + "/.")
    assert run_dir_tag("/run/a") != run_dir_tag("/run/b") and len(run_dir_tag("/run/a")) == 10


def test_new_rank_makes_an_anonymous_sealed_slab_of_slab_and_staging_bytes(tmp_path):
    be = CpuBackend("/run/x", shm_dir=str(tmp_path))
    sp = space(staging_rows=4)
    state, handles = be.new_rank(sp, 7, 1, "cpu")
    assert handles == {"kind": "shm", "fd": "slab", "bytes": sp.layout.slab_bytes + sp.layout.staging_bytes,
                       "slab_bytes": sp.layout.slab_bytes}
    fd = be.share_fds(7)["slab"]
    # a memfd: no name in any file system (nothing in shm_dir), only in /proc/<pid>/fd
    assert os.listdir(tmp_path) == []
    assert os.readlink(f"/proc/self/fd/{fd}") == f"/memfd:sparsekv-{run_dir_tag('/run/x')}-7 (deleted)"
    assert os.fstat(fd).st_size == handles["bytes"]
    # sealed: a client holding the descriptor cannot shrink it under the daemon's mapping
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 0)
    # the daemon's slab array is the memfd: what it writes, a client mapping it reads
    state.slab[1, 2, 3, 4] = 99
    client = mmap.mmap(fd, handles["bytes"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    data = np.frombuffer(client, np.uint8)
    assert data[np.ravel_multi_index((1, 2, 3, 4), state.slab.shape)] == 99
    data[0] = 7  # and the other way round
    assert state.slab.reshape(-1)[0] == 7
    del data
    client.close()
    be.release_rank(7)
    assert be.share_fds(7) == {}
    be.release_rank(7)  # twice is fine


def test_close_releases_every_slab(tmp_path):
    be = CpuBackend("/run/x", shm_dir=str(tmp_path))
    for cid in (1, 2, 3):
        be.new_rank(space(), cid, 0, "cpu")
    assert helpers.slab_memfds("/run/x", os.getpid()) == [f"memfd:sparsekv-{run_dir_tag('/run/x')}-{c}"
                                                          for c in (1, 2, 3)]
    be.close()
    assert helpers.slab_memfds("/run/x", os.getpid()) == [] and os.listdir(tmp_path) == []


def test_start_removes_stale_slabs_of_its_run_dir_only(tmp_path):
    mine = tmp_path / f"sparsekv-{run_dir_tag('/run/x')}-4"
    theirs = tmp_path / f"sparsekv-{run_dir_tag('/run/y')}-4"
    mine.write_bytes(b"stale")
    theirs.write_bytes(b"live")
    CpuBackend("/run/x", shm_dir=str(tmp_path))
    assert not mine.exists() and theirs.exists()


def test_slab_larger_than_shared_memory_is_refused_cleanly(tmp_path):
    """A slab that memory cannot hold fails at attach (TOO_LARGE), not later with SIGBUS."""
    import glob

    import numpy as np
    import pytest

    from sparsekv.daemon.backends import CpuBackend, run_dir_tag
    from sparsekv.daemon.engine import EngineSpace
    from sparsekv.daemon.residency.base import ResidencyError
    from sparsekv.proto import Layout

    lay = Layout(num_layers=64, row_bytes=1024, top_k=1, region_stride=32768, max_reqs=4096, host_rows=1)
    run_dir = str(tmp_path)
    be = CpuBackend(run_dir)
    space = EngineSpace("big", lay, np.zeros((lay.num_layers, 1, lay.row_bytes), np.uint8))
    with pytest.raises(ResidencyError, match="cannot reserve a hot slab") as e:
        be.new_rank(space, 1, 0, "cpu")
    assert e.value.code == "TOO_LARGE"
    assert glob.glob(f"/dev/shm/sparsekv-{run_dir_tag(run_dir)}-*") == []


# -- make_backend: which backend `auto` picks --------------------------------------------
def _cfg(tmp_path, backend):
    from sparsekv.daemon.config import Config

    return Config(backend=backend, run_dir=str(tmp_path), shm_dir=str(tmp_path))


def _no_cupy(monkeypatch):
    from sparsekv.daemon import backends

    monkeypatch.setattr(backends, "cuda_probe",
                        lambda: ("CuPy is not installed (ModuleNotFoundError: No module named 'cupy')", True))


def test_auto_without_a_gpu_picks_the_cpu_backend(tmp_path, monkeypatch):
    from sparsekv.daemon import backends

    _no_cupy(monkeypatch)
    monkeypatch.setattr(backends, "gpu_present", lambda: None)
    be = backends.make_backend(_cfg(tmp_path, "auto"), None)
    try:
        assert isinstance(be, CpuBackend) and be.describe()["backend"] == "cpu"
    finally:
        be.close()


def test_auto_on_a_gpu_machine_without_cupy_is_an_error_naming_the_cuda_extra(tmp_path, monkeypatch):
    import pytest

    from sparsekv.daemon import backends

    _no_cupy(monkeypatch)
    monkeypatch.setattr(backends, "gpu_present", lambda: "/dev/nvidiactl exists")
    with pytest.raises(RuntimeError) as e:
        backends.make_backend(_cfg(tmp_path, "auto"), None)
    msg = str(e.value)
    assert "pip install 'sparsekv[cuda]'" in msg and "/dev/nvidiactl" in msg and 'backend = "cpu"' in msg
    assert os.listdir(tmp_path) == []  # no cpu backend was made behind the error


def test_backend_cuda_without_cupy_names_the_cuda_extra(tmp_path, monkeypatch):
    import pytest

    from sparsekv.daemon import backends

    _no_cupy(monkeypatch)
    monkeypatch.setattr(backends, "gpu_present", lambda: None)
    with pytest.raises(RuntimeError, match=r"backend cuda: CuPy is not installed.*pip install 'sparsekv\[cuda\]'"):
        backends.make_backend(_cfg(tmp_path, "cuda"), None)


def test_backend_cpu_on_a_gpu_machine_is_the_cpu_backend(tmp_path, monkeypatch):
    from sparsekv.daemon import backends

    _no_cupy(monkeypatch)
    monkeypatch.setattr(backends, "gpu_present", lambda: "/dev/nvidiactl exists")
    be = backends.make_backend(_cfg(tmp_path, "cpu"), None)
    be.close()
    assert isinstance(be, CpuBackend)


def test_gpu_probe_asks_the_driver_not_cupy(tmp_path, monkeypatch):
    """``/dev/nvidiactl`` or an ``nvidia-smi -L`` that lists a GPU; an ``nvidia-smi`` that
    fails (installed, no driver loaded) or is absent means no GPU."""
    from sparsekv.daemon import backends

    real_exists = os.path.exists
    monkeypatch.setattr(backends.os.path, "exists", lambda p: False if p == "/dev/nvidiactl" else real_exists(p))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert backends.gpu_present() is None  # no nvidia-smi on PATH
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the driver' >&2\nexit 9\n")
    smi.chmod(0o755)
    assert backends.gpu_present() is None
    smi.write_text("#!/bin/sh\n[ \"$1\" = -L ] && echo 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    assert backends.gpu_present() == "nvidia-smi lists GPU 0: NVIDIA H200 (UUID: GPU-0)"
    monkeypatch.setattr(backends.os.path, "exists", lambda p: p == "/dev/nvidiactl" or real_exists(p))
    assert backends.gpu_present() == "/dev/nvidiactl exists"


@pytest.mark.parametrize("seal", ["F_SEAL_WRITE", "F_SEAL_FUTURE_WRITE"])
def test_engine_memory_sealed_against_writes_is_refused_by_name(seal):
    """A deposited slab or keys buffer the daemon cannot write (sealed against writes):
    BAD_ARGUMENT naming the seal. Seen: PermissionError from mmap, answered INTERNAL."""
    from sparsekv.daemon.backends import map_engine_memory
    from sparsekv.daemon.residency.base import ResidencyError

    fd = os.memfd_create("sealed", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 4096)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | getattr(fcntl, seal, 0x10))
        with pytest.raises(ResidencyError, match="sealed against writes") as e:
            map_engine_memory(fd, 4096, "keys buffer")
        assert e.value.code == "BAD_ARGUMENT"
    finally:
        os.close(fd)


def test_an_installed_cupy_that_cannot_be_imported_is_not_missing(tmp_path, monkeypatch):
    """Found by a review: a driver library not loadable yet (a reinstall, a container before
    its NVIDIA libraries are injected) read as "CuPy is not installed", exit 2: the unit
    would never restart the daemon once the driver came."""
    import importlib
    import sys

    from sparsekv.daemon import backends

    pkg = tmp_path / "cupy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    importlib.invalidate_caches()
    why, missing = backends.cuda_probe()
    assert not missing and why.startswith("CuPy is installed but cannot be imported (ImportError: libcuda.so.1")
    monkeypatch.syspath_prepend(str(tmp_path / "empty"))
    monkeypatch.setattr(backends.importlib.util, "find_spec", lambda name: None)
    assert backends.cuda_probe()[1]  # not found at all: missing
