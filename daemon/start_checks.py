"""The start's checks that make, lock and start nothing, in the order the start makes
them (``daemon/main.py``): first the settings no restart changes (exit 2: the shm dir, the
pool against the machine's RAM, the CPU lists), then what may pass at a later start
(exit 1, or 2 where a setting is at fault: the backend's GPUs, the run dir, the metrics
port, the RAM free now). ``sparsekvd --print-config`` runs them all (:func:`would_start`)
and exits with the first refusal's code, the one the start stops at.
"""

from __future__ import annotations

import errno
import os
import socket
import sys

from sparsekv.proto.cgroups import memory_room, memory_total
from sparsekv.proto.cpus import check_cpus_usable, cpu_quota, format_cpu_list, parse_cpu_list
from sparsekv.proto.settings import format_size

from . import backends as backends_mod
from . import config as config_mod
from .backends import backend_unusable
from .run_dir_lock import SettingRefused, run_dir_refusal


def backend_refusal(cfg, sources: dict) -> tuple[str, int] | None:
    """Why the configured backend cannot start, found before the pool is pre-faulted, and
    the exit code: 2 when no restart would change it (CuPy not installed), 1 when one may
    (a GPU the driver does not serve yet, ``devices`` naming GPUs not visible now: a GPU
    being reset or repartitioned); None when it may start (``backends.backend_unusable``:
    ``auto`` on a machine with no NVIDIA GPU serves from the cpu backend, on one whose GPU
    CuPy cannot use it does not)."""
    if cfg.backend == "cpu":
        return None
    probe = backends_mod.cuda_probe()
    why = backend_unusable(cfg.backend, probe, source=sources.get("backend", "default"))
    if why is not None:
        return why, 2 if probe[1] else 1
    if probe[0] is not None:  # auto on a machine without an NVIDIA GPU: the cpu backend
        return None
    if cfg.devices != "all":
        import cupy  # noqa: PLC0415 - importable: backend_unusable() said so

        count = cupy.cuda.runtime.getDeviceCount()
        bad = [int(o) for o in cfg.devices.split(",") if not 0 <= int(o) < count]
        if bad:
            return f"devices {cfg.devices} ({sources.get('devices', 'default')}) names GPU(s) {bad}, but {count} " \
                   "are visible", 1
    return None


def shm_dir_refusal(cfg, sources: dict) -> str | None:
    """Why ``shm_dir`` cannot serve (a setting: exit code 2), or None."""
    if os.path.isdir(cfg.shm_dir) and os.access(cfg.shm_dir, os.W_OK | os.X_OK):
        return None
    why = "does not exist" if not os.path.exists(cfg.shm_dir) else (
        "is not a directory" if not os.path.isdir(cfg.shm_dir) else "is not writable by this user")
    return (f"shm_dir {cfg.shm_dir} ({sources.get('shm_dir', 'default')}) {why}; stale slab files of older "
            "versions are removed there: point shm_dir at the engines' /dev/shm")


def would_start(cfg, sources: dict) -> int:
    """``--print-config``'s verdict, after the settings: the start's own checks that make,
    lock, pre-fault and start nothing (the shm and run dirs, the backend, the pool against
    the RAM, the CPU lists, the metrics port), each refusal on stderr as the start would
    log it. 0 when none refuses, else the start's exit code (2: a setting; 1: may pass at
    a later start)."""
    found: list[tuple[str, int]] = [(why, 2) for why in settings_refusals(cfg, sources)]
    if (refusal := backend_refusal(cfg, sources)) is not None:
        found.append(refusal)
    no_gpu = None if cfg.backend != "auto" or refusal is not None else backends_mod.cuda_probe()[0]
    if (refusal := run_dir_refusal(cfg.run_dir)) is not None:
        found.append((f"{refusal[0]} (run_dir: {sources.get('run_dir', 'default')})", refusal[1]))
    if (refusal := metrics_port_refusal(cfg, sources)) is not None:
        found.append(refusal)
    if (why := pool_room_refusal(cfg, sources)) is not None:
        found.append((why, 1))
    for why, _ in found:
        print(f"sparsekvd: would not start: {why}", file=sys.stderr)
    if no_gpu is not None:  # auto on a machine without an NVIDIA GPU, as the start would log it
        print(f"sparsekvd: backend auto ({sources.get('backend', 'default')}): no NVIDIA GPU on this machine; "
              "the start would use the cpu backend", file=sys.stderr)
    if (cfg.backend == "cpu" or no_gpu is not None) and (ignored := config_mod.cuda_settings_ignored(sources)):
        print(f"sparsekvd: {ignored}", file=sys.stderr)
    for line in config_mod.moot_settings(cfg, sources):
        print(f"sparsekvd: {line}", file=sys.stderr)
    return found[0][1] if found else 0  # the start stops at its first refusal, in this order


