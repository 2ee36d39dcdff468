"""The engines attached to the daemon, and their lifetimes.

An engine (one model served by one or several TP ranks) is created by its first rank's
ATTACH, which reserves its host pool range; every later rank of the same name joins it
(with the same layout, or LAYOUT_MISMATCH) if it may: the creator's uid, or root or a
member of the daemon's admin group naming the creator (ATTACH ``owner_uid``). When its
last rank detaches, the backend's per-engine resources and the pool range are released, unless the engine has a block store holding
cached blocks (DESIGN §9): then it stays, for the next process that attaches to it. Everything
per engine lives here and in :class:`~.engine.EngineSpace`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterator

from sparsekv.proto import ErrorCode, Layout, ProtocolError
from sparsekv.proto.blocks import KeysPlane
from sparsekv.proto.settings import format_size

from .blocks.contract import UidLedger
from .blocks.store import BlockStore
from .engine import EngineSpace, Owner, RankState
from .engine_blocks import ZeroWrite, write_zeros
from .heavy import HEAVY_BYTES
from .pool import HostPool
from .residency.base import ResidencyError, rank_bytes
from .store_room import StoreRoom, session_bytes
from .tp import TpGroup, TpLedger

log = logging.getLogger("sparsekv.registry")


@dataclass(eq=False)
class PendingAttach:
    """An attach between :meth:`EngineRegistry.begin_attach` and its commit or abort."""

    space: EngineSpace
    created: bool  # this attach made the engine (which has had no rank yet)
    client_id: int
    new_rank_args: tuple  # backend.new_rank's (and prepare_rank's) arguments
    new_rank_kw: dict
    state: RankState | None = None  # the rank, once the backend made it
    handles: dict | None = None
    settled: bool = False  # committed or aborted
    uid: int | None = None  # whose ranks' memory the rank counts in (its client's uid)
    client_uid: int | None = None  # its client's uid (its use of a block store counts against it)
    rank_bytes: int = 0  # the memory the rank takes (residency.base.rank_bytes, an engine slab left out)
    # A new engine's block store: its blocks, and the store once made (off the loop, by prepare: a
    # store of 2M blocks page-faults ~100 MB of tables), which the commit gives the engine.
    store_blocks: int = 0
    store: BlockStore | None = None

    @property
    def rank(self) -> int:
        return self.new_rank_args[2]


class EngineRegistry:
    """Engines by name, each with its pool range and its ranks (by client id).

    Arguments:
        pool: the daemon's :class:`HostPool`; engine ranges are allocated from it.
        backend: an ``engine.Backend``; it makes each rank's state and owns what an
            engine holds beyond its pool range.
        max_pool_bytes_per_uid: pool bytes the engines one uid created may hold together
            (their ranges); a new engine beyond it is QUOTA_EXCEEDED. 0: no quota.
        max_blocks_per_uid: private, reserved and pinned blocks of one uid's sessions (a
            block once for each session that pins it) over every block store
            (QUOTA_EXCEEDED beyond it; a lookup stops short of it); 0: no quota.
        max_rank_bytes_per_uid: the memory every rank one uid's clients attached takes
            together (each bounded by ``max_slab_bytes``: hot slab, staging, residency
            state), where the backend keeps it on the host (``rank_memory_on_host``); an
            attach beyond it is QUOTA_EXCEEDED. 0: no quota.

    ``store_room`` (``store_room.StoreRoom``) caps the daemon memory the block stores take
    (``max_store_bytes``); the daemon's entry sets it from its Config.

    Iterating yields engine names; ``len()`` is the number of engines.
    """

    heavy_bytes = HEAVY_BYTES  # a gone client's private blocks' zeros from this on: off the loop (detach)

    def __init__(self, pool: HostPool, backend, *, max_pool_bytes_per_uid: int = 0, max_blocks_per_uid: int = 0,
                 max_rank_bytes_per_uid: int = 0):
        self.pool = pool
        self.store_room = StoreRoom()
        self.backend = backend
        self.max_pool_bytes_per_uid = max_pool_bytes_per_uid
        self.max_rank_bytes_per_uid = max_rank_bytes_per_uid
        self.rank_ledger = UidLedger()  # attached and attaching ranks' memory, per uid (checked here, not by it)
        self._rank_bytes: dict[int, tuple[int, int]] = {}  # client id -> (uid, bytes) of its rank
        self.block_ledger = UidLedger(max_blocks_per_uid)
        self.tp_ledger = TpLedger(1 << 30)  # (Config.tp_max_lag_bytes, set by the daemon's entry)
        self._engines: dict[str, EngineSpace] = {}
        self._attaching: dict[str, int] = {}  # engine name -> attaches begun, not settled
        # Pool ranges (offset -> bytes) of released engines the backend has not given back
        # yet (a held unregister, cuda/deferred.py): make_room counts them as coming.
        self._returning: dict[int, int] = {}
        # Engines whose gone clients' private blocks are being zeroed on a worker thread
        # (name -> such zeroings in flight): none is released meanwhile (see detach).
        self._zeroing: dict[str, int] = {}

    def begin_attach(self, client_id: int, rank: int, device: str, engine_name: str, layout: Layout,
                     fence_events=None, *, owner: Owner | None = None, privileged: bool = False,
                     transport: str = "zmq", engine_slab=None, block_size: int = 0, index_bytes: int = 0,
                     prefetch: bool = False, tp_size: int = 1, tp_max_lag: int = 256,
                     owner_uid: int | None = None) -> PendingAttach:
        """The first step of an attach of rank ``rank`` (client ``client_id``, on ``device``)
        to ``engine_name``, on the owner's thread: the checks, and a new engine's name and
        pool range. Then :meth:`prepare` (any thread), then :meth:`commit`; :meth:`abort` on
        any error. While an attach is pending its engine is not released.

        ``prefetch``: the rank prefetches (passed to the backend's ``new_rank``).

        ``tp_size`` > 1: the engine's ranks ``0..tp_size-1`` form a TP group resolving once
        (``tp.TpGroup``, keeping at most ``tp_max_lag`` entries): every rank names the same
        size and prefetch choice (LAYOUT_MISMATCH), ``rank`` is a free rank of it, and it
        joins before the group's first step (BAD_ARGUMENT).

        ``block_size`` > 0: the engine has a block store of ``host_rows // block_size``
        blocks (a new engine gets one; an existing one must have the same block size).
        ``index_bytes`` > 0 (with a block size): its blocks have an indexer keys plane of
        that many bytes a position and layer, after the rows in the same range (the same
        for every rank, or LAYOUT_MISMATCH). :func:`range_bytes` is the range's size.

        ``owner``: the client's credentials; a new engine belongs to them. An existing
        engine with an owner is joined with the same uid; another user's engine only as
        uid 0 or ``privileged``, and only when ``owner_uid`` names its owner (a rank then
        trusts that user's rows and cached blocks knowingly: a name another user took
        first is never joined by accident). ``owner_uid`` given, it must be the engine's
        owner (for a new engine: the client's own uid). Raises ``PoolError`` (no room),
        ``ProtocolError`` PERMISSION_DENIED (checked first; naming the owner only to root
        and the admin group, never the layout) or LAYOUT_MISMATCH."""
        uid, rank_mem = self.check_rank(rank, layout, owner=owner, engine_slab=engine_slab, tp_size=tp_size)
        space = self._engines.get(engine_name)
        created = space is None
        if created:
            check_new_owner(engine_name, owner, owner_uid)
            nbytes = range_bytes(layout, block_size, index_bytes)
            self._check_quota(owner, nbytes)
            if block_size:  # checked here; engines kept for their cached blocks yield at the commit
                self._store_yielding(layout.host_rows // block_size, owner.uid if owner else None)
            offset = self.pool.allocate(nbytes)
            try:
                view = self.pool.view(offset, (layout.num_layers, layout.host_rows, layout.row_bytes))
                space = EngineSpace(engine_name, layout, view, offset, owner)
                if block_size:
                    space.block_size = block_size  # its store is made by prepare, given at the commit
                if index_bytes:
                    space.keys_plane = plane = KeysPlane.of(layout, block_size, index_bytes)
                    space.keys = self.pool.view(offset + plane.offset, plane.shape)
            except BaseException:
                self.pool.release(offset, zero=False)  # nothing was written to it
                raise
            self._engines[engine_name] = space
        elif not _may_join(space.owner, owner, privileged, owner_uid):  # the same answer whatever the layout
            raise ProtocolError(ErrorCode.PERMISSION_DENIED, _join_refusal(engine_name, space.owner, owner, privileged,
                                                                           owner_uid))
        elif space.layout != layout:
            raise ProtocolError(ErrorCode.LAYOUT_MISMATCH, f"engine {engine_name!r} is attached with "
                                f"{space.layout.to_wire()}, this rank sent {layout.to_wire()}")
        elif space.block_size != block_size:
            raise ProtocolError(ErrorCode.LAYOUT_MISMATCH, f"engine {engine_name!r} has "
                                f"{f'blocks of {space.block_size} rows' if space.block_size else 'no block store'}, "
                                f"this rank asked for {f'blocks of {block_size}' if block_size else 'none'}")
        elif (space.keys_plane.index_bytes if space.keys_plane else 0) != index_bytes:
            have = space.keys_plane.index_bytes if space.keys_plane else 0
            raise ProtocolError(ErrorCode.LAYOUT_MISMATCH, f"engine {engine_name!r} has "
                                f"{f'indexer keys of {have} bytes' if have else 'no indexer keys plane'} (a position "
                                f"and layer), this rank asked for {index_bytes or 'none'}")
        if not created and space.block_size and space.blocks is None:  # its creator's commit is still to come
            space.blocks = self._new_store(space, layout.host_rows // space.block_size)
        if not created and space.blocks is not None:  # this rank's use of the store (checked again at the commit)
            self._store_yielding(space.blocks.n_blocks, owner.uid if owner else None, store=False, joining=space)
        self._reserve_tp_rank(space, rank, tp_size, tp_max_lag, prefetch)
        kw = {"transport": transport} if transport != "zmq" else {}
        if engine_slab is not None:
            kw["engine_slab"] = engine_slab
        if prefetch:
            kw["prefetch"] = True
        self._attaching[engine_name] = self._attaching.get(engine_name, 0) + 1
        if uid is not None:
            self.rank_ledger.add(uid, rank_mem)
        return PendingAttach(space, created, client_id, (space, client_id, rank, device, fence_events), kw,
                             uid=uid, rank_bytes=rank_mem, client_uid=owner.uid if owner else None,
                             store_blocks=layout.host_rows // block_size if created and block_size else 0)

    @property
    def returning_bytes(self) -> int:
        """Pool bytes of released engines not given back yet."""
        return sum(self._returning.values())

    def check_rank(self, rank: int, layout: Layout, *, owner: Owner | None = None, engine_slab=None,
                   tp_size: int = 1) -> tuple[int | None, int]:
        """What :meth:`begin_attach` refuses of a rank whatever the engine (the uid's rank
        quota, a rank outside its TP group), before anything is allocated, and before
        :meth:`make_room` releases anything for it. Returns (the uid its rank memory counts
        against, or None; that memory)."""
        uid = owner.uid if owner is not None and self.backend.rank_memory_on_host else None
        rank_mem = rank_bytes(layout, engine_slab is not None)["total"]
        self._check_rank_quota(uid, rank_mem)
        if tp_size > 1 and not 0 <= rank < tp_size:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"rank {rank} is not a rank of a TP group of {tp_size} "
                                f"(HELLO's rank must lie in [0, {tp_size}))")
        return uid, rank_mem

    def _check_rank_quota(self, uid: int | None, nbytes: int) -> None:
        held = self.rank_ledger.held.get(uid, 0) if uid is not None else 0
        if uid is not None and self.max_rank_bytes_per_uid and held + nbytes > self.max_rank_bytes_per_uid:
            raise ProtocolError(ErrorCode.QUOTA_EXCEEDED, f"a rank of {format_size(nbytes)} would bring uid {uid}'s "
                                f"attached ranks to {format_size(held + nbytes)} (max_slab_share_per_uid of this host: "
                                f"{format_size(self.max_rank_bytes_per_uid)}; they hold {format_size(held)})")

    def _give_rank_bytes(self, uid: int | None, nbytes: int) -> None:
        if uid is not None:
            self.rank_ledger.add(uid, -nbytes)

    @property
    def rank_bytes_by_uid(self) -> dict[int, int]:
        """Attached and attaching ranks' memory per uid (``max_rank_bytes_per_uid``'s count)."""
        return self.rank_ledger.held

    def _reserve_tp_rank(self, space: EngineSpace, rank: int, tp_size: int, max_lag: int, prefetch: bool) -> None:
        """Hold rank ``rank`` of the engine's TP group (made by its first rank) for an attach."""
        group = space.tp
        if group is None and tp_size == 1:
            return
        if group is None and (space.ranks or self._attaching.get(space.name)) or group and group.size != tp_size:
            raise ProtocolError(ErrorCode.LAYOUT_MISMATCH, f"engine {space.name!r} has "
                                f"{f'a TP group of {group.size} ranks' if group else 'ranks without a TP group'}, "
                                f"this rank asked for tp_size {tp_size}; every rank names the same")
        if group is None:
            group = space.tp = TpGroup(tp_size, max_lag=max_lag, prefetch=prefetch, ledger=self.tp_ledger,
                                       uid=space.owner.uid if space.owner else None)
        try:
            group.reserve(rank, prefetch)
        except ResidencyError:
            self._drop_tp_if_empty(space)
            raise

    @staticmethod
    def _drop_tp_if_empty(space: EngineSpace) -> None:
        if space.tp is not None and not space.tp.members:
            space.tp = None  # with its residency: the engine's next ranks form a new group

    def pool_bytes_of(self, uid: int) -> int:
        """Pool bytes held by the engines ``uid`` created (their ranges: 2 MiB aligned)."""
        return sum(self.pool.range_bytes(space.range_bytes) for space in self._engines.values()
                   if space.owner is not None and space.owner.uid == uid)

    def _check_quota(self, owner: Owner | None, pool_bytes: int) -> None:
        if not self.max_pool_bytes_per_uid or owner is None:
            return
        pool_bytes = self.pool.range_bytes(pool_bytes)
        held = self.pool_bytes_of(owner.uid)
        if held + pool_bytes > self.max_pool_bytes_per_uid:
            raise ProtocolError(ErrorCode.QUOTA_EXCEEDED,
                                f"a new engine of {pool_bytes} pool bytes would bring uid {owner.uid} to "
                                f"{held + pool_bytes} "
                                f"(max_pool_bytes_per_uid {self.max_pool_bytes_per_uid}; its engines hold {held})")

    def _store_yielding(self, blocks: int, uid: int | None, leaving: list[EngineSpace] = (),
                        store: bool = True, joining: EngineSpace | None = None,
                        sessions: int = 0) -> list[EngineSpace]:
        """The kept engines (beside ``leaving``, not counted, and ``joining``, the engine a
        join is for) that must yield for a rank of ``uid`` to use a block store of
        ``blocks`` blocks (with ``store``: a new one, its bookkeeping and ``sessions``
        ranks already using it too) within ``max_store_bytes``; QUOTA_EXCEEDED or
        POOL_FULL when all of them would not do."""
        need = session_bytes(blocks) * (1 + sessions) + (BlockStore.bookkeeping_bytes(blocks) if store else 0)
        return self.store_room.yielding(need, uid, [sp for sp in self._engines.values() if sp not in leaving],
                                        [sp for sp in self._kept() if sp not in leaving and sp is not joining],
                                        f"a block store of {blocks} blocks and this rank's use of it" if store
                                        else f"this rank's use of the block store of {blocks} blocks")

    def _yield_for_store(self, kept: list[EngineSpace]) -> None:
        for space in kept:
            cached = space.blocks.cached_blocks
            if self._release_if_unused(space, keep_cached=False):
                log.info("engine %r, kept for its %d cached blocks with no rank, released to make room for a "
                         "block store's bookkeeping (max_store_bytes)", space.name, cached)

    def open_store(self, space: EngineSpace, session: int, uid: int) -> None:
        """Open ``space``'s block store for ``session`` (of ``uid``), unless it is: its pins
        count against ``max_store_bytes`` (other engines kept for their cached blocks may
        yield; QUOTA_EXCEEDED or POOL_FULL when they would not do)."""
        store = space.blocks
        if not store.is_open(session):
            self._yield_for_store(self._store_yielding(store.n_blocks, uid, store=False, joining=space))
        store.open(session, uid)

    def _new_store(self, space: EngineSpace, n_blocks: int) -> BlockStore:
        """A block store of ``n_blocks`` blocks for ``space`` (any thread: it touches nothing shared)."""
        return BlockStore(n_blocks, space.zero_blocks, self.block_ledger)

    def prepare(self, p: PendingAttach) -> None:
        """The slow part of an attach, on any thread: the backend's ``prepare_rank`` and,
        unless ``new_rank_on_loop``, the rank itself; a new engine's block store. It touches
        only ``p``, its engine's pool range and what the backend makes for it."""
        if p.store_blocks:  # only this attach knows the store: made here, given to the engine at the commit
            p.store = self._new_store(p.space, p.store_blocks)
        self.backend.prepare_rank(*p.new_rank_args, **p.new_rank_kw)
        if not self.backend.new_rank_on_loop:
            p.state, p.handles = self.backend.new_rank(*p.new_rank_args, **p.new_rank_kw)

    def commit(self, p: PendingAttach) -> tuple[RankState, dict]:
        """The last step of an attach (owner's thread): the rank joins its engine. A new
        engine's store is checked against ``max_store_bytes`` again (others may have come
        since), and the engines kept for their cached blocks that it needs yield now, so
        that an attach refused at any step before releases none."""
        if p.store_blocks and p.space.blocks is None:
            p.space.blocks = p.store if p.store is not None else self._new_store(p.space, p.store_blocks)
        store = p.space.blocks
        yielding = [] if store is None else \
            self._store_yielding(store.n_blocks, p.client_uid, [p.space] if p.created else [], store=p.created,
                                 joining=p.space, sessions=store.sessions_of() if p.created else 0)
        if p.state is None:  # the backend makes it here (new_rank_on_loop)
            p.state, p.handles = self.backend.new_rank(*p.new_rank_args, **p.new_rank_kw)
        if store is not None and p.client_uid is not None:
            store.open(p.client_id, p.client_uid)  # counted above: its block requests need no more room
        p.space.ranks[p.client_id] = p.state
        if p.uid is not None:
            self._rank_bytes[p.client_id] = (p.uid, p.rank_bytes)
        if p.space.tp is not None:
            p.space.tp.join(p.rank, p.state)
        p.space.idle_since = None
        self._settle(p)
        self._yield_for_store(yielding)
        return p.state, p.handles

    def abort(self, p: PendingAttach) -> None:
        """Give up an attach (owner's thread; after commit, nothing): release its rank if
        it was made, and its engine if that has no rank and no other attach pending."""
        if p.settled:
            return
        self._give_rank_bytes(p.uid, p.rank_bytes)
        if p.space.blocks is not None:
            p.space.blocks.close(p.client_id)  # (opened by a commit that failed after)
        if p.state is not None:
            p.state = None
            self.backend.release_rank(p.client_id)
        if p.space.tp is not None:
            p.space.tp.unreserve(p.rank)
            self._drop_tp_if_empty(p.space)
        self._settle(p)
        # An engine this attach created never had a rank: its range is still zero.
        self._release_if_unused(p.space, zero=not p.created)

    def _settle(self, p: PendingAttach) -> None:
        p.settled = True
        left = self._attaching.pop(p.space.name) - 1
        if left:
            self._attaching[p.space.name] = left

    def detach(self, client_id: int, engine_name: str) -> list[ZeroWrite]:
        """Release client ``client_id``'s rank of ``engine_name``, and the engine with its
        pool range once it has no rank and no attach pending.

        The client's pins and private blocks go with it. Returns the zeros of those blocks
        left to write when the engine stays and they are ``heavy_bytes`` or more: the caller
        writes them on a worker thread holding the engine, between :meth:`zeroing` and
        :meth:`zeroed`. Fewer are written here; none when the engine goes (its whole range
        is zeroed as the pool takes it back)."""
        space = self._engines.get(engine_name)
        zeros: list[ZeroWrite] = []
        if space is not None:
            state = space.ranks.pop(client_id, None)
            if space.tp is not None and state is not None:
                space.tp.leave(state.rank)
                self._drop_tp_if_empty(space)
            if space.blocks is not None:
                with space.deferring_zeros() as zeros:
                    space.blocks.close(client_id)
        # The rank first: it may hold resources that refer to the engine's (pinned) pool.
        self.backend.release_rank(client_id)
        self._give_rank_bytes(*self._rank_bytes.pop(client_id, (None, 0)))
        if space is not None and self._release_if_unused(space):
            log.info("engine %r released its pool range", engine_name)
            return []
        if space is not None and self._goes_once_zeroed(space):
            return []  # (kept only by another's zeros in flight: its whole range is zeroed after)
        if sum(z.nbytes for z in zeros) < self.heavy_bytes:
            write_zeros(zeros)
            return []
        return zeros

    def _goes_once_zeroed(self, space: EngineSpace) -> bool:
        """Whether ``space`` stays only for zeros in flight (``zeroed`` releases it then)."""
        return space.name in self._zeroing and not space.ranks and not self._attaching.get(space.name) \
            and not (space.blocks is not None and space.blocks.cached_blocks)

    def kept_zeroing(self) -> list[str]:
        """The engines kept with no rank whose gone clients' zeros are being written: not
        released meanwhile, so a new engine that may need their room waits for them."""
        return [name for name in self._zeroing if (sp := self._engines.get(name)) is not None and not sp.ranks
                and not self._attaching.get(name)]

    def zeroing(self, engine_name: str) -> None:
        """A gone client's zeros (:meth:`detach`) are being written: ``engine_name`` is not
        released, nor yields to another's attach, until :meth:`zeroed`."""
        self._zeroing[engine_name] = self._zeroing.get(engine_name, 0) + 1

    def zeroed(self, engine_name: str) -> None:
        """The zeros :meth:`zeroing` announced are written: the engine is released if it
        lost its last rank meanwhile."""
        left = self._zeroing.pop(engine_name) - 1
        if left:
            self._zeroing[engine_name] = left
            return
        space = self._engines.get(engine_name)
        if space is not None and self._release_if_unused(space):
            log.info("engine %r released its pool range", engine_name)

    def make_room(self, nbytes: int, owner: Owner | None = None, blocks: int = 0) -> list[str]:
        """Before a new engine of ``nbytes`` pool bytes (created by ``owner``, with a block
        store of ``blocks`` blocks or none) is allocated (after :meth:`check_rank`), release
        what must go for it, or nothing:

        * its uid's quota (``max_pool_bytes_per_uid``): the uid's own engines kept for their
          cached blocks (no rank, no attach pending) yield, the longest kept first, as many
          as bring it under; QUOTA_EXCEEDED (nothing released) when all of them would not;
        * a free range: unless one will hold it once the ranges being zeroed or given back
          (and those yielding above) are free, other kept engines are released, the longest
          kept first until their ranges open one large enough, then only those that range
          needs. When releasing all of them would not, nothing at all is released (the
          attach is then POOL_FULL, or QUOTA_EXCEEDED, every kept engine intact);
        * ``max_store_bytes`` (the new store's bookkeeping): checked here, so that nothing
          is released for an attach it refuses; the kept engines it needs yield at
          :meth:`commit` (an attach refused before releases none).

        Idle namespaces yield to engines that come to work. Returns the names released. A
        range larger than the whole pool is POOL_FULL at once, nothing released."""
        need = self.pool.range_bytes(nbytes)
        if need > self.pool.size_bytes:
            raise ProtocolError(ErrorCode.POOL_FULL, f"host pool has no free range of {format_size(need)}: the new "
                                "engine's range (its rows, and its indexer keys plane if it has one) exceeds the whole "
                                f"pool of {format_size(self.pool.size_bytes)}")
        own = self._own_kept_for_quota(owner, need)
        if own is None:
            self._check_quota(owner, nbytes)  # raises: its own kept engines cannot bring it under
            own = []
        coming = list(self._returning) + [sp.pool_offset for sp in own]
        chosen: list[EngineSpace] = []
        if not self.pool.fits_after(need, coming):
            kept = [space for space in self._kept() if space not in own]
            for space in kept:  # the longest kept first, until their ranges open one large enough
                chosen.append(space)
                if self.pool.fits_after(need, coming + [sp.pool_offset for sp in chosen]):
                    break
            else:
                return []  # not even all of them would: keep every one (the attach is refused)
            for space in reversed(chosen[:-1]):  # then only those the opened range needs
                rest = [sp.pool_offset for sp in chosen if sp is not space]
                if self.pool.fits_after(need, coming + rest):
                    chosen.remove(space)
        if blocks:
            self._store_yielding(blocks, owner.uid if owner else None, own + chosen)  # raises when they would not do
        out = []
        for space in own + chosen:
            cached = space.blocks.cached_blocks
            if self._release_if_unused(space, keep_cached=False):
                log.info("engine %r, kept for its %d cached blocks with no rank, released to make room%s", space.name,
                         cached, " (its uid's share of the pool)" if space in own else "")
                out.append(space.name)
        return out

    def _own_kept_for_quota(self, owner: Owner | None, need: int) -> list[EngineSpace] | None:
        """The kept engines of ``owner``'s uid that must yield for its new range of
        ``need`` bytes to fit ``max_pool_bytes_per_uid``, the longest kept first ([]: none
        must); None when all of them would not do."""
        if not self.max_pool_bytes_per_uid or owner is None:
            return []
        over = self.pool_bytes_of(owner.uid) + need - self.max_pool_bytes_per_uid
        if over <= 0:
            return []
        mine = [space for space in self._kept() if space.owner is not None and space.owner.uid == owner.uid]
        chosen, freed = [], 0
        for space in mine:
            if freed >= over:
                break
            chosen.append(space)
            freed += self.pool.range_bytes(space.range_bytes)
        return chosen if freed >= over else None

    def _kept(self) -> list[EngineSpace]:
        """The engines kept for their cached blocks alone (no rank, no attach pending), the
        longest kept first."""
        return sorted((space for space in self._engines.values() if space.idle_since is not None and not space.ranks
                       and not self._attaching.get(space.name) and space.name not in self._zeroing),
                      key=lambda sp: sp.idle_since)

    def drop_kept(self) -> list[str]:
        """Release every engine kept only for its cached blocks (no rank, no attach
        pending), cached blocks and all: at stop. Returns their names."""
        kept = [space for space in self._engines.values() if not space.ranks and not self._attaching.get(space.name)]
        return [space.name for space in kept if self._release_if_unused(space, keep_cached=False)]

    def _release_if_unused(self, space: EngineSpace, zero: bool = True, keep_cached: bool = True) -> bool:
        """Release ``space`` (the backend's part, then its pool range) if it has no rank
        and no attach pending (and, with ``keep_cached``, no cached block); return whether it did."""
        if space.ranks or self._attaching.get(space.name) or self._engines.get(space.name) is not space \
                or space.name in self._zeroing:
            return False
        if keep_cached and space.blocks is not None and space.blocks.cached_blocks:
            if space.idle_since is None:
                space.idle_since = time.monotonic()
            return False  # kept for the next process of this namespace (DESIGN §9)
        del self._engines[space.name]
        space.blocks = None  # (the store's zeroing refers back to the space: no cycle keeps the pool's view)
        # Unpinned first (cuda): the pool zeroes the range only once no device mapping is left.
        offset, size = space.pool_offset, self.pool.range_bytes(space.range_bytes)
        self._returning[offset] = size

        def give_back() -> None:
            self._returning.pop(offset, None)
            self.pool.release(offset, zero=zero)
        self.backend.release_engine(space, give_back)
        return True

    def space(self, engine_name: str) -> EngineSpace:
        """The engine named ``engine_name`` (KeyError if none is attached)."""
        return self._engines[engine_name]

    def block_lines(self, uid: int | None = None) -> str:
        """One tab-separated line per engine with a block store (of owner ``uid`` only,
        unless None) under a header line: what ``sparsekv blocks`` shows."""
        cols = ("blocks", "free", "cached", "referenced", "evictable", "private", "reserved_total")
        lines = ["engine\towner_uid\tblock_size\tindex_bytes\tranks\t" + "\t".join(cols)]
        for name, space in sorted(self._engines.items()):
            owner = space.owner.uid if space.owner is not None else -1
            if space.blocks is None or (uid is not None and owner != uid):
                continue
            g = space.blocks.gauges()
            index_bytes = space.keys_plane.index_bytes if space.keys_plane else 0
            lines.append(f"{name}\t{owner}\t{space.block_size}\t{index_bytes}\t{len(space.ranks)}\t"
                         + "\t".join(str(g[c]) for c in cols))
        return "\n".join(lines) + "\n"

    def gauges(self) -> dict:
        """What the stats snapshot shows of engines and the pool."""
        return {"engines": len(self._engines), "pool_bytes": self.pool.size_bytes,
                "pool_used_bytes": self.pool.used_bytes, "pool_huge_bytes": self.pool.huge_bytes or 0}

    def __len__(self) -> int:
        return len(self._engines)

    def __contains__(self, engine_name: object) -> bool:
        return engine_name in self._engines

    def __iter__(self) -> Iterator[str]:
        return iter(self._engines)


def range_bytes(layout: Layout, block_size: int = 0, index_bytes: int = 0) -> int:
    """Bytes of the pool range of an engine of ``layout``: its rows, then its indexer keys
    plane when it has one (``index_bytes`` with a ``block_size``)."""
    return KeysPlane.of(layout, block_size, index_bytes).end if index_bytes else layout.pool_bytes


def check_new_owner(engine_name: str, owner: Owner | None, owner_uid: int | None) -> None:
    """An ATTACH that would create ``engine_name`` names no other owner than its sender
    (BAD_ARGUMENT): checked before anything is made or released for it."""
    if owner_uid is not None and owner is not None and owner_uid != owner.uid:
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"engine {engine_name!r} does not exist: owner_uid {owner_uid} "
                            f"names another user's engine, and a new one would be yours (uid {owner.uid}); attach "
                            "with owner_uid once its owner has made it")


