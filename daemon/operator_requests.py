"""What the operator asks the daemon: STATS on the control socket, the stats socket's
commands and the loopback HTTP ``/metrics`` endpoint; none changes any state."""

from __future__ import annotations

import asyncio
import os
import struct

from sparsekv.proto import MsgType

from . import stats as stats_mod
from .peers import Peer
from .uid_slots import UidSlots

# What generate_latest() writes (CONTENT_TYPE_LATEST names 1.0.0 in recent releases).
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"

# Connections are bounded so that a flood of them cannot take the descriptors the control
# socket needs; each of the two listeners counts its own, so a flood of one leaves the
# other served. A connection beyond a limit is answered "busy" (stats socket: one line
# ``error: busy: ...``; HTTP: 503 with Retry-After) and closed at once.
#
# The stats socket: STATS_MAX_OPEN connections at once, at most STATS_PER_UID of one uid
# (the kernel's SO_PEERCRED uid, never what a client says; credentials that cannot be read
# count as uid -1), so one user cannot take them all. Operators (root, the daemon's own
# uid and admin_gid members: those who see every uid's clients) have STATS_RESERVED more
# of their own, used once their share or the shared connections are taken (UidSlots,
# which the fd socket uses too).
STATS_MAX_OPEN = 32
STATS_PER_UID = 8
STATS_RESERVED = 8
# The loopback HTTP endpoint: TCP gives no uid, so one count for everyone.
HTTP_MAX_OPEN = 32
# Operators' tools send their command as soon as they connect: a connection silent for
# this long is closed. An answer not taken by the client within ANSWER_TIMEOUT_S is dropped.
REQUEST_TIMEOUT_S = 1.0
ANSWER_TIMEOUT_S = 5.0
RETRY_AFTER_S = 1
# A command line (HTTP: a request head) longer than this is answered "command too long"
# (HTTP: 431) and closed: the limit of the asyncio.StreamReader that reads it.
STREAM_LIMIT = 2 ** 16
COMMANDS = "stats, json, prometheus, clients, blocks, health"