def settings_refusals(cfg, sources: dict) -> list[str]:
    """The settings that no restart makes work (exit 2), checked before anything that may
    pass at a later start (the backend's GPUs, the run dir's lock, the metrics port, the
    RAM free now), so that a wrong setting is never retried as a busy resource: the shm
    dir, the pool against this machine's RAM, the CPU lists. Empty when all pass."""
    found = [why] if (why := shm_dir_refusal(cfg, sources)) is not None else []
    for check in (check_pool_fits, check_cpu_lists):
        try:
            check(cfg, sources)
        except SettingRefused as e:
            found.append(str(e))
    return found


def pool_room_refusal(cfg, sources: dict) -> str | None:
    """Why the pool does not fit the RAM available now, or the room its cgroup's memory
    limit leaves (exit 1: it may once other processes are gone; ``HostPool``'s own check,
    made before the pool is pre-faulted and the warm CPU loops start), or None."""
    avail, what = memory_room()
    if cfg.pool_size <= avail:
        return None
    return (f"pool_size {format_size(cfg.pool_size)} ({sources.get('pool_size', 'default')}) does not fit in "
            f"{what} ({format_size(avail)}); lower it, or free memory")


def check_pool_fits(cfg, sources: dict) -> None:
    """SettingRefused when ``pool_size`` is more than this machine's RAM or its cgroup's
    memory limit (no restart makes it fit; more than the room left now is
    :func:`pool_room_refusal`'s, exit 1: it may fit once other processes are gone)."""
    total, what = memory_total()
    if cfg.pool_size > total:
        raise SettingRefused(f"pool_size {format_size(cfg.pool_size)} ({sources.get('pool_size', 'default')}) is "
                             f"more than {what} ({format_size(total)}): lower it")


def metrics_port_refusal(cfg, sources: dict) -> tuple[str, int] | None:
    """Why ``metrics_port`` cannot be listened on (taken, or not this user's to take), found
    before the pool is pre-faulted rather than minutes later, and the exit code: 2 (a bad
    setting, not retried by the unit) when this process may not open an IPv4 socket at all
    or take that port, 1 when the port is taken (it may be free at the next start); None
    when it can (or is 0)."""
    if not cfg.metrics_port:
        return None
    where = f"metrics_port {cfg.metrics_port} ({sources.get('metrics_port', 'default')})"
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    except OSError as e:  # the unit allows AF_UNIX only unless its metrics drop-in is enabled
        return (f"{where}: cannot open an IPv4 socket ({e.strerror or e}); under the systemd unit, install the "
                "drop-in deploy/sparsekvd.service.d/metrics.conf, which allows it", 2)
    with s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's own listener
        try:
            s.bind(("127.0.0.1", cfg.metrics_port))
        except OSError as e:  # a port this user may not take (below 1024) will never be: a setting
            return f"{where}: {e.strerror or e}", 2 if e.errno in (errno.EACCES, errno.EPERM) else 1
    return None


def check_cpu_lists(cfg, sources: dict) -> tuple:
    """``io_cpus`` and ``warm_cpus`` parsed and checked (CPUs this process may use, some
    left to its other threads, the warm loops within the cgroup's CPU quota); with the
    quota when there are warm CPUs under one (else None). SettingRefused naming what is
    wrong and where the setting came from."""
    def refuse(name: str, why: str) -> SettingRefused:
        return SettingRefused(f"{why} ({name}: {sources.get(name, 'default')})")

    lists = {}
    for name in ("io_cpus", "warm_cpus"):
        try:
            lists[name] = parse_cpu_list(getattr(cfg, name), name)
            check_cpus_usable(lists[name], name)
        except ValueError as e:
            raise refuse(name, str(e)) from None
    io_cpus, warm = lists["io_cpus"], lists["warm_cpus"]
    if io_cpus and os.sched_getaffinity(0) <= set(io_cpus):
        raise refuse("io_cpus", f"io_cpus {format_cpu_list(io_cpus)} are all the CPUs this process may run on: "
                     "leave some for its other threads")
    quota = cpu_quota() if warm else None
    # Each loop spends a CPU of the cgroup's quota (k8s CPU limits, systemd CPUQuota=): the
    # daemon's own threads would be throttled.
    if quota is not None and len(warm) + 1 > quota:
        raise refuse("warm_cpus", f"warm_cpus {format_cpu_list(warm)} would spend {len(warm)} of the {quota:g} "
                     "CPUs of run time this cgroup's cpu.max allows (a loop spends it, idle priority or not), "
                     "leaving the daemon less than one: raise the CPU limit by as many CPUs, or warm fewer")
    return io_cpus, warm, quota
