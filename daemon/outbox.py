"""A control connection's replies not yet written (daemon/control_socket.py).

What a peer does not read is queued, up to ``MAX_OUT_BYTES`` a connection and
``MAX_OUT_TOTAL`` over all of them (small pieces coalesced, so the count is the memory).
Past a connection's own cap, :class:`NotReading` says it is to be closed. Past the total,
the uid with the most bytes queued over its connections (the kernel's peer uid: several
connections of one peer count as one) loses its heaviest connection: when that is another
one, its queue is dropped, it takes no more (its stream was cut mid-message), and the
owner's ``evict`` callback closes it (so that peers who do not read cannot get a reading
one closed); when it is this one, :class:`NotReading`. Used from the loop's thread only.
"""

from __future__ import annotations

import collections
import errno
import itertools

MAX_OUT_BYTES = 64 << 20  # replies queued to one connection
MAX_OUT_TOTAL = 128 << 20  # and to all of them
IOV_MAX = 512
SMALL_PIECE = 4096  # pieces under this are copied into one bytearray
PIECES_INTO = 1 << 20  # ... of at most this many bytes


class NotReading(Exception):
    """Queuing a reply would pass a cap: the peer does not read its replies (the message
    gives the bytes); close its connection. Nothing of the reply was queued."""


class Outboxes:
    """Every connection's :class:`Outbox`, through the bytes queued in all of them.
    ``evict(outbox, why)``: close the connection of ``outbox``, whose queue was dropped to
    make room under the total (None: the connection being sent to is closed instead)."""

    def __init__(self, evict=None):
        self.total = 0  # bytes queued, all connections
        self.evict = evict
        self.queued: set = set()  # the outboxes holding bytes

    def new(self, sock, uid: int | None = None) -> Outbox:
        """An outbox of a connection of peer ``uid`` (None: a group of its own)."""
        return Outbox(sock, self, uid)

    def make_room(self, me: Outbox, n: int) -> None:
        """Drop the heaviest queue of the uid holding the most until ``n`` more bytes fit
        the total; :class:`NotReading` when that queue would be ``me``'s (plus ``n``)."""
        while self.total + n > MAX_OUT_TOTAL:
            held = collections.Counter({me.owner: n})
            for o in self.queued:
                held[o.owner] += o.bytes
            owner = max(held, key=held.__getitem__)
            victim = max((o for o in self.queued if o.owner == owner and o is not me), key=lambda o: o.bytes,
                         default=None)
            if self.evict is None or victim is None or (owner == me.owner and victim.bytes < me.bytes + n):
                raise NotReading(f"{me.bytes + n} bytes of replies it does not read ({self.total + n} queued in all)")
            why = (f"{victim.bytes} bytes of replies it does not read, of {held[owner]} queued to its uid's "
                   f"connections, the most of any uid, dropped to make room for another's reply ({self.total + n} "
                   "queued in all)")
            victim.clear()
            victim.evicted = True
            self.evict(victim, why)


class Outbox:
    """One connection's replies not yet written, in order; true while any are queued.

    Arguments:
        sock: the connection's non-blocking socket (the caller owns and closes it).
        everyone: the :class:`Outboxes` whose total this one counts in.
    """

    def __init__(self, sock, everyone: Outboxes, uid: int | None = None):
        self.sock = sock
        self._everyone = everyone
        self.owner = ("uid", uid) if uid is not None else ("connection", id(self))  # whose bytes these count as
        self._bufs: collections.deque = collections.deque()
        self.bytes = 0  # queued here
        self.evicted = False  # its queue was dropped for another's: its connection is being closed

    def __bool__(self) -> bool:
        return bool(self._bufs)

    def write(self, bufs: list) -> None:
        """Send one message's buffers after what is queued: what the socket takes at once
        when nothing is queued, the rest queued. ``OSError``: the socket failed;
        :class:`NotReading`: the rest would pass a cap (neither queues anything). An evicted
        outbox takes nothing (``OSError``): its stream was cut mid-message."""
        if self.evicted:
            raise OSError(errno.EPIPE, "the connection's replies were dropped to make room for another's")
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
        if self.bytes + n > MAX_OUT_BYTES:
            raise NotReading(f"{self.bytes + n} bytes of replies it does not read ({self._everyone.total + n} "
                             "queued in all)")
        self._everyone.make_room(self, n)
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
        self._everyone.queued.add(self)

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
        if not q:
            self._everyone.queued.discard(self)

    def clear(self) -> None:
        """Forget what is queued (the connection is closed)."""
        self._everyone.total -= self.bytes
        self._everyone.queued.discard(self)
        self._bufs.clear()
        self.bytes = 0


def _after(bufs: list, sent: int) -> list:
    """What of ``bufs`` remains once ``sent`` bytes of them went out."""
    for i, b in enumerate(bufs):
        if sent < len(b):
            return ([memoryview(b)[sent:]] if sent else [b]) + bufs[i + 1:]
        sent -= len(b)
    return []
