"""What this process's cgroups allow (``proto/cgroups.py``): the CPU quota the warm loops
spend, and the memory (found by an operator review: the pool checks read the machine's RAM
only, so under ``MemoryMax=`` or a Kubernetes limit a pool too large was OOM-killed while
it was pre-faulted instead of refused at start)."""

from types import SimpleNamespace

import psutil
import pytest

from sparsekv.proto import cgroups

GiB = 1 << 30


def _tree(tmp_path, proc_lines: str, files: dict) -> tuple[str, str]:
    root = tmp_path / "cg"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    proc = tmp_path / "cgroup"
    proc.write_text(proc_lines)
    return str(root), str(proc)


def test_the_smallest_limit_and_the_least_room_of_the_cgroup_and_its_ancestors(tmp_path):
    # v2: a pod limit of 8 GiB (3 used) under a node slice of 16 (14 used); the container none.
    root, proc = _tree(tmp_path / "v2", "0::/kube/pod/ctr\n", {
        "kube/memory.max": f"{16 * GiB}\n", "kube/memory.current": f"{14 * GiB}\n",
        "kube/pod/memory.max": f"{8 * GiB}\n", "kube/pod/memory.current": f"{3 * GiB}\n",
        "kube/pod/ctr/memory.max": "max\n", "kube/pod/ctr/memory.current": f"{1 * GiB}\n"})
    assert cgroups.memory_limit(root, proc) == (8 * GiB, 2 * GiB)
    # v1: the memory hierarchy; its "no limit" is a huge number.
    root, proc = _tree(tmp_path / "v1", "4:memory:/svc\n2:cpu,cpuacct:/svc\n", {
        "memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "5\n",
        "memory/svc/memory.limit_in_bytes": f"{4 * GiB}\n", "memory/svc/memory.usage_in_bytes": f"{1 * GiB}\n"})
    assert cgroups.memory_limit(root, proc) == (4 * GiB, 3 * GiB)
    root, proc = _tree(tmp_path / "none", "0::/a\n", {"memory.max": "max\n", "a/memory.max": "max\n"})
    assert cgroups.memory_limit(root, proc) is None
    assert cgroups.memory_limit(str(tmp_path / "missing"), str(tmp_path / "missing-cgroup")) is None


def test_the_pool_checks_name_the_cgroup_where_it_leaves_less_than_the_ram(monkeypatch):
    from sparsekv.daemon.pool import HostPool, PoolError
    from sparsekv.daemon.start_checks import SettingRefused, check_pool_fits, pool_room_refusal

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=64 * GiB, available=32 * GiB))
    monkeypatch.setattr(cgroups, "memory_limit", lambda: (4 * GiB, 3 * GiB))
    cfg = SimpleNamespace(pool_size=5 * GiB)
    with pytest.raises(SettingRefused, match=r"more than its cgroup's memory limit .*\(4GiB\)"):
        check_pool_fits(cfg, {"pool_size": "flag --pool-size"})
    cfg.pool_size = 3 * GiB + 1
    assert "room under its cgroup's memory limit of 4.0 GiB (3GiB)" in pool_room_refusal(cfg, {})
    with pytest.raises(PoolError, match="room under its cgroup's memory limit"):
        HostPool(3 * GiB + 1)
    cfg.pool_size = 3 * GiB
    assert pool_room_refusal(cfg, {}) is None
    check_pool_fits(cfg, {})
    monkeypatch.setattr(cgroups, "memory_limit", lambda: None)  # no limit: the RAM's figures
    cfg.pool_size = 33 * GiB
    assert "available RAM (32GiB)" in pool_room_refusal(cfg, {})


def test_cpu_quota_reads_the_smallest_of_the_cgroup_and_its_ancestors(tmp_path):
    from sparsekv.proto.cpus import cpu_quota

    # v2: the pod's 4 CPUs under a node slice of 8, the container without its own.
    root, proc = _tree(tmp_path / "v2", "0::/kube/pod/ctr\n", {
        "cpu.max": "max 100000\n", "kube/cpu.max": "800000 100000\n", "kube/pod/cpu.max": "400000 100000\n",
        "kube/pod/ctr/cpu.max": "max 100000\n"})
    assert cpu_quota(root, proc) == 4.0
    # v1: cpu,cpuacct mounted together; -1: none.
    root, proc = _tree(tmp_path / "v1", "4:memory:/x\n2:cpu,cpuacct:/svc\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/svc/cpu.cfs_quota_us": "150000\n", "cpu,cpuacct/svc/cpu.cfs_period_us": "100000\n"})
    assert cpu_quota(root, proc) == 1.5
    root, proc = _tree(tmp_path / "none", "0::/a\n", {"cpu.max": "max 100000\n"})
    assert cpu_quota(root, proc) is None
    assert cpu_quota(str(tmp_path / "missing"), str(tmp_path / "missing-cgroup")) is None
