"""HostPool: refused when it would not fit in RAM, first-fit ranges on 2 MiB boundaries
that coalesce when released, an idempotent close, nothing left in the file system."""

import ctypes
import os
import signal
from types import SimpleNamespace

import numpy as np
import psutil
import pytest

from sparsekv.daemon import pool as pool_mod
from sparsekv.daemon.pool import ALIGN_BYTES, HostPool, PoolError, anon_huge_bytes

MiB = 1 << 20


def test_pool_larger_than_available_ram_is_refused_with_a_clear_error(monkeypatch):
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=8 * MiB))
    with pytest.raises(PoolError) as ei:
        HostPool(16 * MiB)
    msg = str(ei.value)
    assert "16MiB" in msg and "8MiB" in msg and "--pool-size" in msg
    HostPool(8 * MiB).close()  # exactly what is available fits


def test_pool_is_zeroed_shared_memory_with_no_name_in_the_file_system():
    with HostPool(4 * MiB, threads=2, backing="memfd") as p:
        # a memfd: no path exists that a crashed daemon could leave behind
        assert os.readlink(f"/proc/self/fd/{p._fd}").startswith("/memfd:sparsekv-pool")
        assert p.array.shape == (4 * MiB,) and p.array.dtype == np.uint8
        assert not p.array.any()
        p.array[123] = 7
        assert p.view(0, (4, MiB))[0, 123] == 7
        assert p.address == p.array.ctypes.data


