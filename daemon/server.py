"""The control plane: a ZeroMQ ROUTER served on (uv)asyncio, plus the stats socket, the fd
socket (a rank's shared-memory descriptors for the process that attached it) and the
optional loopback HTTP ``/metrics`` endpoint (same loop, same thread).

One thread owns the ROUTER socket and every worker's state (STYLE 5): requests are
handled one at a time in arrival order, so no lock guards the residency state. On the
cpu backend the gather runs inline; on cuda the handlers only enqueue work on the
device's copy stream, so the loop never waits on the GPU. The slow part of a heavy
request (ATTACH, a large WRITE, ...) runs on a worker thread and its reply comes later;
its session's later requests, and those on an engine it holds, wait for it in order
(daemon/heavy.py).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import time
import types
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import psutil
import zmq
from prometheus_client import CollectorRegistry

from sparsekv.proto import (
    ERROR_HINTS,
    LIMITS,
    PROTOCOL_VERSION,
    REQUESTS,
    ErrorCode,
    Layout,
    LayoutError,
    MsgType,
    ProtocolError,
    decode,
    reply_error,
    reply_ok,
)

from sparsekv.proto import fd_socket
from sparsekv.proto.frames import send_copy
from sparsekv.proto.cpus import format_cpu_list, pin_io_threads
from sparsekv.proto.layout import ROW_ALIGN_BYTES
from sparsekv.proto.slab import SlabGeometry

from . import stats as stats_mod
from .connections import Connections
from .connguard import BUSY_SUFFIX, ConnectionGuard
from .engine import EngineSlabImport, Owner, RankState
from .fd_server import FdServer
from .heavy import MAX_WAITING, Gone, HeavyRequests, Job, Slow
from .notify import Notifier
from .peers import Peer, PidWatch, process_groups
from .peers import peer_creds as _peer_creds
from .pool import HostPool, PoolError
from .registry import EngineRegistry
from .residency.base import ResidencyError, check_layout_limits

log = logging.getLogger("sparsekv.server")

# Requests that run on a rank's state: a rank's asynchronous error (one the cuda backend
# learns of after the fact) is answered to the next of these instead of running it.
_RANK_REQUESTS = frozenset({MsgType.STEP, MsgType.TOPK, MsgType.WRITE, MsgType.WRITE_STAGED, MsgType.STAGE})


@dataclass
class Session:
    """One connected client (one engine rank), keyed by its ZeroMQ identity.

    ``pid``, ``uid``, ``gid``: what the kernel says of the connection (``SO_PEERCRED``),
    never what the client claims; ``verified`` False (pid 0, the daemon's own uid and gid)
    for in-process calls, which carry no credentials. ``watch``: a pidfd of the process,
    open from HELLO to DETACH and again from a later ATTACH, so a client that dies holding
    an engine is reclaimed at once (None: pid 0, or no pidfd; the reaper's periodic check
    covers those)."""

    identity: bytes
    client_id: int
    pid: int
    rank: int
    device: str
    name: str
    proc_started: float | None
    connected_at: float = field(default_factory=time.time)
    engine: str | None = None
    state: RankState | None = None
    requests: int = 0
    errors: int = 0
    uid: int = -1
    gid: int = -1
    verified: bool = False
    watch: PidWatch | None = None
    peer_address: str = ""  # the HELLO's Peer-Address, as libzmq gave it ("": unverified)
    fd_token: str | None = None  # the fd socket's token of its attached rank, until used
    last_request_at: float = field(default_factory=time.monotonic)  # idle_timeout_s counts from here


class Daemon:
    # 0, or EXIT_FATAL once a request hit an error no one can be served after (_fatal):
    # serve() then returns and main() exits with it.
    exit_code = 0
    fatal_reason = ""
    # Most bytes one rank's slab + staging + residency state may take (config
    # max_slab_bytes; main sets it): ATTACH checks it with check_layout_limits.
    max_slab_bytes = 16 << 30
    # WRITE, WRITE_STAGED and STAGE (cpu) copies of at least this many bytes run on a
    # worker thread (about a millisecond of copying here); smaller ones cost less than
    # the hop and run inline. An ATTACH's slow part always runs there.
    heavy_bytes = 4 << 20

    def __init__(self, run_dir: str, backend, pool: HostPool, *, max_clients: int = 256,
                 reap_interval_s: float = 2.0, notifier: Notifier | None = None, busy_poll_us: int = 0,
                 metrics_port: int = 0, admin_gid: int | None = None, max_clients_per_uid: int = 0,
                 max_pool_bytes_per_uid: int = 0, max_connections_per_uid: int = 0, hello_timeout_s: float = 10.0,
                 idle_timeout_s: float = 600.0, io_cpus: tuple[int, ...] = (), warmer=None):
        self.run_dir = run_dir
        # The CPUs of the ZeroMQ I/O threads (() : not pinned) and the warm CPU loops
        # (proto/cpus.py CpuWarmer, started and stopped by daemon/main.py), for STATS.
        self.io_cpus = tuple(io_cpus)
        self.warmer = warmer
        # Members of this group (primary or supplementary) may join any user's engine.
        self.admin_gid = admin_gid
        # The credentials of the HELLO being handled (set by handle() from its frames).
        self._peer: Peer | None = None
        self.backend = backend
        self.pool = pool
        self.max_clients = max_clients
        self.max_clients_per_uid = max_clients_per_uid  # 0: no per-uid cap (QUOTA_EXCEEDED at HELLO)
        self.idle_timeout_s = idle_timeout_s  # a session not attached, without a request
        # The control socket's connections: credentials, HELLO deadline, per-uid cap
        # (daemon/connections.py), fed by the connection guard's thread while serving.
        self.connections = Connections(max_per_uid=max_connections_per_uid, hello_timeout_s=hello_timeout_s)
        # Identities of sessions dropped for idleness (the latest 1,024) -> what their next
        # request is told: a client keeps its routing id across reconnects.
        self._expired: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self.reap_interval_s = reap_interval_s
        self.busy_poll_ns = int(busy_poll_us) * 1000
        self.notifier = notifier or Notifier({})
        # The daemon's own registry (never prometheus_client's global one): the top-k
        # histogram, fed per request, and the snapshot's metrics, built at each scrape.
        self.registry = CollectorRegistry()
        self.stats = stats_mod.Stats(registry=self.registry)
        self.registry.register(stats_mod.SnapshotCollector(self.snapshot))
        self.metrics_port = int(metrics_port)  # 0: no HTTP endpoint
        self.metrics_address: tuple[str, int] | None = None  # once bound
        self.version = stats_mod.package_version()
        self.sessions: dict[bytes, Session] = {}
        # engine lifetimes and pool ranges (and the per-uid pool quota)
        self.engines = EngineRegistry(pool, backend, max_pool_bytes_per_uid=max_pool_bytes_per_uid)
        # Heavy requests' slow parts on worker threads, and the requests waiting for them.
        self.heavy = HeavyRequests()
        self._sock = None  # the ROUTER socket, while serving
        self._next_client_id = 1
        # The fd socket: rank memory to its own process, engine slabs from it (fd_server.py).
        self.fd_server = FdServer(self.stats, lambda cid: self.backend.share_fds(cid), self._is_attacher)
        self._stop = asyncio.Event()
        self.handlers = {
            MsgType.HELLO: self.on_hello,
            MsgType.ATTACH: self.on_attach,
            MsgType.STEP: self.on_step,
            MsgType.TOPK: self.on_topk,
            MsgType.WRITE: self.on_write,
            MsgType.STAGE: self.on_stage,
            MsgType.DETACH: self.on_detach,
            MsgType.STATS: self.on_stats,
            MsgType.WRITE_STAGED: self.on_write_staged,
            MsgType.BYE: self.on_bye,
        }
        # The protocol is declared once in proto/; refuse to start if it and the handlers drift.
        missing = set(REQUESTS) - set(self.handlers)
        if missing or set(self.handlers) - set(REQUESTS):
            raise RuntimeError(f"handlers do not match proto.REQUESTS: {sorted(m.name for m in missing)}")

    @property
    def control_path(self) -> str:
        return os.path.join(self.run_dir, "control.sock")

    @property
    def stats_path(self) -> str:
        return os.path.join(self.run_dir, "stats.sock")

    @property
    def fd_path(self) -> str:
        return os.path.join(self.run_dir, fd_socket.FD_SOCKET)

    # -- serving ------------------------------------------------------------------
    async def serve(self, on_ready=None) -> None:
        # A plain ZeroMQ socket whose file descriptor the (uv)loop watches: on each wake-up
        # the loop drains every queued request (a pipelined STEP + TOPK costs one wake-up).
        # The descriptor is edge-triggered, so ZMQ_EVENTS is re-read until no input is left.
        http_server = None
        if self.metrics_port:
            # First: a port in use fails the start before any socket of the run dir exists.
            # Loopback only: the endpoint has no authentication (a node's Prometheus agent
            # or a sidecar scrapes it; expose it further through them, not from here).
            http_server = await asyncio.start_server(self._http_client, host="127.0.0.1", port=self.metrics_port)
            self.metrics_address = http_server.sockets[0].getsockname()[:2]
            log.info("metrics on http://%s:%d/metrics", *self.metrics_address)
        ctx = zmq.Context(io_threads=ZMQ_IO_THREADS)
        if self.io_cpus:
            pin_io_threads(ctx, self.io_cpus)  # before the first socket starts them
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # A client's libzmq reconnects under its own (random, 13-byte) routing id. If the
        # daemon still holds that id's old pipe (its end of the dead connection not yet
        # torn down), libzmq would refuse the new connection, and the client would get no
        # reply until its next reconnect: the new connection takes the id over instead.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # Bound what one peer can cost (see MAX_MESSAGE_BYTES and the heartbeats below
        # _DRAIN_SLICE_NS): a frame larger than any legal request drops its connection
        # before it is read, a silent peer is dropped after HEARTBEAT_TIMEOUT_MS.
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        # Connections the kernel queues for libzmq to accept: after the connection guard
        # renames control.sock away, those still get accepted (each a descriptor). A
        # client that finds the queue full is retried by libzmq.
        sock.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)
        # A ZAP domain turns on libzmq's ZAP path, whose one effect here (no handler is
        # bound, so NULL-mechanism peers pass) is that it refuses ZMTP/1.0 and 2.0 peers
        # (libzmq 2.x; every client of ours speaks 3.x): libzmq 4.3.5 leaks ~16 KiB for
        # every connection that speaks ZMTP/1.0 and then fails (any first byte other than
        # 0xff opens it), 1.5 GiB in 40 s of random bytes.
        sock.setsockopt(zmq.ZAP_DOMAIN, b"sparsekv")
        busy_path = self.control_path + BUSY_SUFFIX
        new_path = self.control_path + ".new"
        for p in (self.control_path, busy_path, new_path, self.stats_path):
            if os.path.lexists(p):
                os.unlink(p)
        # The stats and fd sockets first: whoever sees control.sock (clients, PrivateDaemon,
        # probes) finds them there too.
        stats_server = await asyncio.start_unix_server(self._stats_client, path=self.stats_path)
        os.chmod(self.stats_path, 0o660)
        try:  # listening, mode set, then renamed into place (as control.sock below)
            await self.fd_server.start(self.fd_path)
        except BaseException:
            stats_server.close()
            raise
        # Bound under a private name and renamed into place once it listens (with its
        # mode set): the file exists between bind() and listen(), and a client that
        # connected in that gap was refused as if no daemon were there.
        sock.bind(f"ipc://{new_path}")
        os.chmod(new_path, 0o660)
        os.rename(new_path, self.control_path)
        # libzmq aborts the process if accepting a connection finds no free descriptor:
        # hold off new connections while few are left (daemon/connguard.py).
        self.connections.bound_path = new_path  # what getsockname() says of every connection it accepts
        guard = ConnectionGuard(sock, self.control_path, connections=self.connections.open()).start()
        self.connection_guard = guard
        loop = asyncio.get_running_loop()
        self._sock = sock
        self.heavy.open(loop)  # slow parts of heavy requests on worker threads from now on
        fd = sock.getsockopt(zmq.FD)
        loop.add_reader(fd, self._drain, sock)
        tasks = [asyncio.create_task(self._reaper(), name="reaper"),
                 asyncio.create_task(self._health(), name="health")]
        if self.notifier.watchdog_interval_s:
            tasks.append(asyncio.create_task(self._watchdog(), name="watchdog"))
        status = f"serving {len(self.backend.devices)} device(s), pool {self.pool.size_bytes >> 20} MiB"
        log.info("ready: %s on %s", status, self.control_path)
        self.notifier.ready(status)
        if on_ready:
            on_ready()
        try:
            self._drain(sock)  # anything that arrived before the reader was registered
            await self._stop.wait()
        finally:
            if self.exit_code:  # keep saying why in `systemctl status`
                self.notifier.send(STOPPING=1, STATUS=f"failed: {self.fatal_reason[:200]}")
            else:
                self.notifier.stopping()
            log.info("stopping: detaching %d client(s)", len(self.sessions))
            loop.remove_reader(fd)
            for t in tasks:
                t.cancel()
            stats_server.close()
            self.fd_server.close()
            if http_server is not None:
                http_server.close()
            # Heavy requests in flight: their slow parts finish (never interrupted), then
            # each rolls back (Gone), before the sessions are detached.
            for job in self.heavy.close(wait=not self.exit_code):
                self._resume(job, None, Gone("the daemon stops"))
            if self.exit_code:
                # The GPU context is lost: releasing device memory would only fail (or
                # hang); the process exit frees everything.
                log.info("not detaching %d client(s): the daemon is failing", len(self.sessions))
            else:
                for s in list(self.sessions.values()):
                    try:
                        self._detach(s)
                    except Exception:  # noqa: BLE001 - stop the others cleanly all the same
                        log.exception("detaching client %d at stop failed", s.client_id)
            self.sessions.clear()
            self.heavy.shutdown(wait=not self.exit_code)  # memory being released on its threads
            self._sock = None
            guard.close()
            self.connections.close()  # its spare descriptors (the guard has stopped)
            sock.close(0)
            ctx.term()
            for p in (self.control_path, busy_path, self.stats_path, self.fd_path):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass

    def _drain(self, sock) -> None:
        """Receive, handle, reply until no request is queued: one at a time, in order
        (a heavy request's slow part runs on a worker thread: daemon/heavy.py).

        With ``busy_poll_us``, keep polling that long after the last request before
        going back to sleep: the next request of a decode step then needs no wake-up.
        A wake-up's work is bounded (``_DRAIN_SLICE_NS``); past it the rest is picked up
        on the loop's next turn, so the stats socket, reaper and watchdog still run."""
        now = time.perf_counter_ns
        start = last = now()
        while True:
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                t = now()
                if t - last >= self.busy_poll_ns:
                    return
                if t - start >= _DRAIN_SLICE_NS:
                    asyncio.get_running_loop().call_soon(self._drain, sock)
                    return
                continue
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            tr = now()  # the reply's "tr": the request is here, not yet decoded
            if len(frames) < 2:
                continue  # an empty message carries no request to answer
            self._serve(frames[0].bytes, (frames[1:], tr))
            if self.exit_code:  # a fatal error: run nothing more (serve() is stopping)
                return
            last = now()
            if last - start >= _DRAIN_SLICE_NS:
                asyncio.get_running_loop().call_soon(self._drain, sock)
                return

    def stop(self) -> None:
        self._stop.set()

    def handle(self, identity: bytes, frames, tr: int | None = None) -> list:
        """Answer one request; never raises. Errors are replies with a code and message.

        ``tr``: ``time.perf_counter_ns()`` when the request was received (now if None).
        Every reply carries it as ``tr`` and the time just before it is encoded as ``tx``,
        so a client can split a request's time into its own, the socket's and the daemon's
        (CLOCK_MONOTONIC: one clock for every process of the host).

        A heavy request runs whole here, its slow part on the caller's thread; the
        serving loop goes through :meth:`_serve` instead, which runs that part on a
        worker thread and replies later (daemon/heavy.py)."""
        return self._handle(identity, frames, time.perf_counter_ns() if tr is None else tr, defer=False)

    def _handle(self, identity: bytes, frames, tr: int, defer: bool):
        """The reply to one request (never raises). ``defer`` (serving): instead
        ``_WAIT`` when the request must wait for a heavy request in flight on its
        engine (nothing of it ran), or its :class:`Job` when its handler reached a slow
        part (the reply comes from :meth:`_resume`)."""
        msg_type, req_id = 0, 0
        release = None  # (session, header) of a device-wait TOPK from its own process, once known
        try:
            header, arrays = decode(frames)
            msg_type, req_id = header["t"], header["id"]
            if header["v"] != PROTOCOL_VERSION:
                raise ProtocolError(
                    ErrorCode.BAD_VERSION,
                    f"client speaks protocol version {header['v']}, this daemon speaks {PROTOCOL_VERSION}",
                )
            kind = _KINDS.get(msg_type)
            if kind is None:
                raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {msg_type}")
            need_fields, allowed_arrays = REQUESTS[kind]
            for f in need_fields:
                if f not in header:
                    absent = [f for f in need_fields if f not in header]
                    raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"{kind.name} needs field(s) {sorted(absent)}")
            if not allowed_arrays.issuperset(arrays):
                extra = set(arrays) - allowed_arrays
                raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"{kind.name} takes no array(s) {sorted(extra)}")
            session = self.sessions.get(identity)
            if kind != MsgType.HELLO and session is None:
                why = self._expired.get(identity)
                raise ProtocolError(ErrorCode.NOT_HELLO, why or "no HELLO from this connection")
            # A HELLO makes its connection (and its process's next ones: a reconnect under
            # the same routing id says none) a client's, with no HELLO deadline; on a
            # connection beyond its uid's cap it is not answered (daemon/connections.py).
            if kind == MsgType.HELLO and not self.connections.hello(_src_fd(frames)):
                return None
            if defer and self._must_wait(session, kind, header):
                return _WAIT
            if session is not None:
                if session.peer_address and kind != MsgType.HELLO:
                    # A peer may choose its routing id: the process behind a session's
                    # identity must be the one that said HELLO (SO_PEERCRED, ~0.2 us).
                    if _peer_address(frames) not in (None, session.peer_address):
                        raise ProtocolError(ErrorCode.PERMISSION_DENIED,
                                            "this connection is not the process that said HELLO on it; send HELLO")
                if header.get("done") is not None:
                    release = (session, header)
                session.requests += 1
                session.last_request_at = time.monotonic()
                if kind in _RANK_REQUESTS and session.state is not None \
                        and not getattr(session.state, "device_driven", False):
                    # (A doorbell rank's errors are its handle's check(): not a write's.)
                    # Like CUDA's: an error the rank found after the fact (bad input seen
                    # on the GPU) fails the next call on it, which does not run.
                    err = session.state.take_error()
                    if err is not None:
                        self.stats.add(async_errors=1)
                        what = "nor the STEP it began " if header.get("begin") is True else ""
                        err.args = (f"{err.args[0]}; this {kind.name} request {what}was not run",)
                        raise err
            if kind == MsgType.HELLO: self._peer = _peer_creds(frames)  # noqa: E701 - SO_PEERCRED, HELLO only
            out = self.handlers[kind](session, identity, header, arrays)
            if isinstance(out, types.GeneratorType):  # a heavy request's handler
                job = Job(out, identity, session, kind, msg_type, req_id, tr)
                return self._step(job) if defer else self._inline(job)
            return self._ok(kind, msg_type, req_id, out, tr)
        except Exception as e:  # noqa: BLE001 - answered with its code, never raised
            if release is not None:
                self._release_device_wait(*release)
            return self._failed(e, identity, msg_type, req_id, tr)

    @staticmethod
    def _release_device_wait(session, header: dict) -> None:
        """A device-wait TOPK (``block`` + ``done``) of ``session``'s own process that
        failed: its client's stream waits on the entry's done word, so the result is
        emptied and the word set anyway, unless the request got as far as setting it
        (``CudaRankState.release_topk_block``); the client raises the error from the
        reply. Never raises."""
        try:
            release = getattr(session.state, "release_topk_block", None)
            block, done, fence = header.get("block"), header.get("done"), header.get("fence")
            if release is None or header.get("t") != int(MsgType.TOPK) or type(block) is not int \
                    or type(done) is not int or not 0 <= done <= 0xFFFFFFFF:
                return
            release(block, done, fence if type(fence) is int else None)
        except Exception as e:  # noqa: BLE001 - the reply still says what failed
            log.warning("could not release a failed device-wait TOPK: %r", e)

    def _ok(self, kind: MsgType, msg_type: int, req_id: int, out: tuple, tr: int) -> list:
        """The reply to a request its handler answered with ``out`` (fields, arrays)."""
        fields, out_arrays = out
        self.stats.c["requests"] += 1
        tx = time.perf_counter_ns()
        if kind == MsgType.TOPK:
            self.stats.latency((tx - tr) * 1e-9)
        return reply_ok(msg_type, req_id, fields, out_arrays, tr, tx)

    def _failed(self, e: Exception, identity: bytes, msg_type: int, req_id: int, tr: int) -> list:
        """The error reply to a request that raised ``e``, counted."""
        if isinstance(e, (ProtocolError, ResidencyError, LayoutError, PoolError)):
            code = _code_of(e)
            self.stats.add(requests=1)
            self.stats.error(code.name)
            self._count_client_error(identity)
            log.debug("request type %s from %r failed: %s: %s", msg_type, identity, code.name, e)
            msg = f"{e.args[0]} ({ERROR_HINTS.get(code, '')})"
            return reply_error(msg_type, req_id, code, msg, tr, time.perf_counter_ns())
        # Anything else is a bug, which must not take the daemon down.
        sticky = sticky_cuda_error(e)
        if sticky is not None:
            # The GPU context is lost for good (CUDA's sticky errors): every later
            # call on it fails too. Exit non-zero now, so systemd restarts the daemon
            # and every client learns at once that it is gone, instead of failing
            # request after request.
            self._fatal(f"sticky CUDA error {sticky} on request type {msg_type}: {type(e).__name__}: {e}")
        else:
            log.error("internal error on request type %s", msg_type, exc_info=e)
        self.stats.add(requests=1)
        self.stats.error(ErrorCode.INTERNAL.name)
        self._count_client_error(identity)
        msg = f"{type(e).__name__}: {e} ({ERROR_HINTS[ErrorCode.INTERNAL]})"
        if sticky is not None:
            msg = f"{type(e).__name__}: {e}: the GPU context is lost; sparsekvd exits and must be restarted"
        return reply_error(msg_type, req_id, ErrorCode.INTERNAL, msg, tr, time.perf_counter_ns())

    def _fatal(self, why: str) -> None:
        """Stop serving and make the process exit with :data:`EXIT_FATAL` (main returns
        it): an error after which the daemon cannot serve anyone (a lost GPU context)."""
        log.critical("%s: exiting with code %d", why, EXIT_FATAL)
        self.notifier.status(f"failed: {why[:200]}")
        self.fatal_reason = why
        self.exit_code = EXIT_FATAL
        self.stop()

    # -- heavy requests: slow parts on worker threads (daemon/heavy.py) -------------------
    def _serve(self, identity: bytes, request: tuple) -> None:
        """(serving) Answer ``request`` (frames, tr) of session ``identity`` now, or start
        its slow part (answered by :meth:`_resume`), or queue it behind what it waits for."""
        if self.heavy.busy(identity):  # its session's earlier requests go first
            self._queue(identity, request)
            return
        out = self._handle(identity, *request, defer=True)
        if out is _WAIT:
            self._queue(identity, request)
        else:
            self._answer(identity, out)

    def _queue(self, identity: bytes, request: tuple) -> None:
        if not self.heavy.wait(identity, request):
            log.warning("request of a client dropped: %d of its requests wait already", MAX_WAITING)

    def _answer(self, identity: bytes, out) -> None:
        if isinstance(out, Job):
            self.heavy.start(out, self._resume)
        elif out is not None:
            self._send(identity, out)

    def _send(self, identity: bytes, reply: list) -> None:
        try:
            self._sock.send_multipart([identity, *reply], zmq.NOBLOCK, copy=send_copy(reply))
        except zmq.Again:  # the client stopped reading and its queue is full
            log.warning("reply to a client dropped: its queue is full")

    def _must_wait(self, session: Session | None, kind: MsgType, header: dict) -> bool:
        """Whether a request must wait for a heavy request in flight on an engine: the
        one its session is attached to, or the one it attaches to."""
        if session is not None and self.heavy.engine_busy(session.engine):
            return True
        return kind == MsgType.ATTACH and self.heavy.engine_busy(str(header["engine"]))

    def _step(self, job: Job, value=None, error: BaseException | None = None):
        """Run ``job``'s handler on the loop, from its last ``yield`` (sending ``value``
        or raising ``error`` there) to its next slow part (returns ``job``) or its end
        (returns the reply; None when it had nobody to answer: :class:`Gone`)."""
        try:
            try:
                job.slow = job.gen.throw(error) if error is not None else job.gen.send(value)
            except StopIteration as done:
                return self._ok(job.kind, job.msg_type, job.req_id, done.value, job.tr)
        except Gone:
            self.stats.add(requests=1)  # counted, answered to nobody
            return None
        except Exception as e:  # noqa: BLE001 - answered with its code
            return self._failed(e, job.identity, job.msg_type, job.req_id, job.tr)
        finally:
            # The error's traceback holds this frame: keep no cycle through it (the frames
            # of a failed attach may hold a rank's memory until the cycle is collected).
            gone, error = isinstance(error, Gone), None
        if gone:  # a handler must re-raise Gone, not go on
            job.gen.close()
            return None
        return job

    def _inline(self, job: Job) -> list:
        """A heavy request run whole on this thread (``handle``: no serving loop)."""
        out = self._step(job)
        while out is job:
            try:
                value = job.slow.fn()
            except Exception as e:  # noqa: BLE001 - raised at the handler's yield
                out = self._step(job, None, e)
            else:
                out = self._step(job, value)
        return out

    def _resume(self, job: Job, value, error: BaseException | None) -> None:
        """(loop) ``job``'s slow part is over: run its handler on, then reply, release
        what it held and serve the requests that waited for it."""
        if self.sessions.get(job.identity) is not job.session and not isinstance(error, Gone):
            if error is not None:
                log.debug("heavy request of a client that is gone failed: %r", error)
            value, error = None, Gone(f"client {job.session.client_id} is gone")
        out = self._step(job, value, error)
        value = error = None  # no reference cycle through this frame (see _step)
        if out is job and self.heavy.serving:
            self.heavy.start(job, self._resume)
            return
        self.heavy.finish(job)
        if self.sessions.get(job.identity) is not job.session:
            self._detach(job.session)  # reaped while its request ran: its rank goes now
        if not self.heavy.serving:
            return  # stopping
        if out is not None:
            self._send(job.identity, out)
        if self.exit_code:  # a fatal error: run nothing more (serve() is stopping)
            return
        self._serve_waiting(last=job.identity)
        # A send may take the socket's edge-triggered wake-up for requests that came in
        # meanwhile (libzmq: check ZMQ_EVENTS after every send): drain them now.
        self._drain(self._sock)

    def _serve_waiting(self, last: bytes) -> None:
        """The requests that waited, each session's in order, until one waits again;
        session ``last`` (whose request just ended) after the others: it cannot keep
        an engine from them with request after request."""
        for identity in sorted(self.heavy.waiting_sessions(), key=lambda i: i == last):
            while (request := self.heavy.next_waiting(identity)) is not None:
                out = self._handle(identity, *request, defer=True)
                if out is _WAIT:
                    self.heavy.wait(identity, request, first=True)
                    break
                self._answer(identity, out)
                if self.exit_code:
                    return

    # -- handlers: each returns (fields, arrays); a heavy one is a generator that yields
    # Slow(fn) for each slow part and returns them (daemon/heavy.py) -----------------------
    def on_hello(self, session, identity, h, arrays):
        # Who the client is comes from the kernel: SO_PEERCRED of its connection, read by
        # handle() from the frames (libzmq's "Peer-Address"). The "pid" field is still
        # required (older daemons need it) but only compared with the kernel's.
        peer, self._peer = self._peer, None
        if peer is None:  # an in-process call (plain bytes frames): no credentials to read
            peer = Peer.unverified()
        rank = _int(h, "rank")
        if session is not None:
            # The same connection says hello again. Only its own process may (a ROUTER
            # identity names one connection; another process could reuse it only once
            # that connection is gone), and never while attached: a second HELLO must not
            # silently throw away the rank it holds. Once detached it is a reconnect.
            if session.verified and (peer.uid, peer.pid) != (session.uid, session.pid):
                raise ProtocolError(ErrorCode.PERMISSION_DENIED,
                                    f"this connection is client {session.client_id} of another process")
            if session.state is not None:
                raise ProtocolError(ErrorCode.ALREADY_ATTACHED,
                                    f"client {session.client_id} is attached to engine {session.engine!r}; "
                                    "send DETACH before HELLO again")
            self._detach(session)
            del self.sessions[identity]
        if len(self.sessions) >= self.max_clients:
            raise ProtocolError(ErrorCode.TOO_MANY_CLIENTS, f"{len(self.sessions)} clients connected (max {self.max_clients})")
        if self.max_clients_per_uid:
            mine = sum(1 for other in self.sessions.values() if other.uid == peer.uid)
            if mine >= self.max_clients_per_uid:
                raise ProtocolError(ErrorCode.QUOTA_EXCEEDED, f"uid {peer.uid} has {mine} clients connected "
                                    f"(max_clients_per_uid {self.max_clients_per_uid})")
        pid = peer.pid
        claimed = h.get("pid")
        if peer.verified and claimed != pid:
            # Another pid namespace (a container) numbers the process differently, or the
            # client lies: either way the kernel's number is the one to watch.
            log.info("client hello claims pid %s; the kernel says %d (another pid namespace?): using %d",
                     str(claimed)[:24], pid, pid)
        started = None
        if pid > 0:
            try:
                started = psutil.Process(pid).create_time()
            except (psutil.Error, ValueError, OSError):  # OSError: EMFILE, say
                pass
        s = Session(identity, self._next_client_id, pid, rank, str(h["device"]), str(h["name"])[:128], started,
                    uid=peer.uid, gid=peer.gid, verified=peer.verified, peer_address=peer.address)
        self._next_client_id += 1
        s.watch = self._watch(s)
        self._expired.pop(identity, None)
        self.sessions[identity] = s
        log.info("client %d hello: pid %d uid %d rank %d device %s %s", s.client_id, pid, s.uid, rank, s.device, s.name)
        if peer.verified and pid == 0:
            log.warning("client %d (uid %d) runs outside the daemon's pid namespace: if it dies attached, its rank "
                        "is not reclaimed until the daemon stops (run engines with the host's pid namespace)",
                        s.client_id, s.uid)
        return {"client_id": s.client_id, "daemon_pid": os.getpid(), "version": PROTOCOL_VERSION,
                **self.backend.describe()}, None

    def on_attach(self, s: Session, identity, h, arrays):
        if s.state is not None:
            raise ProtocolError(ErrorCode.ALREADY_ATTACHED, f"client {s.client_id} is attached to engine {s.engine!r}")
        engine = str(h["engine"])
        if not engine or len(engine) > 128:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "engine must be a name of 1..128 characters")
        try:
            layout = Layout.from_wire(h["layout"])
        except (LayoutError, TypeError) as e:
            raise ProtocolError(ErrorCode.BAD_LAYOUT, str(e)) from None
        created = engine not in self.engines
        if s.watch is None and s.pid > 0:  # watched again from now on (DETACH closed it)
            s.watch = self._watch(s)
            if s.watch is not None and s.proc_started is not None and _started(s.pid) != s.proc_started:
                # The pid is another process's now: whoever holds this connection is not
                # the process that said HELLO. The reaper's periodic check reclaims it.
                s.watch.close()
                s.watch = None
                raise ProtocolError(ErrorCode.PERMISSION_DENIED,
                                    f"the process that said HELLO as client {s.client_id} has exited; connect again")
        slab_field = h.get("slab")
        check_layout_limits(layout, self.max_slab_bytes, engine_slab=slab_field is not None)  # before allocating
        transport = h.get("transport", "zmq")
        if transport not in ("zmq", "doorbell"):
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"transport must be 'zmq' or 'doorbell', got {transport!r}")
        if transport == "doorbell" and self.backend.name != "cuda":
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "the doorbell transport needs the cuda backend (device rings "
                                f"and stream memory operations); this daemon runs {self.backend.name}: use zmq")
        engine_slab = self._engine_slab(s, layout, slab_field) if slab_field is not None else None
        admin = not created and self._is_admin(s)  # only joining needs it (a /proc read)
        try:
            if created and (zeroing := self.pool.zeroing_to_wait_for(layout.pool_bytes)):
                # Only released ranges, once zeroed, make room: wait for them off the loop.
                yield Slow(functools.partial(wait_futures, zeroing), engine=engine)
            pending = self.engines.begin_attach(s.client_id, s.rank, s.device, engine, layout,
                                                h.get("fence_events"), owner=Owner(s.uid, s.gid), privileged=admin,
                                                transport=transport, engine_slab=engine_slab)
            try:
                # The slow part on a worker thread: the rank's slab (cpu), the pinning of
                # a new engine's pool range (cuda). ATTACHes to a new engine wait for it.
                yield Slow(functools.partial(self.engines.prepare, pending), engine=engine if pending.created else None)
                state, handles = self.engines.commit(pending)
            except BaseException:  # an error, or Gone: nothing of this attach stays
                self.engines.abort(pending)
                raise
        except (PoolError, ProtocolError, ResidencyError) as e:
            # An engine that cannot attach (no room in the pool, another layout, no room
            # for its slab) is the operator's business, not only the client's: warn.
            # The log may name the owner (the operator's view); the client's reply does not.
            owner = self.engines.space(engine).owner if engine in self.engines else None
            log.warning("client %d (pid %d uid %d rank %d) refused: attach to engine %r%s: %s: %s", s.client_id,
                        s.pid, s.uid, s.rank, engine, f" (owner uid {owner.uid})" if owner else "",
                        _code_of(e).name, e.args[0] if e.args else e)
            raise
        finally:
            if engine_slab is not None:
                engine_slab.close()  # its descriptor, unless the backend took it
        s.engine, s.state = engine, state
        log.info("client %d attached to engine %r (%s)", s.client_id, engine,
                 f"new, owner uid {s.uid}" if created else "joined")
        if self.backend.share_fds(s.client_id):
            # The rank's shared memory has no name to open: its descriptors go to this
            # process only, over the fd socket, for this one-time token.
            s.fd_token = self.fd_server.offer(s)
            handles = {**handles, "fd_socket": fd_socket.FD_SOCKET, "fd_token": s.fd_token}
        return {"handles": handles, "layout": layout.to_wire()}, None

    def _engine_slab(self, s: Session, layout: Layout, field) -> EngineSlabImport:
        """ATTACH's ``slab`` (an engine-owned slab, proto/slab.py): its geometry, checked
        against the layout, and its memory: on cpu the memfd this session's process
        deposited on the fd socket, on cuda a CUDA IPC handle and offset."""
        if not isinstance(field, dict) or "geometry" not in field:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "slab must be a map with a geometry (and, on the cpu "
                                "backend, the deposit id of the slab's descriptor)")
        try:
            geo = SlabGeometry.from_wire(field["geometry"]).check(layout, align=1 if self.backend.name == "cpu"
                                                                   else ROW_ALIGN_BYTES)
        except (LayoutError, TypeError) as e:
            raise ProtocolError(ErrorCode.BAD_LAYOUT, str(e)) from None
        if self.backend.name != "cpu":  # device memory, exported by the engine through CUDA IPC
            handle, offset = field.get("ipc_handle"), field.get("ipc_offset")
            if not isinstance(handle, bytes) or len(handle) != 64 or type(offset) is not int or offset < 0:
                raise ProtocolError(ErrorCode.BAD_ARGUMENT, "a cuda rank's slab needs ipc_handle (the 64-byte CUDA "
                                    "IPC handle of the allocation) and ipc_offset (an int >= 0)")
            return EngineSlabImport(geo, ipc=(handle, offset))
        fd = self.fd_server.take_deposit(field.get("deposit"), s.pid, s.uid, s.gid)
        return EngineSlabImport(geo, fd)

    def on_step(self, s: Session, identity, h, a):
        st = self._state(s)
        if "state_rows" not in a:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "STEP needs the state_rows array")
        # .size, not .shape[0]: a 0-d array must reach begin_step's BAD_ARGUMENT, not IndexError.
        _batch_fits(st, a["state_rows"].size)
        st.begin_step(_int(h, "step"), a["state_rows"], a.get("reset"), a.get("invalidate"))
        self.stats.add(steps=1)
        return {}, None

    def on_topk(self, s: Session, identity, h, a):
        st = self._state(s)
        fence = _fence(h)
        step = _int(h, "step")
        block = h.get("block")
        if block is not None:
            # The client wrote the step block(s) into its pinned ring entry `block`: no
            # array on the socket, nothing to copy (cuda ranks only).
            if type(block) is not int or a:
                raise ProtocolError(ErrorCode.BAD_ARGUMENT, "block must be an entry number, sent without arrays")
            done = h.get("done")  # device wait: the value of the entry's done word (client.py)
            if done is not None and (type(done) is not int or not 0 <= done <= 0xFFFFFFFF):
                raise ProtocolError(ErrorCode.BAD_ARGUMENT, "done must be an integer in [0, 2**32)")
            serve = getattr(st, "serve_topk_block", None)
            if serve is None:
                raise ProtocolError(ErrorCode.BAD_ARGUMENT, "this rank has no client-written step blocks (cuda only)")
            begin = h.get("begin") is True
            fields, arrays, deltas = serve(step, _int(h, "group"), block, begin, fence, done)
            c = self.stats.c
            c["steps"] += begin
            for k, v in deltas.items():
                c[k] += v
            return fields, arrays
        if "topk" not in a:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "TOPK needs the topk array")
        state_rows = a.get("state_rows")
        if h.get("begin") is True:
            # The step's STEP rides on its first TOPK (one message, one wake-up): begin
            # the step with these arrays, then resolve against its state rows.
            if state_rows is None:
                raise ProtocolError(ErrorCode.BAD_ARGUMENT, "a TOPK that begins a step needs the state_rows array")
            _batch_fits(st, state_rows.size)
            st.check_fence(fence)  # all or nothing: the STEP does not run if the TOPK cannot
            st.begin_step(step, state_rows, a.get("reset"), a.get("invalidate"))
            self.stats.c["steps"] += 1
            state_rows = None
        elif "reset" in a or "invalidate" in a:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "reset and invalidate go with a TOPK only when it begins a step")
        topk = a["topk"]
        if topk.ndim:  # before any work: rows of padding cost as much as live ones
            _batch_fits(st, topk.shape[0])
        fields, arrays, deltas = st.serve_topk(step, _int(h, "group"), topk, state_rows, fence)
        c = self.stats.c
        for k, v in deltas.items():
            c[k] += v
        return fields, arrays

    def on_write(self, s: Session, identity, h, a):
        self._state(s)
        if "rows" not in a or "data" not in a:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "WRITE needs the rows and data arrays")
        if a["rows"].size > LIMITS.max_write_rows:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"a write of {a['rows'].size} rows exceeds {LIMITS.max_write_rows}")
        space = self.engines.space(s.engine)
        layers, rows, data = space.check_write(_layers(h), a["rows"], a["data"])
        nbytes, dropped = yield from self._write_rows(s, space, layers, rows, data)
        self.stats.add(rows_written=rows.shape[0] * len(layers), bytes_written=nbytes, hot_invalidated=dropped)
        return {"bytes": nbytes, "invalidated": dropped}, None

    def on_write_staged(self, s: Session, identity, h, a):
        st = self._state(s)
        if "rows" not in a:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "WRITE_STAGED needs the rows array")
        fence = _fence(h)
        space = self.engines.space(s.engine)
        if st.host_memory:  # cpu: a host copy out of the staging buffer, maybe a large one
            layers, rows = space.check_staged(st, _layers(h), a["rows"])
            src = st.staged_rows(layers, rows.shape[0])
            nbytes, dropped = yield from self._write_rows(s, space, layers, rows, src)
        else:  # cuda: enqueued on the device, never waited for
            nbytes, dropped = space.write_staged(st, _layers(h), a["rows"], fence)
        self.stats.add(rows_written=nbytes // st.residency.layout.row_bytes, bytes_written=nbytes, hot_invalidated=dropped)
        return {"bytes": nbytes, "invalidated": dropped}, None

    def _write_rows(self, s: Session, space, layers, rows, src):
        """A write's bulk, for ``yield from``: every rank of the engine quiesced, ``src``
        copied into the pool rows (on a worker thread when large: requests on the engine
        wait meanwhile), then every hot copy of the rows dropped, whatever happened (the
        rows may have changed). Returns (bytes, slots dropped)."""
        nbytes = len(layers) * rows.shape[0] * space.layout.row_bytes
        space.quiesce()
        try:
            if nbytes >= self.heavy_bytes:
                yield Slow(functools.partial(space.copy_rows, layers, rows, src), engine=s.engine)
            else:
                space.copy_rows(layers, rows, src)
        finally:
            dropped = space.drop_rewritten(rows)
        return nbytes, dropped

    def on_stage(self, s: Session, identity, h, a):
        st = self._state(s)
        if "rows" not in a:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "STAGE needs the rows array")
        layers, lay = _layers(h), st.residency.layout
        if st.host_memory and a["rows"].size * len(layers or range(lay.num_layers)) * lay.row_bytes >= self.heavy_bytes:
            # cpu: pool rows to the staging buffer on a worker thread (checked there);
            # writes to the engine wait meanwhile
            nbytes = yield Slow(functools.partial(st.stage, a["rows"], layers), engine=s.engine)
        else:
            nbytes = st.stage(a["rows"], layers)
        self.stats.add(rows_staged=nbytes // st.residency.layout.row_bytes)
        return {"bytes": nbytes}, None

    def on_detach(self, s: Session, identity, h, a):
        attached = s.state is not None
        engine = s.engine
        self._detach(s)
        # A clean exit: the client said goodbye (the reaper's "gone" is the unclean one).
        log.info("client %d (pid %d rank %d) detached%s", s.client_id, s.pid, s.rank,
                 f" from engine {engine!r}" if attached else " (was not attached)")
        return {"was_attached": attached}, None

    def on_bye(self, s: Session, identity, h, a):
        # Client.close(): the client leaves for good. Detach (if attached) and forget the
        # session, so short-lived clients of a long-lived process never fill max_clients
        # (the reaper only frees sessions of processes that have exited).
        attached = s.state is not None
        engine = s.engine
        self._detach(s)
        self.sessions.pop(identity, None)
        log.info("client %d (pid %d rank %d) said goodbye%s", s.client_id, s.pid, s.rank,
                 f", detached from engine {engine!r}" if attached else "")
        return {"was_attached": attached}, None

    def on_stats(self, s: Session, identity, h, a):
        return {"stats": self.snapshot()}, None

    # -- helpers ------------------------------------------------------------------
    def _state(self, s: Session) -> RankState:
        if s.state is None:
            raise ProtocolError(ErrorCode.NOT_ATTACHED, f"client {s.client_id} has not attached a layout")
        return s.state

    def _count_client_error(self, identity: bytes) -> None:
        s = self.sessions.get(identity)  # error path only: the hot path does not pay for it
        if s is not None:
            s.errors += 1

    def _detach(self, s: Session) -> None:
        """Release ``s``'s rank, if any, and stop watching its process: on DETACH (a
        later ATTACH watches it again), when it is reaped or replaced, and at stop."""
        if s.watch is not None:
            s.watch.close()
            s.watch = None
        if s.fd_token is not None:  # withdrawn with the rank
            self.fd_server.withdraw(s.fd_token)
            s.fd_token = None
        if s.state is None:
            return
        if self.heavy.running(s.identity):
            return  # (reaped) its heavy request still uses the rank: _resume releases it
        self.engines.detach(s.client_id, s.engine)
        log.debug("client %d released its rank of engine %r", s.client_id, s.engine)
        # The last reference to a cpu rank's memory is dropped on a worker thread: the
        # unmapping of a large slab (the pages go with the last mapping) takes ~0.1 s a GiB.
        box = [s.state] if s.state.host_memory else []
        s.state, s.engine = None, None
        self.heavy.release(box)

    def _watch(self, s: Session) -> PidWatch | None:
        """A pidfd of ``s``'s process whose exit reaps ``s`` at once (None: pid 0, or no
        pidfd here; then the reaper's periodic check is all there is)."""
        if s.pid <= 0:
            return None
        try:
            return PidWatch(s.pid, functools.partial(self._pid_exited, s.identity, s.client_id))
        except (OSError, AttributeError) as e:
            log.debug("client %d: no pidfd for pid %d (%s); the periodic check watches it", s.client_id, s.pid, e)
            return None

    def _pid_exited(self, identity: bytes, client_id: int) -> None:
        """The event loop saw a client's pidfd become readable: its process has exited."""
        s = self.sessions.get(identity)
        if s is None or s.client_id != client_id:
            return  # already gone (its watch was closed with it)
        try:
            self._reap(s)
        except Exception:  # noqa: BLE001 - a callback of the loop: log, never raise
            log.exception("reaping client %d failed", client_id)

    def _is_admin(self, s: Session) -> bool:
        """Whether ``s``'s process is in the admin group (primary or supplementary gid).
        Supplementary groups come from ``/proc``, trusted only while the pidfd shows the
        process that said HELLO still running (the pid cannot have been reused)."""
        if self.admin_gid is None:
            return False
        if s.verified and s.gid == self.admin_gid:
            return True
        if not s.verified or s.watch is None:
            return False
        groups = process_groups(s.pid)
        return self.admin_gid in groups and not s.watch.exited()

    def snapshot(self) -> dict:
        # cuda: hits, misses and bytes are counted on the GPUs; this reads their pinned
        # host mirrors (no synchronisation), and the rows the kernels refused, by kind.
        device_errors = getattr(self.backend, "device_errors", None)
        arenas = self._arenas()
        return self.stats.snapshot(self.backend.device_counters(), {
            **self.backend.describe(),
            **({"device_errors": device_errors()} if device_errors else {}),
            **({"arenas": arenas} if arenas is not None else {}),
            "clients": len(self.sessions),
            **self.connections.counters(),  # counted on the connection guard's thread
            "attached": sum(1 for s in self.sessions.values() if s.state is not None),
            **self.engines.gauges(),
            "per_engine": self._per_engine(),
            "protocol_version": PROTOCOL_VERSION,
            "version": self.version,
            "io_cpus": format_cpu_list(self.io_cpus),
            "warm_cpus": format_cpu_list(self.warmer.cpus) if self.warmer is not None else "",
            "warm_cpus_running": self.warmer.running() if self.warmer is not None else 0,
            "warm_cpus_revived": self.warmer.revived if self.warmer is not None else 0,
            "pid": os.getpid(),
        })

    def _per_engine(self) -> dict:
        out = {}
        for name in self.engines:
            space = self.engines.space(name)
            lay = space.layout
            out[name] = {"ranks": len(space.ranks), "pool_bytes": lay.pool_bytes,
                         "slab_bytes": len(space.ranks) * lay.slab_bytes}
        return out

    def _arenas(self) -> dict | None:
        """cuda: each GPU's arena (one allocation for every rank's slab and rings)."""
        workers = getattr(self.backend, "workers", None)
        if not workers:
            return None
        out = {}
        for w in workers:
            arena = getattr(w, "arena", None)
            if arena is not None:
                out[f"cuda:{w.ordinal}"] = {"bytes": int(arena.nbytes), "used_bytes": int(arena.used_bytes)}
        return out

    def client_lines(self) -> str:
        """One tab-separated line per client under a header line; columns may be added
        (``sparsekv top`` and tests read them by header name), ``name`` stays last."""
        now = time.time()
        # pid and uid are the kernel's (SO_PEERCRED); pid 0: unknown (another pid namespace).
        lines = ["id\tpid\trank\tdevice\tengine\tattached\trequests\terrors\tage_s\tuid\tname"]
        for s in sorted(self.sessions.values(), key=lambda s: s.client_id):
            name = (s.name or "-").replace("\t", " ").replace("\n", " ")
            lines.append(
                f"{s.client_id}\t{s.pid}\t{s.rank}\t{s.device}\t{s.engine or '-'}\t"
                f"{'yes' if s.state else 'no'}\t{s.requests}\t{s.errors}\t{now - s.connected_at:.0f}\t{s.uid}\t{name}"
            )
        return "\n".join(lines) + "\n"

    def reap_dead(self) -> int:
        """Detach clients whose process is gone (ZeroMQ does not say when a peer leaves).

        A watched client (pidfd) is normally reaped the moment it exits, by the event
        loop; this periodic pass is the fallback for clients without a pidfd (DETACHed,
        or no ``pidfd_open``), checked by pid and start time. A session of pid 0 (an
        in-process call, or a process outside the daemon's pid namespace) is never
        reaped: nothing says whether it lives."""
        dead = [s for s in self.sessions.values() if not _alive(s)]
        for s in dead:
            self._reap(s)
        self.fd_server.expire()  # engine slabs deposited and never attached with
        self.expire_idle()
        return len(dead)

    def expire_idle(self) -> int:
        """Drop the sessions that are not attached (never, or no more) and sent no request
        for ``idle_timeout_s``: such a client holds a place in ``max_clients`` and in its
        uid's quota. Its connection stays (its libzmq would only reconnect); its next
        request is told why. An attached rank may idle as long as its process lives.
        Returns how many were dropped."""
        limit = time.monotonic() - self.idle_timeout_s
        idle = [s for s in self.sessions.values()
                if s.state is None and s.last_request_at <= limit and not self.heavy.busy(s.identity)]
        for s in idle:
            log.info("client %d (pid %d uid %d) dropped: no request for %g s and not attached", s.client_id, s.pid,
                     s.uid, self.idle_timeout_s)
            self.sessions.pop(s.identity, None)
            self._detach(s)
            self._expired[s.identity] = (f"client {s.client_id}'s session expired: no request for "
                                         f"{self.idle_timeout_s:g} s and not attached (idle_timeout_s); connect again")
            while len(self._expired) > 1024:
                self._expired.popitem(last=False)
        self.stats.add(sessions_expired=len(idle))
        return len(idle)

    def _reap(self, s: Session) -> None:
        """Forget session ``s`` whose process is gone, and release what it held."""
        self.sessions.pop(s.identity, None)
        self.heavy.forget(s.identity)  # its requests waiting behind a heavy one
        if s.state is not None:  # died attached: it never said goodbye
            log.warning("client %d (pid %d rank %d) is gone; detaching it from engine %r",
                        s.client_id, s.pid, s.rank, s.engine)
        else:  # had detached (or never attached): a normal exit
            log.info("client %d (pid %d) exited", s.client_id, s.pid)
        self._detach(s)

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(self.reap_interval_s)
            try:
                self.reap_dead()
            except Exception:  # noqa: BLE001
                log.exception("reaper failed")
            if self.warmer is not None:
                try:
                    for cpu, why in self.warmer.revive():
                        log.warning("the warm loop of CPU %d had exited (%s): started again", cpu, why)
                except OSError as e:
                    log.error("cannot start a warm loop again: %s", e)

    async def _health(self) -> None:
        """Exit (70) once the backend cannot serve anyone: GPU work that runs without
        requests (a doorbell rank's stream) fails where no reply can say so."""
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            why = self.backend.failure()
            if why:
                self._fatal(why)
                return

    async def _watchdog(self) -> None:
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(self.notifier.watchdog_interval_s)

    async def _stats_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), timeout=5.0)
            cmd = line.decode(errors="replace").strip().lower() or "stats"
            if cmd == "stats":
                out = stats_mod.render_table(self.snapshot())
            elif cmd == "json":
                out = stats_mod.render_json(self.snapshot())
            elif cmd == "prometheus":
                out = stats_mod.render_prometheus(self.registry)
            elif cmd == "clients":
                out = self.client_lines()
            elif cmd == "health":
                # The socket exists only once the daemon serves (READY=1 sent): answering is ready.
                out = f"ready pid={os.getpid()} clients={len(self.sessions)}\n"
            else:
                out = f"error: unknown command {cmd[:40]!r}; try stats, json, prometheus, clients, health\n"
            writer.write(out.encode())
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    @staticmethod
    def _is_attacher(s: Session, pid: int, uid: int, gid: int) -> bool:
        """Whether process ``pid`` (uid, gid: SO_PEERCRED of the fd socket) is the one
        that said HELLO as ``s`` (SO_PEERCRED of control.sock) and still runs; an
        in-process session (no credentials) is the daemon's own process."""
        if not s.verified:
            return pid == os.getpid()
        if (pid, uid, gid) != (s.pid, s.uid, s.gid):
            return False
        return s.watch is None or not s.watch.exited()  # exited: the pid may be another's now

    async def _http_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A minimal HTTP/1.0 responder: ``GET /metrics`` (Prometheus text), one request
        per connection. Runs on the daemon's loop: a scrape costs one snapshot, no thread."""
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
                status, body, ctype = "200 OK", stats_mod.render_prometheus(self.registry).encode(), _PROMETHEUS_TEXT
            head_out = (f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                        f"{extra}Connection: close\r\n\r\n").encode()
            writer.write(head_out if parts and parts[0] == "HEAD" else head_out + body)
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()