class OperatorRequests:
    """Over the daemon's :class:`~sparsekv.daemon.snapshot.Snapshot`, its own
    ``prometheus_client`` registry, its sessions and its :class:`~sparsekv.daemon.stats.Stats`
    (where refusals are counted: ``stats_connections_refused``, ``metrics_connections_refused``)."""

    def __init__(self, snapshot, registry, sessions, stats, collector=None):
        self.snapshot, self.registry, self.sessions, self.stats = snapshot, registry, sessions, stats
        self.collector = collector  # the registry's SnapshotCollector: filtered per viewer on the stats socket
        self.slots = UidSlots(sessions.sees_all, STATS_MAX_OPEN, STATS_PER_UID, STATS_RESERVED,
                              "stats socket connections")  # stats socket connections being answered
        self.http_open = 0  # HTTP connections being answered

    def handlers(self) -> dict:
        """This role's control-socket handlers by message type."""
        return {MsgType.STATS: self.on_stats}

    def on_stats(self, s, identity, h, a):
        return {"stats": self.snapshot(self._owner_filter(s))}, None

    def _prometheus(self, owner_uid: int | None) -> str:
        """The registry's text, its engines those of ``owner_uid`` only (None: all)."""
        c = self.collector
        if c is not None:
            c.owner_uid = owner_uid
        try:
            return stats_mod.render_prometheus(self.registry)
        finally:
            if c is not None:
                c.owner_uid = None

    def _owner_filter(self, viewer) -> int | None:
        """None where ``viewer`` (a Peer or a Session: uid, gid, pid from the kernel) may
        see every uid's engines, else its uid: ``per_engine`` then holds its own only."""
        return None if self.sessions.sees_all(viewer) else viewer.uid

    async def stats_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection of the stats socket: one command line, one answer; one busy
        line when its uid's share and the operators' slots are taken (:class:`UidSlots`)."""
        peer = _viewer(writer)
        reserved, why = self.slots.take(peer)
        if reserved is None:
            self.stats.add(stats_connections_refused=1)
            _refuse(writer, f"error: busy: {why}; try again\n".encode())
            return
        try:
            try:
                line = await asyncio.wait_for(reader.readline(), timeout=REQUEST_TIMEOUT_S)
            except (ValueError, asyncio.LimitOverrunError):  # no newline within the reader's limit (64 KiB)
                await _answer(writer, f"error: command too long (no newline within {STREAM_LIMIT} bytes); try "
                                      f"{COMMANDS}\n".encode())
                return
            cmd = line.decode(errors="replace").strip().lower() or "stats"
            if cmd == "stats":  # other uids' engines to root and the admin group only
                out = stats_mod.render_table(self.snapshot(self._owner_filter(peer)))
            elif cmd == "json":
                out = stats_mod.render_json(self.snapshot(self._owner_filter(peer)))
            elif cmd == "prometheus":  # other uids' engines to root and the admin group only
                out = self._prometheus(self._owner_filter(peer))
            elif cmd == "clients":  # other uids' clients to root and the admin group only
                out = self.sessions.client_lines(peer)
            elif cmd == "blocks":  # block stores by engine; other uids' to root and the admin group only
                out = self.sessions.engines.block_lines(None if self.sessions.sees_all(peer) else peer.uid)
            elif cmd == "health":
                # The socket exists only once the daemon serves (READY=1 sent): answering is ready.
                out = f"ready pid={os.getpid()} clients={len(self.sessions)}\n"
            else:
                out = f"error: unknown command {cmd[:40]!r}; try {COMMANDS}\n"
            await _answer(writer, out.encode())
        except (asyncio.TimeoutError, ConnectionError):
            pass
        except asyncio.CancelledError:  # the daemon stops: a connection still open ends with it
            pass  # (re-raised, asyncio's callback would log a traceback for each one)
        finally:
            self.slots.give(peer, reserved)
            writer.close()

    async def http_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A minimal HTTP/1.0 responder: ``GET /metrics`` (Prometheus text), one request
        per connection. Runs on the daemon's loop: a scrape costs one snapshot, no thread.
        Beyond HTTP_MAX_OPEN connections: 503 with Retry-After, at once."""
        if self.http_open >= HTTP_MAX_OPEN:
            self.stats.add(metrics_connections_refused=1)
            body = f"busy: {self.http_open} connections open (at most {HTTP_MAX_OPEN}); try again\n".encode()
            _refuse(writer, _http_response("503 Service Unavailable", body, "text/plain; charset=utf-8",
                                           f"Retry-After: {RETRY_AFTER_S}\r\n"))
            return
        self.http_open += 1
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=REQUEST_TIMEOUT_S)
            except asyncio.LimitOverrunError:  # no blank line within the reader's limit (64 KiB)
                await _answer(writer, _http_response("431 Request Header Fields Too Large",
                                                     f"request head over {STREAM_LIMIT} bytes\n".encode(),
                                                     "text/plain; charset=utf-8"))
                return
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
            head_only = status != "400 Bad Request" and parts[0] == "HEAD"  # (no parts at all: 400)
            await _answer(writer, _http_response(status, body, ctype, extra, head_only=head_only))
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        except asyncio.CancelledError:  # the daemon stops (as stats_client)
            pass
        finally:
            self.http_open -= 1
            writer.close()


def _http_response(status: str, body: bytes, ctype: str, extra: str = "", head_only: bool = False) -> bytes:
    head = (f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            f"{extra}Connection: close\r\n\r\n").encode()
    return head if head_only else head + body


def _refuse(writer: asyncio.StreamWriter, answer: bytes) -> None:
    """Answer a connection beyond a limit and close it, waiting for nothing: a short answer
    fits the socket's buffer. Its request is not read (the client may see a reset after
    the answer)."""
    try:
        writer.write(answer)
    except (ConnectionError, RuntimeError):
        pass
    if writer.transport.get_write_buffer_size():  # the client's buffer is full: drop it
        writer.transport.abort()
    else:
        writer.close()


async def _answer(writer: asyncio.StreamWriter, data: bytes) -> None:
    """Write an answer; one the client has not taken within ANSWER_TIMEOUT_S is dropped
    (the transport aborted), so a client that does not read cannot keep its slot."""
    writer.write(data)
    try:
        await asyncio.wait_for(writer.drain(), timeout=ANSWER_TIMEOUT_S)
    except asyncio.TimeoutError:
        writer.transport.abort()
        raise


def _viewer(writer: asyncio.StreamWriter) -> Peer:
    """The kernel's credentials of a stats socket connection (SO_PEERCRED); a viewer
    whose credentials cannot be read is nobody (uid -1: sees no client)."""
    try:
        return Peer.of_socket(writer.get_extra_info("socket"), groups=True)
    except (OSError, AttributeError, struct.error):
        return Peer(-1, -1, 0, False)
