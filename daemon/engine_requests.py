"""What an engine rank asks the daemon: HELLO, ATTACH, the decode path (STEP, TOPK), the
write path (WRITE, STAGE, WRITE_STAGED), DETACH and BYE.

Each handler takes (session, identity, header, arrays) and returns the reply's (fields,
arrays); a heavy one is a generator that yields ``Slow(fn)`` for each slow part and
returns them (daemon/heavy.py). Errors are raised, typed.
"""

from __future__ import annotations

import functools
import logging
import os
from concurrent.futures import wait as wait_futures

from sparsekv.proto import LIMITS, PROTOCOL_VERSION, ErrorCode, Layout, LayoutError, MsgType, ProtocolError
from sparsekv.proto import fd_socket
from sparsekv.proto.args import engine_name, hello_text
from sparsekv.proto.blocks import check_store
from sparsekv.proto.layout import ROW_ALIGN_BYTES
from sparsekv.proto.slab import SlabGeometry

from .blocks.contract import BlockError
from .engine import EngineSlabImport, Owner, RankState
from .engine_blocks import drop_copies
from .heavy import HEAVY_BYTES, HEAVY_SLOTS, Gone, Slow
from .peers import Peer
from .pool import PoolError
from .registry import check_new_owner, range_bytes
from .residency.base import ResidencyError, check_layout_limits
from .sessions import Session

log = logging.getLogger("sparsekv.server")

TRANSPORTS = ("zmq", "doorbell")
MAX_FENCE_EVENTS = 256  # an ATTACH's fence event ring (the client's has 16)


