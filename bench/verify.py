"""The byte pattern ``--verify`` fills the pool with: a function of (layer, host row)."""

from __future__ import annotations

import numpy as np


def pattern(layer: int, rows: np.ndarray, row_bytes: int) -> np.ndarray:
    """uint8 [len(rows), row_bytes]; every (layer, row) pair gets distinct-looking bytes."""
    rows = np.asarray(rows, dtype=np.uint64)[:, None]
    col = np.arange(row_bytes, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):  # wrap-around multiplication is the point of the mix
        x = (rows * np.uint64(0x9E3779B97F4A7C15) + np.uint64(layer + 1) * np.uint64(0xBF58476D1CE4E5B9)
             + col * np.uint64(0x94D049BB133111EB))
        x ^= x >> np.uint64(31)
        x *= np.uint64(0xD6E8FEB86659FD93)
        x ^= x >> np.uint64(29)
    return (x & np.uint64(0xFF)).astype(np.uint8)


# Bytes of pattern made at once (its uint64 arithmetic takes ~8x that beside it), and of
# one write of every layer's rows (past it, a write a layer): a layout of large rows or
# many layers must not make --verify take gigabytes its pool does not.
PATTERN_BYTES = 4 << 20
WRITE_BYTES = 64 << 20


def fill_pool(client, layout, chunk_rows: int = 8192) -> None:
    """Write the pattern into every host row of every layer through ``client.write``, at
    most :data:`PATTERN_BYTES` of a layer's rows made at once."""
    rb, n_layers = layout.row_bytes, layout.num_layers
    step = max(1, min(chunk_rows, PATTERN_BYTES // rb))
    by_layer = step * rb * n_layers > WRITE_BYTES
    for start in range(0, layout.host_rows, step):
        rows = np.arange(start, min(start + step, layout.host_rows), dtype=np.int32)
        if by_layer:
            for layer in range(n_layers):
                client.write(rows, pattern(layer, rows, rb)[None], layers=[layer])
        else:
            client.write(rows, np.stack([pattern(layer, rows, rb) for layer in range(n_layers)]))


def count_mismatches(slab: np.ndarray, layers, state_rows: np.ndarray, topk: np.ndarray,
                     slots: np.ndarray, host_rows: int) -> int:
    """Rows (per layer and column) whose hot copy differs from the pattern of its host row."""
    bad = 0
    row_bytes = slab.shape[-1]
    for b in np.flatnonzero(state_rows >= 0):
        ids = topk[b]
        ok = (ids >= 0) & (ids < host_rows)
        if not ok.any():
            continue
        if (slots[b][ok] < 0).any():
            bad += int((slots[b][ok] < 0).sum()) * len(layers)
            ok &= slots[b] >= 0
        cols = np.flatnonzero(ok)
        step = max(1, PATTERN_BYTES // row_bytes)
        for layer in layers:
            for c in range(0, cols.size, step):
                part = cols[c:c + step]
                got = slab[layer, int(state_rows[b]), slots[b][part]]
                if not isinstance(got, np.ndarray):  # a torch tensor on the GPU (cuda backend)
                    got = got.cpu().numpy()
                bad += int((got != pattern(layer, ids[part], row_bytes)).any(axis=1).sum())
    return bad
