"""The per-rank device error record (``csrc/common.cuh``) read on the host, by both sides.

The daemon's kernels count rows they refused or mended in an int32 record, copied to a
pinned mirror after each request (zmq) or step (doorbell). :class:`ErrorRecord` turns new
counts into typed errors: for the daemon's next reply, and for a doorbell handle's
``check()``, which maps the same mirror.
"""

from __future__ import annotations

# Kinds, in the record's order (csrc/common.cuh SKV_E_*).
ERROR_KINDS = ("DUPLICATE_IDS", "CORRUPT_STATE", "BAD_STATE_ROW", "TOO_MANY_TOKENS", "BAD_STEP", "TP_MISMATCH")

# Kind -> (proto.ErrorCode name, what it means for the client).
ERROR_CODES = {
    "DUPLICATE_IDS": ("DUPLICATE_IDS", "names the same host row twice; ids must be unique. That row was refused "
                      "(slots -1, no state change)"),
    "CORRUPT_STATE": ("INTERNAL", "found the residency state corrupt (a daemon bug); its rows may be missing"),
    "BAD_STATE_ROW": ("BAD_STATE_ROW", "has a state row outside [-1, max_reqs); the row was treated as padding"),
    "TOO_MANY_TOKENS": ("BAD_ARGUMENT", "is one token too many for its state row: region_stride / top_k tokens "
                        "of one request fit a step. That row was refused (slots -1, no state change)"),
    "BAD_STEP": ("BAD_ARGUMENT", "had a step descriptor out of range; nothing of it was done"),
    "TP_MISMATCH": ("TP_MISMATCH", "differs from the same row of the TP group's leader rank (its state row, its "
                    "top-k, or the step it belongs to); the row was refused (slots -1): every rank of a TP group "
                    "sends the same steps and top-k batches"),
}


class ErrorRecord:
    """Reads a mirror of the record (int32 array, at least 32 entries) and remembers
    what it already reported."""

    def __init__(self, mirror):
        self.mirror = mirror
        self._reported = [0] * len(ERROR_KINDS)

    def take(self) -> list[tuple[str, str]]:
        """Every kind counted since the last call, as (ErrorCode name, message), first
        kind first; marks them reported."""
        err = self.mirror
        found = []
        for kind, name in enumerate(ERROR_KINDS):
            n = int(err[kind])
            if n != self._reported[kind]:
                new = n - self._reported[kind]
                self._reported[kind] = n
                code, what = ERROR_CODES[name]
                row, step, group = int(err[8 + kind]), int(err[16 + kind]), int(err[24 + kind])
                found.append((code, f"step {step}, group {group}: batch row {row} {what} "
                                    f"({new} such row(s) since the last check)"))
        return found

    def counts(self) -> dict[str, int]:
        """Rows refused or mended, by kind (lower-case names)."""
        return {name.lower(): int(self.mirror[k]) for k, name in enumerate(ERROR_KINDS)}