_KINDS = {int(m): m for m in MsgType}
_WAIT = object()  # _handle: the request waits for a heavy request in flight on its engine


def _frame_property(frames, name, unreadable):
    """libzmq's property ``name`` of received frames (``unreadable`` if libzmq has none);
    None for plain bytes (an in-process call)."""
    get = getattr(frames[0], "get", None) if frames else None
    if get is None:
        return None
    try:
        return get(name)
    except Exception:  # noqa: BLE001 - zmq.ZMQError: no such property (an older or newer libzmq)
        return unreadable


def _peer_address(frames) -> str | None:
    """libzmq's ``Peer-Address`` of received frames ("" if unreadable); None for plain
    bytes (an in-process call)."""
    return _frame_property(frames, "Peer-Address", "")


def _src_fd(frames) -> int | None:
    """The descriptor of the connection received frames came on (libzmq's ``ZMQ_SRCFD``
    property: deprecated, present in 4.3); None for plain bytes or when unreadable."""
    fd = _frame_property(frames, zmq.SRCFD, None)
    return fd if type(fd) is int and fd >= 0 else None


# What generate_latest() writes (prometheus_client's CONTENT_TYPE_LATEST names 1.0.0 in
# recent releases, which this text is not).
_PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
_DRAIN_SLICE_NS = 20_000_000  # most time one loop wake-up spends on requests


