"""What one engine owns inside the daemon: its pool range and, per rank, a hot slab with
its residency state. Used by the daemon's server and by the in-process transport alike.

Ordering rules kept here:
* a step's resets and invalidations apply before any top-k batch of that step;
* a write lands in the pool before the hot copies of its rows are dropped, in every rank:
  the next resolve that names the row misses and reads the new bytes.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from sparsekv.proto.blocks import KeysPlane
from sparsekv.proto.args import layers_in, repeated, reset_flags
from sparsekv.proto.layout import Layout

from .engine_blocks import EngineBlocks
from .residency.base import (Mover, Residency, ResidencyError, Resolved, apply_step, as_ids, check_batch,
                             prefetch_into_next, whole_arg)
from .residency.cpu import CpuMover
from .tp import TpGroup


class EngineSlabImport:
    """An engine-owned hot slab on its way to a backend: its checked geometry and its memory
    (cpu: a deposited memfd, owned from :meth:`take_fd` on; cuda: an IPC handle)."""

    def __init__(self, geometry, fd: int = -1, ipc: tuple[bytes, int] | None = None):
        self.geometry = geometry
        self._fd = fd
        self.ipc = ipc  # cuda: (IPC handle of the engine's allocation, byte offset in it)

    def take_fd(self) -> int:
        fd, self._fd = self._fd, -1
        if fd < 0:
            raise ResidencyError("BAD_ARGUMENT", "this engine slab brings no descriptor (a cpu rank needs one)")
        return fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass
class RankState:
    """One rank's attachment: its hot slab, its residency and the current step."""

    rank: int
    device: str
    residency: Residency
    mover: Mover
    slab: np.ndarray | object
    staging: np.ndarray | object | None
    step: int = -1
    state_rows: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    prefetch: bool = False  # after each group's top-k, fetch its rows ahead into the next group's regions
    pending_prefetch: tuple | None = None  # (group, state rows, top-k) to prefetch once the reply is out
    resolved_at: dict = field(default_factory=dict)  # (prefetch) index group -> the step of its latest top-k
    _prefetch_seen: tuple[int, int, int] = (0, 0, 0)  # the residency's (prefetched, hits, wasted) last reported
    tp: TpGroup | None = None  # the engine's TP group (daemon/tp.py): its residency is this rank's, shared
    # A TP rank's lone STEP (not riding on its TOPK), as the group took it: its arrays, and
    # whether a top-k of that step came since; or the error that refused it (its step's
    # top-k batches are refused too, until the STEP comes again: all or nothing of a step).
    _tp_step: tuple | None = None
    _tp_step_refused: tuple | None = None  # (step, code, message)

    def begin_step(self, step: int, state_rows, reset=None, invalidate=None, then=None) -> None:
        """Record the batch of a decode step; apply its resets and invalidations. ``then``:
        ``(group, top-k)`` of the TOPK the step rides on, checked first (its resolve's
        checks; a TP group's too): a TOPK refused runs neither half."""
        step = whole_arg("step", step)
        state_rows, reset, invalidate = self.check_step(state_rows, reset, invalidate)
        then = None if then is None else (whole_arg("group", then[0]), as_ids("topk", then[1], 2))
        if self.tp is not None:
            # The same STEP again, alone or under the TOPK it rides on (its top-k was refused
            # and the client retries): the group holds it; the TOPK goes on alone.
            held = self._tp_step is not None and self._tp_step[0] == int(step) \
                and _same_step(self._tp_step[1:], (state_rows, reset, invalidate))
            if not held:
                try:
                    self.tp.begin_step(self.rank, int(step), state_rows, reset, invalidate, then)
                except ResidencyError as e:
                    if then is None:
                        self._tp_step_refused = (int(step), e.code, str(e))
                    raise
                self._tp_step_refused = None
                self._tp_step = (int(step), state_rows, reset, invalidate) if then is None else None
        else:
            if then is not None:
                check_batch(self.residency.layout, then[0], state_rows, then[1])
            apply_step(self.residency, state_rows, reset, invalidate)
        self.step = int(step)
        self.state_rows = state_rows

    def check_step(self, state_rows, reset, invalidate):
        """Validate a step's arrays (nothing changes on error); return them normalised."""
        lay = self.residency.layout
        state_rows = as_ids("state_rows", state_rows, 1)
        if state_rows.shape[0] > lay.max_batch:  # as the daemon's message check, before anything changes
            raise ResidencyError("TOO_LARGE", f"batch of {state_rows.shape[0]} rows exceeds max_batch {lay.max_batch}")
        if state_rows.size > 0 and ((state_rows < -1) | (state_rows >= lay.max_reqs)).any():
            bad = state_rows[(state_rows < -1) | (state_rows >= lay.max_reqs)][0]
            raise ResidencyError("BAD_STATE_ROW", f"state row {int(bad)} out of range [-1, {lay.max_reqs})")
        reset = self.check_reset(state_rows, reset)
        if invalidate is not None:
            invalidate = as_ids("invalidate", invalidate, 2)
            if invalidate.shape[0] != state_rows.shape[0]:
                raise ResidencyError("BAD_ARGUMENT", f"invalidate must be [batch, n] with batch {state_rows.shape[0]}, "
                                     f"got {invalidate.shape}")
            bad = (invalidate < -1) | (invalidate >= lay.host_rows)
            if bad.any():
                raise ResidencyError("BAD_ARGUMENT", f"invalidate holds {int(invalidate[bad][0])}: a host row in "
                                     f"[0, {lay.host_rows}), or -1 for none")
        return state_rows, reset, invalidate

    @staticmethod
    def check_reset(state_rows: np.ndarray, reset):
        """A step's ``reset`` as bool ``[batch]`` (None stays None): bools, or integers 0 and
        1 only (BAD_ARGUMENT: a cast would wrap 2**32 to 0 and turn NaN into a reset)."""
        if reset is None:
            return None
        try:
            r = reset_flags(reset)
        except ValueError as e:
            raise ResidencyError("BAD_ARGUMENT", str(e)) from None
        if r.shape != state_rows.shape:
            raise ResidencyError("BAD_ARGUMENT", f"reset must be [batch]={state_rows.shape}, got {r.shape}")
        return r

    def batch_rows(self, step: int, state_rows) -> np.ndarray:
        """The state rows of a top-k batch: given with it, or those of its STEP."""
        if state_rows is not None:
            return as_ids("state_rows", state_rows, 1)
        if step != self.step:
            raise ResidencyError("BAD_ARGUMENT",
                                 f"top-k for step {step} but the last STEP was {self.step}; send STEP first")
        if self.state_rows is None:
            raise ResidencyError("BAD_ARGUMENT",
                                 f"step {step} began in a client-written block; send state_rows with this top-k")
        return self.state_rows

    def topk(self, step: int, group: int, topk, state_rows=None) -> tuple[Resolved, int]:
        """Resolve one index group's top-k batch and gather its misses for every layer of
        the group; return the result and the bytes moved. With ``prefetch``, leave the
        next group's prefetch pending (:meth:`run_prefetch`), unless that group's top-k of
        this step came already: its slots the engine was told about must stay, and a
        prefetch keeps only its latest top-k row's."""
        step, group = whole_arg("step", step), whole_arg("group", group)  # a 0-d array indexes a copy of the state
        res, moved, _ = self.resolve_and_gather(step, group, topk, state_rows)
        return res, moved

    def resolve_and_gather(self, step: int, group: int, topk, state_rows=None) -> tuple[Resolved, int, bool]:
        """:meth:`topk`, and whether this rank's resolve made the result (False: a TP peer's
        resolve did, this rank only gathered its plan)."""
        state_rows = self.batch_rows(step, state_rows)
        topk = as_ids("topk", topk, 2)
        lay = self.residency.layout
        if self.tp is not None:
            refused = self._tp_step_refused
            if refused is not None and refused[0] == int(step):
                raise ResidencyError(refused[1], f"step {step}'s STEP was refused ({refused[2]}); its top-k batches "
                                     "wait for it: send the step again")
            entry = self.tp.topk(self.rank, int(step), int(group), state_rows, topk)
            self._tp_step = None  # a top-k of the step came: the same STEP again is a new one
            moved = self.mover.gather(entry.resolved.plan, lay.groups[group])
            if entry.pf_group is not None:
                self.pending_prefetch = entry  # its plan gathered by run_prefetch once the result is out
            return entry.resolved, moved, entry.maker == self.rank
        res = self.residency.resolve(group, state_rows, topk)
        moved = self.mover.gather(res.plan, lay.groups[group])
        if self.prefetch_next(step, group):
            self.pending_prefetch = (group + 1, state_rows, topk)  # run by the caller once its result is out
        return res, moved, True

    def prefetch_next(self, step: int, group: int) -> bool:
        """Record group ``group``'s top-k batch of ``step``; whether (with ``prefetch``) its
        rows go ahead into group + 1's regions: not past the last group, and not into a
        group that had a batch of this step already."""
        return self.prefetch and prefetch_into_next(self.resolved_at, step, group, self.residency.layout.num_groups)

    def serve_topk(self, step: int, group: int, topk, state_rows=None, fence=None) -> tuple[dict, dict, dict]:
        """The daemon's TOPK: (reply fields, reply arrays, counter deltas). The rows are in
        the slab when this returns (cpu); the cuda rank overrides it to only enqueue."""
        res, moved, made = self.resolve_and_gather(step, group, topk, state_rows)
        misses = int(res.misses.sum())
        layers = len(self.residency.layout.groups[group])
        deltas = {"topk_batches": 1, "rows_moved": misses * layers, "bytes_moved": moved,
                  **self.prefetch_outcomes()}
        if made:  # a TP group's batch counts its hits once, at its resolve
            deltas.update(hits=res.hits, misses=misses, out_of_range=res.out_of_range)
        else:
            deltas["tp_followed"] = 1
        return {"hits": res.hits, "out_of_range": res.out_of_range}, {"slots": res.slots, "misses": res.misses}, deltas

    def run_prefetch(self) -> dict:
        """The pending prefetch (set by the last :meth:`serve_topk`; run once its reply is
        out, before anything else reaches this rank): the counter deltas."""
        pending, self.pending_prefetch = self.pending_prefetch, None
        if self.tp is not None:  # the group's entry: its plan made once, gathered into every rank's slab
            group, plan = pending.pf_group, self.tp.prefetch_plan(pending)
        else:
            group, state_rows, topk = pending
            plan = self.residency.prefetch(group, state_rows, topk)
        layers = self.residency.layout.groups[group]
        moved = self.mover.gather(plan, layers)
        return {"rows_moved": len(plan) * len(layers), "bytes_moved": moved, **self.prefetch_outcomes()}

    def prefetch_outcomes(self) -> dict:
        """Rows prefetched, and prefetched rows hit and wasted, since the last call
        (counter deltas)."""
        if self.tp is not None:
            return self.tp.prefetch_outcomes()
        r = self.residency
        now = (r.prefetched, r.prefetch_hits, r.prefetch_wasted)
        seen, self._prefetch_seen = self._prefetch_seen, now
        return {k: a - b for k, a, b in zip(("prefetched", "prefetch_hits", "prefetch_wasted"), now, seen)}

    def write_staged(self, space: "EngineSpace", layers: tuple[int, ...], rows: np.ndarray, fence=None) -> tuple[int, int]:
        """Write the first ``len(rows)`` rows of this rank's staging buffer (each of
        ``layers``) into host ``rows``, checked (:meth:`EngineSpace.check_staged`)."""
        space.quiesce()
        space.copy_rows(layers, rows, self.staged_rows(layers, rows.shape[0]))
        return len(layers) * rows.shape[0] * space.layout.row_bytes, space.drop_rewritten(rows)

    def staged_rows(self, layers: tuple[int, ...], n: int) -> list[np.ndarray]:
        """The first ``n`` rows of the staging buffer of each of ``layers`` (host views)."""
        return [self.staging[layer, :n] for layer in layers]

    @property
    def host_memory(self) -> bool:
        """Whether this rank's slab and staging buffer are host memory (the cpu mover): its
        copies, and the unmapping of its memory, may then run on a worker thread."""
        return isinstance(self.mover, CpuMover)

    def drop_rewritten(self, rows: np.ndarray) -> int:
        """Empty every slot of this rank holding one of ``rows``; return how many (a TP
        group's shared residency: once, by whichever member comes first)."""
        if self.tp is not None:
            self.tp.settle()  # a prefetch still owed comes first, as it would for a rank of its own
        return self.residency.invalidate_everywhere(rows)

    def stage(self, rows, layers=None) -> int:
        """Copy host ``rows`` of ``layers`` (all when None) to the front of the staging
        buffer; return the bytes once they are there."""
        lay = self.residency.layout
        return self.mover.stage(host_rows_arg(lay, rows, "stage"), check_layers(lay, layers))

    def serve_topk_block(self, step: int, group: int, entry: int, begin: bool, fence=None,
                         done: int | None = None) -> tuple[dict, dict | None, dict]:
        """A TOPK (with ``begin``: and its STEP) whose step blocks the client wrote into its
        pinned block ``entry`` (cuda); the cpu rank has none."""
        raise ResidencyError("BAD_ARGUMENT", "this rank has no client-written step blocks (cuda only)")

    def release_topk_block(self, entry: int, done: int, fence: int | None = None) -> None:
        """A device-wait TOPK on ``entry`` failed: release its client's stream (cuda); the
        cpu rank has no done words."""

    def check_fence(self, fence) -> None:
        """Raise if ``fence`` names no event the client exported (cuda); cpu: nothing."""

    def take_error(self) -> "ResidencyError | None":
        """An error this rank found after the fact (on the GPU), returned once; None when there
        is none. The daemon answers the next request on the rank with it, not running it."""
        return None

    def quiesce(self) -> None:
        """Wait until no copy of this rank is in flight (before the pool is rewritten)."""

    def quiesce_keys(self) -> None:
        """Wait until no keys load of this rank is in flight (before keys are zeroed)."""

    def close(self) -> None:
        """Free what the rank holds beyond its slab (device buffers, events)."""