def _may_join(engine_owner: Owner | None, owner: Owner | None, privileged: bool, owner_uid: int | None) -> bool:
    """Whether a client with ``owner`` credentials (``privileged``: in the admin group),
    expecting the engine's owner to be ``owner_uid`` (None: its own uid), may join an
    engine of ``engine_owner``."""
    if engine_owner is None:
        return owner_uid is None or owner is None or owner_uid == owner.uid
    if owner is not None and owner.uid == engine_owner.uid:
        return owner_uid is None or owner_uid == engine_owner.uid
    return (privileged or (owner is not None and owner.uid == 0)) and owner_uid == engine_owner.uid


def _join_refusal(engine_name: str, engine_owner: Owner | None, owner: Owner | None, privileged: bool,
                  owner_uid: int | None) -> str:
    """Why :func:`_may_join` said no: the owner named only to those who may join it."""
    mine = owner is not None and engine_owner is not None and owner.uid == engine_owner.uid
    if mine or engine_owner is None:
        return f"engine {engine_name!r} is not uid {owner_uid}'s (owner_uid); attach without owner_uid to join it"
    if privileged or (owner is not None and owner.uid == 0):
        return (f"engine {engine_name!r} belongs to uid {engine_owner.uid}" +
                (f", not uid {owner_uid}" if owner_uid is not None else "") +
                f"; to join another user's engine (and trust its rows and cached blocks) attach with "
                f"owner_uid={engine_owner.uid}, or choose another name")
    return f"engine {engine_name!r} belongs to another user; attach as its owner, or choose another name"
