"""This process's control groups (v2 unified, or v1 per controller), read from
``/proc/self/cgroup`` and the cgroup file system: the limits a unit (systemd
``CPUQuota=``, ``MemoryMax=``) or a container (Kubernetes limits) sets, which the
machine-wide figures (``os.cpu_count()``, ``psutil.virtual_memory()``) do not show."""

from __future__ import annotations

import os

# v1's "no limit" is the largest page-aligned int64; anything this large is none.
_NO_LIMIT = 1 << 62


def cgroup_dirs(controller: str, cgroup_root: str = "/sys/fs/cgroup",
                proc_cgroup: str = "/proc/self/cgroup") -> list[tuple[int, str]]:
    """(version, directory) of this process's cgroup and each of its ancestors, the root
    last, in the hierarchy that has ``controller`` (v1), or the unified one (v2): where
    that controller's limits are read (the smallest applies). Empty when none can be read."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return []
    out = []
    for hier, controllers, path in lines:
        if hier == "0" and controllers == "":
            version, base = 2, cgroup_root
        elif controller in controllers.split(","):
            version, base = 1, os.path.join(cgroup_root, controllers)
            if not os.path.isdir(base):
                base = os.path.join(cgroup_root, controller)
        else:
            continue
        parts = [p for p in path.split("/") if p]
        out += [(version, os.path.join(base, *parts[:i])) for i in range(len(parts), -1, -1)]
    return out


def memory_limit(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> tuple[int, int] | None:
    """(limit, room) of the memory this process's cgroup and its ancestors allow: the
    smallest limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) and the least room
    left under any of them (its limit less its usage, ``memory.current`` /
    ``memory.usage_in_bytes``), in bytes; None without a limit."""
    found = []
    for version, d in cgroup_dirs("memory", cgroup_root, proc_cgroup):
        limit_file, usage_file = ("memory.max", "memory.current") if version == 2 else \
            ("memory.limit_in_bytes", "memory.usage_in_bytes")
        limit = _read_bytes(os.path.join(d, limit_file))
        if limit is None or limit >= _NO_LIMIT:
            continue
        usage = _read_bytes(os.path.join(d, usage_file)) or 0
        found.append((limit, max(0, limit - usage)))
    if not found:
        return None
    return min(lim for lim, _ in found), min(room for _, room in found)


def _read_bytes(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def memory_room() -> tuple[int, str]:
    """The bytes this process may take now, and what says so: the RAM available
    (``psutil``), or less where its cgroup's limit leaves less room."""
    import psutil  # noqa: PLC0415 - a dependency of the daemon, not of every importer of proto

    avail = psutil.virtual_memory().available
    cg = memory_limit()
    if cg is not None and cg[1] < avail:
        return cg[1], f"the room under its cgroup's memory limit of {_gib(cg[0])}"
    return avail, "available RAM"


def memory_total() -> tuple[int, str]:
    """The most this process could ever take, and what says so: the machine's RAM, or its
    cgroup's memory limit where that is lower."""
    import psutil  # noqa: PLC0415

    total = psutil.virtual_memory().total
    cg = memory_limit()
    if cg is not None and cg[0] < total:
        return cg[0], "its cgroup's memory limit (memory.max / memory.limit_in_bytes)"
    return total, "this machine's RAM"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
