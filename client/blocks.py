"""The engine's view of its engine's block store (DESIGN §9): ``Client.blocks`` after an
``attach(..., block_size=n)``.

A block is ``block_size`` host rows, ``[b * block_size, (b + 1) * block_size)``, of every
layer, so block ids go straight into the block table of ``swap_in`` / ``topk`` with the
same ``block_size`` (proto/positions.py): a looked-up prefix is read where it lies, no
copy. The life of a request's blocks:

1. ``lookup(hashes)``: the longest cached prefix of the prompt's chain, pinned (a block
   this client pins already costs nothing; any other takes one block of its reservation
   if it has one, else one of its uid's ``max_blocks_per_uid``, and the prefix stops
   short of the quota);
2. ``reserve(n)`` for what the lookup missed and the decode will need: ``n`` blocks
   promised, or ``PoolExhausted`` at once (``free``, ``evictable``, ``reserved``; release
   the hits and admit the request later), never a failure later in the request (reserved
   before the lookup, a prefix this client pins already would count twice against the
   quota until the unused promise is given back);
3. ``alloc(k)`` for the rest (zeroed, private), written with ``Client.write`` (rows:
   ``rows(blocks)``), then ``commit(blocks, hashes)`` for the full ones;
4. ``release(blocks)`` when the request ends: cached blocks stay cached (evictable once
   nobody pins them), private ones are freed.
A client that detaches or dies releases everything it held.

With ``attach(..., index_bytes=m)`` each block has a second plane, DSA's indexer keys
(``m`` bytes a position and layer): ``write_keys`` those of its own blocks before it
commits them (they are committed with the block, read-only from then on), and
``read_keys`` those of the blocks a lookup found instead of computing them again, or
``load_keys`` them straight into the engine's (GPU) buffer by the daemon's bulk stream.
"""

from __future__ import annotations

import collections
from typing import Callable

import numpy as np

from sparsekv.proto import LIMITS, ErrorCode, MsgType
from sparsekv.proto.blocks import chain_hashes

from .errors import BadRequest, NotAttached
from .tensors import INT32_MAX, host_array, host_int32


