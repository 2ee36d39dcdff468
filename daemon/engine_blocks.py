"""An engine's block store side (DESIGN §9), mixed into ``EngineSpace``: the bytes of the
blocks it frees or evicts (zeroed: now, or by a worker thread while the request that freed
them waits) and its indexer keys plane's requests. ``self`` is the ``EngineSpace``: its
``pool``, ``blocks``, ``block_size``, ``keys_plane``, ``keys``, ``ranks``, ``quiesce`` and
``drop_rewritten``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from sparsekv.proto import LIMITS
from sparsekv.proto.blocks import KeysPlane

from .blocks.contract import BlockError


class ZeroWrite:
    """The zeros of blocks freed or evicted (``EngineSpace.forget_blocks``), to write on any
    thread: their rows in every layer, a slice a run of consecutive blocks, and their keys."""

    def __init__(self, space: "EngineBlocks", runs: list[tuple[int, int, int]], nbytes: int,
                 drop: np.ndarray | None = None):
        self.space, self.runs, self.nbytes = space, runs, nbytes
        self.drop = drop  # rows whose hot copies are dropped first (None: dropped already)

    def __call__(self) -> int:
        sp, bs = self.space, self.space.block_size
        if self.drop is not None:
            drop_copies(sp, self.drop)
            self.drop = None
        for first, _, n in self.runs:
            sp.pool[:, first * bs:(first + n) * bs] = 0
            if sp.keys is not None:
                sp.keys[first:first + n] = 0
        return self.nbytes


class UnsafeRows(Exception):
    """Rows freed or rewritten could not be made safe to serve, so the daemon must not serve
    on (the server stops, exit code 70): a later request could get a wrong row."""


class ZeroFailed(UnsafeRows):
    """The zeros of freed blocks could not be written: those blocks are free and not zero."""


class DropFailed(UnsafeRows):
    """The hot copies of rows rewritten or freed could not all be dropped: a later top-k
    could hit a stale copy."""


def drop_copies(space, rows) -> int:
    """``space.drop_rewritten(rows)``; DropFailed when it raises (whatever it was, stale
    copies may remain)."""
    try:
        return space.drop_rewritten(rows)
    except Exception as e:  # noqa: BLE001 - whatever it was, copies may be stale
        raise DropFailed(f"dropping the hot copies of rewritten or freed rows failed: {type(e).__name__}: {e}") from e


def write_zeros(zeros: list[ZeroWrite]) -> int:
    """Write the zeros ``EngineBlocks.deferring_zeros`` left (any thread); returns their
    bytes. ZeroFailed when any cannot be written."""
    try:
        return sum(z() for z in zeros)
    except DropFailed:
        raise
    except Exception as e:  # noqa: BLE001 - whatever it was, the blocks are dirty
        raise ZeroFailed(f"writing the zeros of freed blocks failed: {type(e).__name__}: {e}") from e


class EngineBlocks:
    """The block store's and the keys plane's part of an engine (see the module's docstring)."""

    _deferred: list | None = None  # inside deferring_zeros: the zeros not written yet
    _drops_from: int | None = None  # inside deferring_zeros: the drops scanning this many slots or more go too

    def zero_blocks(self, blocks: list[int]) -> None:
        """Write zeros over every row of ``blocks`` in every layer (and their indexer keys)
        and drop their hot copies in every rank: the block store frees or evicts them. Inside
        :meth:`deferring_zeros` the zeros are left to the caller; otherwise written now."""
        write = self.forget_blocks(blocks)
        if self._deferred is None:
            write()
        else:
            self._deferred.append(write)

    def forget_blocks(self, blocks: list[int]) -> "ZeroWrite":
        """What freeing or evicting ``blocks`` asks of the loop's thread: no copy or keys load
        of any rank in flight and every hot copy of their rows dropped; the writing of their
        zeros, which any thread may run (nobody may use those blocks until the request that
        freed or took them has replied), is returned. A run of consecutive blocks is one
        slice (a dead client's million blocks one by one had held the loop for a second)."""
        bs = self.block_size
        self.quiesce()
        # Sorted once (a block named twice is a run of its own: zeroed twice), then used for
        # the keys and the rows too: the list is converted once. (np.unique hashed 2M ids in 2 s.)
        ids = np.sort(np.asarray(blocks, dtype=np.int64))
        if self.keys is not None:
            for r in self.ranks.values():
                r.quiesce_keys()
        rows = (ids.astype(np.int32)[:, None] * bs + np.arange(bs, dtype=np.int32)).reshape(-1)
        drop = None
        if self._drops_from is not None and self.drop_scan_slots() >= self._drops_from:
            drop = rows  # with the zeros, on the thread that writes them
        else:
            drop_copies(self, rows)
        keys_bytes = 0 if self.keys is None else ids.size * self.keys[0].nbytes
        return ZeroWrite(self, self.keys_runs(ids), rows.size * self.layout.num_layers * self.layout.row_bytes
                         + keys_bytes, drop)

    @contextlib.contextmanager
    def deferring_zeros(self, drops_from: int | None = None) -> Iterator[list]:
        """``with space.deferring_zeros() as zeros:`` the block store's zeros of the blocks
        freed or evicted inside are not written: ``zeros`` holds them (:class:`ZeroWrite`),
        for a worker thread. Only where nothing may use those blocks before they are written
        (a block request, whose reply comes after). ``drops_from``: their hot copies' drop
        goes with them when it scans that many host slots or more (:meth:`drop_scan_slots`;
        only where nothing else touches the engine's ranks until they are written: a request
        holding its engine). When the block raises, what it freed before is zeroed (and
        dropped) at once, as without deferring, and the error goes on."""
        if self._deferred is not None:
            raise RuntimeError("zeros are deferred already")
        zeros = self._deferred = []
        self._drops_from = drops_from
        try:
            yield zeros
        except BaseException:
            write_zeros(zeros)
            raise
        finally:
            self._deferred = self._drops_from = None

    # A keys request in two steps: the checks (the loop's thread), then the copy (any
    # thread: it touches those blocks' keys only, which nobody else may write or free meanwhile).
    def check_keys_write(self, session: int, blocks, keys) -> np.ndarray:
        """The block ids (int64 [n]) whose indexer keys ``keys`` (uint8 [n, layers,
        block_size, index_bytes]) may replace: ``blocks`` distinct and private to
        ``session``, the shape exact; BlockError before anything is written."""
        plane = self._plane(blocks)
        want = (len(blocks), *plane.shape[1:])
        if keys.dtype != np.uint8 or keys.shape != want:
            raise BlockError("BAD_ARGUMENT", f"keys must be uint8 {list(want)} ([blocks, layers, block_size, "
                             f"index_bytes]), got {keys.dtype} {list(keys.shape)}")
        return self.blocks.keys_writable(session, blocks)

    def check_keys_read(self, session: int, blocks) -> np.ndarray:
        """The block ids (int64 [n]) of ``blocks`` if each is pinned by ``session`` or
        private to it and their keys fit one request; BlockError otherwise."""
        self._plane(blocks)
        return self.blocks.keys_readable(session, blocks)

    def check_keys_load(self, session: int, blocks, dst_bytes: int) -> np.ndarray:
        """The block ids (int64 [n]) whose indexer keys a load may copy into ``dst_bytes``
        of the engine's buffer: the same rule as a read (pinned by ``session`` or private to
        it), each named once (the work of a request is then bounded by the store's keys), with
        no per-request size limit but the buffer's; BlockError otherwise."""
        plane = self._plane(blocks[:0])
        ids = np.asarray(blocks)
        if ids.size > 1 and np.unique(ids).size != ids.size:
            raise BlockError("BAD_ARGUMENT", "a keys load names a block more than once: name each block once")
        need = len(blocks) * plane.block_bytes
        if need > dst_bytes:
            raise BlockError("BAD_ARGUMENT", f"the indexer keys of {len(blocks)} blocks take {need} bytes "
                             f"({plane.block_bytes} each); the destination has {dst_bytes}")
        return self.blocks.keys_readable(session, blocks)

    def keys_runs(self, ids: np.ndarray) -> list[tuple[int, int, int]]:
        """``(first block, its index in ids, blocks)`` of each run of consecutive ids: the
        keys of a run are one contiguous span of the plane (block-major), one copy."""
        cut = np.flatnonzero(np.diff(ids) != 1) + 1
        starts, ends = np.r_[0, cut], np.r_[cut, ids.size]
        return [(int(ids[a]), int(a), int(b - a)) for a, b in zip(starts, ends) if b > a]

    def keys_copies(self, ids: np.ndarray, pinned, dst: int) -> list[tuple[int, int, int]]:
        """``(destination, host address, bytes)`` of each copy that loads the indexer keys of
        blocks ``ids`` (checked) to device address ``dst`` (block ``i`` of ``ids`` at ``dst + i
        * block_bytes``): one a run of consecutive ids, cut only where a page-locked chunk of
        ``pinned`` (the engine's registered range, ``PinnedRegion`` or ``PinnedView``) ends."""
        plane = self.keys_plane
        bb = plane.block_bytes
        copies = []
        for first, i, n in self.keys_runs(ids):
            to = dst + i * bb
            for src, k in pinned.host_spans(plane.offset + first * bb, n * bb):
                copies.append((to, src, k))
                to += k
        return copies

    def copy_keys_to(self, ids: np.ndarray, out: np.ndarray) -> int:
        """Copy the indexer keys of blocks ``ids`` (checked) into ``out`` (uint8, block ``i``
        of ``ids`` at ``i * block_bytes``), one copy a run; returns the bytes."""
        bb = self.keys_plane.block_bytes
        flat = self.keys.reshape(self.keys.shape[0], bb)
        for first, i, n in self.keys_runs(ids):
            out[i * bb:(i + n) * bb] = flat[first:first + n].reshape(-1)
        return ids.size * bb

    def copy_keys_in(self, ids: np.ndarray, keys: np.ndarray) -> int:
        """Copy ``keys`` into the indexer keys of blocks ``ids`` (checked); returns the bytes."""
        self.keys[ids] = keys
        return keys.nbytes

    def copy_keys_out(self, ids: np.ndarray) -> np.ndarray:
        """A copy of the indexer keys of blocks ``ids`` (checked): uint8 [n, layers, block_size, index_bytes]."""
        return self.keys[ids]

    def _plane(self, blocks) -> KeysPlane:
        """The keys plane, if the engine has one and ``blocks``' keys fit one request."""
        plane = self.keys_plane
        if plane is None:
            raise BlockError("BAD_ARGUMENT", f"engine {self.name!r} has no indexer keys plane: its first rank "
                             "attaches with index_bytes (Client.attach(..., block_size=n, index_bytes=m))")
        if len(blocks) * plane.block_bytes > LIMITS.max_keys_bytes:
            raise BlockError("TOO_LARGE", f"the indexer keys of {len(blocks)} blocks ({plane.block_bytes} bytes each) "
                             f"exceed {LIMITS.max_keys_bytes} bytes a request: at most "
                             f"{LIMITS.max_keys_bytes // plane.block_bytes} blocks")
        return plane