# What one peer may cost the ROUTER (libzmq enforces these in its I/O thread):
# - the largest frame of a legal request; a peer announcing a larger one is disconnected
#   before the frame is read (ZMQ_MAXMSGSIZE applies to each frame of a multipart);
MAX_MESSAGE_BYTES = max(LIMITS.max_frame_bytes, LIMITS.max_header_bytes)
# - a PING every HEARTBEAT_IVL_MS; a connection silent for HEARTBEAT_TIMEOUT_MS (a frozen
#   or vanished peer: nothing answers the PINGs) is closed;
HEARTBEAT_IVL_MS = 5_000
HEARTBEAT_TIMEOUT_MS = 30_000
# - a connection that has not finished the ZMTP handshake within this is closed (a raw
#   socket that connects and says nothing holds a descriptor only this long).
HANDSHAKE_IVL_MS = 5_000
LISTEN_BACKLOG = 32
# - libzmq reads a large frame in one read() while its sender keeps up (256 MiB: 0.1-0.3 s
#   on the 2-core dev VM), and every connection served by the same I/O thread waits
#   meanwhile. A new connection goes to the least loaded thread: with several, one
#   client's large WRITE stalls only those that share its thread. Measured, another
#   client's top-k during a 256 MiB WRITE: 1 thread 250-370 ms, 2: 27 ms, 4: 17-57 ms
#   (tests/soak/stall.py; what is left there is both cores copying the frame).
ZMQ_IO_THREADS = 4

