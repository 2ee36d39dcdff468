"""What an engine asks of its block store (DESIGN §9): BLOCK_RESERVE, BLOCK_ALLOC,
BLOCK_COMMIT, BLOCK_LOOKUP, BLOCK_RELEASE, and the indexer keys plane's BLOCK_WRITE_KEYS,
BLOCK_READ_KEYS, BLOCK_LOAD_KEYS.

The store is the one of the engine the session is attached to (an ATTACH with
``blocks: {"block_size": n}``, with ``"index_bytes": m`` for a keys plane), so who may use
it is settled at ATTACH: the engine's owner uid, root and the admin group. Each handler takes (session, identity, header,
arrays) and returns the reply's (fields, arrays); errors are raised, typed
(``BlockError``: BAD_ARGUMENT, POOL_EXHAUSTED with its figures, QUOTA_EXCEEDED).
"""

from __future__ import annotations

import functools
import os

import numpy as np

from sparsekv.proto import LIMITS, ErrorCode, MsgType, ProtocolError

from .backends import map_engine_memory
from .blocks.chains import owned
from .blocks.store import BlockStore, Found
from .engine_blocks import write_zeros
from .heavy import HEAVY_BYTES, HEAVY_SLOTS, Slow
from .sessions import Session


class BlockRequests:
    """The handlers of the block store requests, over the daemon's engine registry and stats."""

    heavy_bytes = HEAVY_BYTES
    heavy_slots = HEAVY_SLOTS  # their hot copies' drop with the zeros from this many cpu slots scanned on

    def __init__(self, engines, stats, fd_server=None):
        self.engines, self.stats, self.fd_server = engines, stats, fd_server

    def handlers(self) -> dict:
        """This role's handlers by message type."""
        return {MsgType.BLOCK_RESERVE: self.on_reserve, MsgType.BLOCK_ALLOC: self.on_alloc,
                MsgType.BLOCK_COMMIT: self.on_commit, MsgType.BLOCK_LOOKUP: self.on_lookup,
                MsgType.BLOCK_RELEASE: self.on_release, MsgType.BLOCK_WRITE_KEYS: self.on_write_keys,
                MsgType.BLOCK_READ_KEYS: self.on_read_keys, MsgType.BLOCK_LOAD_KEYS: self.on_load_keys}

    def _store(self, s: Session) -> BlockStore:
        """The block store of ``s``'s engine, opened for ``s``."""
        if s.state is None:
            raise ProtocolError(ErrorCode.NOT_ATTACHED, f"client {s.client_id} has not attached to an engine")
        space = self.engines.space(s.engine)
        if space.blocks is None:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"engine {s.engine!r} has no block store: its first rank "
                                "attaches with a block size (Client.attach(..., block_size=n))")
        self.engines.open_store(space, s.client_id, s.uid)
        return space.blocks

    def on_reserve(self, s: Session, identity, h, a):
        store = self._store(s)
        reserved = store.reserve(s.client_id, block_count(h, signed=True))
        return {**store.gauges(), "reserved": reserved}, None

    def on_alloc(self, s: Session, identity, h, a):
        store = self._store(s)
        blocks = yield from self._zeroing(s, functools.partial(alloc_counted, store, self.stats, s.client_id,
                                                               block_count(h)))
        return {}, {"blocks": blocks}

    def on_commit(self, s: Session, identity, h, a):
        store = self._store(s)
        return {}, {"held": commit_counted(store, self.stats, s.client_id, block_array(a, "blocks"),
                                           block_array(a, "hashes"))}

    def on_lookup(self, s: Session, identity, h, a):
        store = self._store(s)
        chain = h.get("chain")
        if chain is not None and type(chain) is not int:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"chain must be a token a lookup's reply gave, got "
                                f"{str(chain)[:40]}")
        found = store.find(s.client_id, lookup_hashes(chain, a), chain)
        c = self.stats.c  # (Stats.add, without its keyword arguments: every lookup passes here)
        if chain is not None:
            c["block_chain_lookups" if found is not None else "block_chain_resends"] += 1
        if found is None:
            return lookup_reply(found, chain)
        count_hits(c, self.engines.space(s.engine), found.blocks.size)
        return lookup_reply(found, chain)

    def on_release(self, s: Session, identity, h, a):
        store = self._store(s)
        yield from self._zeroing(s, functools.partial(store.release, s.client_id, block_array(a, "blocks")))
        return {}, None

    def _zeroing(self, s: Session, op):
        """``op()``, a store request that may free or evict blocks, for ``yield from``: the
        zeros of those blocks are written before the reply, on a worker thread holding the
        engine from ``heavy_bytes`` on (2,048 DeepSeek-V3.2 blocks are 5.3 GB: ~75 ms that
        held every client on the loop), their hot copies dropped there first when that
        scans ``heavy_slots`` of cpu state or more: no request of the engine may take or
        write them, or read a copy, meanwhile, and nobody else learns a taken block before
        the reply."""
        space = self.engines.space(s.engine)
        with space.deferring_zeros(drops_from=self.heavy_slots) as zeros:
            out = op()
        drops = any(z.drop is not None for z in zeros)
        if sum(z.nbytes for z in zeros) >= self.heavy_bytes or drops:
            yield Slow(functools.partial(write_zeros, zeros), engine=s.engine, ranks=drops)
        else:
            write_zeros(zeros)
        return out

    # The keys' copies run on a worker thread from HEAVY_BYTES on, holding the engine (so
    # no request of it frees or evicts those blocks meanwhile, daemon/heavy.py).
    def on_write_keys(self, s: Session, identity, h, a):
        self._store(s)
        space, keys = self.engines.space(s.engine), block_array(a, "keys")
        ids = space.check_keys_write(s.client_id, block_array(a, "blocks"), keys)
        copy = functools.partial(space.copy_keys_in, ids, keys)
        nbytes = (yield Slow(copy, engine=s.engine)) if keys.nbytes >= self.heavy_bytes else copy()
        self.stats.add(block_keys_bytes_written=nbytes)
        return {"bytes": nbytes}, None

    def on_read_keys(self, s: Session, identity, h, a):
        self._store(s)
        space = self.engines.space(s.engine)
        ids = space.check_keys_read(s.client_id, block_array(a, "blocks"))
        copy = functools.partial(space.copy_keys_out, ids)
        keys = (yield Slow(copy, engine=s.engine)) if ids.size * space.keys_plane.block_bytes >= self.heavy_bytes \
            else copy()
        self.stats.add(block_keys_bytes_read=keys.nbytes)
        return {}, {"keys": keys}

    # A load copies keys straight into the engine's buffer: on cuda its GPU's bulk stream
    # does it after the client's fence and records an event the client's stream waits on
    # (CudaRankState.load_keys; the reply comes once it is enqueued); on cpu the buffer is
    # a memfd the client deposited for this request, copied into before the reply.
    def on_load_keys(self, s: Session, identity, h, a):
        self._store(s)
        dst = _dst(h)
        fd = self.fd_server.take_deposit(dst["deposit"], s.pid, s.uid, s.gid) if "deposit" in dst else -1
        try:
            space, st = self.engines.space(s.engine), s.state
            if st.host_memory != (fd >= 0):
                raise ProtocolError(ErrorCode.BAD_ARGUMENT, "dst must be a deposited memfd (deposit) for a cpu rank, "
                                    "a CUDA IPC handle (ipc_handle) of the rank's GPU for a cuda rank")
            ids = space.check_keys_load(s.client_id, block_array(a, "blocks"), dst["bytes"])
            runs = len(space.keys_runs(ids))
            if fd < 0:
                fence = h.get("fence")
                if fence is not None and type(fence) is not int:
                    raise ProtocolError(ErrorCode.BAD_ARGUMENT, "fence must be an integer entry of the client's "
                                        "event ring")
                fields = st.load_keys(space, ids, dst, fence)
            else:
                mm = map_engine_memory(fd, dst["offset"] + dst["bytes"], "keys buffer", "the load names")
                copy = functools.partial(space.copy_keys_to, ids, np.frombuffer(mm, np.uint8)[dst["offset"]:])
                if ids.size * space.keys_plane.block_bytes >= self.heavy_bytes:
                    yield Slow(copy, engine=s.engine)
                else:
                    copy()
                fields = {}
        finally:
            if fd >= 0:
                os.close(fd)
        nbytes = ids.size * space.keys_plane.block_bytes
        self.stats.add(block_keys_bytes_loaded=nbytes)
        return {"bytes": nbytes, "copies": runs, **fields}, None


