"""What the operator asks the daemon: STATS on the control socket, the stats socket's
commands and the loopback HTTP ``/metrics`` endpoint; none changes any state."""

from __future__ import annotations

import asyncio
import os
import socket
import struct

from sparsekv.proto import MsgType

from . import stats as stats_mod
from .peers import Peer

# What generate_latest() writes (CONTENT_TYPE_LATEST names 1.0.0 in recent releases).
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
# Connections of the stats socket (and of the HTTP endpoint) open at once; more are closed
# as soon as they are accepted, so that a flood of them cannot take the descriptors the
# control socket needs. A command takes a millisecond: operators' tools never need more.
MAX_OPEN = 32


class OperatorRequests:
    """Over the daemon's :class:`~sparsekv.daemon.snapshot.Snapshot`, its own
    ``prometheus_client`` registry and its sessions."""

    def __init__(self, snapshot, registry, sessions):
        self.snapshot, self.registry, self.sessions = snapshot, registry, sessions
        self.open = 0  # stats and HTTP connections being answered
        self.refused = 0  # closed when accepted: MAX_OPEN were open

    def handlers(self) -> dict:
        """This role's control-socket handlers by message type."""
        return {MsgType.STATS: self.on_stats}

    def on_stats(self, s, identity, h, a):
        return {"stats": self.snapshot()}, None

    async def stats_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection of the stats socket: one command line, one answer."""
        if self.open >= MAX_OPEN:
            self.refused += 1
            writer.close()
            return
        self.open += 1
        try:
            line = await asyncio.wait_for(reader.readline(), timeout=5.0)
            cmd = line.decode(errors="replace").strip().lower() or "stats"
            if cmd == "stats":
                out = stats_mod.render_table(self.snapshot())
            elif cmd == "json":
                out = stats_mod.render_json(self.snapshot())
            elif cmd == "prometheus":
                out = stats_mod.render_prometheus(self.registry)
            elif cmd == "clients":  # other uids' clients to root and the admin group only
                out = self.sessions.client_lines(_viewer(writer))
            elif cmd == "blocks":  # block stores by engine; other uids' to root and the admin group only
                viewer = _viewer(writer)
                out = self.sessions.engines.block_lines(None if self.sessions.sees_all(viewer) else viewer.uid)
            elif cmd == "health":
                # The socket exists only once the daemon serves (READY=1 sent): answering is ready.
                out = f"ready pid={os.getpid()} clients={len(self.sessions)}\n"
            else:
                out = f"error: unknown command {cmd[:40]!r}; try stats, json, prometheus, clients, blocks, health\n"
            writer.write(out.encode())
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            self.open -= 1
            writer.close()

    async def http_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A minimal HTTP/1.0 responder: ``GET /metrics`` (Prometheus text), one request
        per connection. Runs on the daemon's loop: a scrape costs one snapshot, no thread."""
        if self.open >= MAX_OPEN:
            self.refused += 1
            writer.close()
            return
        self.open += 1
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5.0)
            parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            body, ctype, extra = b"", "text/plain; charset=utf-8", ""
            if len(parts) != 3 or not parts[2].startswith("HTTP/"):
                status, body = "400 Bad Request", b"bad request line\n"
            elif parts[0] not in ("GET", "HEAD"):
                status, body, extra = "405 Method Not Allowed", b"only GET\n", "Allow: GET, HEAD\r\n"
            elif parts[1].split("?", 1)[0] != "/metrics":
                status, body = "404 Not Found", b"not found; metrics are at /metrics\n"
            else:
                status, body, ctype = "200 OK", stats_mod.render_prometheus(self.registry).encode(), PROMETHEUS_TEXT
            head_out = (f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                        f"{extra}Connection: close\r\n\r\n").encode()
            writer.write(head_out if parts and parts[0] == "HEAD" else head_out + body)
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            self.open -= 1
            writer.close()


_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _viewer(writer: asyncio.StreamWriter) -> Peer:
    """The kernel's credentials of a stats socket connection (SO_PEERCRED); a viewer
    whose credentials cannot be read is nobody (uid -1: sees no client)."""
    sock = writer.get_extra_info("socket")
    try:
        pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    except (OSError, AttributeError, struct.error):
        return Peer(-1, -1, 0, False)
    return Peer(uid, gid, pid, True)