class Blocks:
    """The block store of engine ``namespace`` (blocks of ``block_size`` rows), through a
    client's request function ``call(msg_type, fields, arrays) -> (fields, arrays)``;
    with ``index_bytes``, the indexer keys plane of its ``num_layers`` layers."""

    def __init__(self, call: Callable, namespace: str, block_size: int, num_layers: int = 0, index_bytes: int = 0,
                 load: Callable | None = None, chain_refs: bool = False):
        self._call = call
        # Chains the daemon named in lookup replies (``chain_refs``: a daemon's store, whose
        # tokens name them in this session's next lookups).
        self._refs = ChainRefs() if chain_refs else None
        self._load = load  # BLOCK_LOAD_KEYS (client/keys_load.py); None: not through a daemon
        self.namespace = namespace
        self.block_size = block_size
        self.num_layers = num_layers
        self.index_bytes = index_bytes  # 0: no indexer keys plane

    def close(self) -> None:
        """The attachment this handle was made by has ended (detach, a new attach, the
        daemon lost): every request through it is NOT_ATTACHED from now on, never one to
        whatever engine the client attaches next (its ``blocks`` is a new handle)."""
        def ended(*args, **kwargs):
            raise NotAttached(f"this block store handle of engine {self.namespace!r} belongs to an attachment "
                              "that has ended; use the client's current .blocks")

        self._call = ended
        if self._load is not None:
            self._load = ended

    @property
    def keys_shape(self) -> tuple[int, int, int]:
        """One block's indexer keys: (layers, block_size, index_bytes), uint8."""
        return (self.num_layers, self.block_size, self.index_bytes)

    def hashes(self, tokens, parent: bytes | None = None) -> np.ndarray:
        """The chain hashes (int64 [n, 2]) of the full blocks of ``tokens`` in this
        namespace (proto/blocks.py)."""
        try:
            return chain_hashes(self.namespace, tokens, self.block_size, parent)
        except ValueError as e:
            raise BadRequest(str(e), ErrorCode.BAD_ARGUMENT) from None

    def rows(self, blocks) -> np.ndarray:
        """The host rows (int32 [n * block_size]) of ``blocks``, in order."""
        b = host_int32("blocks", blocks).astype(np.int64).reshape(-1, 1)
        rows = b * self.block_size + np.arange(self.block_size)
        if rows.size and (rows.min() < 0 or rows.max() > INT32_MAX):
            raise BadRequest(f"blocks {int(b.min())}..{int(b.max())} of {self.block_size} rows are not host rows "
                             "(0 .. int32)", ErrorCode.BAD_ARGUMENT)
        return rows.reshape(-1).astype(np.int32)

    def reserve(self, n: int) -> dict:
        """Promise ``n`` more blocks to this client (``n < 0`` gives back up to ``-n``, at most
        what it holds); returns
        ``reserved`` (this client's now) and the store's ``blocks``, ``free``, ``cached``,
        ``referenced``, ``evictable``, ``private`` and ``reserved_total`` counts.
        ``PoolExhausted`` when it cannot."""
        return self._call(MsgType.BLOCK_RESERVE, {"n": _count("n", n)})[0]

    def alloc(self, n: int) -> np.ndarray:
        """``n`` zeroed blocks (int32 [n]) only this client may write; its reservation first."""
        return self._call(MsgType.BLOCK_ALLOC, {"n": _count("n", n)})[1]["blocks"]

    def commit(self, blocks, hashes) -> np.ndarray:
        """Cache this client's ``blocks`` under ``hashes`` (int64 [n, 2]), pinned for it; they
        are read-only from now on. Returns the block cached under each hash (int32 [n]): the
        block itself, or another's committed first (then this one stays private)."""
        blocks, hashes = _blocks(blocks), _hashes(hashes)
        return self._call(MsgType.BLOCK_COMMIT, arrays={"blocks": blocks, "hashes": hashes})[1]["held"]

    def lookup(self, hashes) -> np.ndarray:
        """Pin and return (int32 [m]) the blocks of the longest cached prefix of the chain
        ``hashes`` (int64 [n, 2]).

        Through a daemon, a chain that begins with one a lookup of this client found before
        (requests sharing a system prompt) is sent as that chain's token and the hashes that
        follow it, and the reply names its blocks the same way (DESIGN §9)."""
        hashes = _hashes(hashes)
        refs = self._refs
        ref = refs.match(hashes) if refs is not None else None
        if ref is not None:
            rest = hashes[ref.blocks.size:]
            fields, arrays = self._call(MsgType.BLOCK_LOOKUP, {"chain": ref.token},
                                        arrays={"hashes": rest} if rest.size else None)
            if fields.get("resend"):  # the daemon has forgotten the chain: the hashes themselves
                refs.drop(ref)
                ref = None
        if ref is None:
            fields, arrays = self._call(MsgType.BLOCK_LOOKUP, arrays={"hashes": hashes})
        if ref is not None:
            tail = arrays["blocks"] if arrays else None  # (none after the chain named: no array)
            if fields.get("head"):
                blocks = ref.blocks.copy() if tail is None else np.concatenate([ref.blocks, tail])
            else:  # found shorter than the chain named (not cached whole any more, or cut short by
                # the uid's quota or others' reservations): the full hashes next time
                refs.drop(ref)
                blocks = np.zeros(0, np.int32) if tail is None else tail
        else:
            blocks = arrays["blocks"]
        token = fields.get("chain")
        if refs is not None and token is not None and (ref is None or token != ref.token):
            refs.add(token, hashes[:blocks.size], blocks)
        return blocks

    def release(self, blocks) -> None:
        """Unpin cached ``blocks`` and free private ones (zeroed); all or nothing."""
        self._call(MsgType.BLOCK_RELEASE, arrays={"blocks": _blocks(blocks)})

    def write_keys(self, blocks, keys) -> int:
        """Write the indexer keys (uint8 [n, layers, block_size, index_bytes]) of ``blocks``:
        distinct blocks this client allocated and has not committed; all or nothing, in one
        request (at most ``LIMITS.max_keys_bytes``: TOO_LARGE beyond, split the call).
        Returns the bytes written."""
        blocks, keys = _blocks(blocks), np.ascontiguousarray(host_array("keys", keys, "uint8 [n, layers, block_size, "
                                                                           "index_bytes]"))
        if keys.dtype != np.uint8:
            raise BadRequest(f"keys must be uint8 [n, layers, block_size, index_bytes], got {keys.dtype}",
                             ErrorCode.BAD_ARGUMENT)
        if keys.nbytes > LIMITS.max_keys_bytes:
            raise BadRequest(f"indexer keys of {keys.nbytes} bytes exceed {LIMITS.max_keys_bytes} a request: at most "
                             f"{self._per_request()} blocks a call", ErrorCode.TOO_LARGE)
        return self._call(MsgType.BLOCK_WRITE_KEYS, arrays={"blocks": blocks, "keys": keys})[0]["bytes"]

    def read_keys(self, blocks) -> np.ndarray:
        """The indexer keys (uint8 [n, layers, block_size, index_bytes]) of ``blocks``, each
        pinned by this client (a lookup's) or its own private one; in requests of at most
        ``LIMITS.max_keys_bytes`` and ``LIMITS.max_blocks`` blocks."""
        blocks = host_int32("blocks", blocks).reshape(-1)
        out = np.empty((blocks.size, *self.keys_shape), np.uint8)
        step = min(self._per_request(), LIMITS.max_blocks)
        for i in range(0, blocks.size, step):
            out[i:i + step] = self._call(MsgType.BLOCK_READ_KEYS, arrays={"blocks": blocks[i:i + step]})[1]["keys"]
        return out

    def load_keys(self, blocks, dst) -> int:
        """Have the daemon copy the indexer keys of ``blocks`` (each pinned by this client or
        its own private one) into ``dst``, block ``i`` at byte ``i * block_bytes``: on a cuda
        rank a contiguous torch tensor on its GPU (attach with ``fence=True``; the copies run
        after the current stream's work so far, and the current stream waits for them), on a
        cpu rank an ``EngineSlab.shared_memory`` buffer (client/keys_load.py). Returns the
        bytes loaded."""
        blocks = _blocks(blocks)
        if self._load is None:
            raise BadRequest("load_keys copies through a daemon's bulk stream; in process, use read_keys",
                             ErrorCode.BAD_ARGUMENT)
        need = blocks.size * self._block_bytes()
        return self._load(blocks, need, dst)["bytes"]

    def _block_bytes(self) -> int:
        """One block's indexer key bytes (BadRequest without a keys plane)."""
        if not self.index_bytes:
            raise BadRequest(f"engine {self.namespace!r} was attached without index_bytes: its blocks have no "
                             "indexer keys plane", ErrorCode.BAD_ARGUMENT)
        return self.num_layers * self.block_size * self.index_bytes

    def _per_request(self) -> int:
        """Blocks whose indexer keys fit one request."""
        return LIMITS.max_keys_bytes // self._block_bytes()