_NO_HASHES = np.zeros((0, 2), np.int64)
_NO_HASHES.flags.writeable = False


# How a block request is counted, by the daemon and in process alike (embedded/inproc.py).
def alloc_counted(store: BlockStore, stats, client: int, n: int) -> np.ndarray:
    """BLOCK_ALLOC's ``n`` blocks for ``client``; the cached blocks it evicted counted."""
    before = store.counts["evictions"]
    blocks = store.alloc(client, n)
    stats.add(block_evictions=store.counts["evictions"] - before)
    return blocks


def commit_counted(store: BlockStore, stats, client: int, blocks: np.ndarray, hashes: np.ndarray) -> np.ndarray:
    """BLOCK_COMMIT's held blocks; those cached under their hash (held as given) counted."""
    held = store.commit(client, blocks, hashes)
    stats.add(block_commits=int((held == blocks).sum()))
    return held


def count_hits(c: dict, space, hits: int) -> None:
    """A lookup that found ``hits`` blocks of ``space``'s store, into the counters ``c``."""
    tokens = hits * space.block_size
    c["block_lookups"] += 1
    c["block_hits"] += hits
    c["block_hit_tokens"] += tokens
    c["block_hit_bytes"] += tokens * space.layout.num_layers * space.layout.row_bytes


