"""``TpGroup``: the ranks of one tensor-parallel engine resolving once (DESIGN §5.6).

DeepSeek-V3.2's MLA rows are the same on every TP rank and its ranks send the same top-k,
so an engine attached with ``tp_size`` N > 1 keeps one residency for all N ranks. Every
rank sends its steps and top-k batches as before; the group turns them into one
sequence of **entries** (a step's resets and invalidations; a top-k batch with its
resolve and, with prefetch, the next group's prefetch plan). The first rank to reach a
point of the sequence makes its entry (applies it to the residency, once); every other
rank, at the same point, must send the same request (state rows, top-k, resets,
invalidations: ``TP_MISMATCH`` otherwise, nothing changed, the rank stays where it was)
and gets that entry's answer: the same slots. Each rank moves bytes into its own slab
when it reaches an entry (the entry's plan, in sequence order), so a rank's slab changes
only at its own requests, never while it reads the rows of its last answer; a rank
that lags applies the plans it missed in order and ends with the slab the others had.

The group keeps the entries not every member has reached: at most ``max_lag``, and the
groups of one uid's engines at most ``TpLedger.cap`` bytes of them together; a rank
that would make one more is refused (``TP_LAG``, naming the rank it waits for). Ranks
begin their attach before the group's first entry (an engine's ranks attach, then serve;
the entries its peers make while a rank's attach is under way are kept for it); a rank that
leaves (detach, death) stops counting; when the last leaves the group is dropped with
its residency, and the engine's next ranks form a new one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from .residency.base import Plan, Residency, ResidencyError, Resolved, apply_step, check_batch, prefetch_into_next


class TpLedger:
    """Bytes of the entries kept by the TP groups of each uid's engines, within ``cap``."""

    def __init__(self, cap: int):
        self.cap = cap
        self.held: dict[int | None, int] = {}

    def add(self, uid: int | None, n: int) -> None:
        left = self.held.get(uid, 0) + n
        if left:
            self.held[uid] = left
        else:
            self.held.pop(uid, None)


def entry_bytes(*arrays) -> int:
    """What an entry keeps, bounded before it is made: its arrays, and for a top-k batch
    its result (slots as large as the top-k, a plan at most twice) and with prefetch its
    prefetch plan (at most twice again)."""
    return sum(a.nbytes for a in arrays if a is not None)


@dataclass
class StepEntry:
    """A step's start: its batch's state rows, resets and invalidations (int32 [b, n])."""

    step: int
    state_rows: np.ndarray
    reset: np.ndarray  # bool [batch]
    invalidate: np.ndarray  # int32 [batch, n]


@dataclass
class TopkEntry:
    """One index group's top-k batch, resolved once; with prefetch, the plan that fetches
    its rows ahead into group ``pf_group``'s regions (made right after the resolve, in
    sequence, before any later entry)."""

    step: int
    group: int
    state_rows: np.ndarray
    topk: np.ndarray
    resolved: Resolved
    maker: int  # the rank that made it (its reply counts the hits and misses)
    pf_group: int | None = None
    pf_plan: Plan | None = None


