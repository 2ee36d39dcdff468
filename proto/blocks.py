"""The block store's hash rule (DESIGN §9): how an engine names a full block of positions.

A block's key is a 16-byte chain hash, as engines' prefix caches compute theirs: the
BLAKE2b-128 of its parent's key followed by the block's token ids (little-endian int32).
The first block's parent is the namespace's root key, the BLAKE2b-128 of
``b"sparsekv-blocks\\0"`` and the namespace (the model and its layout, as the engine names
them). So two engines that name the same namespace and the same tokens compute the same
keys, and one block's key stands for every token before it too.

The daemon never sees tokens: it trusts the keys of the processes that may use a
namespace (its owner's uid, root, the admin group). On the wire a chain is int64 [n, 2]
(the 16 bytes of each key).

An engine may give its blocks a second plane, DSA's indexer keys: :class:`KeysPlane` says
where it lies in the engine's range.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from .args import int32_array
from .layout import Layout
from .messages import LIMITS, ErrorCode, ProtocolError

KEY_BYTES = 16
_ROOT = b"sparsekv-blocks\0"


def root_key(namespace: str) -> bytes:
    """The key a namespace's first block has as its parent."""
    return hashlib.blake2b(_ROOT + namespace.encode(), digest_size=KEY_BYTES).digest()


def chain_hashes(namespace: str, tokens, block_size: int, parent: bytes | None = None) -> np.ndarray:
    """The keys of the full blocks of ``tokens`` (int [n]; a partial last block has none),
    as int64 [n // block_size, 2], chained from ``parent`` (a key; the namespace's root when
    None). Raises ValueError for a bad block size or a parent that is not a key."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    key = root_key(namespace) if parent is None else _parent_key(parent)
    toks = _token_ids(tokens)
    n = toks.size // block_size
    out = bytearray()
    for i in range(n):
        key = hashlib.blake2b(key + toks[i * block_size:(i + 1) * block_size].tobytes(), digest_size=KEY_BYTES).digest()
        out += key
    return np.frombuffer(bytes(out), dtype=np.int64).reshape(n, 2).copy()


def _parent_key(parent) -> bytes:
    """A chain's parent key: 16 bytes, or one row of :func:`chain_hashes` (int64 [2])."""
    if isinstance(parent, np.ndarray):
        if parent.dtype != np.int64 or parent.shape != (2,):
            raise ValueError(f"parent must be a key: {KEY_BYTES} bytes or one int64 [2] row of hashes, got "
                             f"{parent.dtype} {parent.shape}")
        return np.ascontiguousarray(parent).tobytes()
    if not isinstance(parent, (bytes, bytearray, memoryview)):  # bytes(16) would be 16 zero bytes
        raise ValueError(f"parent must be a key: {KEY_BYTES} bytes or one int64 [2] row of hashes, got "
                         f"{type(parent).__name__}")
    key = bytes(parent)
    if len(key) != KEY_BYTES:
        raise ValueError(f"parent must be a {KEY_BYTES}-byte key, got {len(key)} bytes")
    return key


def _token_ids(tokens) -> np.ndarray:
    """Token ids as little-endian int32, refused rather than cast: floats and bools (a cast
    truncates) and ids outside int32 (a cast wraps) would give another prompt's keys."""
    return np.ascontiguousarray(int32_array("tokens", tokens).reshape(-1), dtype="<i4")


# The indexer keys plane starts on a page of its own after the rows: a later cuda path can
# register or copy it apart from them.
KEYS_ALIGN_BYTES = 4096
MAX_INDEX_BYTES = 1 << 16  # indexer key bytes of one position of one layer (DeepSeek-V3.2: 132)


@dataclass(frozen=True)
class KeysPlane:
    """Where an engine's indexer keys (DSA's, the second plane of its blocks, DESIGN §9) lie
    in its pool range: after its rows, block-major ``[blocks, layers, block_size,
    index_bytes]``, so that one block's keys for every layer are one contiguous chunk of
    ``block_bytes`` at ``offset + block * block_bytes``."""

    offset: int  # bytes from the start of the engine's range
    blocks: int
    layers: int
    block_size: int
    index_bytes: int  # one position of one layer

    @classmethod
    def of(cls, layout: Layout, block_size: int, index_bytes: int) -> "KeysPlane":
        offset = -(-layout.pool_bytes // KEYS_ALIGN_BYTES) * KEYS_ALIGN_BYTES
        return cls(offset, layout.host_rows // block_size, layout.num_layers, block_size, index_bytes)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.blocks, self.layers, self.block_size, self.index_bytes)

    @property
    def block_bytes(self) -> int:
        return self.layers * self.block_size * self.index_bytes

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block_bytes

    @property
    def end(self) -> int:
        """The range's bytes: rows, alignment, keys."""
        return self.offset + self.nbytes


def check_store(layout: Layout, block_size, index_bytes) -> tuple[int, int]:
    """An engine's block store as ATTACH names it: ``block_size`` positions a block (0 for
    no store) and ``index_bytes`` of indexer keys a position and layer (0 for no keys plane).
    Returns them; ProtocolError (BAD_ARGUMENT) unless both are exact integers with
    1 <= block_size <= host_rows, host_rows // block_size <= ``LIMITS.max_store_blocks``,
    0 <= index_bytes <= MAX_INDEX_BYTES (and only with a block size), and one block's keys
    within ``LIMITS.max_keys_bytes`` (so that a request can carry them). The daemon and the
    in-process engine both check with it."""
    if type(block_size) is not int:
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"block_size must be an integer in [0, host_rows="
                            f"{layout.host_rows}], got {block_size!r:.40}")
    if type(index_bytes) is not int:
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"index_bytes must be an integer in [0, {MAX_INDEX_BYTES}], "
                            f"got {index_bytes!r:.40}")
    if block_size == 0:
        if index_bytes:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "index_bytes needs a block_size: the indexer keys are a "
                                "plane of the blocks")
        return 0, 0
    if not 1 <= block_size <= layout.host_rows:
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"block_size must be in [1, host_rows={layout.host_rows}] "
                            f"(0: no block store), got {block_size}")
    if layout.host_rows // block_size > LIMITS.max_store_blocks:
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"a block store of {layout.host_rows // block_size} blocks "
                            f"(host_rows {layout.host_rows} // block_size {block_size}) exceeds "
                            f"{LIMITS.max_store_blocks}: use larger blocks")
    if not 0 <= index_bytes <= MAX_INDEX_BYTES:
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"index_bytes must be an integer in [0, {MAX_INDEX_BYTES}] "
                            f"(indexer key bytes of one position of one layer), got {index_bytes}")
    if index_bytes and KeysPlane.of(layout, block_size, index_bytes).block_bytes > LIMITS.max_keys_bytes:
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"one block's indexer keys ({layout.num_layers} layers x "
                            f"{block_size} positions x {index_bytes} bytes) exceed the {LIMITS.max_keys_bytes} "
                            "bytes a request may carry: use smaller blocks")
    return block_size, index_bytes