@dataclass(frozen=True)
class Owner:
    """Who created an engine: the uid and gid the kernel reported for its first rank's
    connection (``SO_PEERCRED``; see ``EngineRegistry.begin_attach``)."""

    uid: int
    gid: int


class EngineSpace(EngineBlocks):
    """One engine's share of the daemon: layout, pool range, and its ranks' states.

    ``owner``: the creator's credentials (None: the in-process transport's engine)."""

    def __init__(self, name: str, layout: Layout, pool: np.ndarray, pool_offset: int = 0,
                 owner: Owner | None = None):
        self.name = name
        self.layout = layout
        self.pool = pool  # uint8 [num_layers, host_rows, row_bytes]
        self.pool_offset = pool_offset
        self.owner = owner
        self.ranks: dict[int, RankState] = {}  # by client id
        # The engine's block store (DESIGN §9), when its first rank attached with a block
        # size: block b is host rows [b * block_size, (b + 1) * block_size) of every layer.
        self.blocks = None
        self.block_size = 0
        # Its indexer keys plane, when attached with index bytes too: uint8 [blocks, layers,
        # block_size, index_bytes] at ``keys_plane.offset`` in its range (proto/blocks.py).
        self.keys_plane: KeysPlane | None = None
        self.keys: np.ndarray | None = None
        self.idle_since: float | None = None  # monotonic time since it is kept with no rank
        self.tp: TpGroup | None = None  # its TP group, when its ranks attached with tp_size > 1

    @property
    def range_bytes(self) -> int:
        """Bytes of its pool range: the rows, then the indexer keys plane if it has one."""
        return self.layout.pool_bytes if self.keys_plane is None else self.keys_plane.end

    def write(self, layers, rows, data, checked: bool = False) -> tuple[int, int]:
        """Copy ``data`` [len(layers), n, row_bytes] into host ``rows`` of ``layers`` and drop
        every hot copy of those rows in every rank (``checked``: by :meth:`check_write`
        already). Returns (bytes written, slots dropped)."""
        if not checked:
            layers, rows, data = self.check_write(layers, rows, data)
        self.quiesce()
        self.copy_rows(layers, rows, data)
        return data.nbytes, self.drop_rewritten(rows)

    # The daemon runs a write in steps: check_write, quiesce, copy_rows (any thread), drop_rewritten.
    def check_write(self, layers, rows, data) -> tuple[tuple[int, ...], np.ndarray, np.ndarray]:
        """A write's arguments checked (BAD_ARGUMENT, nothing changed) and normalised."""
        lay = self.layout
        layers = check_layers(lay, layers)
        rows = host_rows_arg(lay, rows, "write", distinct=True)
        want = (len(layers), rows.shape[0], lay.row_bytes)
        try:
            data = np.asarray(data)
        except (TypeError, ValueError, OverflowError) as e:  # (a ragged list, in process)
            raise ResidencyError("BAD_ARGUMENT", f"data must be uint8 {list(want)}: {e}") from None
        if data.dtype != np.uint8 or data.shape != want:
            raise ResidencyError("BAD_ARGUMENT", f"write data must be uint8 {list(want)}, got {data.dtype} {list(data.shape)}")
        return layers, rows, data

    def quiesce(self) -> None:
        """Wait until no copy of any rank is in flight: no gather may read a row while it
        is being rewritten."""
        for r in self.ranks.values():
            r.quiesce()

    def copy_rows(self, layers, rows: np.ndarray, src) -> None:
        """Copy ``src[i]`` (uint8 [len(rows), row_bytes]) into host ``rows`` of
        ``layers[i]``: a write's bulk, which any thread may run (it touches these rows only)."""
        for layer, part in zip(layers, src):
            self.pool[layer, rows] = part

    def drop_rewritten(self, rows: np.ndarray) -> int:
        """Empty every slot of every rank holding one of ``rows``; return how many. A TP
        group's ranks share one residency: it is scanned once. Any thread, when
        :meth:`drop_scan_slots` is not 0 and the engine is held (its ranks as they were
        when the call began)."""
        done, n = set(), 0
        for r in list(self.ranks.values()):
            if id(r.residency) not in done:
                done.add(id(r.residency))
                n += r.drop_rewritten(rows)
        return n

    def drop_scan_slots(self) -> int:
        """Region slots :meth:`drop_rewritten` scans in host memory: every rank's state; 0
        where it must stay on the loop's thread (a cuda rank: a kernel on its stream; a TP
        group's state: shared beyond the engine)."""
        if self.tp is not None or not all(r.host_memory for r in self.ranks.values()):
            return 0
        lay = self.layout
        return len(self.ranks) * lay.num_groups * lay.max_reqs * lay.region_stride

    def check_staged(self, rank: RankState, layers, rows) -> tuple[tuple[int, ...], np.ndarray]:
        """A staged write's arguments checked (nothing changed) and normalised: its size
        first (a rows array no staging buffer holds is refused before it is read)."""
        lay = self.layout
        layers = check_layers(lay, layers)
        if rank.staging is None:
            raise ResidencyError("BAD_ARGUMENT", "layout has no staging buffer (staging_rows = 0) to write from")
        rows = as_ids("rows", rows, 1)
        if rows.shape[0] > lay.staging_rows:
            raise ResidencyError("TOO_LARGE", f"{rows.shape[0]} rows exceed the staging buffer of {lay.staging_rows}")
        return layers, host_rows_arg(lay, rows, "write", distinct=True)

    def read(self, layers, rows) -> np.ndarray:
        layers = check_layers(self.layout, layers)
        rows = as_ids("rows", rows, 1)
        return self.pool[np.asarray(layers)[:, None], rows[None, :]]