def lookup_hashes(chain: int | None, a: dict) -> np.ndarray:
    """A BLOCK_LOOKUP's hashes: its ``hashes`` array; with a chain named it may send none
    (no hash follows the chain)."""
    return _NO_HASHES if chain is not None and "hashes" not in a else block_array(a, "hashes")


def lookup_reply(found: Found | None, chain: int | None) -> tuple[dict, dict | None]:
    """BLOCK_LOOKUP's reply (fields, arrays) to what ``BlockStore.find`` answered a lookup
    that named remembered chain ``chain`` (or none): ``resend`` (nothing pinned: the chain
    is not one the client may name now; it sends the hashes instead), else ``blocks``
    and, when the prefix found is a remembered chain, its token as ``chain``; with a chain
    named, ``head`` counts the first blocks that are the named chain's, which ``blocks``
    leaves out (no ``blocks`` when none follow them)."""
    if found is None:
        return {"resend": True}, None
    fields = {} if found.token is None else {"chain": found.token}
    # A view is copied: the reply may wait in the outbox, which counts the bytes it sends,
    # and a view would keep its whole base (a remembered chain's ids) alive with it.
    if chain is None:
        return fields, {"blocks": owned(found.blocks)}
    fields["head"] = found.head
    rest = found.blocks[found.head:]
    return fields, ({"blocks": owned(rest)} if rest.size else None)  # (none after the chain named: one frame)


def _dst(h: dict) -> dict:
    """The ``dst`` field of BLOCK_LOAD_KEYS: ``offset`` (>= 0) and ``bytes`` (> 0) of the
    engine's buffer, with ``deposit`` (cpu) or ``ipc_handle`` and ``bus_id`` (cuda)."""
    d = h.get("dst")
    if not isinstance(d, dict):
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, "dst must be a map: offset, bytes, and deposit (cpu) or "
                            "ipc_handle and bus_id (cuda)")
    for k, low in (("offset", 0), ("bytes", 1)):
        v = d.get(k)
        if type(v) is not int or v < low or v > 1 << 48:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"dst.{k} must be an integer in [{low}, 2**48], "
                                f"got {str(v)[:40]}")
    if ("deposit" in d) == ("ipc_handle" in d):
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, "dst names its memory by deposit (cpu) or ipc_handle (cuda)")
    if "ipc_handle" in d and (not isinstance(d["ipc_handle"], bytes) or len(d["ipc_handle"]) != 64
                              or not isinstance(d.get("bus_id"), str)):
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, "dst.ipc_handle must be the 64-byte CUDA IPC handle of the "
                            "buffer's allocation, with its GPU's bus_id")
    return d


def block_count(h: dict, signed: bool = False) -> int:
    """The ``n`` field: an int within ``LIMITS.max_blocks`` (negative only when ``signed``)."""
    n = h.get("n")
    if type(n) is not int or abs(n) > LIMITS.max_blocks or (n < 0 and not signed):
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"n must be an integer in [{-LIMITS.max_blocks if signed else 0}, "
                            f"{LIMITS.max_blocks}], got {str(n)[:40]}")
    return n


def block_array(a: dict, name: str) -> np.ndarray:
    """Array ``name`` of the request, at least 1-d (a scalar is no list of blocks, hashes
    or keys) and at most ``LIMITS.max_blocks`` long (TOO_LARGE)."""
    if name not in a:
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"this request needs the {name} array")
    if a[name].ndim == 0:
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"{name} must be an array (one entry a block), got a scalar")
    if a[name].shape[0] > LIMITS.max_blocks:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{a[name].shape[0]} {name} exceed {LIMITS.max_blocks} a request")
    return a[name]
