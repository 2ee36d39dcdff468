"""The daemon's own memory that block stores take, and its caps (DESIGN §9).

A store's bookkeeping (``blocks/store.py``: its arrays, its key table, its chain memo)
costs the daemon ``BlockStore.bookkeeping_bytes`` at most (8 KiB and about 200 B to
1.1 KiB a block, the most for small stores), and each session that uses the store
``session_bytes`` (2 KiB and 8 B a block: its pins of each block), whatever the rows'
size: an engine of one-byte rows has as many blocks per pool byte as its block size allows. So the
pool's room does not bound it, and ``max_store_bytes`` does: the stores of every engine
and their sessions together, at most ``max_store_share_per_uid`` of it for one uid (a
store counts against its engine's owner, a session's pins against the session's uid).

A rank's session opens its engine's store at its ATTACH, which counts it (the registry),
so its block requests never need more room. Counted from what exists (the stores and
their open sessions), never kept as a tally that could drift. Engines kept only for
their cached blocks yield for a new store or session that would pass a cap, the longest
kept first, only as many as needed (the uid's own first for its share); when all of them
would not do, nothing yields and the request is refused: QUOTA_EXCEEDED for the uid's
share, POOL_FULL for the daemon's cap.
"""

from __future__ import annotations

from typing import Iterable

from sparsekv.proto import ErrorCode, ProtocolError
from sparsekv.proto.settings import format_size

from .blocks.store import BlockStore

SESSION_BYTES_PER_BLOCK = 8  # a session's pin count of each block (int64)
SESSION_FIXED_BYTES = 2 << 10  # its entries in the store's dicts, its tokens (at most CHAIN_GRANTS)


def session_bytes(n_blocks: int) -> int:
    """What a session using a store of ``n_blocks`` blocks takes of the daemon's memory."""
    return SESSION_FIXED_BYTES + n_blocks * SESSION_BYTES_PER_BLOCK


def least_store_bytes() -> int:
    """What the smallest block store takes with one rank using it (one block): a cap below
    it refuses every store."""
    return BlockStore.bookkeeping_bytes(1) + session_bytes(1)


class StoreRoom:
    """Caps on the block stores' bookkeeping: ``cap_bytes`` for every store together (0: no
    cap) and ``share_per_uid`` of it for one uid's."""

    def __init__(self, cap_bytes: int = 0, share_per_uid: float = 0.5):
        self.cap_bytes = cap_bytes
        self.share_per_uid = share_per_uid

    @property
    def uid_cap(self) -> int:
        return int(self.cap_bytes * self.share_per_uid)

    @staticmethod
    def cost(space, uid: int | None = None) -> int:
        """Bytes the store of ``space`` (an ``EngineSpace``) takes: its arrays and its
        sessions' pins; of ``uid`` only: the arrays when ``uid`` owns the engine, and that
        uid's sessions' pins."""
        store = space.blocks
        mine = uid is None or (space.owner is not None and space.owner.uid == uid)
        if store is None:  # none, or a new engine's, made by its attach's slow part: counted already
            pending = space.layout.host_rows // space.block_size if space.block_size else 0
            return BlockStore.bookkeeping_bytes(pending) if pending and mine else 0
        return ((BlockStore.bookkeeping_bytes(store.n_blocks) if mine else 0)
                + session_bytes(store.n_blocks) * store.sessions_of(uid))

    def held(self, spaces: Iterable, uid: int | None = None) -> int:
        """Bytes the stores of ``spaces`` take (of ``uid`` only, when given)."""
        return sum(self.cost(space, uid) for space in spaces)

    def yielding(self, need: int, uid: int | None, spaces: list, kept: list, what: str) -> list:
        """The engines of ``kept`` (kept for their cached blocks, the longest kept first) that
        must yield for ``need`` more bytes of ``uid``'s (``what``: the request, named in the
        error) to fit; ``spaces``: every engine that stays whatever yields, ``kept`` too.
        Raises QUOTA_EXCEEDED (the uid's share) or POOL_FULL (the cap) when all of ``kept``
        would not do."""
        if not need or not self.cap_bytes:
            return []
        chosen: list = []
        if uid is not None and self.share_per_uid < 1:
            over = self.held(spaces, uid) + need - self.uid_cap
            for space in kept:
                if over <= 0:
                    break
                if space.owner is not None and space.owner.uid == uid:
                    chosen.append(space)
                    over -= self.cost(space, uid)
            if over > 0:
                held = self.held(spaces, uid)
                raise ProtocolError(ErrorCode.QUOTA_EXCEEDED, f"{what} would bring uid {uid}'s block stores' "
                                    f"bookkeeping to {held + need} bytes of the daemon's memory, {over} over its "
                                    f"share of max_store_bytes ({self.uid_cap}; it holds {held}): use larger "
                                    "blocks, or fewer engines")
        over = self.held(spaces) - sum(self.cost(space) for space in chosen) + need - self.cap_bytes
        for space in kept:
            if over <= 0:
                break
            if space not in chosen:
                chosen.append(space)
                over -= self.cost(space)
        if over > 0:
            held = self.held(spaces)
            raise ProtocolError(ErrorCode.POOL_FULL, f"{what} would bring the block stores' bookkeeping to "
                                f"{held + need} bytes of the daemon's memory, {over} over max_store_bytes "
                                f"({format_size(self.cap_bytes)}; about 200 B to 1.1 KiB a block, and "
                                f"{SESSION_BYTES_PER_BLOCK} B a block for each rank using a store, whatever the rows' "
                                "size): use larger blocks, or release engines")
        return chosen