HEALTH_INTERVAL_S = 0.25  # how often the backend's own failures are looked for
EXIT_FATAL = 70  # EX_SOFTWARE: the daemon cannot go on (a sticky CUDA error)

# CUDA errors after which the context is unusable and the process must exit ("sticky"):
# the runtime's cudaError and the driver's CUresult share these numbers.
STICKY_CUDA_ERRORS = {
    214: "ECC uncorrectable",
    700: "illegal address",
    702: "launch timeout",
    710: "device-side assert",
    714: "hardware stack error",
    715: "illegal instruction",
    716: "misaligned address",
    717: "invalid address space",
    718: "invalid program counter",
    719: "launch failure",
}
_CUDA_ERROR_CLASSES = frozenset({"CUDARuntimeError", "CUDADriverError"})


def sticky_cuda_error(e: BaseException) -> str | None:
    """``"700 (illegal address)"`` when ``e`` (or an exception it was raised from) is
    CuPy's ``CUDARuntimeError`` / ``CUDADriverError`` with a sticky status; else None.
    Matched by class name and ``.status``: the cpu backend never imports CuPy."""
    seen = 0
    while e is not None and seen < 8:
        if type(e).__name__ in _CUDA_ERROR_CLASSES:
            status = getattr(e, "status", None)
            if isinstance(status, int) and status in STICKY_CUDA_ERRORS:
                return f"{status} ({STICKY_CUDA_ERRORS[status]})"
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def _int(h: dict, name: str) -> int:
    v = h.get(name)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"field {name!r} must be an integer, got {type(v).__name__}")
    return v


