"""A control connection's replies not yet written (daemon/control_socket.py).

What a peer does not read is queued, up to ``MAX_OUT_BYTES`` a connection and
``MAX_OUT_TOTAL`` over all of them (small pieces coalesced, so the count is the memory);
past either, :class:`NotReading` says the connection is to be closed. Used from the
loop's thread only.
"""

from __future__ import annotations

import collections
import itertools

MAX_OUT_BYTES = 64 << 20  # replies queued to one connection
MAX_OUT_TOTAL = 128 << 20  # and to all of them: past either, the connection being sent to is closed
IOV_MAX = 512
SMALL_PIECE = 4096  # pieces under this are copied into one bytearray
PIECES_INTO = 1 << 20  # ... of at most this many bytes


class NotReading(Exception):
    """Queuing a reply would pass a cap: the peer does not read its replies (the message
    gives the bytes); close its connection. Nothing of the reply was queued."""


class Outboxes:
    """Every connection's :class:`Outbox`, through the bytes queued in all of them."""

    def __init__(self):
        self.total = 0  # bytes queued, all connections

    def new(self, sock) -> Outbox:
        return Outbox(sock, self)


class Outbox:
    """One connection's replies not yet written, in order; true while any are queued.

    Arguments:
        sock: the connection's non-blocking socket (the caller owns and closes it).
        everyone: the :class:`Outboxes` whose total this one counts in.
    """

    def __init__(self, sock, everyone: Outboxes):
        self.sock = sock
        self._everyone = everyone
        self._bufs: collections.deque = collections.deque()
        self.bytes = 0  # queued here

    def __bool__(self) -> bool:
        return bool(self._bufs)

    def write(self, bufs: list) -> None:
        """Send one message's buffers after what is queued: what the socket takes at once
        when nothing is queued, the rest queued. ``OSError``: the socket failed;
        :class:`NotReading`: the rest would pass a cap (neither queues anything)."""
        if not self._bufs:
            try:
                sent = self.sock.sendmsg(bufs[:IOV_MAX])
            except BlockingIOError:
                sent = 0
            bufs = _after(bufs, sent)
            if not bufs:
                return
        self._queue(bufs)

    def _queue(self, bufs: list) -> None:
        n = sum(len(b) for b in bufs)
        if self.bytes + n > MAX_OUT_BYTES or self._everyone.total + n > MAX_OUT_TOTAL:
            raise NotReading(f"{self.bytes + n} bytes of replies it does not read ({self._everyone.total + n} "
                             "queued in all)")
        q = self._bufs
        for b in bufs:  # small pieces into one bytearray: a Python object each would cost more than its bytes
            if len(b) < SMALL_PIECE and q and type(q[-1]) is bytearray and len(q[-1]) < PIECES_INTO:
                q[-1] += b
            elif len(b) < SMALL_PIECE:
                q.append(bytearray(b))
            else:
                q.append(b)
        self.bytes += n
        self._everyone.total += n

    def flush(self) -> None:
        """Write what the socket takes now. ``OSError``: the socket failed."""
        q = self._bufs
        while q:
            bufs = list(itertools.islice(q, IOV_MAX))  # never a copy of a long queue
            try:
                sent = self.sock.sendmsg(bufs)
            except BlockingIOError:
                return
            self.bytes -= sent
            self._everyone.total -= sent
            while sent:
                b = q[0]
                if len(b) <= sent:
                    sent -= len(b)
                    q.popleft()
                else:
                    q[0] = memoryview(b)[sent:]
                    sent = 0

    def clear(self) -> None:
        """Forget what is queued (the connection is closed)."""
        self._everyone.total -= self.bytes
        self._bufs.clear()
        self.bytes = 0


def _after(bufs: list, sent: int) -> list:
    """What of ``bufs`` remains once ``sent`` bytes of them went out."""
    for i, b in enumerate(bufs):
        if sent < len(b):
            return ([memoryview(b)[sent:]] if sent else [b]) + bufs[i + 1:]
        sent -= len(b)
    return []
