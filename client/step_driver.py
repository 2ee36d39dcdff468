"""Who sends a TP rank's steps: one driver while it lives, either the client's raw
``step``/``topk`` calls or one ``HostSwapIn``. A rank of a TP group sends the same steps
and top-k batches as its peers, which match them one for one; a second driver numbers its
steps on its own and leaves an entry the peers never match (a wedged group). So the
second is refused (BAD_ARGUMENT) while the first lives; a closed (or dropped) handle gives
way, and the next handle numbers its steps on from the last one sent."""

from __future__ import annotations

import weakref

from sparsekv.proto import ErrorCode

from .errors import BadRequest


class StepDriver:
    """One client's record: its attachment's ``tp_size``, the driver (weakref) and the
    number after the last step sent."""

    def __init__(self):
        self.reset()

    def reset(self, tp_size: int = 1) -> None:
        """A new attachment (``tp_size`` 1 when none): no driver yet, steps from 0."""
        self.tp_size, self._ref, self.next_step = tp_size, None, 0

    def claim(self, client, driver) -> None:
        """``driver`` (``client`` itself for its raw calls, or a handle) sends a request of
        this rank's steps; BadRequest when another driver of a TP rank still lives."""
        if self.tp_size <= 1:
            return
        cur = self._ref() if self._ref is not None else None
        if cur is not None and cur is not driver and not getattr(cur, "closed", False):
            who = "its raw step() and topk() calls" if cur is client else "a handle"
            raise BadRequest(f"this TP rank's steps are sent by {who}; a rank of a TP group has one step driver "
                             "(client/README.md)", ErrorCode.BAD_ARGUMENT)
        self._ref = weakref.ref(driver)

    def stepped(self, step: int) -> None:
        """Step ``step`` was begun on this rank: a new handle of a TP rank numbers on after it."""
        if self.tp_size > 1:
            self.next_step = step + 1

    def unstep(self, step: int) -> None:
        """Step ``step``'s STEP was refused: a new handle numbers from it again."""
        if self.tp_size > 1 and self.next_step == step + 1:
            self.next_step = step