def _batch_fits(st: RankState, rows: int) -> None:
    """TOO_LARGE unless a batch of ``rows`` rows fits the protocol and the rank's layout
    (its ``max_batch``: device buffers are sized by it, and a cpu resolve is as slow for
    padding rows as for live ones)."""
    limit = st.residency.layout.max_batch
    if rows > LIMITS.max_batch or rows > limit:
        raise ProtocolError(ErrorCode.TOO_LARGE,
                            f"batch of {rows} rows exceeds max_batch {min(limit, LIMITS.max_batch)}")


def _layers(h: dict) -> list[int] | None:
    """The ``layers`` field: null (every layer) or a non-empty list of integers (their
    range is the layout's to check)."""
    v = h["layers"]
    if v is None:
        return None
    if type(v) is not list or not v or not all(type(x) is int for x in v):
        raise ProtocolError(ErrorCode.BAD_ARGUMENT,
                            f"layers must be null (every layer) or a non-empty list of layer numbers, got {str(v)[:60]}")
    return v


def _fence(h: dict) -> int | None:
    """The optional ``fence`` field: an entry of the client's exported event ring."""
    fence = h.get("fence")
    if fence is not None and (not isinstance(fence, int) or isinstance(fence, bool)):
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, "fence must be an integer entry of the client's event ring")
    return fence


def _code_of(e: Exception) -> ErrorCode:
    if isinstance(e, ProtocolError):
        return e.code
    if isinstance(e, ResidencyError):
        return ErrorCode[e.code]
    if isinstance(e, LayoutError):
        return ErrorCode.BAD_LAYOUT
    if isinstance(e, PoolError):
        return ErrorCode.POOL_FULL
    return ErrorCode.INTERNAL


def _started(pid: int) -> float | None:
    """Process ``pid``'s start time (psutil), None when it cannot be read."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, ValueError, OverflowError):
        return None


def _alive(s: Session) -> bool:
    """Whether session ``s``'s process still runs, for the reaper's periodic pass."""
    if s.pid <= 0:
        return True  # unknown (in process, or outside our pid namespace): never reaped
    if s.watch is not None:
        return not s.watch.exited()
    try:
        p = psutil.Process(s.pid)
        alive = p.create_time() == s.proc_started if s.proc_started else True
        # A killed client that its parent has not waited for yet is a zombie: it still
        # has a create time, but it will never send again.
        return alive and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # cannot tell (permissions): keep it