def host_rows_arg(layout: Layout, rows, what: str, distinct: bool = False) -> np.ndarray:
    """``rows`` as int32 [n], each a host row in [0, host_rows), or BAD_ARGUMENT; with
    ``distinct`` (a write's) each named once (two copies into one row: which lands, or a row torn between them on the
    GPU's parallel copies, would be nobody's choice)."""
    rows = as_ids("rows", rows, 1)
    if rows.size and (rows.min() < 0 or rows.max() >= layout.host_rows):
        raise ResidencyError("BAD_ARGUMENT", f"{what} rows must lie in [0, {layout.host_rows})")
    if distinct and (twice := repeated(rows)) is not None:
        raise ResidencyError("BAD_ARGUMENT", f"a {what} names host row {twice} more than once: name each row once")
    return rows


def check_layers(layout: Layout, layers) -> tuple[int, ...]:
    """A request's ``layers``: None (every layer), or distinct integer layer numbers of
    ``layout`` (a float, bool or text is no layer number; a layer named twice would be
    copied twice, and a list of them could multiply a request's work)."""
    if layers is None:
        return tuple(range(layout.num_layers))
    try:
        return layers_in(layers, layout.num_layers)
    except ValueError as e:
        raise ResidencyError("BAD_ARGUMENT", str(e)) from None