class ChainRef:
    """A chain the daemon named: its ``token``, its hashes (``raw``: int64 [n, 2] as bytes),
    its blocks (int32 [n], read-only) and its last hash (``key``)."""

    __slots__ = ("token", "raw", "blocks", "key")

    def __init__(self, token: int, raw: bytes, blocks: np.ndarray, key: tuple[int, int]):
        self.token, self.raw, self.blocks, self.key = token, raw, blocks, key


class ChainRefs:
    """The chains lookup replies named lately (at most ``CHAIN_REFS`` of them and
    ``CHAIN_REF_IDS`` blocks in all; the least recently used go first), by their last hash;
    ``match`` finds the longest one a chain of hashes begins with, among the lengths of the
    ``CHAIN_REF_TRIES`` used most recently."""

    def __init__(self):
        self._by_key: collections.OrderedDict[tuple[int, int], ChainRef] = collections.OrderedDict()
        self._ids = 0

    def match(self, hashes: np.ndarray) -> ChainRef | None:
        n, lengths = hashes.shape[0], []
        for ref in reversed(self._by_key.values()):
            m = ref.blocks.size
            if m <= n and m not in lengths:
                lengths.append(m)
                if len(lengths) == CHAIN_REF_TRIES:
                    break
        for m in sorted(lengths, reverse=True):
            ref = self._by_key.get((int(hashes[m - 1, 0]), int(hashes[m - 1, 1])))
            if ref is not None and ref.blocks.size == m and ref.raw == hashes[:m].tobytes():
                self._by_key.move_to_end(ref.key)
                return ref
        return None

    def add(self, token: int, hashes: np.ndarray, blocks: np.ndarray) -> None:
        if not blocks.size or blocks.size > CHAIN_REF_IDS:
            return
        key = (int(hashes[-1, 0]), int(hashes[-1, 1]))
        old = self._by_key.pop(key, None)
        if old is not None:
            self._ids -= old.blocks.size
        blocks = np.array(blocks, dtype=np.int32)  # its own copy: the caller's array may be written (torch views)
        blocks.flags.writeable = False
        self._by_key[key] = ChainRef(token, hashes.tobytes(), blocks, key)
        self._ids += blocks.size
        while len(self._by_key) > CHAIN_REFS or self._ids > CHAIN_REF_IDS:
            self._ids -= self._by_key.popitem(last=False)[1].blocks.size

    def drop(self, ref: ChainRef) -> None:
        if self._by_key.get(ref.key) is ref:
            del self._by_key[ref.key]
            self._ids -= ref.blocks.size


