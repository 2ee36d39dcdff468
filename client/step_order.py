"""The order of a device-driven decode step, kept on the host: what the engine may call next.

The daemon's stream runs a step as: begin; then, index group by index group in order,
wait for the group's bell, resolve, gather each of its layers and set the layer's ready
word. The engine's stream must follow the same order or one of them waits for ever:

* a group's leader layer rings its bell, so groups are rung in order (ringing group 1
  while the daemon waits for group 0 deadlocks both streams);
* every layer's ready word is consumed once per step by its ``swap_in``: a second one
  waits for ever, and a missing one leaves the word set, so the next step's ``swap_in``
  of that layer would pass before the daemon gathered;
* so a step must be complete before the next ``begin_step`` (``finish_step`` completes
  an interrupted one).

:class:`StepOrder` checks these rules before anything is launched (BadRequest; the
streams are left as they were). It tracks what was *enqueued*: a CUDA graph captured
from a complete step replays a complete step.
"""

from __future__ import annotations

from sparsekv.proto import ErrorCode

from .errors import BadRequest, NotAttached


class StepOrder:
    """Args: ``groups``: the layout's index groups (lists of layers; the first leads)."""

    def __init__(self, groups):
        self.groups = [list(g) for g in groups]
        self.group_of = {layer: g for g, layers in enumerate(self.groups) for layer in layers}
        self.num_layers = len(self.group_of)
        self.step = 0  # begin_step calls so far (messages number steps from 0)
        self.rung = -1  # the last group rung in this step
        self.consumed: set[int] = set()  # layers whose ready word this step consumed
        self.closed = False

    # -- checks (raise before anything is enqueued) ------------------------------------
    def check_begin(self) -> None:
        self._check_open()
        if self.step and not self.complete:
            raise BadRequest(f"step {self.step - 1} is not complete ({self.describe_pending()}): a new begin_step "
                             "would release those layers one step early. Call swap_in for them, or "
                             "finish_step() to end the step", ErrorCode.BAD_ARGUMENT)

    def check_layer(self, layer: int) -> bool:
        """Whether ``layer``'s swap_in rings its group (it is the leader); raise if the
        call is out of order."""
        self._check_open()
        g = self.group_of.get(layer)
        if g is None:
            raise BadRequest(f"layer {layer} out of range [0, {self.num_layers})", ErrorCode.BAD_ARGUMENT)
        if not self.step:
            raise BadRequest("call begin_step before swap_in", ErrorCode.BAD_ARGUMENT)
        if layer in self.consumed:
            raise BadRequest(f"swap_in for layer {layer} twice in step {self.step - 1}: its rows are made ready once "
                             "per step", ErrorCode.BAD_ARGUMENT)
        leader = self.groups[g][0] == layer
        if leader:
            if g != self.rung + 1:
                want = self.groups[self.rung + 1][0]
                raise BadRequest(f"index groups go in order: layer {layer} leads group {g}, but group "
                                 f"{self.rung + 1} (leader layer {want}) has not been called in step "
                                 f"{self.step - 1}", ErrorCode.BAD_ARGUMENT)
        elif g > self.rung:
            lead = self.groups[g][0]
            raise BadRequest(f"layer {layer} follows layer {lead} in index group {g}, whose swap_in has not run in "
                             f"step {self.step - 1}: call swap_in for layer {lead} first", ErrorCode.BAD_ARGUMENT)
        return leader

    # -- what was enqueued ---------------------------------------------------------------
    def began(self) -> None:
        self.step += 1
        self.rung = -1
        self.consumed = set()

    def rang(self, group: int) -> None:
        self.rung = group

    def ready(self, layer: int) -> None:
        self.consumed.add(layer)

    # -- state -------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return self.rung == len(self.groups) - 1 and len(self.consumed) == self.num_layers

    def pending(self) -> tuple[list[int], list[int]]:
        """(groups not rung, layers not consumed) of the current step, in order."""
        if not self.step:
            return [], []
        groups = list(range(self.rung + 1, len(self.groups)))
        layers = [layer for ls in self.groups for layer in ls if layer not in self.consumed]
        return groups, layers

    def describe_pending(self) -> str:
        groups, layers = self.pending()
        parts = []
        if groups:
            parts.append(f"groups {groups} not rung")
        if layers:
            parts.append(f"layers {_span(layers)} without swap_in")
        return ", ".join(parts) or "complete"

    def close(self) -> None:
        self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise NotAttached("this handle is closed (its rank detached or its client closed)")


def _span(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    out, start, prev = [], None, None
    for x in layers:
        if start is None:
            start = prev = x
        elif x == prev + 1:
            prev = x
        else:
            out.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = prev = x
    if start is not None:
        out.append(f"{start}-{prev}" if prev > start else f"{start}")
    return ", ".join(out)
