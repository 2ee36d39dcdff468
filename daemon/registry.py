"""The engines attached to the daemon, and their lifetimes.

An engine (one model served by one or several TP ranks) is created by its first rank's
ATTACH, which reserves its host pool range; every later rank of the same name joins it
(with the same layout, or LAYOUT_MISMATCH) if it may: an engine belongs to the uid of the
client that created it, and only that uid, root, or a member of the daemon's admin group
joins it (anyone else gets PERMISSION_DENIED, which names neither the owner nor the
layout); when its last rank detaches, the backend's per-engine resources and the pool
range are released (the pool zeroes the range before it is reused). The server keeps sessions and
maps each attached session to (engine name, rank state); everything per engine lives
here and in :class:`~.engine.EngineSpace`, so a feature that acts once for all ranks of
one engine is a change in these two places only.
"""

from __future__ import annotations

import logging
from typing import Iterator

from sparsekv.proto import ErrorCode, Layout, ProtocolError

from .engine import EngineSpace, Owner, RankState
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
               fence_events=None, *, owner: Owner | None = None, privileged: bool = False,
               transport: str = "zmq") -> tuple[RankState, dict]:
        """Add rank ``rank`` (client ``client_id``, on ``device``) to ``engine_name``,
        creating the engine (and its pool range) if it is new. Returns the rank's state and
        the handles its client maps.

        ``owner``: the client's credentials; a new engine belongs to them. An existing
        engine with an owner is joined only with the same uid, as uid 0, or when
        ``privileged`` (the caller's admin-group check); ``owner`` None joins only
        engines that have none.

        Raises ``PoolError`` (no room), ``ProtocolError`` PERMISSION_DENIED (another
        user's engine: checked first, and the message names neither its owner nor its
        layout), LAYOUT_MISMATCH (the engine exists with another layout) or whatever the
        backend raises; on any error nothing is left allocated for a new engine."""
        space = self._engines.get(engine_name)
        created = space is None
        if created:
            offset = self.pool.allocate(layout.pool_bytes)
            try:
                view = self.pool.view(offset, (layout.num_layers, layout.host_rows, layout.row_bytes))
                space = EngineSpace(engine_name, layout, view, offset, owner)
            except BaseException:
                self.pool.release(offset, zero=False)  # nothing was written to it
                raise
        elif not _may_join(space.owner, owner, privileged):
            # The same answer whatever the layout: another user learns nothing of the
            # engine beyond its name being taken.
            raise ProtocolError(
                ErrorCode.PERMISSION_DENIED,
                f"engine {engine_name!r} belongs to another user; attach as its owner, or choose another name",
            )
        elif space.layout != layout:
            raise ProtocolError(
                ErrorCode.LAYOUT_MISMATCH,
                f"engine {engine_name!r} is attached with {space.layout.to_wire()}, this rank sent {layout.to_wire()}",
            )
        try:
            kw = {"transport": transport} if transport != "zmq" else {}
            state, handles = self.backend.new_rank(space, client_id, rank, device, fence_events, **kw)
        except BaseException:
            if created:  # the engine never had a rank: nothing of it may stay behind
                self.backend.release_engine(space)
                # No rank ever existed, so nothing wrote to the range: it is still zero.
                self.pool.release(space.pool_offset, zero=False)
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
            # Unpinned first (cuda): the pool zeroes the range, in the background, only
            # once no device mapping of it is left.
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


def _may_join(engine_owner: Owner | None, owner: Owner | None, privileged: bool) -> bool:
    """Whether a client with ``owner`` credentials may join an engine of ``engine_owner``."""
    if engine_owner is None or privileged:
        return True
    return owner is not None and owner.uid in (engine_owner.uid, 0)
