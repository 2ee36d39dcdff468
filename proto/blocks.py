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
"""

from __future__ import annotations

import hashlib

import numpy as np

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
    key = root_key(namespace) if parent is None else bytes(parent)
    if len(key) != KEY_BYTES:
        raise ValueError(f"parent must be a {KEY_BYTES}-byte key, got {len(key)} bytes")
    toks = np.ascontiguousarray(np.asarray(tokens).reshape(-1), dtype="<i4")
    n = toks.size // block_size
    out = bytearray()
    for i in range(n):
        key = hashlib.blake2b(key + toks[i * block_size:(i + 1) * block_size].tobytes(), digest_size=KEY_BYTES).digest()
        out += key
    return np.frombuffer(bytes(out), dtype=np.int64).reshape(n, 2).copy()
