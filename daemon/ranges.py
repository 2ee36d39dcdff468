"""First-fit allocation of aligned byte ranges: engine ranges in the host pool, rank
buffers in a GPU's device arena."""

from __future__ import annotations

import threading
from collections.abc import Iterable


class RangeFull(RuntimeError):
    """No free range is large enough; callers turn this into their own message."""


class RangeAllocator:
    def __init__(self, size_bytes: int, align_bytes: int):
        self.size_bytes = int(size_bytes)
        self.align_bytes = int(align_bytes)
        self._free: list[tuple[int, int]] = [(0, self.size_bytes)]  # (offset, length), sorted
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()

    def rounded(self, nbytes: int) -> int:
        return max(self.align_bytes, -(-int(nbytes) // self.align_bytes) * self.align_bytes)

    def allocate(self, nbytes: int) -> int:
        """Reserve ``nbytes`` rounded up to the alignment; return the offset."""
        need = self.rounded(nbytes)
        with self._lock:
            for i, (off, length) in enumerate(self._free):
                if length >= need:
                    self._free[i : i + 1] = [] if length == need else [(off + need, length - need)]
                    self._used[off] = need
                    return off
        raise RangeFull(f"no free range of {need} bytes")

    def fits(self, nbytes: int) -> bool:
        """Whether ``allocate(nbytes)`` would find a free range now."""
        need = self.rounded(nbytes)
        with self._lock:
            return any(length >= need for _, length in self._free)

    def fits_with(self, nbytes: int, held: Iterable[int] = ()) -> bool:
        """Whether ``allocate(nbytes)`` would find a free range once the ranges at the
        offsets ``held`` (each of them allocated now) were released too."""
        need = self.rounded(nbytes)
        with self._lock:
            spans = sorted(self._free + [(off, self._used[off]) for off in set(held)])
        run_at, run = None, 0
        for off, n in spans:
            if run_at is not None and run_at + run == off:
                run += n
            else:
                run_at, run = off, n
            if run >= need:
                return True
        return False

    def release(self, offset: int) -> None:
        """Give back the range at ``offset``, merging it with free neighbours."""
        with self._lock:
            length = self._used.pop(offset)
            merged: list[tuple[int, int]] = []
            for off, n in sorted(self._free + [(offset, length)]):
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((off, n))
            self._free = merged

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    @property
    def free_bytes(self) -> int:
        return self.size_bytes - self.used_bytes