def test_prefault_reports_progress_up_to_done():
    seen = []
    HostPool(3 * 64 * MiB // 2, threads=2, progress=seen.append).close()
    assert seen and seen[-1] == 1.0 and seen == sorted(seen)


def test_allocate_rounds_up_to_2mib_first_fit():
    with HostPool(8 * MiB) as p:
        a = p.allocate(1)
        b = p.allocate(ALIGN_BYTES + 1)
        assert (a, b) == (0, ALIGN_BYTES)
        assert p.used_bytes == 3 * ALIGN_BYTES and p.free_bytes == ALIGN_BYTES
        c = p.allocate(ALIGN_BYTES)
        assert c == 3 * ALIGN_BYTES and p.free_bytes == 0


def test_no_room_is_a_pool_error_naming_sizes():
    with HostPool(4 * MiB) as p:
        p.allocate(3 * MiB)
        with pytest.raises(PoolError) as ei:
            p.allocate(1)
        assert "no free range of 2MiB" in str(ei.value) and "free 0B" in str(ei.value)


def test_released_ranges_coalesce():
    with HostPool(8 * MiB) as p:
        offs = [p.allocate(ALIGN_BYTES) for _ in range(4)]
        assert p.free_bytes == 0
        p.release(offs[1])
        p.release(offs[3])
        with pytest.raises(PoolError):
            p.allocate(2 * ALIGN_BYTES)  # two free ranges, not adjacent
        p.release(offs[2])  # joins both neighbours
        assert p._ranges._free == [(ALIGN_BYTES, 3 * ALIGN_BYTES)]
        assert p.allocate(3 * ALIGN_BYTES) == ALIGN_BYTES
        p.release(ALIGN_BYTES)
        p.release(0)
        assert p._ranges._free == [(0, 8 * MiB)] and p.used_bytes == 0


def test_close_is_idempotent_and_frees_the_fd():
    p = HostPool(2 * MiB)
    fd = p._fd
    p.close()
    p.close()
    assert p.array is None
    with pytest.raises(OSError):
        os.fstat(fd)


def test_close_with_a_live_view_does_not_raise():
    p = HostPool(2 * MiB)
    v = p.view(0, (2, MiB))
    p.close()  # warns, leaves the mapping to the OS while the view lives
    p.close()
    assert v.shape == (2, MiB)


def test_an_anonymous_huge_page_pool_serves_like_the_memfd_one():
    """The default backing: an anonymous mapping (no fd), not
    inherited by a child (MADV_DONTFORK: a forked child touching it faults), pre-faulted
    and zeroed on release like the memfd pool; a bad value is a clear error."""
    pool = HostPool(8 << 20, threads=2)
    try:
        assert pool.backing == "anon_thp" and pool._fd == -1
        off = pool.allocate(4 << 20)
        pool.array[off: off + 16] = 7
        pool.release(off)
        off2 = pool.allocate(4 << 20)
        assert off2 == off and not pool.array[off: off + 16].any()  # zeroed before reuse
        # A forked child does not get the mapping: reading it there is a fault, not a copy.
        pid = os.fork()
        if pid == 0:
            try:
                import faulthandler

                faulthandler.disable()  # the fault is the point: no stack dump in the test log
                ctypes.string_at(pool.address, 1)
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV
    finally:
        pool.close()
    with pytest.raises(PoolError, match="pool backing must be one of anon_thp, memfd, got 'hugetlbfs'"):
        HostPool(8 << 20, threads=1, backing="hugetlbfs")


def test_an_anonymous_pool_the_kernel_will_not_keep_from_children_gives_way_to_a_memfd(monkeypatch, caplog):
    """MADV_DONTFORK refused (a sandboxed kernel): the daemon still gets a pool, a memfd,
    and says so; other advice failing changes nothing."""

    real = pool_mod._madvise

    def refuse_dontfork(address, nbytes, advice, what, required):
        if advice == pool_mod._MADV_DONTFORK:
            raise PoolError(f"madvise({what}) on the pool failed: Invalid argument")
        return real(address, nbytes, advice, what, required)

    monkeypatch.setattr(pool_mod, "_madvise", refuse_dontfork)
    with caplog.at_level("WARNING", logger="sparsekv.pool"), HostPool(4 * MiB, threads=1) as p:
        assert p.backing == "memfd" and p._fd >= 0
        assert os.readlink(f"/proc/self/fd/{p._fd}").startswith("/memfd:sparsekv-pool")
        off = p.allocate(MiB)
        p.array[off: off + 4] = 9
        assert p.view(off, (MiB,))[:4].tolist() == [9, 9, 9, 9]
    assert any("the pool is a memfd instead" in r.getMessage() for r in caplog.records)


def test_the_huge_page_count_is_the_pools_own():
    """anon_huge_bytes(address, nbytes): only the mappings over that range (the pool's
    share in huge pages, whatever else the process holds), at most its size; nothing
    for a range nothing is mapped at."""

    with HostPool(8 * MiB, threads=1) as p:
        got = anon_huge_bytes(p.address, p.size_bytes)
        assert 0 <= got <= p.size_bytes and got % (2 * MiB) == 0
        # The process's total, read around the range's: the kernel may split or collapse
        # huge pages in between (khugepaged, DAMON), so a few tries.
        for _ in range(5):
            before, mine, after = anon_huge_bytes(), anon_huge_bytes(p.address, p.size_bytes), anon_huge_bytes()
            if mine <= max(before, after) or after == 0:
                break
        else:
            pytest.fail(f"the pool's huge pages ({mine}) exceed the process's ({before}, {after}) five times")
    assert anon_huge_bytes(4096, 4096) == 0  # page 1: never mapped


def test_prefault_times_and_the_kernels_counters_are_reported(tmp_path):
    """fault_s / faulted_s (the pool start's figures): every page is faulted no later than
    the pre-fault ends. vmstat reads the counters it names from /proc/vmstat's format and
    vmstat_delta subtracts the ones both snapshots have."""
    with HostPool(3 * 64 * MiB, threads=2) as p:
        assert 0.0 < p.faulted_s <= p.fault_s
    f = tmp_path / "vmstat"
    f.write_text("nr_free_pages 5\nthp_fault_alloc 10\ncompact_stall 2\nthp_fault_fallback 1\n")
    before = pool_mod.vmstat(path=str(f))
    assert before == {"thp_fault_alloc": 10, "compact_stall": 2, "thp_fault_fallback": 1}
    assert pool_mod.vmstat(path=str(tmp_path / "missing")) == {}
    assert pool_mod.vmstat_delta(before, {"thp_fault_alloc": 25, "compact_stall": 2}) == {
        "thp_fault_alloc": 15, "compact_stall": 0}