class TpGroup:
    """One residency shared by the ranks ``0..size-1`` of a TP engine."""

    def __init__(self, size: int, *, max_lag: int, prefetch: bool, ledger: TpLedger | None = None,
                 uid: int | None = None):
        self.size = size
        self.ledger = ledger if ledger is not None else TpLedger(1 << 62)
        self.uid = uid  # the engine owner's: whose ledger share the entries take
        self.residency: Residency | None = None  # the first member's, from its join on
        self.max_lag = max_lag
        self.prefetch = prefetch  # every member attached with it, or none
        self.entries: deque = deque()  # (entry, bytes) some member has not reached; entries[0] is number `base`
        self.base = 0
        self.cursor: dict[int, int] = {}  # member rank -> the number of the next entry it reaches
        self.joining: set[int] = set()  # ranks whose attach is under way: the entries are kept for them
        self.made = 0  # entries ever made (none yet: ranks may join)
        self.resolved_at: dict[int, int] = {}  # (prefetch) index group -> step of its latest batch
        self.device = None  # the cuda backend's device side on the doorbell (cuda/tp_doorbell.py)
        self._pf_seen = (0, 0, 0)

    # -- membership ------------------------------------------------------------------
    def reserve(self, rank: int, prefetch: bool) -> None:
        """Rank ``rank``'s attach begins: it must be a free rank of the group, the group must
        not have served yet, and its prefetch choice the group's. ResidencyError otherwise."""
        if not 0 <= rank < self.size:
            raise ResidencyError("BAD_ARGUMENT", f"rank {rank} is not a rank of a TP group of {self.size} "
                                 f"(HELLO's rank must lie in [0, {self.size}))")
        if rank in self.cursor or rank in self.joining:
            raise ResidencyError("BAD_ARGUMENT", f"rank {rank} of this TP group is attached already "
                                 "(each rank of an engine attaches once, with its own rank number)")
        if self.made:
            raise ResidencyError("BAD_ARGUMENT", f"this TP group has served {self.made} requests: its ranks join "
                                 "before the first step (restart every rank of the engine to re-form it)")
        if prefetch != self.prefetch:
            raise ResidencyError("LAYOUT_MISMATCH", "every rank of a TP group attaches with the same prefetch "
                                 f"choice; the group's is {self.prefetch}")
        self.joining.add(rank)

    def unreserve(self, rank: int) -> None:
        self.joining.discard(rank)
        self._trim()

    def join(self, rank: int, state) -> None:
        """The reserved rank's attach is done (``state``: its ``RankState``): it shares the
        group's residency (the first member's) and reaches entries from the first on."""
        if self.residency is None:
            self.residency = state.residency
        state.residency, state.tp = self.residency, self
        self.joining.discard(rank)
        self.cursor[rank] = 0  # its peers may have served meanwhile: it reaches their entries too (kept for it)

    def leave(self, rank: int) -> None:
        """Rank ``rank`` is gone: the entries only it had still to reach go (all of them with
        the last member: the ledger gets their bytes back)."""
        self.cursor.pop(rank, None)
        self.joining.discard(rank)
        self._trim()

    @property
    def members(self) -> int:
        return len(self.cursor) + len(self.joining)

    def _positions(self) -> dict[int, int]:
        """Each rank's next entry: a member's cursor; a joining rank's the first (it reserved
        before any entry was made, and reaches every one once attached)."""
        return {**dict.fromkeys(self.joining, 0), **self.cursor}

    # -- the sequence ----------------------------------------------------------------
    def begin_step(self, rank: int, step: int, state_rows: np.ndarray, reset, invalidate, then=None) -> None:
        """Rank ``rank`` begins ``step`` (arrays checked by ``RankState.check_step``).
        ``then``: ``(group, top-k)`` of the TOPK this STEP rides on, checked first as
        :meth:`topk` will check it (TP_MISMATCH, TP_LAG, its resolve's checks): a TOPK
        refused runs neither half (its client cannot tell which half was refused, and a
        STEP run twice would put the group out of step for good)."""
        reset = np.zeros(state_rows.shape, bool) if reset is None else reset
        invalidate = np.empty((state_rows.shape[0], 0), np.int32) if invalidate is None else invalidate
        entry = self._next(rank)
        more = 0 if then is None else self._topk_bytes(state_rows, then[1])
        if entry is not None:
            self._expect(rank, entry, StepEntry, step, None)
            if not (np.array_equal(entry.state_rows, state_rows) and np.array_equal(entry.reset, reset)
                    and _same_invalidations(entry.invalidate, invalidate)):
                raise self._mismatch(rank, entry, f"step {step}'s state rows, resets or invalidations differ")
            i = self.cursor[rank] + 1 - self.base  # the entry its TOPK reaches
            if then is not None and i < len(self.entries):
                self._check_topk(rank, self.entries[i][0], step, then[0], state_rows, then[1])
            elif then is not None:  # its TOPK will make an entry: that entry's room, its resolve's checks
                self._room(rank, more)
                check_batch(self.residency.layout, then[0], state_rows, then[1])
            self.cursor[rank] += 1
            self._trim()
            return
        nbytes = entry_bytes(state_rows, reset, invalidate)
        self._room(rank, nbytes + more, entries=1 if then is None else 2)
        if then is not None:
            check_batch(self.residency.layout, then[0], state_rows, then[1])
        apply_step(self.residency, state_rows, reset, invalidate)
        self._append(rank, StepEntry(int(step), state_rows.copy(), reset.copy(), invalidate.copy()), nbytes)

    def topk(self, rank: int, step: int, group: int, state_rows: np.ndarray, topk: np.ndarray) -> TopkEntry:
        """Rank ``rank``'s top-k batch: the entry that answers it (made now, resolved once,
        when ``rank`` is the first to reach this point)."""
        entry = self._next(rank)
        if entry is not None:
            self._check_topk(rank, entry, step, group, state_rows, topk)
            self.cursor[rank] += 1
            self._trim()
            return entry
        nbytes = self._topk_bytes(state_rows, topk)
        self._room(rank, nbytes)
        res = self.residency.resolve(group, state_rows, topk)
        entry = TopkEntry(int(step), int(group), state_rows.copy(), topk.copy(), res, rank)
        if self.prefetch and prefetch_into_next(self.resolved_at, step, group, self.residency.layout.num_groups):
            entry.pf_group = group + 1
        self._append(rank, entry, nbytes)
        return entry

    def prefetch_plan(self, entry: TopkEntry) -> Plan:
        """The plan of ``entry``'s prefetch, made once (by :meth:`settle` at the latest)."""
        self.settle()
        return entry.pf_plan

    def settle(self) -> None:
        """Run the prefetch the newest entry leaves, if it has not run: right after that
        entry's reply (the maker's ``run_prefetch``) or, if the maker went before it, before
        anything else changes the residency."""
        if self.entries:
            e = self.entries[-1][0]
            if isinstance(e, TopkEntry) and e.pf_group is not None and e.pf_plan is None:
                e.pf_plan = self.residency.prefetch(e.pf_group, e.state_rows, e.topk)

    def prefetch_outcomes(self) -> dict:
        """The shared residency's prefetch counters since the last call (once for the group)."""
        r = self.residency
        now = (r.prefetched, r.prefetch_hits, r.prefetch_wasted)
        seen, self._pf_seen = self._pf_seen, now
        return {k: a - b for k, a, b in zip(("prefetched", "prefetch_hits", "prefetch_wasted"), now, seen)}

    def lag(self) -> int:
        """Entries the furthest-behind member has still to reach."""
        end = self.base + len(self.entries)
        return end - min(self._positions().values(), default=end)

    # -- internals -------------------------------------------------------------------
    def _next(self, rank: int):
        """The entry ``rank`` reaches next, or None when it is at the end (it makes one)."""
        if rank not in self.cursor:
            raise ResidencyError("BAD_ARGUMENT", f"rank {rank} is not a member of this TP group")
        self.settle()
        i = self.cursor[rank] - self.base
        return self.entries[i][0] if i < len(self.entries) else None

    def _topk_bytes(self, state_rows: np.ndarray, topk: np.ndarray) -> int:
        """What a top-k batch's entry keeps (:func:`entry_bytes`): its arrays; slots, plan and
        misses; and with prefetch the prefetch plan."""
        return entry_bytes(state_rows, topk) + (5 if self.prefetch else 3) * topk.nbytes + state_rows.nbytes

    def _check_topk(self, rank: int, entry, step: int, group: int, state_rows: np.ndarray, topk: np.ndarray) -> None:
        """TP_MISMATCH unless rank ``rank``'s top-k batch is the one ``entry`` answers."""
        self._expect(rank, entry, TopkEntry, step, group)
        if not np.array_equal(entry.state_rows, state_rows):
            raise self._mismatch(rank, entry, "the batch's state rows differ")
        if entry.topk.shape != topk.shape or not np.array_equal(entry.topk, topk):
            raise self._mismatch(rank, entry, _first_difference(entry.topk, topk))

    def _room(self, rank: int, nbytes: int, entries: int = 1) -> None:
        """Refuse (TP_LAG) ``entries`` entries (of ``nbytes`` together) that a peer behind
        would make the group keep past its bounds."""
        behind = [(c, r) for r, c in self._positions().items() if r != rank]
        if not behind:
            return  # nobody to keep it for: it goes at once
        if nbytes > self.ledger.cap:  # kept for the peers whatever they do: never, however often sent
            raise ResidencyError("TOO_LARGE", f"this request's entry would keep {nbytes} bytes for the other ranks of "
                                 f"its TP group, more than tp_max_lag_bytes ({self.ledger.cap}) allows at all: send "
                                 "smaller batches or raise tp_max_lag_bytes")
        end = self.base + len(self.entries)
        c, slow = min(behind)
        if end - c + entries > self.max_lag:
            more = " (this TOPK and the STEP it carries would add 2)" if entries > 1 else ""
            raise ResidencyError("TP_LAG", f"rank {rank} is {end - c} requests ahead of rank {slow} of its TP group"
                                 f"{more}, which keeps at most {self.max_lag} (tp_max_lag); every rank must send the "
                                 f"same steps and top-k batches: rank {slow} has stopped or sends something else")
        held = self.ledger.held.get(self.uid, 0)
        if held + nbytes > self.ledger.cap:  # one budget for every TP engine of the owner: maybe another's rank
            own = sum(b for _, b in self.entries)
            raise ResidencyError("TP_LAG", f"the TP groups of this engine's owner keep {held} bytes for ranks behind "
                                 f"({own} of them this group's) and this request's entry would add {nbytes}, past "
                                 f"tp_max_lag_bytes ({self.ledger.cap}), one budget for all of that uid's TP engines: "
                                 "a rank of one of them has stopped or sends something else (`sparsekv stats`: each "
                                 "engine's tp_lag)")

    def _append(self, rank: int, entry, nbytes: int) -> None:
        self.entries.append((entry, nbytes))
        self.ledger.add(self.uid, nbytes)
        self.made += 1
        self.cursor[rank] += 1
        self._trim()

    def _trim(self) -> None:
        low = min(self._positions().values(), default=self.base + len(self.entries))
        while self.entries and self.base < low:
            if len(self.entries) == 1:
                self.settle()  # only the newest may owe its prefetch: it runs before the entry goes
            self.ledger.add(self.uid, -self.entries.popleft()[1])
            self.base += 1

    def _expect(self, rank: int, entry, kind, step: int, group: int | None) -> None:
        if not isinstance(entry, kind) or entry.step != step or (group is not None and entry.group != group):
            what = (f"the TOPK of step {step}, group {group}" if kind is TopkEntry else f"the STEP of step {step}")
            raise self._mismatch(rank, entry, f"it sent {what}")

    def _mismatch(self, rank: int, entry, why: str) -> ResidencyError:
        where = (f"the TOPK of step {entry.step}, group {entry.group}" if isinstance(entry, TopkEntry)
                 else f"the STEP of step {entry.step}")
        return ResidencyError("TP_MISMATCH", f"rank {rank} of a TP group differs from its peers at {where}: {why}; "
                              "every rank sends the same steps and top-k batches in the same order (nothing was run)")


