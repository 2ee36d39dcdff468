"""Progress of a long command on stderr: a bar redrawn in place on a terminal; elsewhere
(a pipe, a file, journald) a plain line every ``every_s`` seconds and one at the end."""

from __future__ import annotations

import sys
import time


class Progress:
    """``p = Progress("replay", steps); p.update(done)`` per step; ``p.close()`` at the end."""

    def __init__(self, what: str, total: int, every_s: float = 5.0, stream=None):
        self.what, self.total, self.every_s = what, max(total, 1), every_s
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty()
        self.t0 = self.last = time.monotonic()
        self.done = 0

    def update(self, done: int) -> None:
        self.done = done
        now = time.monotonic()
        if now - self.last >= (0.1 if self.tty else self.every_s):
            self.last = now
            self._write(now)

    def _write(self, now: float) -> None:
        n, total = self.done, self.total
        if self.tty:
            fill = 30 * n // total
            self.stream.write(f"\r{self.what} [{'#' * fill}{'.' * (30 - fill)}] {n}/{total}")
        else:
            self.stream.write(f"{self.what}: {n}/{total} steps ({n * 100 // total} %, {now - self.t0:.0f} s)\n")
        self.stream.flush()

    def close(self) -> None:
        self._write(time.monotonic())
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
