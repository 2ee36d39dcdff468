"""systemd notification (sd_notify) without extra dependencies.

Writes datagrams to ``$NOTIFY_SOCKET`` (a path, or an abstract name starting with '@').
Silent no-op when not started by systemd.
"""

from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self, environ=None):
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET", "")
        self._addr = ("\0" + addr[1:]) if addr.startswith("@") else addr
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        ours = not pid or pid == str(os.getpid())
        # Ping at half the period systemd waits, as sd_watchdog_enabled() advises.
        self.watchdog_interval_s = int(usec) / 2e6 if usec.isdigit() and ours else 0.0
        self._sock = None

    @property
    def enabled(self) -> bool:
        return bool(self._addr)

    def send(self, **fields: str | int) -> bool:
        """``send(READY=1, STATUS="serving")``; returns False when nothing was sent."""
        if not self._addr:
            return False
        msg = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(msg, self._addr)
            return True
        except OSError:
            return False

    def ready(self, status: str) -> bool:
        return self.send(READY=1, STATUS=status)

    def status(self, status: str) -> bool:
        return self.send(STATUS=status)

    def stopping(self) -> bool:
        return self.send(STOPPING=1, STATUS="stopping")

    def extend_timeout(self, seconds: float, status: str | None = None) -> bool:
        """Ask systemd (>= 236) for ``seconds`` more before it gives up on the current
        start (or stop), so ``TimeoutStartSec=`` bounds a stall, not a slow moving start."""
        fields: dict[str, str | int] = {} if status is None else {"STATUS": status}
        fields["EXTEND_TIMEOUT_USEC"] = max(1, int(seconds * 1e6))
        return self.send(**fields)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
