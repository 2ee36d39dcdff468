"""The daemon's stats snapshot: every counter and gauge at one moment, as one dict (STATS,
the stats socket, ``/metrics`` through ``stats.SnapshotCollector``). Computed at scrape
time; per request the handlers only bump counters."""

from __future__ import annotations

import os

from sparsekv.proto import PROTOCOL_VERSION
from sparsekv.proto.cpus import format_cpu_list

from .stats import package_version


class Snapshot:
    """Callable: the snapshot of a daemon's parts (see ``Daemon.__init__``), read on the
    loop's thread."""

    def __init__(self, stats, backend, sessions, control, engines, io_cpus=(), warmer=None):
        self.stats, self.backend, self.sessions = stats, backend, sessions
        self.control, self.engines = control, engines
        self.io_cpus, self.warmer = tuple(io_cpus), warmer
        self.version = package_version()

    def __call__(self, owner_uid: int | None = None) -> dict:
        """The snapshot; with ``owner_uid``, ``per_engine`` holds only the engines that uid
        owns (a viewer who may not see every uid's: ``Sessions.sees_all``)."""
        device_errors, arenas = self.backend.device_errors(), self.backend.arenas()
        warmer = self.warmer
        return self.stats.snapshot(self.backend.device_counters(), {
            **self.backend.describe(),
            **({"device_errors": device_errors} if device_errors is not None else {}),
            **({"arenas": arenas} if arenas is not None else {}),
            "clients": len(self.sessions),
            **self.control.counters(),
            "attached": sum(1 for s in self.sessions.values() if s.state is not None),
            **self.engines.gauges(),
            "per_engine": self._per_engine(owner_uid),
            "protocol_version": PROTOCOL_VERSION,
            "version": self.version,
            "io_cpus": format_cpu_list(self.io_cpus),
            "warm_cpus": format_cpu_list(warmer.cpus) if warmer is not None else "",
            "warm_cpus_running": warmer.running() if warmer is not None else 0,
            "warm_cpus_revived": warmer.revived if warmer is not None else 0,
            "pid": os.getpid(),
        })

    def _per_engine(self, owner_uid: int | None = None) -> dict:
        out = {}
        for name in self.engines:
            space = self.engines.space(name)
            if owner_uid is not None and (space.owner is None or space.owner.uid != owner_uid):
                continue  # another uid's engine: its name and figures are its owner's business
            lay = space.layout
            out[name] = {"ranks": len(space.ranks), "pool_bytes": space.range_bytes,
                         "slab_bytes": len(space.ranks) * lay.slab_bytes,
                         "tp_size": space.tp.size if space.tp else 1, "tp_lag": space.tp.lag() if space.tp else 0}
            if space.blocks is not None:
                out[name]["blocks"] = space.blocks.gauges()
        return out