CHAIN_REFS = 16  # the daemon answers the tokens of a client's 16 latest chains (CHAIN_GRANTS)
CHAIN_REF_IDS = 1 << 18  # 5 MiB of hashes and block ids at most
CHAIN_REF_TRIES = 4


def _count(name: str, n) -> int:
    """An integer argument (not a float or bool a cast would truncate), or BadRequest."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise BadRequest(f"{name} must be an integer, got {n!r}"[:120], ErrorCode.BAD_ARGUMENT)
    return int(n)


def _blocks(blocks) -> np.ndarray:
    """Block ids int32 [n] (one id: [1]); BadRequest for another shape."""
    b = host_int32("blocks", blocks)
    if b.ndim > 1:
        raise BadRequest(f"blocks must be block ids [n], got shape {list(b.shape)}", ErrorCode.BAD_ARGUMENT)
    b = b.reshape(-1)
    if b.size > LIMITS.max_blocks:
        raise BadRequest(f"{b.size} blocks exceed {LIMITS.max_blocks} a request", ErrorCode.TOO_LARGE)
    return b


def _hashes(hashes) -> np.ndarray:
    h = host_array("hashes", hashes, "int64 [n, 2]")
    if h.ndim != 2 or h.shape[1] != 2 or h.dtype != np.int64:
        raise BadRequest(f"hashes must be int64 [n, 2], got {h.dtype} {list(h.shape)}", ErrorCode.BAD_ARGUMENT)
    if h.shape[0] > LIMITS.max_blocks:
        raise BadRequest(f"{h.shape[0]} hashes exceed {LIMITS.max_blocks} a request", ErrorCode.TOO_LARGE)
    return np.ascontiguousarray(h)


def block_store(blocks: "Blocks | None", attached: bool) -> "Blocks":
    """A client's ``blocks``: its attachment's block store handle, or NotAttached saying
    why there is none (no attachment, or an engine attached without a block size)."""
    if blocks is None:
        why = ("its engine has no block store (attach with block_size=n)" if attached
               else "it is not attached (call attach(layout, block_size=n) first)")
        raise NotAttached(f"this client has no block store: {why}")
    return blocks