class Backend(abc.ABC):
    """Where ranks' slabs live and which residency and mover a rank gets: one per daemon.
    The registry calls ``prepare_rank`` and ``new_rank`` on a worker thread (``new_rank``
    on the loop's with ``new_rank_on_loop``); the rest runs on the loop's thread."""

    name: str  # "cpu" or "cuda"
    devices: list[str]
    new_rank_on_loop = False
    # Whether a rank's slab, staging and residency state are host memory (counted in the
    # per-uid share, ``max_slab_share_per_uid``); cuda: they live in the device arena,
    # whose size is fixed at start.
    rank_memory_on_host = True

    @abc.abstractmethod
    def describe(self) -> dict:
        """What HELLO's reply and STATS say of the backend (``backend``, ``devices``, ...)."""

    def prepare_rank(self, space: EngineSpace, client_id: int, rank: int, device: str, fence_events=None,
                     **kw) -> None:
        """``new_rank``'s checks and slow part, run before it (cuda: pinning the pool)."""

    @abc.abstractmethod
    def new_rank(self, space: EngineSpace, client_id: int, rank: int, device: str, fence_events=None,
                 **kw) -> tuple[RankState, dict]:
        """A rank's state and the handles its client opens (``transport``, ``engine_slab``,
        ``prefetch`` in ``kw`` when the ATTACH names them)."""

    @abc.abstractmethod
    def share_fds(self, client_id: int) -> dict[str, int]:
        """The descriptors the client of rank ``client_id`` maps, by the names its handles
        give them (still owned by the backend)."""

    @abc.abstractmethod
    def release_rank(self, client_id: int) -> None:
        """Free what rank ``client_id`` holds (after its work is done)."""

    @abc.abstractmethod
    def release_engine(self, space: EngineSpace, give_back: Callable[[], None]) -> None:
        """The engine's last rank left: free what the backend holds for it, then call
        ``give_back`` (the pool range goes back to the pool), at once or, where a free has
        to wait (cuda: ``cuda/deferred.py``), once it has run."""

    @abc.abstractmethod
    def failure(self) -> str | None:
        """Why the backend cannot serve anyone any more (the server then exits 70), or None."""

    @abc.abstractmethod
    def device_counters(self) -> dict:
        """Counters kept on devices, summed over every rank ever attached."""

    def device_errors(self) -> dict | None:
        """Rows the kernels refused or mended, by kind (None: no device checks input)."""
        return None

    def arenas(self) -> dict | None:
        """Each device's arena: ``bytes`` and ``used_bytes`` (None: no device memory)."""
        return None

    def may_free_pinned(self) -> bool:
        """Whether the host pool's page-locking may be undone at stop (cuda: not while a
        device stream that did not drain may still wait)."""
        return True

    @abc.abstractmethod
    def close(self) -> None:
        """Release every rank and everything the backend holds."""


def _same_step(a: tuple, b: tuple) -> bool:
    """Whether two steps' (state rows, reset, invalidate) are the same (None: none)."""
    return all((x is None and y is None) or (x is not None and y is not None and np.array_equal(x, y))
               for x, y in zip(a, b))