class EngineRequests:
    """The handlers of an engine rank's requests, over the daemon's sessions, engine
    registry, backend, pool, stats and fd server."""

    max_slab_bytes = 16 << 30
    tp_max_lag = 256  # Config.tp_max_lag
    # Copies of at least this many bytes run on a worker thread. An ATTACH's slow part always runs there.
    heavy_bytes = HEAVY_BYTES
    # A cpu rank's STEP or TOPK of at least this much host work (region slots its resets and
    # invalidations scan, top-k ids it resolves) runs there too (:meth:`_host_heavy`).
    heavy_slots = HEAVY_SLOTS

    def __init__(self, sessions, engines, backend, pool, stats, fd_server):
        self.sessions, self.engines, self.backend = sessions, engines, backend
        self.pool, self.stats, self.fd_server = pool, stats, fd_server
        # The credentials of the HELLO being handled (set by the dispatcher); None in process.
        self.peer: Peer | None = None
        self.peer_alive = None  # HELLO: whether the process that opened its connection still runs (server.py)
        self.prefetching: list = []  # ranks whose last TOPK left a prefetch to run once its reply is out

    def run_prefetches(self) -> None:
        """Run the prefetches the TOPKs just answered left (DESIGN.md §4): after the reply,
        before any other request reaches the rank. Never raises: a prefetch that fails is
        logged and dropped (the next resolve then misses what it would have fetched)."""
        ranks, self.prefetching = self.prefetching, []
        for st in ranks:
            if st.pending_prefetch is None:  # its rank detached since (a reply that could not be sent)
                continue
            try:
                deltas = st.run_prefetch()
            except Exception:  # noqa: BLE001 - the reply is out; the state is what the resolve left
                log.exception("prefetch of rank %d failed; dropped", st.rank)
                continue
            for k, v in deltas.items():
                self.stats.c[k] += v

    def handlers(self) -> dict:
        """This role's handlers by message type."""
        return {MsgType.HELLO: self.on_hello, MsgType.ATTACH: self.on_attach, MsgType.STEP: self.on_step,
                MsgType.TOPK: self.on_topk, MsgType.WRITE: self.on_write, MsgType.STAGE: self.on_stage,
                MsgType.DETACH: self.on_detach, MsgType.WRITE_STAGED: self.on_write_staged,
                MsgType.BYE: self.on_bye}

    # -- sessions ------------------------------------------------------------------------
    def on_hello(self, session, identity, h, arrays):
        # Who the client is comes from the kernel (SO_PEERCRED); the "pid" field is only
        # compared with the kernel's.
        peer, self.peer = self.peer, None
        alive, self.peer_alive = self.peer_alive, None
        rank = _int(h, "rank")
        if not 0 <= rank < 1 << 16:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"rank must be in [0, 65536), got {rank}")
        for name in ("device", "name"):
            try:
                h[name] = hello_text(name, h.get(name))
            except ValueError as e:
                raise ProtocolError(ErrorCode.BAD_ARGUMENT, str(e)) from None
        s = self.sessions.open(identity, peer or Peer.unverified(), h, rank, alive)
        return {"client_id": s.client_id, "daemon_pid": os.getpid(), "version": PROTOCOL_VERSION,
                **self.backend.describe()}, None

    def on_attach(self, s: Session, identity, h, arrays):
        if s.state is not None:
            raise ProtocolError(ErrorCode.ALREADY_ATTACHED, f"client {s.client_id} is attached to engine {s.engine!r}")
        try:
            engine = engine_name(h["engine"])
        except ValueError as e:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, str(e)) from None
        try:
            layout = Layout.from_wire(h["layout"])
        except (LayoutError, TypeError) as e:
            raise ProtocolError(ErrorCode.BAD_LAYOUT, str(e)) from None
        block_size, index_bytes = _blocks_field(h.get("blocks"), layout)
        prefetch = h.get("prefetch", False)
        if type(prefetch) is not bool:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"prefetch must be true or false, got {prefetch!r}")
        owner_uid = h.get("owner_uid")
        if owner_uid is not None and (type(owner_uid) is not int or not 0 <= owner_uid < 1 << 32):
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"owner_uid must be a uid (an integer in [0, 2**32)), "
                                f"got {owner_uid!r}")
        tp_size = h.get("tp_size", 1)
        if type(tp_size) is not int or not 1 <= tp_size <= LIMITS.max_tp_size:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"tp_size must be an integer in [1, {LIMITS.max_tp_size}], "
                                f"got {tp_size!r}")
        fence_events = h.get("fence_events")
        if fence_events is not None and (type(fence_events) is not list or not 1 <= len(fence_events) <= MAX_FENCE_EVENTS
                                         or any(type(e) is not bytes or len(e) != 64 for e in fence_events)):
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"fence_events must be a list of 1 to {MAX_FENCE_EVENTS} CUDA "
                                "IPC event handles of 64 bytes each")
        created = engine not in self.engines
        self.sessions.rewatch(s)
        slab_field = h.get("slab")
        try:
            check_layout_limits(layout, self.max_slab_bytes, engine_slab=slab_field is not None)  # before allocating
        except ResidencyError as e:  # a daemon setting refused it: the operator's business too
            log.warning("client %d (pid %d uid %d rank %d) refused: attach to engine %r: %s: %s", s.client_id,
                        s.pid, s.uid, s.rank, engine, code_of(e).name, e.args[0])
            raise
        transport = h.get("transport", "zmq")
        if transport not in TRANSPORTS:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"transport must be 'zmq' or 'doorbell', got {transport!r}")
        if transport == "doorbell" and self.backend.name != "cuda":
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "the doorbell transport needs the cuda backend (device rings "
                                f"and stream memory operations); this daemon runs {self.backend.name}: use zmq")
        if tp_size > 1 and self.backend.name == "cuda" and transport != "doorbell":
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "a TP group (tp_size > 1: one resolve for every rank) on the "
                                "cuda backend runs on the doorbell transport (the check and the resolve on the "
                                "device): attach its ranks with transport='doorbell', or each without tp_size")
        engine_slab = self._engine_slab(s, layout, slab_field) if slab_field is not None else None
        admin = not created and self.sessions.is_admin(s)  # only joining needs it (a /proc read)
        try:
            nbytes = range_bytes(layout, block_size, index_bytes)
            if created:  # engines kept only for their cached blocks yield to a new one the checks admit
                check_new_owner(engine, Owner(s.uid, s.gid), owner_uid)
                self.engines.check_rank(s.rank, layout, owner=Owner(s.uid, s.gid), engine_slab=engine_slab,
                                        tp_size=tp_size)
                # Kept engines whose gone clients' zeros are being written may yield only after.
                while zeroing := self.sessions.heavy.hold_futures(self.engines.kept_zeroing()):
                    yield Slow(functools.partial(wait_futures, zeroing), engine=engine)
                self.engines.make_room(nbytes, Owner(s.uid, s.gid),
                                        layout.host_rows // block_size if block_size else 0)
            if created and (zeroing := self.pool.zeroing_to_wait_for(nbytes)):
                # Only released ranges, once zeroed, make room: wait for them off the loop.
                yield Slow(functools.partial(wait_futures, zeroing), engine=engine)
            pending = self.engines.begin_attach(s.client_id, s.rank, s.device, engine, layout,
                                                fence_events, owner=Owner(s.uid, s.gid), privileged=admin,
                                                transport=transport, engine_slab=engine_slab, block_size=block_size,
                                                index_bytes=index_bytes, prefetch=prefetch, tp_size=tp_size,
                                                tp_max_lag=self.tp_max_lag, owner_uid=owner_uid)
            try:
                # The slow part on a worker thread; ATTACHes to a new engine wait for it.
                yield Slow(functools.partial(self.engines.prepare, pending), engine=engine if pending.created else None)
                state, handles = self.engines.commit(pending)
            except BaseException:  # an error, or Gone: nothing of this attach stays
                self.engines.abort(pending)
                raise
        except (PoolError, ProtocolError, ResidencyError) as e:
            # The operator's business too: warn. The log may name the owner; the reply does not.
            owner = self.engines.space(engine).owner if engine in self.engines else None
            log.warning("client %d (pid %d uid %d rank %d) refused: attach to engine %r%s: %s: %s", s.client_id,
                        s.pid, s.uid, s.rank, engine, f" (owner uid {owner.uid})" if owner else "",
                        code_of(e).name, e.args[0] if e.args else e)
            raise
        finally:
            if engine_slab is not None:
                engine_slab.close()  # its descriptor, unless the backend took it
        s.engine, s.state = engine, state
        log.info("client %d attached to engine %r (%s)", s.client_id, engine,
                 f"new, owner uid {s.uid}" if created else "joined")
        if self.backend.share_fds(s.client_id):  # to this process only, over the fd socket
            s.fd_token = self.fd_server.offer(s)
            handles = {**handles, "fd_socket": fd_socket.FD_SOCKET, "fd_token": s.fd_token}
        return {"handles": handles, "layout": layout.to_wire()}, None

    def _engine_slab(self, s: Session, layout: Layout, field) -> EngineSlabImport:
        """ATTACH's ``slab`` (proto/slab.py): its geometry, checked against the layout, and
        its memory (cpu: this process's deposit on the fd socket; cuda: an IPC handle)."""
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

    def on_detach(self, s: Session, identity, h, a, bye: bool = False):
        attached, engine = s.state is not None, s.engine
        self.sessions.detach(s)
        if bye:  # Client.close(): forgotten, so short-lived clients never fill max_clients
            self.sessions.pop(identity, None)
            self.sessions.rlog.log("bye", logging.INFO, "client %d (pid %d rank %d) said goodbye%s", s.client_id, s.pid,
                                   s.rank, f", detached from engine {engine!r}" if attached else "")
        else:
            log.info("client %d (pid %d rank %d) detached%s", s.client_id, s.pid, s.rank,
                     f" from engine {engine!r}" if attached else " (was not attached)")
        return {"was_attached": attached}, None

    def on_bye(self, s: Session, identity, h, a):
        return self.on_detach(s, identity, h, a, bye=True)

    # -- the decode path -----------------------------------------------------------------
    def _rank(self, s: Session, kind: MsgType, began: bool = False) -> RankState:
        """``s``'s rank, for a request that runs on it. An error the rank found after the
        fact fails the next request on it, which does not run (``began``: nor its STEP)."""
        st = s.state
        if st is None:
            raise ProtocolError(ErrorCode.NOT_ATTACHED, f"client {s.client_id} has not attached a layout")
        err = st.take_error()
        if err is not None:
            self.stats.add(async_errors=1)
            what = "nor the STEP it began " if began else ""
            err.args = (f"{err.args[0]}; this {kind.name} request {what}was not run",)
            raise err
        return st

    def _host_heavy(self, st, state_rows, reset, invalidate, topk=None) -> bool:
        """Whether a cpu rank's STEP (its resets and invalidations scan each named region of
        every group) or TOPK (its resolve sorts each batch row's region and places its ids;
        its prefetch scans the regions again; the STEP it begins) is host work of
        ``heavy_slots`` or more: then it runs on a worker thread, its engine's and its
        session's later requests waiting for it (one STEP over 4,096 regions of 2,048
        slots took 3 s on the loop; a TOPK of 4,096 rows of one id in regions of 32,768
        slots 1.5 s). Sizes only: the arrays are checked where they are used.
        Not a TP rank's: its group's state and the uid's TP ledger are shared beyond its
        engine (its peers leave on the loop), so it stays there."""
        if not st.host_memory or st.tp is not None:
            return False
        lay = st.residency.layout
        work = 0
        if topk is not None:  # a batch row's region is scanned whatever its width
            work = topk.size + (topk.shape[0] * lay.region_stride if topk.ndim else 0)
        if state_rows is not None and (reset is not None or (invalidate is not None and invalidate.size)):
            work += state_rows.size * lay.num_groups * lay.region_stride
        return work >= self.heavy_slots

    def on_step(self, s: Session, identity, h, a):
        st = self._rank(s, MsgType.STEP)
        if "state_rows" not in a:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "STEP needs the state_rows array")
        # .size, not .shape[0]: a 0-d array must reach begin_step's BAD_ARGUMENT, not IndexError.
        _batch_fits(st, a["state_rows"].size)
        state_rows, reset, invalidate = a["state_rows"], a.get("reset"), a.get("invalidate")
        begin = functools.partial(st.begin_step, _int(h, "step"), state_rows, reset, invalidate)
        if self._host_heavy(st, state_rows, reset, invalidate):
            return self._slow_step(s, st, begin)
        begin()
        return self._stepped(st)

    def _stepped(self, st):
        self.stats.add(steps=1, **st.prefetch_outcomes())  # prefetched rows its resets and invalidations dropped
        return {}, None

    def _slow_step(self, s: Session, st, begin):
        """A STEP's resets and invalidations on a worker thread (a heavy handler: the common
        STEP returns its reply at once, no generator)."""
        yield Slow(begin, engine=s.engine, ranks=True)
        return self._stepped(st)

    def on_topk(self, s: Session, identity, h, a):
        """A TOPK, which may carry its step's STEP (``begin``), as arrays or (cuda) in the
        step block the client wrote. All or nothing: the STEP does not run if the TOPK
        cannot. A failed device-wait TOPK still releases its client's stream (a cuda
        rank's: never a heavy handler, whose errors come later, at its yield)."""
        try:
            return self._topk(s, h, a)
        except Exception:
            if h.get("done") is not None:
                release_device_wait(s, h)
            raise

    def _topk(self, s: Session, h, a):
        begin = h.get("begin", False)
        if type(begin) is not bool:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"begin must be true or false, got {begin!r}"[:120])
        st = self._rank(s, MsgType.TOPK, began=begin)
        fence, step, group = _fence(h), _int(h, "step"), _int(h, "group")
        block = h.get("block")
        if block is not None:  # the client wrote the step block(s) into ring entry `block` (cuda)
            if type(block) is not int or a:
                raise ProtocolError(ErrorCode.BAD_ARGUMENT, "block must be an entry number, sent without arrays")
            done = h.get("done")  # device wait: the value of the entry's done word (client.py)
            if done is not None and (type(done) is not int or not 0 <= done <= 0xFFFFFFFF):
                raise ProtocolError(ErrorCode.BAD_ARGUMENT, "done must be an integer in [0, 2**32)")
            fields, arrays, deltas = st.serve_topk_block(step, group, block, begin, fence, done)
            self.stats.c["steps"] += begin
            return self._served(st, fields, arrays, deltas)
        if "topk" not in a:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "TOPK needs the topk array")
        state_rows, topk = a.get("state_rows"), a["topk"]
        if topk.ndim:  # before any work: rows of padding cost as much as live ones
            _batch_fits(st, topk.shape[0])
        reset, invalidate = a.get("reset"), a.get("invalidate")
        if begin:
            if state_rows is None:
                raise ProtocolError(ErrorCode.BAD_ARGUMENT, "a TOPK that begins a step needs the state_rows array")
            _batch_fits(st, state_rows.size)
            st.check_fence(fence)
        elif "reset" in a or "invalidate" in a:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT,
                                "reset and invalidate go with a TOPK only when it begins a step")
        began = []

        def serve():
            rows = state_rows
            if begin:
                st.begin_step(step, rows, reset, invalidate, then=(group, topk))
                began.append(step)
                rows = None  # the step has begun: resolve against its state rows
            return st.serve_topk(step, group, topk, rows, fence)

        if self._host_heavy(st, state_rows if begin else None, reset, invalidate, topk):
            return self._slow_topk(s, st, serve, began)
        try:
            fields, arrays, deltas = serve()
        finally:
            self.stats.c["steps"] += len(began)
        return self._served(st, fields, arrays, deltas)

    def _slow_topk(self, s: Session, st, serve, began: list):
        """A TOPK's resolve and gather (and the STEP it begins) on a worker thread, then the
        prefetch it leaves there too, before its reply: a batch this large would hold the
        loop as long in the prefetch after it (the engine waits for it instead)."""
        try:
            fields, arrays, deltas = yield Slow(serve, engine=s.engine, ranks=True)
        except Gone as e:  # its client went while it ran: the rows it moved count, unanswered
            if e.result is not None:
                self._count(e.result[2])
            raise
        finally:
            self.stats.c["steps"] += len(began)  # (on the loop, as every counter)
        if st.pending_prefetch is not None:
            deltas = dict(deltas)
            for k, v in (yield Slow(functools.partial(_prefetch_quietly, st), engine=s.engine, ranks=True)).items():
                deltas[k] = deltas.get(k, 0) + v
        return self._served(st, fields, arrays, deltas)

    def _served(self, st, fields, arrays, deltas):
        """A TOPK's reply; its counters added, its rank's prefetch left to run after it."""
        if st.pending_prefetch is not None:
            self.prefetching.append(st)
        self._count(deltas)
        return fields, arrays

    def _count(self, deltas: dict) -> None:
        c = self.stats.c
        for k, v in deltas.items():
            c[k] += v

    # -- the write path ------------------------------------------------------------------
    def on_write(self, s: Session, identity, h, a):
        self._rank(s, MsgType.WRITE)
        if "rows" not in a or "data" not in a:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "WRITE needs the rows and data arrays")
        if a["rows"].size > LIMITS.max_write_rows:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"a write of {a['rows'].size} rows exceeds {LIMITS.max_write_rows}")
        space = self.engines.space(s.engine)
        layers, rows, data = space.check_write(_layers(h), a["rows"], a["data"])
        _own_blocks(s, space, rows)
        nbytes, dropped = yield from self._write_rows(s, space, layers, rows, data)
        return {"bytes": nbytes, "invalidated": dropped}, None

    def on_write_staged(self, s: Session, identity, h, a):
        st = self._rank(s, MsgType.WRITE_STAGED)
        if "rows" not in a:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "WRITE_STAGED needs the rows array")
        fence = _fence(h)
        space = self.engines.space(s.engine)
        layers, rows = space.check_staged(st, _layers(h), a["rows"])
        _own_blocks(s, space, rows)
        if st.host_memory:  # cpu: a host copy out of the staging buffer, maybe a large one
            src = st.staged_rows(layers, rows.shape[0])
            nbytes, dropped = yield from self._write_rows(s, space, layers, rows, src)
        else:  # cuda: enqueued on the device, never waited for
            nbytes, dropped = st.write_staged(space, layers, rows, fence)
            self.stats.add(rows_written=nbytes // st.residency.layout.row_bytes, bytes_written=nbytes,
                           hot_invalidated=dropped)
        return {"bytes": nbytes, "invalidated": dropped}, None

    def _write_rows(self, s: Session, space, layers, rows, src):
        """A write's bulk, for ``yield from``: the engine quiesced, ``src`` copied into the
        pool rows (on a worker thread holding the engine when large), then every hot copy
        of the rows dropped, whatever happened: with the copy on the worker thread when
        the drop scans ``heavy_slots`` of cpu state or more (a one-row write to an engine
        of 134M cpu slots held every client 1.5 s), else on the loop (a cuda rank's or a TP
        group's drop always: ``drop_scan_slots`` 0). Counted once copied (its client gone
        meanwhile too). Returns (bytes, slots dropped)."""
        nbytes = len(layers) * rows.shape[0] * space.layout.row_bytes
        space.quiesce()
        drop_there = space.drop_scan_slots() >= self.heavy_slots
        dropped, copied = [], []

        def write():
            try:
                space.copy_rows(layers, rows, src)
                copied.append(True)
            finally:
                if drop_there:
                    dropped.append(drop_copies(space, rows))

        try:
            if nbytes >= self.heavy_bytes or drop_there:
                yield Slow(write, engine=s.engine, ranks=drop_there)
            else:
                write()
        finally:
            if not drop_there:  # on the loop (a failure is fatal: DropFailed)
                dropped.append(drop_copies(space, rows))
            for st in space.ranks.values():  # prefetched rows dropped: wasted
                self.stats.add(**st.prefetch_outcomes())
            if copied:
                self.stats.add(rows_written=rows.shape[0] * len(layers), bytes_written=nbytes,
                               hot_invalidated=dropped[0] if dropped else 0)
        return nbytes, dropped[0]

    def on_stage(self, s: Session, identity, h, a):
        st = self._rank(s, MsgType.STAGE)
        if "rows" not in a:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "STAGE needs the rows array")
        layers, lay = _layers(h), st.residency.layout
        if st.host_memory and a["rows"].size * len(layers or range(lay.num_layers)) * lay.row_bytes >= self.heavy_bytes:
            # cpu: on a worker thread (checked there); writes to the engine wait meanwhile
            nbytes = yield Slow(functools.partial(st.stage, a["rows"], layers), engine=s.engine)
        else:
            nbytes = st.stage(a["rows"], layers)
        self.stats.add(rows_staged=nbytes // st.residency.layout.row_bytes)
        return {"bytes": nbytes}, None


def _prefetch_quietly(st) -> dict:
    """``st.run_prefetch()``'s counter deltas; a prefetch that fails is logged and dropped,
    as :meth:`EngineRequests.run_prefetches` drops it (the TOPK it follows stands)."""
    try:
        return st.run_prefetch()
    except Exception:  # noqa: BLE001 - the state is what the resolve left
        log.exception("prefetch of rank %d failed; dropped", st.rank)
        return {}


def release_device_wait(session, header: dict) -> None:
    """A device-wait TOPK (``block`` + ``done``) failed: its client's stream waits on the
    entry's done word, so the word is set anyway (``RankState.release_topk_block``); the
    client raises the error from the reply. Never raises."""
    try:
        block, done, fence = header.get("block"), header.get("done"), header.get("fence")
        if session.state is None or header.get("t") != int(MsgType.TOPK) or type(block) is not int \
                or type(done) is not int or not 0 <= done <= 0xFFFFFFFF:
            return
        session.state.release_topk_block(block, done, fence if type(fence) is int else None)
    except Exception as e:  # noqa: BLE001 - the reply still says what failed
        log.warning("could not release a failed device-wait TOPK: %r", e)


def code_of(e: Exception) -> ErrorCode:
    """The error code a handler's exception is answered with."""
    if isinstance(e, ProtocolError):
        return e.code
    if isinstance(e, (ResidencyError, BlockError)):
        return ErrorCode[e.code]
    if isinstance(e, LayoutError):
        return ErrorCode.BAD_LAYOUT
    if isinstance(e, PoolError):
        return ErrorCode.POOL_FULL
    return ErrorCode.INTERNAL


def _blocks_field(field, layout: Layout) -> tuple[int, int]:
    """ATTACH's optional ``blocks`` field (``{"block_size": n}``, optionally
    ``"index_bytes": m``): the engine's block size (0 for none) and its indexer keys' bytes
    a position and layer (0 for no keys plane), as ``check_store`` admits them; a block
    size of 0 here is refused (the field is left out for no store)."""
    if field is None:
        return 0, 0
    n = field.get("block_size") if isinstance(field, dict) else None
    if type(n) is not int or n < 1 or set(field) - {"block_size", "index_bytes"}:
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"blocks must be {{'block_size': n}} with 1 <= n <= host_rows "
                            f"({layout.host_rows}), optionally with 'index_bytes', got {str(field)[:60]}")
    return check_store(layout, n, field.get("index_bytes", 0))


def _own_blocks(s: Session, space, rows) -> None:
    """A write into an engine with a block store: only into blocks the writer allocated
    (a cached block is read-only, DESIGN §9)."""
    if space.blocks is not None:
        space.blocks.writable(s.client_id, rows, space.block_size)


def _int(h: dict, name: str) -> int:
    v = h.get(name)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"field {name!r} must be an integer, got {type(v).__name__}")
    return v


def _batch_fits(st: RankState, rows: int) -> None:
    """TOO_LARGE unless a batch of ``rows`` rows fits the protocol and the layout's
    ``max_batch`` (device buffers are sized by it)."""
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
