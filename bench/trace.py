"""Decode traces (DESIGN §6, docs/TRACES.md): load, check, save, and a synthetic generator.

A trace ``.npz`` holds ``topk`` int32 [steps, batch, top_k] (host row ids, -1 = none),
``state_rows`` int32 [steps, batch] (-1 = padding batch row), ``reset`` bool
[steps, batch], ``invalidate`` int32 [steps, batch, n] (rows rewritten before the step,
-1 = none), and scalars ``region_stride``, ``host_rows``, ``max_reqs``, ``row_bytes``,
``num_layers`` (layers of one index group).

A *position trace* also holds ``block_table`` int32 [steps, batch, max_blocks] (the host
block of each logical block of the batch row's request, -1 = none) and scalar
``block_size``; its ``topk`` then holds logical token positions, mapped to host rows by
:func:`sparsekv.proto.positions.host_rows` (:meth:`Trace.host_topk`). ``invalidate``
stays in host rows.
"""

from __future__ import annotations

import os
import stat
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from sparsekv.proto import Layout
from sparsekv.proto.args import int32_array
from sparsekv.proto.layout import MAX_BATCH, MAX_LAYERS
from sparsekv.proto.positions import host_rows as map_positions

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
    block_table: np.ndarray | None = None  # position traces: int32 [steps, batch, max_blocks]
    block_size: int = 0  # position traces: tokens per block; 0: topk holds host rows

    def __post_init__(self):
        # A NumPy integer scalar is an int here (the layout takes Python ints only); any
        # other type stays as given, for the layout's check to name.
        for name in (*SCALARS, "block_size"):
            v = getattr(self, name)
            if isinstance(v, np.integer):
                setattr(self, name, int(v))

    @property
    def steps(self) -> int:
        return int(self.topk.shape[0])

    @property
    def batch(self) -> int:
        return int(self.topk.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.topk.shape[2])

    @property
    def positional(self) -> bool:
        """True when ``topk`` holds logical positions (a block table maps them)."""
        return self.block_table is not None

    def host_topk(self, t: int) -> np.ndarray:
        """int32 [batch, top_k]: the host rows step ``t``'s top-k names (a position that
        does not map: ``proto.positions.UNMAPPED``, counted as out of range)."""
        if self.block_table is None:
            return self.topk[t]
        return map_positions(self.topk[t], self.block_table[t], self.block_size)

    def to_host_rows(self) -> "Trace":
        """The same trace with every step's top-k mapped to host rows (no block table)."""
        if self.block_table is None:
            return self
        topk = np.stack([self.host_topk(t) for t in range(self.steps)]) if self.steps else self.topk.copy()
        return replace(self, topk=topk.astype(np.int32), block_table=None, block_size=0)

    def layout(self, staging_rows: int = 0) -> Layout:
        """The layout of one index group of ``num_layers`` layers, as the trace describes;
        ``max_batch`` its batch width where that passes ``max_reqs`` (several rows of one
        state row: speculative decoding)."""
        return Layout(num_layers=self.num_layers, row_bytes=self.row_bytes, top_k=self.top_k,
                      region_stride=self.region_stride, max_reqs=self.max_reqs, host_rows=self.host_rows,
                      index_groups=(tuple(range(self.num_layers)),), staging_rows=staging_rows,
                      max_batch=max(self.max_reqs, self.topk.shape[1])).validate()

    def check(self) -> "Trace":
        s, b = self.topk.shape[:2] if self.topk.ndim == 3 else (None, None)
        if self.topk.ndim != 3:
            raise TraceError(f"topk must be [steps, batch, top_k], got shape {self.topk.shape}")
        for name in ("state_rows", "reset"):
            if getattr(self, name).shape != (s, b):
                raise TraceError(f"{name} must be [{s}, {b}], got {getattr(self, name).shape}")
        if self.invalidate.ndim != 3 or self.invalidate.shape[:2] != (s, b):
            raise TraceError(f"invalidate must be [{s}, {b}, n], got {self.invalidate.shape}")
        bad = (self.invalidate < -1) | (self.invalidate >= self.host_rows)
        if bad.any():
            t, r, _ = (int(x[0]) for x in np.nonzero(bad))
            raise TraceError(f"invalidate at step {t}, batch row {r} holds {int(self.invalidate[bad][0])}: a host row "
                             f"in [0, {self.host_rows}), or -1 for none")
        k = self.topk.shape[2]
        if b > MAX_BATCH or b * k >= 1 << 31:
            raise TraceError(f"topk's batch of {b} rows of {k} ids passes a top-k batch's limits (at most {MAX_BATCH} "
                             "rows, fewer than 2**31 ids)")
        try:
            self.layout()
        except ValueError as e:
            raise TraceError(f"trace scalars do not make a valid layout: {e}") from None
        self._check_block_table()
        return self

    def _check_block_table(self) -> None:
        table, bs = self.block_table, self.block_size
        if table is None:
            if bs != 0:
                raise TraceError(f"block_size {bs} given without a block_table; a position trace needs both "
                                 "(a host-row trace has neither)")
            return
        s, b = self.topk.shape[:2]
        if not isinstance(bs, (int, np.integer)) or bs <= 0:
            raise TraceError(f"block_table given with block_size {bs}; a position trace needs both, block_size > 0")
        if bs > self.host_rows:  # (and so < 2**31: position arithmetic stays in int64)
            raise TraceError(f"block_size {bs} exceeds host_rows {self.host_rows}: no host block fits the pool")
        if table.ndim != 3 or table.shape[:2] != (s, b):
            raise TraceError(f"block_table must be [{s}, {b}, max_blocks], got {table.shape}")
        if table.dtype.kind not in "iu":
            raise TraceError(f"block_table must hold integers, got {table.dtype}")
        if table.size:
            whole = self.host_rows // bs  # host blocks that lie wholly in the pool
            lo, hi = int(table.min()), int(table.max())
            if lo < -1:
                raise TraceError(f"block_table holds block {lo}; host blocks are >= 0, -1 = none")
            if hi >= whole:
                raise TraceError(f"block_table names host block {hi}, but host_rows {self.host_rows} holds "
                                 f"{whole} whole blocks of block_size {bs}")
        self._check_shared_tables()

    def _check_shared_tables(self) -> None:
        """The batch rows of one request in a step (one state row: speculative rows) carry
        one block table: an engine keeps one per request (the doorbell maps by state row)."""
        t, b = np.nonzero(self.state_rows >= 0)
        state = self.state_rows[t, b]
        order = np.lexsort((b, state, t))
        t, b, state = t[order], b[order], state[order]
        pairs = np.flatnonzero((t[1:] == t[:-1]) & (state[1:] == state[:-1]))  # row i and i + 1: one request
        # Compared a chunk of pairs at a time: two copies of the whole table's rows took
        # 2.7x the memory the load counts when every row was one request's.
        chunk = max(1, TABLE_CHUNK_BYTES // max(1, self.block_table.shape[2] * self.block_table.itemsize))
        for lo in range(0, pairs.size, chunk):
            p = pairs[lo:lo + chunk]
            differ = (self.block_table[t[p], b[p]] != self.block_table[t[p + 1], b[p + 1]]).any(axis=1)
            if differ.any():
                i = p[np.flatnonzero(differ)[0]]
                raise TraceError(f"step {t[i]}: batch rows {b[i]} and {b[i + 1]} are one request (state row "
                                 f"{state[i]}) but carry different block tables; a request's rows share its table "
                                 "(docs/TRACES.md)")

    def save(self, path: str) -> None:
        """Write the trace to ``path`` (:func:`save_npz`)."""
        extra = {}
        if self.block_table is not None:
            extra = {"block_table": self.block_table.astype(np.int32), "block_size": np.int64(self.block_size)}
        save_npz(path, topk=self.topk.astype(np.int32), state_rows=self.state_rows.astype(np.int32),
                 reset=self.reset.astype(bool), invalidate=self.invalidate.astype(np.int32),
                 **{k: np.int64(getattr(self, k)) for k in SCALARS}, **extra)

    @classmethod
    def load(cls, path: str) -> "Trace":
        """The trace at ``path`` (docs/TRACES.md), checked: each member's header (a NumPy
        array, its type, shape and size) before any data is read, every integer array's
        values within int32, the scalars integers, ``reset`` bool; TraceError otherwise."""
        need = {"topk", "state_rows", "reset", "invalidate", *SCALARS}
        arrays = _read_npz(path, (*SCALARS, "block_size"), lambda scalars: _check_scalars(path, scalars),
                           frozenset({*need, "block_table", "block_size"}))
        missing = need - set(arrays)
        if missing:
            raise TraceError(f"trace {path} lacks {sorted(missing)}")
        positional = {"block_table", "block_size"} & set(arrays)
        if len(positional) == 1:
            raise TraceError(f"trace {path} has {positional.pop()} alone; a position trace needs both "
                             "block_table and block_size")
        extra = {}
        if positional:
            extra = {"block_table": _int32(path, "block_table", arrays["block_table"]),
                     "block_size": _scalar(path, "block_size", arrays["block_size"])}
        reset = arrays["reset"]
        if reset.dtype != np.bool_:
            raise TraceError(f"trace {path}: reset must be bool, got {reset.dtype}")
        trace = cls(topk=_int32(path, "topk", arrays["topk"]), state_rows=_int32(path, "state_rows", arrays["state_rows"]),
                    reset=reset, invalidate=_int32(path, "invalidate", arrays["invalidate"]),
                    **{k: _scalar(path, k, arrays[k]) for k in SCALARS}, **extra)
        try:
            return trace.check()
        except TraceError as e:
            raise TraceError(f"trace {path}: {e}") from None


def save_npz(path: str, **arrays) -> None:
    """``arrays`` as a compressed .npz at ``path`` itself (NumPy would add ``.npz`` to a name
    without it), written beside it and renamed over it: a write that fails leaves what was
    there."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# Copies of a request's context ids (int64 [span]) synth makes at once while it draws a
# top-k row: the ids, the position mask and table lookups, setdiff1d's sort, choice's pool
# (measured: 2**24 rows a request, host rows or positions, peaked at 7.5-7.6 copies).
SYNTH_CONTEXT_COPIES = 8
# What Trace._check_shared_tables takes per (step, batch row) of a position trace at once:
# the live cells' indices, their order and the reordered copies (measured: 58 bytes, every
# cell live, 300 steps of 65,536 rows).
SHARED_TABLE_CELL_BYTES = 64
# The block-table rows one comparison of a request's rows copies at most (Trace._check_shared_tables).
TABLE_CHUNK_BYTES = 32 << 20
# What the replay keeps per step whatever the batch (its time, and room for the driver's
# per-step state): counted with the arrays, so that a trace of many empty steps is refused
# by its size as a large one is, before its steps are run.
STEP_BYTES = 64
# What a trace's arrays may take of the memory available when it is loaded (their bytes as
# stored; the replay keeps them and its own state beside them).
TRACE_MEMORY_SHARE = 0.25
# (RuntimeError: an encrypted member; NotImplementedError: a compression zipfile lacks.)
_READ_ERRORS = (OSError, EOFError, ValueError, MemoryError, RuntimeError, NotImplementedError, zipfile.BadZipFile,
                zlib.error)


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a plain file"


def _check_room(total: float, what: str, how: str = "") -> None:
    """TraceError ("``what`` N GiB``how``; this machine has room for ...") when ``total``
    bytes of arrays pass :data:`TRACE_MEMORY_SHARE` of the memory available."""
    import psutil  # noqa: PLC0415

    room = psutil.virtual_memory().available * TRACE_MEMORY_SHARE
    if total > room:
        raise TraceError(f"{what} {total / 2**30:.1f} GiB{how}; this machine has room for {room / 2**30:.1f} GiB "
                         f"({TRACE_MEMORY_SHARE:g} of its available memory)")


def _check_scalars(path: str, scalars: dict) -> None:
    """The layout the trace's scalars make, checked before its arrays are read."""
    missing = set(SCALARS) - set(scalars)
    if missing:
        raise TraceError(f"trace {path} lacks {sorted(missing)}")
    values = {k: _scalar(path, k, scalars[k]) for k in SCALARS}
    if not 0 < values["num_layers"] <= MAX_LAYERS:
        raise TraceError(f"trace {path}: its scalars do not make a valid layout: num_layers {values['num_layers']} is not in "
                         f"[1, {MAX_LAYERS}]")
    try:
        Layout(top_k=1, index_groups=(tuple(range(values["num_layers"])),), **values).validate()
    except (TypeError, ValueError) as e:
        raise TraceError(f"trace {path}: its scalars do not make a valid layout: {e}") from None


def _read_npz(path: str, scalars: tuple, check_scalars, known: frozenset) -> dict:
    """The members of the .npz at ``path`` as arrays: each one of ``known`` (no other
    member: a NumPy array of another name, or another file), every header read and
    checked (a NumPy array of a plain dtype, no negative dimension, all of them together
    within TRACE_MEMORY_SHARE of the available memory, the members named in ``scalars``
    0-d), then those read and given to ``check_scalars``, then the other members' data,
    each read to its member's end (nothing after the array; the zip's CRC checked)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e}") from None
    if not stat.S_ISREG(mode):  # a FIFO would block for ever, a device be read without end
        raise TraceError(f"trace {path} is not a regular file ({_file_kind(mode)}); name an .npz file")
    try:
        zf = zipfile.ZipFile(path)
    except FileNotFoundError as e:
        raise TraceError(f"cannot read trace {path}: {e}") from None
    except _READ_ERRORS as e:
        raise TraceError(f"trace {path} is not an .npz archive (numpy.savez): {e}") from None
    with zf:
        members = {}
        for n in zf.namelist():
            key = n[:-4] if n.endswith(".npy") else None
            if key not in known:
                raise TraceError(f"trace {path}: member {n!r} is not one of its arrays ({', '.join(sorted(known))}, "
                                 "each a NumPy .npy)")
            if key in members:  # (zipfile would read the last of them)
                raise TraceError(f"trace {path}: member {n!r} appears twice")
            members[key] = n
        total, shapes = 0, {}
        for key, name in members.items():
            try:
                with zf.open(name) as f:
                    version = np.lib.format.read_magic(f)
                    if version == (1, 0):
                        shape, _, dtype = np.lib.format.read_array_header_1_0(f)
                    elif version == (2, 0):
                        shape, _, dtype = np.lib.format.read_array_header_2_0(f)
                    else:
                        raise ValueError(f"NumPy array format version {version} (1.0 and 2.0 are read)")
            except _READ_ERRORS as e:
                raise TraceError(f"trace {path}: {key} is not a readable NumPy array: {e}") from None
            # Its type from the header, before its data is read: reset bool, the rest integers.
            if key in scalars and (shape != () or dtype.kind not in "iu"):
                raise TraceError(f"trace {path}: {key} must be an integer scalar, got {dtype} of shape {shape}")
            if dtype.hasobject or dtype.fields is not None or dtype.kind not in ("b" if key == "reset" else "iu"):
                raise TraceError(f"trace {path}: {key} must {'be bool' if key == 'reset' else 'hold integers'}, "
                                 f"got {dtype}")
            if any(d < 0 for d in shape):
                raise TraceError(f"trace {path}: {key} has shape {shape}")
            shapes[key] = shape
            # As loaded: integers become int32, the copy made beside the array read unless it
            # is int32 in this machine's byte order (an int8 array takes 5 bytes a value, a
            # uint32 or big-endian one 8, an int64 one 12), and the replay keeps slots as
            # large as the top-k beside it.
            loaded = dtype.itemsize if dtype.kind == "b" or dtype == np.int32 else dtype.itemsize + 4
            total += int(np.prod(shape, dtype=np.float64)) * loaded * (2 if key == "topk" else 1)
            if key == "topk" and len(shape) >= 2:  # the replay's own: per step, and a batch row's misses
                total += shape[0] * STEP_BYTES + shape[0] * shape[1] * 4
            if key == "block_table" and len(shape) >= 2:  # the check that a request's rows share one table
                total += shape[0] * shape[1] * SHARED_TABLE_CELL_BYTES
        _check_room(total, f"trace {path} takes", " loaded (its integers as int32, and the replay's slots)")
        def read(keys) -> dict:
            got = {}
            for key in keys:
                try:
                    with zf.open(members[key]) as f:
                        got[key] = np.lib.format.read_array(f, allow_pickle=False)
                        if f.read(1):  # (reaching the member's end checks its CRC too)
                            raise ValueError("bytes follow the array in its member")
                except _READ_ERRORS as e:
                    raise TraceError(f"trace {path}: {key} could not be read: {e}") from None
            return got

        out = read([key for key in members if key in scalars])
        check_scalars(out)
        return {**out, **read([key for key in members if key not in scalars])}


def _int32(path: str, name: str, a: np.ndarray) -> np.ndarray:
    """``a`` as int32: an integer array whose every value fits int32 (never wrapped)."""
    try:
        return int32_array(name, a, lists=False)
    except ValueError as e:
        raise TraceError(f"trace {path}: {e}") from None


def _scalar(path: str, name: str, a: np.ndarray) -> int:
    """A scalar of the trace: a 0-d integer array."""
    if a.shape != () or a.dtype.kind not in "iu":
        raise TraceError(f"trace {path}: {name} must be an integer scalar, got {a.dtype} of shape {a.shape}")
    return int(a)


# -- the synthetic generator ---------------------------------------------------------------
NULL_BLOCK = 0.05  # position traces: chance a logical block of a new request's own context is null


@dataclass
class _Request:
    """One request of the generator: its context is host rows ``base .. base + length``, or
    (position traces) positions ``0 .. length`` not on a null block of ``table``."""

    state: int  # its state row
    base: int  # host-row traces: first host row of its context (a donor's when it shares a prefix)
    own: int  # first host row of its state row's own range
    length: int  # context tokens
    left: int  # decode steps to go
    prev: np.ndarray | None = None  # its last top-k row, before stray ids
    new: bool = True
    table: list[int] | None = None  # position traces only
    free: list[int] = field(default_factory=list)  # position traces: own host blocks not used yet

    def context(self, block_size: int) -> np.ndarray:
        """The ids its top-k may name: host rows, or positions on a mapped block."""
        if self.table is None:
            return np.arange(self.base, self.base + self.length, dtype=np.int64)
        pos = np.arange(self.length, dtype=np.int64)
        return pos[np.asarray(self.table, np.int64)[pos // block_size] >= 0]

    def host_rows_of(self, ids: np.ndarray, block_size: int) -> np.ndarray:
        if self.table is None:
            return ids
        return np.asarray(self.table, np.int64)[ids // block_size] * block_size + ids % block_size

    def strays(self, host_rows: int, block_size: int, max_blocks: int) -> list[int]:
        """Ids that name no row: out of range, or (positions) negative, past the table or on a null block."""
        if self.table is None:
            return [host_rows, host_rows + 7, -5]
        past = max_blocks * block_size
        nulls = [i * block_size for i, blk in enumerate(self.table) if blk < 0]
        return [-1, -5, past, past + 3] + nulls[:1]

    def grow(self, span: int, block_size: int, max_blocks: int) -> None:
        """Decode appends one token, in the request's own range (a new block when the last is full)."""
        if self.table is None:
            if self.base == self.own and self.length < span - 1:
                self.length += 1
            return
        if self.length // block_size == len(self.table):
            if not self.free or len(self.table) >= max_blocks:
                return
            self.table.append(self.free.pop())
        self.length += 1


def _arrive(rng, state: int, live: list, *, span: int, context: int, lifetime: int, share_prefix: float,
            block_size: int, max_blocks: int) -> _Request:
    """A new request on ``state``; it may share a live request's prefix (prefix cache)."""
    length = int(min(span - lifetime - 1, max(8, rng.normal(context, context / 4))))
    length = max(1, length)
    base = state * span
    others = [r for r in live if r is not None]
    donor = None
    if others and rng.random() < share_prefix:
        donor = others[rng.integers(len(others))]
        base = donor.base  # shares the donor's prefix rows
        length = min(length, donor.length)
    req = _Request(state=state, base=base, own=state * span, length=length,
                   left=int(rng.integers(lifetime // 2, lifetime * 3 // 2 + 1)))
    if block_size:
        _give_blocks(rng, req, donor, others, block_size, max_blocks)
    return req


def _give_blocks(rng, req: _Request, donor: _Request | None, others: list, block_size: int, max_blocks: int) -> None:
    """A position request's block table: a shared prefix's whole blocks from the donor's
    table, the rest from its own host blocks (``max_blocks`` from ``state * max_blocks``)
    in random order, skipping any a live request holds; a few are null (-1), never its last."""
    held = {blk for r in others for blk in r.table if blk >= 0}
    first = req.state * max_blocks
    req.free = [int(blk) for blk in rng.permutation(np.arange(first, first + max_blocks)) if blk not in held]
    req.table = list(donor.table[: req.length // block_size]) if donor is not None else []
    n_blocks = -(-req.length // block_size)
    null = rng.random(n_blocks) < NULL_BLOCK
    for i in range(len(req.table), n_blocks):
        if null[i] and i < n_blocks - 1:
            req.table.append(-1)
        elif req.free:
            req.table.append(req.free.pop())
        else:
            break  # every own block is held by requests sharing an earlier owner's prefix
    req.length = min(req.length, len(req.table) * block_size)


def _pick(rng, ctx: np.ndarray, prev: np.ndarray | None, top_k: int, overlap: float) -> np.ndarray:
    """A top-k row of distinct ids of ``ctx`` keeping a fraction ``overlap`` of ``prev``'s
    ids; -1 after the ids when ``ctx`` has fewer than ``top_k``."""
    if ctx.size <= top_k:
        ids = rng.permutation(ctx)
    else:
        keep = np.empty(0, np.int64)
        if prev is not None:
            prev = prev[prev >= 0]
            keep = rng.choice(prev, int(overlap * prev.size), replace=False) if prev.size else keep
        need = top_k - keep.size
        pool = np.setdiff1d(ctx, keep, assume_unique=False)
        ids = np.concatenate([keep, rng.choice(pool, need, replace=False)])
        ids = rng.permutation(ids)
    row = np.full(top_k, -1, np.int64)
    row[: ids.size] = ids
    return row


def _with_strays(rng, row: np.ndarray, rate: float, strays: list[int]) -> np.ndarray:
    """``row`` with each column replaced, with chance ``rate``, by one of ``strays``."""
    row = row.copy()
    bad = rng.random(row.size) < rate
    row[bad] = rng.choice(strays, int(bad.sum()))
    return row


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
    block_size: int = 0,
    spec: float = 0.0,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> Trace:
    """Generate a decode trace. Requests arrive (with probability ``arrive`` per free batch
    row and step), each with a context of about ``context`` host rows, decode one row per
    step for about ``lifetime`` steps, then leave. Each step keeps a fraction ``overlap``
    of the previous top-k and draws the rest from the request's rows. A fraction ``pad``
    of live rows are padding for a step (state row -1, junk ids). ``invalidate``: the
    chance per request and step that one of its rows is rewritten; ``out_of_range``: per
    column of a bad id; ``share_prefix``: that a new request shares a live one's prefix.

    ``block_size`` > 0 writes a position trace: each request's context is whole host
    blocks of its own range (in random order; shared prefix blocks are the donor's) in a
    per-request block table, some of its logical blocks null (-1); ``topk`` holds
    positions, and a bad column is a negative position, one past the table or one on a
    null block. ``spec`` is the chance that a live request also takes a free batch row for
    a step (speculative decoding: the same state row, the same block table, another
    top-k); it needs ``region_stride >= 2 * top_k``. With both 0 they draw no random
    numbers. ``progress(steps_done)`` is called after each step."""
    for name, v in dict(steps=steps, batch=batch, top_k=top_k, region_stride=region_stride, max_reqs=max_reqs,
                        host_rows=host_rows, row_bytes=row_bytes, num_layers=num_layers, context=context,
                        lifetime=lifetime).items():
        if v < 1:
            raise TraceError(f"{name} must be >= 1, got {v}")
    for name, v in dict(context=context, lifetime=lifetime).items():
        if v >= 1 << 31:
            raise TraceError(f"{name} must be < 2**31, got {v}")
    for name, v in dict(overlap=overlap, arrive=arrive, pad=pad, invalidate=invalidate, out_of_range=out_of_range,
                        share_prefix=share_prefix, spec=spec).items():
        if not 0.0 <= v <= 1.0:
            raise TraceError(f"{name} is a probability in [0, 1], got {v}")
    if seed < 0:
        raise TraceError(f"seed must be >= 0, got {seed}")
    try:
        Layout(num_layers=num_layers, row_bytes=row_bytes, top_k=top_k, region_stride=region_stride,
               max_reqs=max_reqs, host_rows=host_rows, index_groups=(tuple(range(num_layers)),)).validate()
    except ValueError as e:
        raise TraceError(f"these parameters do not make a valid layout: {e}") from None
    rng = np.random.default_rng(seed)
    if batch > max_reqs:
        raise TraceError(f"batch {batch} exceeds max_reqs {max_reqs}")
    if block_size < 0:
        raise TraceError(f"block_size must be >= 0 (0: a host-row trace), got {block_size}")
    if spec > 0 and region_stride < 2 * top_k:
        raise TraceError(f"spec needs region_stride >= 2 * top_k (a state row on two batch rows of a step); "
                         f"got region_stride {region_stride}, top_k {top_k}")
    max_blocks = 0  # position traces: blocks of a state row's own range, the table's width
    if block_size:
        max_blocks = host_rows // block_size // max_reqs
        span = max_blocks * block_size
        if span < top_k + 2:
            raise TraceError(f"host_rows {host_rows} gives {max_blocks} blocks of {block_size} ({span} rows per "
                             f"request); need more than top_k {top_k}")
    else:
        span = host_rows // max_reqs  # host rows a state row's requests may use
        if span < top_k + 2:
            raise TraceError(f"host_rows {host_rows} gives {span} rows per request; need more than top_k {top_k}")
    # The arrays' bytes (top-k, state rows, reset, invalidate; a position trace's tables
    # besides), checked as a load checks them, before any is made; with the working memory
    # of a step: a request's context ids (int64, up to ``span``) and their copies while its
    # top-k is drawn (SYNTH_CONTEXT_COPIES), and with ``spec`` every served row's kept too.
    working = ((batch if spec > 0 else 0) + SYNTH_CONTEXT_COPIES) * 8 * span
    _check_room(steps * batch * (4 * top_k + 4 + 1 + 8 + (4 * max_blocks if block_size else 0)) + working,
                f"a trace of {steps} steps of batch {batch} and top_k {top_k} takes",
                f" (with {working / 2**30:.1f} GiB of context ids of up to {span} rows a request while it is drawn)")
    t_topk = np.full((steps, batch, top_k), -1, np.int32)
    t_rows = np.full((steps, batch), -1, np.int32)
    t_reset = np.zeros((steps, batch), bool)
    t_inval = np.full((steps, batch, 2), -1, np.int32)
    t_table = np.full((steps, batch, max_blocks), -1, np.int32) if block_size else None
    free_state = list(rng.permutation(max_reqs))
    live: list[_Request | None] = [None] * batch  # the request on each batch row
    for t in range(steps):
        served = []  # (batch row, request, its context) of this step's live rows
        for b in range(batch):
            req = live[b]
            if req is not None and req.left <= 0:
                free_state.append(req.state)
                live[b] = req = None
            if req is None and free_state and rng.random() < arrive:
                req = live[b] = _arrive(rng, int(free_state.pop(0)), live, span=span, context=context,
                                        lifetime=lifetime, share_prefix=share_prefix, block_size=block_size,
                                        max_blocks=max_blocks)
            if req is None or (not req.new and rng.random() < pad):  # padding (a request stays)
                t_topk[t, b] = rng.integers(-1, host_rows, top_k)  # padding rows carry junk
                continue
            t_rows[t, b] = req.state
            t_reset[t, b] = req.new
            req.new = False
            ctx = req.context(block_size)
            req.prev = _pick(rng, ctx, req.prev, top_k, overlap)
            t_topk[t, b] = _with_strays(rng, req.prev, out_of_range, req.strays(host_rows, block_size, max_blocks))
            if t_table is not None:
                t_table[t, b, : len(req.table)] = req.table
            if rng.random() < invalidate and ctx.size:
                t_inval[t, b, 0] = req.host_rows_of(ctx[rng.integers(ctx.size)], block_size)
            served.append((b, req, ctx if spec > 0 else None))  # (a context kept only for speculative rows)
            req.grow(span, block_size, max_blocks)
            req.left -= 1
        if spec > 0:  # speculative rows: a second batch row of a served request, on a free batch row
            free_rows = [b for b in range(batch) if live[b] is None]
            for b, req, ctx in served:
                if free_rows and rng.random() < spec:
                    c = free_rows.pop(0)
                    t_rows[t, c] = req.state  # reset and invalidations ride on the first row
                    row = _pick(rng, ctx, req.prev, top_k, min(overlap, 0.5))
                    t_topk[t, c] = _with_strays(rng, row, out_of_range, req.strays(host_rows, block_size, max_blocks))
                    if t_table is not None:
                        t_table[t, c] = t_table[t, b]
        if progress is not None:
            progress(t + 1)
    return Trace(t_topk, t_rows, t_reset, t_inval, region_stride, host_rows, max_reqs, row_bytes, num_layers,
                 block_table=t_table, block_size=block_size).check()
