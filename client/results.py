"""What a top-k request returns, what an attachment can do, and a cpu rank's attachment:
shared by the zmq client, the cuda attachment and the in-process transport, none of which
imports another."""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from sparsekv.proto import Layout


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


@dataclass
class Attachment:
    """What attach gives a cpu rank: its layout and the hot slab it reads rows from."""

    layout: Layout
    engine: str
    slab: np.ndarray  # uint8 [num_layers, max_reqs, region_stride, row_bytes]
    staging: np.ndarray | None  # uint8 [num_layers, staging_rows, row_bytes]
    _mm: mmap.mmap | None = None
    # An engine-owned slab (client/engine_slab.py): the hot rows live there; ``slab`` is None.
    engine_slab: object = None
    caps = AttachmentCaps()

    def close(self, wait_s: float | None = None) -> None:
        """Unmap the slab. ``wait_s``: as CudaAttachment's (nothing here runs on a device)."""
        self.slab = self.staging = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a caller still holds a view; the OS unmaps at exit
            self._mm = None
