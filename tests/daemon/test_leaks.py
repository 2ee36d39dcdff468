"""Nothing leaks: an ATTACH that fails after allocating leaves no pool range, slab file or
attachment behind, however often it fails; a repeated HELLO neither piles up sessions nor
throws an attached one away; slab files have names nobody can create first."""

import errno
import os

import numpy as np
import pytest

import helpers
from helpers import request
from sparsekv.daemon import backends as backends_mod
from sparsekv.daemon.backends import CpuBackend, run_dir_tag
from sparsekv.daemon.pool import ALIGN_BYTES, HostPool
from sparsekv.daemon.residency.base import ResidencyError
from sparsekv.daemon.server import Daemon
from sparsekv.proto import ErrorCode, MsgType

MiB = 1 << 20
FAILURES = 33


class FlakyBackend(CpuBackend):
    """A cpu backend whose first ``fails`` new_rank calls fail after creating the slab
    file (as a real backend fails after taking resources)."""

    def __init__(self, *a, fails: int, **kw):
        super().__init__(*a, **kw)
        self.fails = fails

    def new_rank(self, space, client_id, *a, **kw):
        state, handles = super().new_rank(space, client_id, *a, **kw)
        if self.fails > 0:
            self.fails -= 1
            self.release_rank(client_id)  # a backend cleans up what it took itself
            raise ResidencyError("TOO_LARGE", "no room for the slab (injected)")
        return state, handles


