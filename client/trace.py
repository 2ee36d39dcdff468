"""Decode traces (DESIGN §6): load, check, save, and a synthetic generator.

A trace ``.npz`` holds ``topk`` int32 [steps, batch, top_k] (host row ids, -1 = none),
``state_rows`` int32 [steps, batch] (-1 = padding batch row), ``reset`` bool
[steps, batch], ``invalidate`` int32 [steps, batch, n] (rows rewritten before the step,
-1 = none), and scalars ``region_stride``, ``host_rows``, ``max_reqs``, ``row_bytes``,
``num_layers`` (layers of one index group).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsekv.proto import Layout

SCALARS = ("region_stride", "host_rows", "max_reqs", "row_bytes", "num_layers")


class TraceError(ValueError):
    pass


@dataclass
class Trace:
    topk: np.ndarray
    state_rows: np.ndarray
    reset: np.ndarray
    invalidate: np.ndarray
    region_stride: int
    host_rows: int
    max_reqs: int
    row_bytes: int
    num_layers: int

    @property
    def steps(self) -> int:
        return int(self.topk.shape[0])

    @property
    def batch(self) -> int:
        return int(self.topk.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.topk.shape[2])

    def layout(self, staging_rows: int = 0) -> Layout:
        """The layout of one index group of ``num_layers`` layers, as the trace describes."""
        return Layout(num_layers=self.num_layers, row_bytes=self.row_bytes, top_k=self.top_k,
                      region_stride=self.region_stride, max_reqs=self.max_reqs, host_rows=self.host_rows,
                      index_groups=(tuple(range(self.num_layers)),), staging_rows=staging_rows).validate()

    def check(self) -> "Trace":
        s, b = self.topk.shape[:2] if self.topk.ndim == 3 else (None, None)
        if self.topk.ndim != 3:
            raise TraceError(f"topk must be [steps, batch, top_k], got shape {self.topk.shape}")
        if self.state_rows.shape != (s, b):
            raise TraceError(f"state_rows must be [{s}, {b}], got {self.state_rows.shape}")
        if self.reset.shape != (s, b):
            raise TraceError(f"reset must be [{s}, {b}], got {self.reset.shape}")
        if self.invalidate.ndim != 3 or self.invalidate.shape[:2] != (s, b):
            raise TraceError(f"invalidate must be [{s}, {b}, n], got {self.invalidate.shape}")
        try:
            self.layout()
        except ValueError as e:
            raise TraceError(f"trace scalars do not make a valid layout: {e}") from None
        return self

    def save(self, path: str) -> None:
        np.savez_compressed(
            path, topk=self.topk.astype(np.int32), state_rows=self.state_rows.astype(np.int32),
            reset=self.reset.astype(bool), invalidate=self.invalidate.astype(np.int32),
            **{k: np.int64(getattr(self, k)) for k in SCALARS},
        )

    @classmethod
    def load(cls, path: str) -> "Trace":
        try:
            z = np.load(path, allow_pickle=False)
        except OSError as e:
            raise TraceError(f"cannot read trace {path}: {e}") from None
        except ValueError:  # np.load's guess at an unknown format talks about pickles
            raise TraceError(f"trace {path} is not an .npz archive (numpy.savez)") from None
        if not isinstance(z, np.lib.npyio.NpzFile):  # np.load also reads a bare .npy array
            raise TraceError(f"trace {path} is not an .npz archive")
        need = {"topk", "state_rows", "reset", "invalidate", *SCALARS}
        missing = need - set(z.files)
        if missing:
            raise TraceError(f"trace {path} lacks {sorted(missing)}")
        for name in ("topk", "state_rows", "invalidate"):
            if z[name].dtype.kind not in "iu":
                raise TraceError(f"trace {path}: {name} must hold integers (int32), got {z[name].dtype}")
        try:
            trace = cls(
                topk=z["topk"].astype(np.int32), state_rows=z["state_rows"].astype(np.int32),
                reset=z["reset"].astype(bool), invalidate=z["invalidate"].astype(np.int32),
                **{k: int(z[k]) for k in SCALARS},
            )
        except (TypeError, ValueError) as e:  # object or text arrays, an array where a number belongs
            raise TraceError(f"trace {path} has an array of the wrong type: {e}") from None
        return trace.check()


def synth(
    *,
    steps: int = 200,
    batch: int = 8,
    top_k: int = 256,
    region_stride: int = 512,
    max_reqs: int = 16,
    host_rows: int = 65536,
    row_bytes: int = 656,
    num_layers: int = 2,
    overlap: float = 0.8,
    context: int = 2048,
    lifetime: int = 64,
    arrive: float = 0.5,
    pad: float = 0.1,
    invalidate: float = 0.05,
    out_of_range: float = 0.0005,
    share_prefix: float = 0.1,
    seed: int = 0,
) -> Trace:
    """Generate a decode trace.

    Requests arrive (with probability ``arrive`` per free batch row and step), each with a
    context of about ``context`` host rows, decode one row per step for about ``lifetime``
    steps, then leave. Each step keeps a fraction ``overlap`` of the previous top-k and
    draws the rest from the request's rows. A fraction ``pad`` of live rows are padding
    for a step (state row -1, junk ids). ``invalidate`` is the chance per request and step
    that one of its rows is rewritten; ``out_of_range`` the chance per column of a bad id;
    ``share_prefix`` the chance a new request shares the first rows of a live one.
    """
    rng = np.random.default_rng(seed)
    if batch > max_reqs:
        raise TraceError(f"batch {batch} exceeds max_reqs {max_reqs}")
    span = host_rows // max_reqs  # host rows a state row's requests may use
    if span < top_k + 2:
        raise TraceError(f"host_rows {host_rows} gives {span} rows per request; need more than top_k {top_k}")
    t_topk = np.full((steps, batch, top_k), -1, np.int32)
    t_rows = np.full((steps, batch), -1, np.int32)
    t_reset = np.zeros((steps, batch), bool)
    t_inval = np.full((steps, batch, 2), -1, np.int32)
    free_state = list(rng.permutation(max_reqs))
    # Per batch slot: None or dict(state, base, length, left, prev)
    live: list[dict | None] = [None] * batch
    for t in range(steps):
        for b in range(batch):
            req = live[b]
            if req is not None and req["left"] <= 0:
                free_state.append(req["state"])
                live[b] = req = None
            if req is None and free_state and rng.random() < arrive:
                s = int(free_state.pop(0))
                length = int(min(span - lifetime - 1, max(8, rng.normal(context, context / 4))))
                length = max(1, length)
                base = s * span
                others = [r for r in live if r is not None]
                if others and rng.random() < share_prefix:
                    donor = others[rng.integers(len(others))]
                    base = donor["base"]  # shares the donor's prefix rows (prefix cache)
                    length = min(length, donor["length"])
                req = live[b] = {"state": s, "base": base, "own": s * span, "length": length,
                                 "left": int(rng.integers(lifetime // 2, lifetime * 3 // 2 + 1)), "prev": None, "new": True}
            if req is None:
                t_topk[t, b] = rng.integers(-1, host_rows, top_k)  # padding rows carry junk
                continue
            if not req["new"] and rng.random() < pad:
                t_topk[t, b] = rng.integers(-1, host_rows, top_k)
                continue  # padding this step; the request stays
            t_rows[t, b] = req["state"]
            t_reset[t, b] = req["new"]
            req["new"] = False
            n_ctx = req["length"]
            ctx_rows = np.arange(req["base"], req["base"] + n_ctx, dtype=np.int64)
            if n_ctx <= top_k:
                ids = rng.permutation(ctx_rows)
            else:
                keep = np.empty(0, np.int64)
                if req["prev"] is not None:
                    prev = req["prev"][req["prev"] >= 0]
                    keep = rng.choice(prev, int(overlap * prev.size), replace=False) if prev.size else keep
                need = top_k - keep.size
                pool = np.setdiff1d(ctx_rows, keep, assume_unique=False)
                ids = np.concatenate([keep, rng.choice(pool, need, replace=False)])
                ids = rng.permutation(ids)
            row = np.full(top_k, -1, np.int64)
            row[: ids.size] = ids
            req["prev"] = row.copy()
            bad = rng.random(top_k) < out_of_range
            row[bad] = rng.choice([host_rows, host_rows + 7, -5], int(bad.sum()))
            t_topk[t, b] = row
            if rng.random() < invalidate:
                t_inval[t, b, 0] = ctx_rows[rng.integers(ctx_rows.size)]
            # decode appends one row (in the request's own range) and ages the request
            if req["base"] == req["own"] and req["length"] < span - 1:
                req["length"] += 1
            req["left"] -= 1
    return Trace(t_topk, t_rows, t_reset, t_inval, region_stride, host_rows, max_reqs, row_bytes, num_layers).check()
