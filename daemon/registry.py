"""The engines attached to the daemon, and their lifetimes.

An engine (one model served by one or several TP ranks) is created by its first rank's
ATTACH, which reserves its host pool range; every later rank of the same name joins it
(with the same layout, or LAYOUT_MISMATCH); when its last rank detaches, the backend's
per-engine resources and the pool range are released. The server keeps sessions and
maps each attached session to (engine name, rank state); everything per engine lives
here and in :class:`~.engine.EngineSpace`, so a feature that acts once for all ranks of
one engine is a change in these two places only.
"""

from __future__ import annotations

import logging
from typing import Iterator

from sparsekv.proto import ErrorCode, Layout, ProtocolError

from .engine import EngineSpace, RankState
from .pool import HostPool

log = logging.getLogger("sparsekv.registry")


class EngineRegistry:
    """Engines by name, each with its pool range and its ranks (by client id).

    Arguments:
        pool: the daemon's :class:`HostPool`; engine ranges are allocated from it.
        backend: a backend (``new_rank``, ``release_rank``, ``release_engine``); it makes
            each rank's state and owns what an engine holds beyond its pool range.

    Iterating yields engine names; ``len()`` is the number of engines.
    """

    def __init__(self, pool: HostPool, backend):
        self.pool = pool
        self.backend = backend
        self._engines: dict[str, EngineSpace] = {}

    def attach(self, client_id: int, rank: int, device: str, engine_name: str, layout: Layout,
               fence_events=None) -> tuple[RankState, dict]:
        """Add rank ``rank`` (client ``client_id``, on ``device``) to ``engine_name``,
        creating the engine (and its pool range) if it is new. Returns the rank's state and
        the handles its client maps. Raises ``PoolError`` (no room), ``ProtocolError``
        LAYOUT_MISMATCH (the engine exists with another layout) or whatever the backend
        raises; on any error nothing is left allocated for a new engine."""
        space = self._engines.get(engine_name)
        created = space is None
        if created:
            offset = self.pool.allocate(layout.pool_bytes)
            try:
                view = self.pool.view(offset, (layout.num_layers, layout.host_rows, layout.row_bytes))
                space = EngineSpace(engine_name, layout, view, offset)
            except BaseException:
                self.pool.release(offset)
                raise
        elif space.layout != layout:
            raise ProtocolError(
                ErrorCode.LAYOUT_MISMATCH,
                f"engine {engine_name!r} is attached with {space.layout.to_wire()}, this rank sent {layout.to_wire()}",
            )
        try:
            state, handles = self.backend.new_rank(space, client_id, rank, device, fence_events)
        except BaseException:
            if created:  # the engine never had a rank: nothing of it may stay behind
                self.backend.release_engine(space)
                self.pool.release(space.pool_offset)
            raise
        space.ranks[client_id] = state
        self._engines[engine_name] = space
        return state, handles

    def detach(self, client_id: int, engine_name: str) -> None:
        """Release client ``client_id``'s rank of ``engine_name``; when it was the
        engine's last rank, release the engine and its pool range too."""
        space = self._engines.get(engine_name)
        if space is not None:
            space.ranks.pop(client_id, None)
            if not space.ranks:  # the last rank left: the engine's rows go with it
                del self._engines[engine_name]
        # The rank first: it may hold resources that refer to the engine's (pinned) pool.
        self.backend.release_rank(client_id)
        if space is not None and not space.ranks:
            self.backend.release_engine(space)
            self.pool.release(space.pool_offset)
            log.info("engine %r released its pool range", engine_name)

    def space(self, engine_name: str) -> EngineSpace:
        """The engine named ``engine_name`` (KeyError if none is attached)."""
        return self._engines[engine_name]

    def gauges(self) -> dict:
        """What the stats snapshot shows of engines and the pool."""
        return {
            "engines": len(self._engines),
            "pool_bytes": self.pool.size_bytes,
            "pool_used_bytes": self.pool.used_bytes,
        }

    def __len__(self) -> int:
        return len(self._engines)

    def __contains__(self, engine_name: object) -> bool:
        return engine_name in self._engines

    def __iter__(self) -> Iterator[str]:
        return iter(self._engines)
