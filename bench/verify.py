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


def fill_pool(client, layout, chunk_rows: int = 8192) -> None:
    """Write the pattern into every host row of every layer through ``client.write``."""
    for start in range(0, layout.host_rows, chunk_rows):
        rows = np.arange(start, min(start + chunk_rows, layout.host_rows), dtype=np.int32)
        data = np.stack([pattern(layer, rows, layout.row_bytes) for layer in range(layout.num_layers)])
        client.write(rows, data)


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
        for layer in layers:
            got = slab[layer, int(state_rows[b]), slots[b][ok]]
            if not isinstance(got, np.ndarray):  # a torch tensor on the GPU (cuda backend)
                got = got.cpu().numpy()
            want = pattern(layer, ids[ok], row_bytes)
            bad += int((got != want).any(axis=1).sum())
    return bad