def hello(dm, ident=b"A"):
    return request(dm, ident, MsgType.HELLO, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": ""})[0]


@pytest.fixture
def one_engine_pool():
    """A pool with room for exactly one engine of ``LAYOUT``: a range leaked by a failed
    attach would make the next one POOL_FULL."""
    p = HostPool(-(-LAYOUT.pool_bytes // ALIGN_BYTES) * ALIGN_BYTES, threads=1)
    yield p
    p.close()


LAYOUT = helpers.layout(row_bytes=4096, host_rows=2048)  # 16 MiB: zeroed in the background


def attach(dm, ident=b"A", engine="e"):
    return request(dm, ident, MsgType.ATTACH, {"engine": engine, "layout": LAYOUT.to_wire()})[0]


def assert_clean(dm, tmp_path):
    assert dm.pool.used_bytes == 0 and dm.pool.zeroing_bytes == 0 and not dm.engines
    assert all(s.state is None for s in dm.sessions.values())
    assert helpers.shm_slabs(str(tmp_path), str(tmp_path)) == []


def test_backend_failing_33_times_leaves_nothing_and_then_an_attach_fits(tmp_path, one_engine_pool):
    backend = FlakyBackend(str(tmp_path), shm_dir=str(tmp_path), fails=FAILURES)
    dm = Daemon(str(tmp_path), backend, one_engine_pool)
    try:
        assert hello(dm)["ok"]
        for _ in range(FAILURES):
            h = attach(dm)
            assert h["code"] == int(ErrorCode.TOO_LARGE) and "injected" in h["msg"], h
            assert_clean(dm, tmp_path)
        assert attach(dm)["ok"]
        assert dm.pool.used_bytes == one_engine_pool.size_bytes
        assert len(helpers.shm_slabs(str(tmp_path), str(tmp_path))) == 1
    finally:
        for s in list(dm.sessions.values()):
            dm.sessions.detach(s)
        backend.close()


def test_slab_reservation_failing_33_times_leaves_no_file(tmp_path, one_engine_pool, monkeypatch):
    backend = CpuBackend(str(tmp_path), shm_dir=str(tmp_path))
    dm = Daemon(str(tmp_path), backend, one_engine_pool)
    real = os.posix_fallocate
    left = [FAILURES]

    def fallocate(fd, off, n):
        if left[0] > 0:
            left[0] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, off, n)

    monkeypatch.setattr(backends_mod.os, "posix_fallocate", fallocate)
    try:
        assert hello(dm)["ok"]
        for _ in range(FAILURES):
            h = attach(dm)
            assert h["code"] == int(ErrorCode.TOO_LARGE) and "cannot reserve a hot slab" in h["msg"], h
            assert_clean(dm, tmp_path)
        assert attach(dm)["ok"]
    finally:
        for s in list(dm.sessions.values()):
            dm.sessions.detach(s)
        backend.close()


def test_attach_detach_cycles_reuse_the_same_range(tmp_path, one_engine_pool):
    backend = CpuBackend(str(tmp_path), shm_dir=str(tmp_path))
    dm = Daemon(str(tmp_path), backend, one_engine_pool)
    try:
        assert hello(dm)["ok"]
        for i in range(FAILURES):
            assert attach(dm, engine=f"e{i}")["ok"]  # waits for the previous range's zeroing
            assert request(dm, b"A", MsgType.DETACH)[0]["was_attached"]
        dm.pool.wait_zeroed()
        assert_clean(dm, tmp_path)
    finally:
        for s in list(dm.sessions.values()):
            dm.sessions.detach(s)
        backend.close()


def test_repeated_hello_never_piles_up_sessions(tmp_path):
    pool = HostPool(8 * MiB, threads=1)
    backend = CpuBackend(str(tmp_path), shm_dir=str(tmp_path))
    dm = Daemon(str(tmp_path), backend, pool, max_clients=2)
    try:
        for _ in range(FAILURES):
            assert hello(dm)["ok"]
        assert len(dm.sessions) == 1
        assert request(dm, b"A", MsgType.ATTACH, {"engine": "e", "layout": helpers.layout().to_wire()})[0]["ok"]
        for _ in range(FAILURES):
            assert hello(dm)["code"] == int(ErrorCode.ALREADY_ATTACHED)
        assert len(dm.sessions) == 1 and dm.sessions[b"A"].state is not None
        assert hello(dm, b"B")["ok"]  # a second client still fits under max_clients=2
    finally:
        for s in list(dm.sessions.values()):
            dm.sessions.detach(s)
        backend.close()
        pool.close()


# -- slabs have no name -----------------------------------------------------------------------
def test_slabs_are_memfds_and_squatted_names_change_nothing(tmp_path):
    be = CpuBackend("/run/x", shm_dir=str(tmp_path))
    # names the daemon used to pick, taken by someone else after it started
    squat = tmp_path / f"sparsekv-{run_dir_tag('/run/x')}-1"
    squat.write_bytes(b"someone else's")
    os.symlink("/etc/passwd", f"{squat}-0000000000000000")
    lay = helpers.layout()
    from sparsekv.daemon.engine import EngineSpace

    space = EngineSpace("e", lay, np.zeros((lay.num_layers, lay.host_rows, lay.row_bytes), np.uint8))
    for _ in range(2):  # the same client id twice: a new memfd each time
        _, h = be.new_rank(space, 1, 0, "cpu")
        fd = be.share_fds(1)[h["fd"]]
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:") and os.fstat(fd).st_size == h["bytes"]
        be.release_rank(1)
    assert sorted(os.listdir(tmp_path)) == [squat.name, f"{squat.name}-0000000000000000"]  # nothing made, nothing touched
    assert squat.read_bytes() == b"someone else's"
    be.close()


def test_stale_files_with_tokens_are_removed_by_prefix(tmp_path):
    tag = run_dir_tag("/run/x")
    stale = [tmp_path / f"sparsekv-{tag}-3-0123456789abcdef", tmp_path / f"sparsekv-{tag}-blocks-3-0123456789abcdef"]
    theirs = tmp_path / f"sparsekv-{run_dir_tag('/run/y')}-3-0123456789abcdef"
    for p in (*stale, theirs):
        p.write_bytes(b"x")
    CpuBackend("/run/x", shm_dir=str(tmp_path))
    assert not any(p.exists() for p in stale) and theirs.exists()
