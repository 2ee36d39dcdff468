"""Decode traces (DESIGN §6, docs/TRACES.md): load, check and save (the synthetic generator:
``bench/synth.py``).

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
from dataclasses import dataclass, replace

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


def check_room(total: float, what: str, how: str = "") -> None:
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
        declared = _entries_declared(zf)
        if declared is not None and declared != len(zf.infolist()):  # (a damaged central directory hides some)
            raise TraceError(f"trace {path} is a damaged .npz archive: its directory declares {declared} members, "
                             f"{len(zf.infolist())} can be read")
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
        check_room(total, f"trace {path} takes", " loaded (its integers as int32, and the replay's slots)")
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


def _entries_declared(zf: zipfile.ZipFile) -> int | None:
    """The member count the archive's end record declares (None where zipfile's reader of
    it is not there): a damaged central directory entry can swallow the entries after it
    (its comment's length), which zipfile then reads as fewer members without a word."""
    try:
        end = zipfile._EndRecData(zf.fp)  # noqa: SLF001 - the stdlib's own reader of the record
        return None if end is None else int(end[zipfile._ECD_ENTRIES_TOTAL])  # noqa: SLF001
    except (AttributeError, IndexError, TypeError, ValueError, OSError):
        return None


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
