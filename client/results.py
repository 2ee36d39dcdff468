"""What a top-k request returns and what an attachment can do: shared by the zmq client,
the cuda attachment and the in-process transport, none of which imports another."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TopkResult:
    """Where a top-k batch's rows are. cpu: NumPy arrays, and ``hits`` / ``out_of_range``
    from the reply. cuda: torch int32 views of the result ring (valid until ``ring_depth``
    more requests; the current stream already waits for them), counts left to stats."""

    slots: object  # int32 [batch, k]: hot slot of each column in its state row's region, -1 if none
    misses: object  # int32 [batch]
    hits: int | None
    out_of_range: int | None

    def host(self) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, misses)`` as NumPy (cuda: waits for the current stream)."""
        if isinstance(self.slots, np.ndarray):
            return self.slots, self.misses
        import torch  # noqa: PLC0415

        if self.slots.is_cuda:
            torch.cuda.current_stream(self.slots.device).synchronize()
        return self.slots.cpu().numpy(), self.misses.cpu().numpy()


@dataclass(frozen=True)
class AttachmentCaps:
    """What an attachment can do, fixed when it is made: the client and the handles read
    this instead of probing the object."""

    device: bool = False  # a cuda rank (CudaAttachment): results are views of its GPU result ring
    fenced: bool = False  # it records fence events the daemon's stream waits on
    step_blocks: bool = False  # pinned step blocks shared with the daemon take the TOPK batches
    done_words: bool = False  # a done word per ring entry: device wait is possible