def _same_invalidations(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two invalidation arrays ([batch, n], -1 padded) name the same rows per batch row."""
    if a.shape[0] != b.shape[0]:
        return False
    return all(np.array_equal(np.sort(x[x >= 0]), np.sort(y[y >= 0])) for x, y in zip(a, b))


def _first_difference(want: np.ndarray, got: np.ndarray) -> str:
    if want.shape != got.shape:
        return f"its top-k is {list(got.shape)}, the peers' {list(want.shape)}"
    row = int(np.flatnonzero((want != got).any(axis=1))[0])
    return f"top-k row {row} differs"


# -- the doorbell's group on the device (csrc/tp.cu): what each kernel must compute ----------
def step_matches(lead: tuple, foll: tuple) -> bool:
    """Whether a follower's STEP (``(step, state_rows, reset, invalidate)``, invalidate
    [batch, n]) is the leader's: ``skv_tp_check_step``'s rule."""
    (ls, lr, lx, li), (fs, fr, fx, fi) = lead, foll
    return (ls == fs and lr.shape == fr.shape and li.shape == fi.shape and np.array_equal(lr, fr)
            and np.array_equal(np.asarray(lx, bool), np.asarray(fx, bool)) and np.array_equal(li, fi))


def follow_rows(lead: tuple, foll: tuple, slots: np.ndarray, misses: np.ndarray, step_ok: bool = True):
    """A follower's answer to its TOPK (``(step, group, state_rows, topk)``) from the
    leader's (``slots`` [batch, k], ``misses`` [batch]): ``skv_tp_follow``'s rule. Row b of
    the follower is the leader's row b when the steps, groups and shapes agree, ``step_ok``,
    and its state row and ids are the leader's; else slots -1 and 0 misses (refused).
    Returns ``(slots, misses, refused)`` for the follower's batch, ``refused`` bool [batch]."""
    (ls, lg, lr, lt), (fs, fg, fr, ft) = lead, foll
    batch = fr.shape[0]
    same = step_ok and ls == fs and lg == fg and lt.shape == ft.shape
    ok = np.zeros(batch, bool)
    if same:
        ok = (lr == fr) & (lt == ft).all(axis=1)
    out = np.full((batch, slots.shape[1]), -1, np.int32)
    out[ok] = slots[:batch][ok]
    return out, np.where(ok, misses[:batch], 0).astype(np.int32), ~ok
