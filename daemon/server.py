"""The control plane: a ZeroMQ ROUTER served on (uv)asyncio, plus the stats socket and
the optional loopback HTTP ``/metrics`` endpoint (same loop, same thread).

One thread owns the ROUTER socket and every worker's state (STYLE 5): requests are
handled one at a time in arrival order, so no lock guards the residency state. On the
cpu backend the gather runs inline; on cuda the handlers only enqueue work on the
device's copy stream, so the loop never waits on the GPU.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
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

from sparsekv.proto.frames import send_copy

from . import stats as stats_mod
from .engine import RankState
from .notify import Notifier
from .pool import HostPool, PoolError
from .registry import EngineRegistry
from .residency.base import ResidencyError

log = logging.getLogger("sparsekv.server")

# Requests that run on a rank's state: a rank's asynchronous error (one the cuda backend
# learns of after the fact) is answered to the next of these instead of running it.
_RANK_REQUESTS = frozenset({MsgType.STEP, MsgType.TOPK, MsgType.WRITE, MsgType.WRITE_STAGED, MsgType.STAGE})


@dataclass
class Session:
    """One connected client (one engine rank), keyed by its ZeroMQ identity."""

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


class Daemon:
    def __init__(self, run_dir: str, backend, pool: HostPool, *, max_clients: int = 256,
                 reap_interval_s: float = 2.0, notifier: Notifier | None = None, busy_poll_us: int = 0,
                 metrics_port: int = 0):
        self.run_dir = run_dir
        self.backend = backend
        self.pool = pool
        self.max_clients = max_clients
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
        self.engines = EngineRegistry(pool, backend)  # engine lifetimes and pool ranges
        self._next_client_id = 1
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
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        for p in (self.control_path, self.stats_path):
            if os.path.exists(p):
                os.unlink(p)
        # The stats socket first: whoever sees control.sock (clients, PrivateDaemon, probes)
        # finds stats.sock there too.
        stats_server = await asyncio.start_unix_server(self._stats_client, path=self.stats_path)
        os.chmod(self.stats_path, 0o660)
        sock.bind(f"ipc://{self.control_path}")
        os.chmod(self.control_path, 0o660)
        loop = asyncio.get_running_loop()
        fd = sock.getsockopt(zmq.FD)
        loop.add_reader(fd, self._drain, sock)
        tasks = [asyncio.create_task(self._reaper(), name="reaper")]
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
            self.notifier.stopping()
            log.info("stopping: detaching %d client(s)", len(self.sessions))
            loop.remove_reader(fd)
            for t in tasks:
                t.cancel()
            stats_server.close()
            if http_server is not None:
                http_server.close()
            for s in list(self.sessions.values()):
                self._detach(s)
            self.sessions.clear()
            sock.close(0)
            ctx.term()
            for p in (self.control_path, self.stats_path):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass

    def _drain(self, sock) -> None:
        """Receive, handle, reply until no request is queued: one at a time, in order.

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
            identity = frames[0].bytes
            reply = self.handle(identity, frames[1:], tr)
            try:
                sock.send_multipart([identity, *reply], zmq.NOBLOCK, copy=send_copy(reply))
            except zmq.Again:  # the client stopped reading and its queue is full
                log.warning("reply to a client dropped: its queue is full")
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
        (CLOCK_MONOTONIC: one clock for every process of the host)."""
        if tr is None:
            tr = time.perf_counter_ns()
        msg_type, req_id = 0, 0
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
                raise ProtocolError(ErrorCode.NOT_HELLO, "no HELLO from this connection")
            if session is not None:
                session.requests += 1
                if kind in _RANK_REQUESTS and session.state is not None:
                    # Like CUDA's: an error the rank found after the fact (bad input seen
                    # on the GPU) fails the next call on it, which does not run.
                    err = session.state.take_error()
                    if err is not None:
                        self.stats.add(async_errors=1)
                        what = "nor the STEP it began " if header.get("begin") is True else ""
                        err.args = (f"{err.args[0]}; this {kind.name} request {what}was not run",)
                        raise err
            fields, out_arrays = self.handlers[kind](session, identity, header, arrays)
            self.stats.c["requests"] += 1
            tx = time.perf_counter_ns()
            if kind == MsgType.TOPK:
                self.stats.latency((tx - tr) * 1e-9)
            return reply_ok(msg_type, req_id, fields, out_arrays, tr, tx)
        except (ProtocolError, ResidencyError, LayoutError, PoolError) as e:
            code = _code_of(e)
            self.stats.add(requests=1)
            self.stats.error(code.name)
            self._count_client_error(identity)
            log.debug("request type %s from %r failed: %s: %s", msg_type, identity, code.name, e)
            msg = f"{e.args[0]} ({ERROR_HINTS.get(code, '')})"
            return reply_error(msg_type, req_id, code, msg, tr, time.perf_counter_ns())
        except Exception as e:  # noqa: BLE001 - a bug must not take the daemon down
            log.exception("internal error on request type %s", msg_type)
            self.stats.add(requests=1)
            self.stats.error(ErrorCode.INTERNAL.name)
            self._count_client_error(identity)
            msg = f"{type(e).__name__}: {e} ({ERROR_HINTS[ErrorCode.INTERNAL]})"
            return reply_error(msg_type, req_id, ErrorCode.INTERNAL, msg, tr, time.perf_counter_ns())

    # -- handlers: each returns (fields, arrays) --------------------------------------
    def on_hello(self, session, identity, h, arrays):
        if session is not None:  # the same connection says hello again: start over
            self._detach(session)
            del self.sessions[identity]
        if len(self.sessions) >= self.max_clients:
            raise ProtocolError(ErrorCode.TOO_MANY_CLIENTS, f"{len(self.sessions)} clients connected (max {self.max_clients})")
        pid, rank = _int(h, "pid"), _int(h, "rank")
        # A pid no process can have would make the reaper's psutil calls raise for ever
        # (OverflowError), and then no dead client would be reaped.
        if not 0 < pid < 2**31:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"pid {pid} is not a process id")
        try:
            started = psutil.Process(pid).create_time()
        except (psutil.Error, ValueError):
            started = None
        s = Session(identity, self._next_client_id, pid, rank, str(h["device"]), str(h["name"])[:128], started)
        self._next_client_id += 1
        self.sessions[identity] = s
        log.info("client %d hello: pid %d rank %d device %s %s", s.client_id, pid, rank, s.device, s.name)
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
        try:
            state, handles = self.engines.attach(s.client_id, s.rank, s.device, engine, layout, h.get("fence_events"))
        except (PoolError, ProtocolError, ResidencyError) as e:
            # An engine that cannot attach (no room in the pool, another layout, no room
            # for its slab) is the operator's business, not only the client's: warn.
            log.warning("client %d (pid %d rank %d) refused: attach to engine %r: %s: %s", s.client_id, s.pid,
                        s.rank, engine, _code_of(e).name, e.args[0] if e.args else e)
            raise
        s.engine, s.state = engine, state
        log.info("client %d attached to engine %r (%s)", s.client_id, engine, "new" if created else "joined")
        return {"handles": handles, "layout": layout.to_wire()}, None

    def on_step(self, s: Session, identity, h, a):
        st = self._state(s)
        if "state_rows" not in a:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "STEP needs the state_rows array")
        # .size, not .shape[0]: a 0-d array must reach begin_step's BAD_ARGUMENT, not IndexError.
        if a["state_rows"].size > LIMITS.max_batch:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"batch of {a['state_rows'].size} exceeds {LIMITS.max_batch}")
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
            serve = getattr(st, "serve_topk_block", None)
            if serve is None:
                raise ProtocolError(ErrorCode.BAD_ARGUMENT, "this rank has no client-written step blocks (cuda only)")
            begin = h.get("begin") is True
            fields, arrays, deltas = serve(step, _int(h, "group"), block, begin, fence)
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
            if state_rows.size > LIMITS.max_batch:
                raise ProtocolError(ErrorCode.TOO_LARGE, f"batch of {state_rows.size} exceeds {LIMITS.max_batch}")
            st.check_fence(fence)  # all or nothing: the STEP does not run if the TOPK cannot
            st.begin_step(step, state_rows, a.get("reset"), a.get("invalidate"))
            self.stats.c["steps"] += 1
            state_rows = None
        elif "reset" in a or "invalidate" in a:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "reset and invalidate go with a TOPK only when it begins a step")
        fields, arrays, deltas = st.serve_topk(step, _int(h, "group"), a["topk"], state_rows, fence)
        c = self.stats.c
        for k, v in deltas.items():
            c[k] += v
        return fields, arrays

    def on_write(self, s: Session, identity, h, a):
        self._state(s)
        if "rows" not in a or "data" not in a:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "WRITE needs the rows and data arrays")
        nbytes, dropped = self.engines.space(s.engine).write(h["layers"], a["rows"], a["data"])
        self.stats.add(rows_written=a["rows"].shape[0] * a["data"].shape[0], bytes_written=nbytes, hot_invalidated=dropped)
        return {"bytes": nbytes, "invalidated": dropped}, None

    def on_write_staged(self, s: Session, identity, h, a):
        st = self._state(s)
        if "rows" not in a:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "WRITE_STAGED needs the rows array")
        fence = _fence(h)
        nbytes, dropped = self.engines.space(s.engine).write_staged(st, h["layers"], a["rows"], fence)
        self.stats.add(rows_written=nbytes // st.residency.layout.row_bytes, bytes_written=nbytes, hot_invalidated=dropped)
        return {"bytes": nbytes, "invalidated": dropped}, None

    def on_stage(self, s: Session, identity, h, a):
        st = self._state(s)
        if "rows" not in a:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "STAGE needs the rows array")
        nbytes = st.stage(a["rows"], h["layers"])
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
        if s.state is None:
            return
        self.engines.detach(s.client_id, s.engine)
        log.debug("client %d released its rank of engine %r", s.client_id, s.engine)
        s.state, s.engine = None, None

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
            "attached": sum(1 for s in self.sessions.values() if s.state is not None),
            **self.engines.gauges(),
            "per_engine": self._per_engine(),
            "protocol_version": PROTOCOL_VERSION,
            "version": self.version,
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
        lines = ["id\tpid\trank\tdevice\tengine\tattached\trequests\terrors\tage_s\tname"]
        for s in sorted(self.sessions.values(), key=lambda s: s.client_id):
            name = (s.name or "-").replace("\t", " ").replace("\n", " ")
            lines.append(
                f"{s.client_id}\t{s.pid}\t{s.rank}\t{s.device}\t{s.engine or '-'}\t"
                f"{'yes' if s.state else 'no'}\t{s.requests}\t{s.errors}\t{now - s.connected_at:.0f}\t{name}"
            )
        return "\n".join(lines) + "\n"

    def reap_dead(self) -> int:
        """Detach clients whose process is gone (ZeroMQ does not say when a peer leaves)."""
        dead = []
        for identity, s in self.sessions.items():
            try:
                alive = psutil.Process(s.pid).create_time() == s.proc_started if s.proc_started else psutil.pid_exists(s.pid)
                # A killed client that its parent has not waited for yet is a zombie: it
                # still has a create time, but it will never send again.
                if alive and psutil.Process(s.pid).status() == psutil.STATUS_ZOMBIE:
                    alive = False
            except psutil.NoSuchProcess:
                alive = False
            except psutil.Error:
                alive = True  # cannot tell (permissions): keep it
            if not alive:
                dead.append(identity)
        for identity in dead:
            s = self.sessions.pop(identity)
            if s.state is not None:  # died attached: it never said goodbye
                log.warning("client %d (pid %d rank %d) is gone; detaching it from engine %r",
                            s.client_id, s.pid, s.rank, s.engine)
            else:  # had detached (or never attached): a normal exit
                log.info("client %d (pid %d) exited", s.client_id, s.pid)
            self._detach(s)
        return len(dead)

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(self.reap_interval_s)
            try:
                self.reap_dead()
            except Exception:  # noqa: BLE001
                log.exception("reaper failed")

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
# What generate_latest() writes (prometheus_client's CONTENT_TYPE_LATEST names 1.0.0 in
# recent releases, which this text is not).
_PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
_DRAIN_SLICE_NS = 20_000_000  # most time one loop wake-up spends on requests


def _int(h: dict, name: str) -> int:
    v = h.get(name)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"field {name!r} must be an integer, got {type(v).__name__}")
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
