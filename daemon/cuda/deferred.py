"""Frees held back while a doorbell stream may be parked.

A doorbell rank's stream spends its life parked on a stream wait for its engine's next
bell (``doorbell.py``). Some CUDA calls wait for every stream of the calling process
before they return: ``cudaHostUnregister`` does (seen on the H200: a detach hung there
while another doorbell rank waited on its engine, and the engine waited on the detach's
reply), and ``cudaIpcCloseMemHandle``, ``cudaEventDestroy`` of an imported event and
``cudaFree`` may. Made on the daemon's loop while any doorbell rank is attached, such a
call would stop the daemon until that rank's engine rings again, or for ever.

So the cuda backend hands each such free to :class:`DeferredFrees`: with no doorbell rank
attached it runs at once; else it waits here, with its bytes counted in the stats
(``arenas[device]["deferred_free_bytes"]``), and runs when the last doorbell rank of the
daemon detaches (``flush``) or the daemon stops. What waits here is memory the GPU no
longer touches (its rank's stream drained first): the imports of its engine's slab, keys
buffers and fence events, and the rank's pinned host blocks. Device arena ranges never
wait here: they go back to the arena at detach (no CUDA call).

A node whose engines restart one at a time may never be without a doorbell rank, so
held pinned host blocks are *spares*: the next rank of the same owner (uid), GPU and size
takes them, zeroed (``reuse``), instead of registering new ones; a restarted engine
reuses what its predecessor held. Only the same uid: the old client may still map the
blocks (a memfd), and a process of that uid may already write that engine's rows.
"""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger("sparsekv.cuda")

# A free: (what, bytes, call). ``what`` names it in the log.
FreeFn = Callable[[str, int, Callable[[], None]], None]


def free_now(what: str, nbytes: int, fn: Callable[[], None]) -> None:
    """The free of a rank outside a daemon (tests, benches): run it."""
    fn()


class DeferredFrees:
    """Frees of one daemon's cuda backend that must not run while a doorbell stream may be
    parked. ``parked``: whether one may be (any doorbell rank attached)."""

    def __init__(self, parked: Callable[[], bool]):
        self._parked = parked
        self._held: list[tuple[int | None, str, int, Callable[[], None]]] = []
        self._spares: dict[tuple, list[tuple[int | None, int, object, Callable[[], None]]]] = {}

    def free_for(self, device: int | None) -> FreeFn:
        """The free callback of one GPU's rank (``device``: its ordinal; None: host memory
        of no one GPU)."""
        def free(what: str, nbytes: int, fn: Callable[[], None]) -> None:
            self.free(device, what, nbytes, fn)
        return free

    def free(self, device: int | None, what: str, nbytes: int, fn: Callable[[], None]) -> None:
        if not self._parked():
            fn()
            return
        self._held.append((device, what, int(nbytes), fn))
        log.info("%s (%d bytes) freed once no doorbell rank is attached (%d frees, %d bytes waiting)",
                 what, nbytes, len(self._held), self.held_bytes())

    def keep_spare(self, key: tuple, device: int | None, nbytes: int, obj, close: Callable[[], None]) -> None:
        """Free ``obj`` (``close``) at once, or while a doorbell stream may be parked keep
        it for :meth:`reuse` under ``key`` (closed by ``flush`` if nobody takes it)."""
        if not self._parked():
            close()
            return
        self._spares.setdefault(key, []).append((device, int(nbytes), obj, close))
        log.info("pinned host blocks (%d bytes) kept for the next rank of their owner (%d bytes waiting)",
                 nbytes, self.held_bytes())

    def reuse(self, key: tuple):
        """A spare kept under ``key``, no longer counted, or None."""
        spares = self._spares.get(key)
        if not spares:
            return None
        obj = spares.pop()[2]
        if not spares:
            del self._spares[key]
        return obj

    def flush(self) -> None:
        """Run every held free and close every spare, if no doorbell stream may be parked
        now. A failing free is logged; the rest still run."""
        if not (self._held or self._spares) or self._parked():
            return
        held, self._held = self._held, []
        for spares in self._spares.values():
            held += [(d, "spare pinned host blocks", n, close) for d, n, _obj, close in spares]
        self._spares = {}
        for _device, what, _nbytes, fn in held:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - free the rest regardless
                log.error("freeing %s failed: %s", what, e)
        log.info("ran %d held frees", len(held))

    def _waiting(self):
        """(device, bytes) of every held free and spare."""
        yield from ((d, n) for d, _w, n, _f in self._held)
        yield from ((d, n) for spares in self._spares.values() for d, n, _o, _c in spares)

    def held_bytes(self, device: int | None = ...) -> int:
        """Bytes waiting (of one GPU's ranks, or of all)."""
        return sum(n for d, n in self._waiting() if device is ... or d == device)

    def held_count(self, device: int | None = ...) -> int:
        return sum(1 for d, _n in self._waiting() if device is ... or d == device)

    def close(self) -> None:
        """At the daemon's stop, after every rank closed: run what is held."""
        self.flush()
