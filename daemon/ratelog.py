"""Log lines that a client can cause, limited per cause.

A peer can make the daemon log once per connection (a connection closed without HELLO, a
session closed without BYE, a connection over its uid's cap): a flood of them must not
flood the journal. Each cause may log ``burst`` lines per ``interval_s``; the rest are
counted, and once the interval is over one summary line says how many were left out (at
the next line of any cause, or at :meth:`flush`, which the connection table's thread calls
every second). Thread-safe: the event loop and the connection table's thread both log.
"""

from __future__ import annotations

import logging
import threading
import time

INTERVAL_S = 10.0  # a cause's window
BURST = 10  # lines of one cause logged per window


class RateLimitedLog:
    """``log(cause, level, msg, *args)``, at most ``burst`` lines a cause per ``interval_s``."""

    def __init__(self, logger: logging.Logger, *, interval_s: float = INTERVAL_S, burst: int = BURST,
                 clock=time.monotonic):
        self.logger, self.interval_s, self.burst, self._clock = logger, interval_s, burst, clock
        self._lock = threading.Lock()
        self._windows: dict[str, list] = {}  # cause -> [window start, lines logged, lines left out]

    def log(self, cause: str, level: int, msg: str, *args) -> None:
        """Log ``msg % args`` at ``level`` unless ``cause`` has had its lines this window."""
        now = self._clock()
        with self._lock:
            summaries = self._due(now)
            w = self._windows.setdefault(cause, [now, 0, 0])
            emit = w[1] < self.burst
            if emit:
                w[1] += 1
            else:
                w[2] += 1
        self._summarise(summaries)
        if emit:
            self.logger.log(level, msg, *args)

    def flush(self) -> None:
        """Write the summary of every window that is over."""
        with self._lock:
            summaries = self._due(self._clock())
        self._summarise(summaries)

    def left_out(self, cause: str) -> int:
        """Lines of ``cause`` left out in its current window (tests)."""
        with self._lock:
            w = self._windows.get(cause)
            return w[2] if w else 0

    def _due(self, now: float) -> list[tuple[str, int, int, float]]:
        """(lock held) The windows that are over, removed: (cause, logged, left out, seconds)."""
        over = [(c, w) for c, w in self._windows.items() if now - w[0] >= self.interval_s]
        for c, _ in over:
            del self._windows[c]
        return [(c, w[1], w[2], now - w[0]) for c, w in over if w[2]]

    def _summarise(self, summaries) -> None:
        for cause, logged, left_out, span_s in summaries:
            self.logger.warning("%d more log lines of cause %r left out in the last %.0f s (%d logged; at most %d "
                                "a cause every %g s)", left_out, cause, span_s, logged, self.burst, self.interval_s)
