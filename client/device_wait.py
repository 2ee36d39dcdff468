"""The watcher of a zmq rank's device waits (``Client(device_wait=True)``).

With device wait the rank's stream waits on the GPU for an entry's done word, which the
daemon sets after the request's work; should the daemon die first, the stream would hang.
This thread watches the daemon and, once it is gone, has the waits released.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("sparsekv.client")

WATCH_INTERVAL_S = 0.02  # how often the daemon's liveness is checked


class DeviceWaitWatch:
    """Calls ``check()`` (why the daemon is gone, or None) every ``interval_s``; once it
    says gone (``gone``), calls ``release()`` every ``interval_s`` (a wait enqueued during
    one release is released by the next) until ``close()``."""

    def __init__(self, check, release, interval_s: float = WATCH_INTERVAL_S):
        self._check, self._release = check, release
        self._interval_s = float(interval_s)
        self._closed = threading.Event()
        self.gone: str | None = None
        self._thread = threading.Thread(target=self._run, name="sparsekv-device-wait-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.wait(self._interval_s):
            try:
                why = self._check()
            except Exception as e:  # noqa: BLE001 - keep watching
                log.debug("daemon check failed: %r", e)
                continue
            if why is not None:
                self.gone = why
                log.error("%s: releasing this rank's device waits (their results are empty)", why)
                break
        while not self._closed.is_set():
            try:
                self._release()
            except Exception as e:  # noqa: BLE001 - try again
                log.debug("release failed: %r", e)
            self._closed.wait(self._interval_s)

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)


class DeviceWaits:
    """The client's side of it (a mixin of :class:`~sparsekv.client.Client`: its
    ``_handles``, ``attachment``, ``_daemon_dead``, ``_process_alive`` and ``_lost``)."""

    def _watch_device_waits(self) -> None:
        """Start (once per attachment) the thread that releases this rank's device waits
        if the daemon dies: a stream waiting on a done word must never wait for ever."""
        if any(isinstance(h, DeviceWaitWatch) for h in self._handles):
            return
        self._handles.append(DeviceWaitWatch(self._daemon_dead, self._release_device_waits))

    def _raise_if_watch_gone(self) -> None:
        """The device-wait watcher found the daemon gone: this client is lost (raises)."""
        for h in self._handles:
            if isinstance(h, DeviceWaitWatch) and h.gone is not None:
                self._lost(h.gone)

    def _release_device_waits(self) -> None:
        """The daemon is gone: release this rank's device waits (``CudaAttachment.release_done``),
        unless its process still lives (then its own stream sets the words)."""
        att = self.attachment
        if att is None or not att.caps.device or self._process_alive() is True:
            return
        try:
            att.release_done()
        except Exception as e:  # noqa: BLE001 - nothing more can be done for them
            log.error("could not release the device waits of a lost daemon: %r", e)
