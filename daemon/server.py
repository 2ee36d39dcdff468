"""The control plane's loop and dispatch: the control socket (ZMTP, daemon/control_socket.py)
served on (uv)asyncio, plus the stats socket, the fd socket and the optional loopback HTTP
``/metrics`` endpoint (same loop, same thread).

One thread owns the control socket and every worker's state (STYLE 5): requests are
handled one at a time in arrival order, so no lock guards the residency state; on cuda
the handlers only enqueue GPU work. The slow part of a heavy request runs on a worker
thread and its reply comes later (daemon/heavy.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import types

from prometheus_client import CollectorRegistry

from sparsekv.proto import (ERROR_HINTS, PROTOCOL_VERSION, REQUESTS, ErrorCode, LayoutError, MsgType, ProtocolError,
                            decode, reply_error, reply_ok)
from sparsekv.proto import fd_socket
from sparsekv.proto.settings import format_size

from . import stats as stats_mod
from .control_socket import ControlSocket
from .inflight import message_ids
from .block_requests import BlockRequests
from .blocks.contract import BlockError
from .engine_blocks import UnsafeRows
from .engine_requests import EngineRequests, code_of
from .fd_server import FdServer
from .heavy import MAX_WAITING, Gone, HeavyRequests, Job
from .notify import Notifier
from .operator_requests import STREAM_LIMIT, OperatorRequests
from .pool import HostPool, PoolError
from .registry import EngineRegistry
from .residency.base import ResidencyError
from .sessions import Sessions, is_attacher, opener_gone
from .snapshot import Snapshot

log = logging.getLogger("sparsekv.server")


class Daemon:
    """The serving loop and the dispatch of requests to their role's handlers."""

    # 0, or EXIT_FATAL once an error no one can be served after was hit (_fatal).
    exit_code = 0
    fatal_reason = ""

    def __init__(self, run_dir: str, backend, pool: HostPool, *, max_clients: int = 256,
                 reap_interval_s: float = 2.0, notifier: Notifier | None = None, busy_poll_us: int = 0,
                 metrics_port: int = 0, admin_gid: int | None = None, max_clients_per_uid: int = 0,
                 max_pool_bytes_per_uid: int = 0, max_connections_per_uid: int = 0, hello_timeout_s: float = 10.0,
                 idle_timeout_s: float = 600.0, inflight_bytes: int = 256 << 20, io_cpus: tuple[int, ...] = (),
                 warmer=None, max_blocks_per_uid: int = 0, max_rank_bytes_per_uid: int = 0):
        self.run_dir = run_dir
        self.control_path = os.path.join(run_dir, "control.sock")
        self.stats_path = os.path.join(run_dir, "stats.sock")
        self.fd_path = os.path.join(run_dir, fd_socket.FD_SOCKET)
        self.io_cpus = tuple(io_cpus)
        self.warmer = warmer
        self.backend = backend
        self.pool = pool
        self.control = ControlSocket(self.control_path, on_message=self._received, on_closed=self._connection_closed,
                                     inflight_bytes=inflight_bytes, max_per_uid=max_connections_per_uid,
                                     hello_timeout_s=hello_timeout_s)
        self.reap_interval_s = reap_interval_s
        self.busy_poll_ns = int(busy_poll_us) * 1000
        self.notifier = notifier or Notifier({})
        # The daemon's own registry, never prometheus_client's global one.
        self.registry = CollectorRegistry()
        self.stats = stats_mod.Stats(registry=self.registry)
        self.metrics_port = int(metrics_port)  # 0: no HTTP endpoint
        self.metrics_address: tuple[str, int] | None = None  # once bound
        self.engines = EngineRegistry(pool, backend, max_pool_bytes_per_uid=max_pool_bytes_per_uid,
                                      max_blocks_per_uid=max_blocks_per_uid,
                                      max_rank_bytes_per_uid=max_rank_bytes_per_uid)
        self.heavy = HeavyRequests()
        self._serving = False
        self.fd_server = FdServer(self.stats, lambda cid: self.backend.share_fds(cid), is_attacher,
                                  lambda peer: self.sessions.sees_all(peer))
        self.sessions = Sessions(self.engines, self.heavy, self.fd_server, self.stats, max_clients=max_clients,
                                 max_clients_per_uid=max_clients_per_uid, idle_timeout_s=idle_timeout_s,
                                 admin_gid=admin_gid)
        self.snapshot = Snapshot(self.stats, backend, self.sessions, self.control, self.engines, io_cpus, warmer)
        collector = stats_mod.SnapshotCollector(self.snapshot)
        self.registry.register(collector)
        self.engine_requests = EngineRequests(self.sessions, self.engines, backend, pool, self.stats, self.fd_server)
        self.operator_requests = OperatorRequests(self.snapshot, self.registry, self.sessions, self.stats, collector)
        self._stop = asyncio.Event()
        self.block_requests = BlockRequests(self.engines, self.stats, self.fd_server)
        self.handlers = {**self.engine_requests.handlers(), **self.operator_requests.handlers(),
                         **self.block_requests.handlers()}
        # The protocol is declared once in proto/; refuse to start if it and the handlers drift.
        missing = set(REQUESTS) - set(self.handlers)
        if missing or set(self.handlers) - set(REQUESTS):
            raise RuntimeError(f"handlers do not match proto.REQUESTS: {sorted(m.name for m in missing)}")

    # -- serving ------------------------------------------------------------------
    async def serve(self, on_ready=None) -> None:
        # The loop watches the ZeroMQ socket's (edge-triggered) descriptor: each wake-up
        # drains every queued request, re-reading ZMQ_EVENTS until no input is left.
        http_server = None
        if self.metrics_port:
            # First: a port in use fails the start before any socket of the run dir exists.
            # Loopback only: the endpoint has no authentication.
            http_server = await asyncio.start_server(self.operator_requests.http_client, host="127.0.0.1",
                                                     port=self.metrics_port, limit=STREAM_LIMIT)
            self.metrics_address = http_server.sockets[0].getsockname()[:2]
            log.info("metrics on http://%s:%d/metrics", *self.metrics_address)
        others = os.sched_getaffinity(0)
        if self.io_cpus:  # this thread reads the control socket; the workers keep off its CPUs
            os.sched_setaffinity(0, self.io_cpus)
        if os.path.lexists(self.stats_path):
            os.unlink(self.stats_path)
        # The stats and fd sockets first: whoever sees control.sock finds them there too.
        stats_server = await asyncio.start_unix_server(self.operator_requests.stats_client, path=self.stats_path,
                                                       limit=STREAM_LIMIT)
        os.chmod(self.stats_path, 0o660)
        try:
            await self.fd_server.start(self.fd_path)
        except BaseException:
            stats_server.close()
            raise
        loop = asyncio.get_running_loop()
        self.control.open(loop)
        self._serving = True
        self.heavy.open(loop, others if self.io_cpus else None, released=lambda: self._serve_waiting(last=b""),
                        failed=self._fatal)
        loop.add_reader(self.control.fileno(), self._drain)
        tasks = [asyncio.create_task(self._reaper(), name="reaper"),
                 asyncio.create_task(self._health(), name="health"),
                 asyncio.create_task(self._connections(), name="connections")]
        if self.notifier.watchdog_interval_s:
            tasks.append(asyncio.create_task(self._watchdog(), name="watchdog"))
        where = "the cpu backend" if self.backend.name == "cpu" else f"{len(self.backend.devices)} GPU(s)"
        status = f"serving on {where}, pool {format_size(self.pool.size_bytes)}"
        log.info("ready: %s on %s", status, self.control_path)
        self.notifier.ready(status)
        if on_ready:
            on_ready()
        try:
            self._drain()  # anything that arrived before the reader was registered
            await self._stop.wait()
        finally:
            if self.exit_code:  # keep saying why in `systemctl status`
                self.notifier.send(STOPPING=1, STATUS=f"failed: {self.fatal_reason[:200]}")
            else:
                self.notifier.stopping()
            log.info("stopping: detaching %d client(s)", len(self.sessions))
            loop.remove_reader(self.control.fileno())
            for t in tasks:
                t.cancel()
            stats_server.close()
            self.fd_server.close()
            if http_server is not None:
                http_server.close()
            for job in self.heavy.close(wait=not self.exit_code):
                self._resume(job, None, Gone("the daemon stops"))
            if self.exit_code:  # the GPU context is lost: the process exit frees everything
                log.info("not detaching %d client(s): the daemon is failing", len(self.sessions))
            else:
                for s in list(self.sessions.values()):
                    try:
                        self.sessions.detach(s)
                    except Exception:  # noqa: BLE001 - stop the others cleanly all the same
                        log.exception("detaching client %d at stop failed", s.client_id)
                dropped = self.engines.drop_kept()
                if dropped:
                    log.info("released %d engine(s) kept for their cached blocks: %s", len(dropped), ", ".join(dropped))
            self.sessions.clear()
            self.heavy.shutdown(wait=not self.exit_code)  # memory being released on its threads
            self._serving = False
            self.control.close()
            for p in (self.stats_path, self.fd_path):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass

    def _drain(self) -> None:
        """Read, handle, reply until nothing is ready: each connection's requests one at a
        time, in order.

        With ``busy_poll_us``, keep polling that long after the last event before going
        back to sleep. A wake-up's work is bounded (``_DRAIN_SLICE_NS``); the rest is
        picked up on the loop's next turn, so the stats socket, reaper and watchdog run."""
        if not self._serving:
            return
        now = time.perf_counter_ns
        start = last = now()
        while True:
            if self.control.poll():
                if self.exit_code:  # a fatal error: run nothing more (serve() is stopping)
                    return
                last = now()
            elif now() - last >= self.busy_poll_ns:
                return
            if now() - start >= _DRAIN_SLICE_NS:
                asyncio.get_running_loop().call_soon(self._drain)
                return

    def _received(self, identity: bytes, frames: list, tr: int, refusal: tuple | None) -> None:
        """(control socket) A whole request of connection ``identity``, or one refused
        unread (``refusal``: its code and message)."""
        if self.exit_code:
            return
        if refusal is not None:
            self._send(identity, self._failed(ProtocolError(*refusal), identity, *message_ids(frames), tr))
            return
        self._serve(identity, (frames, tr))

    def stop(self) -> None:
        self._stop.set()

    def _connection_closed(self, identity: bytes) -> None:
        """(control socket) Connection ``identity``, whose HELLO was answered, closed: its
        session goes with it."""
        try:
            self.sessions.closed(identity)
        except Exception:  # noqa: BLE001 - a callback of the loop: log, never raise
            log.exception("dropping the session of a closed connection failed")

    def handle(self, identity: bytes, frames, tr: int | None = None, peer=None) -> list:
        """Answer one request; never raises. Errors are replies with a code and message.
        ``peer``: the credentials of the connection ``identity`` names, for a request handed
        over in this process (None: the control socket's, or the daemon's own).

        ``tr``: ``time.perf_counter_ns()`` when the request was received (now if None).
        Every reply carries it as ``tr`` and the time just before it is encoded as ``tx``
        (CLOCK_MONOTONIC: one clock for every process of the host). A heavy request runs
        whole here, its slow part on the caller's thread (the loop uses :meth:`_serve`)."""
        try:
            return self._handle(identity, frames, time.perf_counter_ns() if tr is None else tr, defer=False, peer=peer)
        finally:
            self.engine_requests.run_prefetches()

    def _handle(self, identity: bytes, frames, tr: int, defer: bool, peer=None):
        """The reply to one request (never raises). ``defer`` (serving): ``_WAIT`` instead when
        it must wait for a heavy request on its engine, or its :class:`Job` when its handler
        reached a slow part (the reply comes from :meth:`_resume`)."""
        msg_type, req_id = 0, 0
        try:
            header, arrays = decode(frames)
            msg_type, req_id = header["t"], header["id"]
            if header["v"] != PROTOCOL_VERSION:
                raise ProtocolError(ErrorCode.BAD_VERSION, f"client speaks protocol version {header['v']}, "
                                    f"this daemon speaks {PROTOCOL_VERSION}")
            kind = _KINDS.get(msg_type)
            if kind is None:
                raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {msg_type}")
            need_fields, allowed_arrays = REQUESTS[kind]
            absent = [f for f in need_fields if f not in header]
            if absent:
                raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"{kind.name} needs field(s) {sorted(absent)}")
            if not allowed_arrays.issuperset(arrays):
                extra = set(arrays) - allowed_arrays
                raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"{kind.name} takes no array(s) {sorted(extra)}")
            session = self.sessions.get(identity)
            if kind != MsgType.HELLO and session is None:
                why = self.sessions.expired(identity)
                raise ProtocolError(ErrorCode.NOT_HELLO, why or "no HELLO from this connection")
            if defer and self._must_wait(session, kind, header):
                return _WAIT
            if session is not None:
                session.requests += 1
                session.last_request_at = time.monotonic()
            if kind == MsgType.ATTACH and self._serving and not self.control.peer_alive(identity):
                raise opener_gone()
            if kind == MsgType.HELLO:
                peer = peer or self.control.peer(identity)  # SO_PEERCRED (None: in process)
                if peer is None and self._serving:  # its connection closed while it waited
                    raise ProtocolError(ErrorCode.PERMISSION_DENIED, "this connection is closed")
                self.engine_requests.peer = peer
                self.engine_requests.peer_alive = (lambda: self.control.peer_alive(identity)) if self._serving \
                    else None
            out = self.handlers[kind](session, identity, header, arrays)
            if kind == MsgType.HELLO:  # full-size requests from now on
                self.control.greet(identity)
            if isinstance(out, types.GeneratorType):  # a heavy request's handler
                job = Job(out, identity, session, kind, msg_type, req_id, tr)
                return self._step(job) if defer else self._inline(job)
            return self._ok(kind, msg_type, req_id, out, tr)
        except Exception as e:  # noqa: BLE001 - answered with its code, never raised
            if not req_id:  # not decoded: answered under its header's type and id where it has them
                msg_type, req_id = message_ids(frames)
            return self._failed(e, identity, msg_type, req_id, tr)

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
        code = code_of(e)
        if isinstance(e, (ProtocolError, ResidencyError, LayoutError, PoolError, BlockError)):
            log.debug("request type %s from %r failed: %s: %s", msg_type, identity, code.name, e)
            msg = f"{e.args[0]} ({ERROR_HINTS.get(code, '')})"
        elif isinstance(e, UnsafeRows):  # freed blocks left dirty, or stale hot copies: serving on could hand them out
            self._fatal(f"request type {msg_type}: {e}")
            msg = f"{e}: sparsekvd exits and must be restarted"
        elif (sticky := sticky_cuda_error(e)) is not None:
            # The GPU context is lost: exit now, so systemd restarts the daemon and every client learns at once.
            self._fatal(f"sticky CUDA error {sticky} on request type {msg_type}: {type(e).__name__}: {e}")
            msg = f"{type(e).__name__}: {e}: the GPU context is lost; sparsekvd exits and must be restarted"
        else:  # a bug, which must not take the daemon down
            log.error("internal error on request type %s", msg_type, exc_info=e)
            msg = f"{type(e).__name__}: {e} ({ERROR_HINTS[ErrorCode.INTERNAL]})"
        self.stats.add(requests=1)
        self.stats.error(code.name)
        s = self.sessions.get(identity)  # error path only: the hot path does not pay for it
        if s is not None:
            s.errors += 1
        return reply_error(msg_type, req_id, code, msg, tr, time.perf_counter_ns(), getattr(e, "detail", None))

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
        if self.engine_requests.prefetching:  # after the reply: off the engine's critical path
            self.engine_requests.run_prefetches()

    def _send(self, identity: bytes, reply: list) -> None:
        self.control.send(identity, reply)

    def _must_wait(self, session, kind: MsgType, header: dict) -> bool:
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
            # The error's traceback holds this frame: keep no cycle through it (a failed
            # attach's frames may hold a rank's memory until the cycle is collected).
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
            if isinstance(error, UnsafeRows) or (error is not None and sticky_cuda_error(error) is not None):
                # fatal whoever asked: freed blocks left dirty, stale hot copies, or the GPU context lost
                self._fatal(f"request type {job.msg_type} of client {job.session.client_id}, gone since: "
                            f"{type(error).__name__}: {error}")
            elif error is not None:
                log.debug("heavy request of a client that is gone failed: %r", error)
            value, error = None, Gone(f"client {job.session.client_id} is gone", value if error is None else None)
        out = self._step(job, value, error)
        value = error = None  # no reference cycle through this frame (see _step)
        if out is job and self.heavy.serving:
            self.heavy.start(job, self._resume)
            return
        self.heavy.finish(job)
        if self.sessions.get(job.identity) is not job.session:
            self.sessions.detach(job.session)  # reaped while its request ran: its rank goes now
        self.sessions.detach_postponed()  # others of its engine reaped meanwhile: theirs too
        if not self.heavy.serving:
            return  # stopping
        if out is not None:
            self._send(job.identity, out)
        if self.exit_code:  # a fatal error: run nothing more (serve() is stopping)
            return
        self._serve_waiting(last=job.identity)

    def _serve_waiting(self, last: bytes) -> None:
        """The requests that waited, each session's in order, until one waits again; session
        ``last`` after the others, so it cannot keep an engine from them. None after a
        fatal error."""
        if self.exit_code:
            return
        for identity in sorted(self.heavy.waiting_sessions(), key=lambda i: i == last):
            while (request := self.heavy.next_waiting(identity)) is not None:
                out = self._handle(identity, *request, defer=True)
                if out is _WAIT:
                    self.heavy.wait(identity, request, first=True)
                    break
                self._answer(identity, out)
                if self.exit_code:
                    return

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(self.reap_interval_s)
            try:
                self.sessions.reap_dead()
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

    async def _connections(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                self.control.expire()
            except Exception:  # noqa: BLE001
                log.exception("expiring control connections failed")

    async def _watchdog(self) -> None:
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(self.notifier.watchdog_interval_s)


_KINDS = {int(m): m for m in MsgType}
_WAIT = object()  # _handle: the request waits for a heavy request in flight on its engine


_DRAIN_SLICE_NS = 20_000_000  # most time one loop wake-up spends on requests


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
    """``"700 (illegal address)"`` when ``e`` (or its cause) is CuPy's ``CUDARuntimeError`` /
    ``CUDADriverError`` with a sticky status, matched by class name (no CuPy import); else None."""
    seen = 0
    while e is not None and seen < 8:
        if type(e).__name__ in _CUDA_ERROR_CLASSES:
            status = getattr(e, "status", None)
            if isinstance(status, int) and status in STICKY_CUDA_ERRORS:
                return f"{status} ({STICKY_CUDA_ERRORS[status]})"
        e = e.__cause__ or e.__context__
        seen += 1
    return None
