"""The daemon's clients: one session per control connection that said HELLO, who it is
(the kernel's credentials), what it may join and when it ends. Event loop's thread only.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import time
from dataclasses import dataclass, field

import psutil

from sparsekv.proto import ErrorCode, ProtocolError
from sparsekv.proto.args import breaks_line

from .engine import RankState
from .engine_blocks import UnsafeRows, write_zeros
from .peers import Peer, PidWatch, process_groups
from .ratelog import RateLimitedLog

log = logging.getLogger("sparsekv.server")

EXPIRED_KEPT = 1024  # identities of expired sessions remembered, to tell their next request why


@dataclass
class Session:
    """One connected client (one engine rank), keyed by its ZeroMQ identity.

    ``pid``, ``uid``, ``gid``: the kernel's (``SO_PEERCRED``); ``verified`` False for
    in-process calls. ``watch``: a pidfd of the process while not detached (None: pid 0,
    or no pidfd; the reaper's periodic check covers those)."""

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
    requests: int = 1  # requests answered, errors included; its HELLO the first (as the daemon's count)
    errors: int = 0
    uid: int = -1
    gid: int = -1
    verified: bool = False
    watch: PidWatch | None = None
    fd_token: str | None = None  # the fd socket's token of its attached rank, until used
    last_request_at: float = field(default_factory=time.monotonic)  # idle_timeout_s counts from here


class Sessions(dict):
    """The sessions by ZeroMQ identity, and their lifetimes.

    Args:
        engines, heavy, fd_server, stats: the daemon's registry, heavy requests, fd server
            and stats.
        max_clients: sessions at once (TOO_MANY_CLIENTS at HELLO).
        max_clients_per_uid: sessions of one uid (QUOTA_EXCEEDED at HELLO); 0: no cap.
        idle_timeout_s: a session not attached, without a request this long, is dropped.
        admin_gid: members of this group (primary or supplementary) may join any user's
            engine, naming its owner (ATTACH ``owner_uid``); None: nobody but the owner and
            root.
    """

    def __init__(self, engines, heavy, fd_server, stats, *, max_clients: int = 256, max_clients_per_uid: int = 0,
                 idle_timeout_s: float = 600.0, admin_gid: int | None = None):
        super().__init__()
        self.engines, self.heavy, self.fd_server, self.stats = engines, heavy, fd_server, stats
        self.max_clients = max_clients
        self.max_clients_per_uid = max_clients_per_uid
        self.idle_timeout_s = idle_timeout_s
        self.admin_gid = admin_gid
        self._next_client_id = 1
        self.rlog = RateLimitedLog(log)  # lines a client can cause at will, limited per cause
        # Identities of sessions dropped for idleness -> what their next request is told.
        self._expired: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        # Sessions gone while another's heavy request held their engine: their ranks go
        # when it ends (detach_postponed).
        self._postponed: list[Session] = []

    def expired(self, identity: bytes) -> str | None:
        """Why ``identity`` has no session any more, if it was dropped for idleness."""
        return self._expired.get(identity)

    # -- HELLO -----------------------------------------------------------------------
    def open(self, identity: bytes, peer: Peer, h: dict, rank: int, alive=None) -> Session:
        """The session a HELLO (header ``h``) of ``peer`` on ``identity`` opens, replacing the
        connection's detached one; refused when attached, over a cap, or another process's.
        ``alive()``: whether the process that opened the connection still runs. A HELLO on a
        connection it left behind (passed to a child, say) is refused: the pid SO_PEERCRED
        gave may be another process's by now, whose groups and exit the session would take
        for its own (found by a review: a recycled pid of the admin group let another uid
        join an engine)."""
        if alive is not None and not alive():
            raise opener_gone()
        old = self.get(identity)
        if old is not None:
            # The same connection says hello again: only its own process may, and never
            # while attached (that would throw away the rank it holds).
            if old.verified and (peer.uid, peer.pid) != (old.uid, old.pid):
                raise ProtocolError(ErrorCode.PERMISSION_DENIED,
                                    f"this connection is client {old.client_id} of another process")
            if old.state is not None:
                raise ProtocolError(ErrorCode.ALREADY_ATTACHED,
                                    f"client {old.client_id} is attached to engine {old.engine!r}; "
                                    "send DETACH before HELLO again")
            self.detach(old)
            del self[identity]
        if len(self) >= self.max_clients:
            raise ProtocolError(ErrorCode.TOO_MANY_CLIENTS, f"{len(self)} clients connected (max {self.max_clients})")
        if self.max_clients_per_uid:
            mine = sum(1 for other in self.values() if other.uid == peer.uid)
            if mine >= self.max_clients_per_uid:
                raise ProtocolError(ErrorCode.QUOTA_EXCEEDED, f"uid {peer.uid} has {mine} clients connected "
                                    f"(max_clients_per_uid {self.max_clients_per_uid})")
        pid = peer.pid
        claimed = h.get("pid")
        if peer.verified and claimed != pid:  # another pid namespace, or a lie: the kernel's wins
            self.rlog.log("hello's pid", logging.INFO, "client hello claims pid %s; the kernel says %d (another pid "
                          "namespace?): using %d", repr(claimed)[:24], pid, pid)  # (repr: no line of its own)
        s = Session(identity, self._next_client_id, pid, rank, str(h["device"]), str(h["name"])[:128],
                    started(pid) if pid > 0 else None, uid=peer.uid, gid=peer.gid, verified=peer.verified)
        self._next_client_id += 1
        s.watch = self.watch(s)
        if alive is not None and not alive():  # it exited while its pid was watched: the watch may be another's
            if s.watch is not None:
                s.watch.close()
            raise opener_gone()
        self._expired.pop(identity, None)
        self[identity] = s
        self.rlog.log("hello", logging.INFO, "client %d hello: pid %d uid %d rank %d device %s %s", s.client_id, pid,
                      s.uid, rank, s.device, s.name)
        if peer.verified and pid == 0:
            log.warning("client %d (uid %d) runs outside the daemon's pid namespace: if it dies attached, its rank "
                        "is not reclaimed until the daemon stops (run engines with the host's pid namespace)",
                        s.client_id, s.uid)
        return s

    # -- ownership -------------------------------------------------------------------
    def rewatch(self, s: Session) -> None:
        """ATTACH: watch ``s``'s process again (DETACH closed its watch); PERMISSION_DENIED
        when its pid is another process's now."""
        if s.watch is not None or s.pid <= 0:
            return
        s.watch = self.watch(s)
        if s.watch is None and s.verified and not psutil.pid_exists(s.pid):  # no pidfd: the process is gone
            raise ProtocolError(ErrorCode.PERMISSION_DENIED,
                                f"the process that said HELLO as client {s.client_id} has exited; connect again")
        if s.watch is not None and s.proc_started is not None and started(s.pid) != s.proc_started:
            s.watch.close()  # not the process that said HELLO: the reaper reclaims it
            s.watch = None
            raise ProtocolError(ErrorCode.PERMISSION_DENIED,
                                f"the process that said HELLO as client {s.client_id} has exited; connect again")

    def is_admin(self, s: Session) -> bool:
        """Whether ``s``'s process is in the admin group (primary or supplementary gid,
        the latter trusted only while the pidfd shows the process still running)."""
        if self.admin_gid is None:
            return False
        if s.verified and s.gid == self.admin_gid:
            return True
        if not s.verified or s.watch is None:
            return False
        groups = process_groups(s.pid)
        return self.admin_gid in groups and not s.watch.exited()

    # -- ends ------------------------------------------------------------------------
    def detach(self, s: Session) -> None:
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
            return  # (reaped) its heavy request still uses the rank: the request's end releases it
        if self.heavy.ranks_in_use(s.engine):
            # (reaped) another session's heavy request works on this engine's ranks on a
            # worker thread: dropping this one's blocks' hot copies from them now would race it
            self._postponed.append(s)
            return
        try:
            zeros = self.engines.detach(s.client_id, s.engine)
        except UnsafeRows as e:  # its freed blocks are dirty or copies stale: the daemon stops (as a request's would)
            if not self.heavy.fail(str(e)):
                raise
            zeros = []
        if zeros:  # its private blocks' zeros (GBs): off the loop, its engine held meanwhile
            self.engines.zeroing(s.engine)
            self.heavy.hold(s.engine, functools.partial(write_zeros, zeros),
                            functools.partial(self.engines.zeroed, s.engine))
        log.debug("client %d released its rank of engine %r", s.client_id, s.engine)
        s.state.pending_prefetch = None  # its TOPK's reply failed (the connection went): no prefetch for it
        # The last reference to a cpu rank's memory is dropped on a worker thread (a slow unmap).
        box = [s.state] if s.state.host_memory else []
        s.state, s.engine = None, None
        self.heavy.release(box)

    def detach_postponed(self) -> None:
        """Release the ranks of the sessions gone while their engine was held (:meth:`detach`)
        whose engine is free now (a heavy request ended)."""
        waiting, self._postponed = self._postponed, []
        for s in waiting:
            try:
                self.detach(s)  # (postponed again while its engine is still held)
            except Exception:  # noqa: BLE001 - the others, and the request that ended, go on
                log.exception("releasing the rank of client %d, gone while its engine was held, failed", s.client_id)

    def watch(self, s: Session) -> PidWatch | None:
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
        s = self.get(identity)
        if s is None or s.client_id != client_id:
            return  # already gone (its watch was closed with it)
        try:
            self.reap(s)
        except Exception:  # noqa: BLE001 - a callback of the loop: log, never raise
            log.exception("reaping client %d failed", client_id)

    def reap(self, s: Session) -> None:
        """Forget session ``s`` whose process is gone, and release what it held."""
        self.pop(s.identity, None)
        self.heavy.forget(s.identity)  # its requests waiting behind a heavy one
        if s.state is not None:  # died attached: it never said goodbye
            log.warning("client %d (pid %d rank %d) is gone; detaching it from engine %r",
                        s.client_id, s.pid, s.rank, s.engine)
        else:  # had detached (or never attached): a normal exit
            self.rlog.log("exit", logging.INFO, "client %d (pid %d) exited", s.client_id, s.pid)
        self.detach(s)

    def reap_dead(self) -> int:
        """Detach clients whose process is gone (the fallback for those without a pidfd); a
        session of pid 0 is never reaped: nothing says whether it lives."""
        dead = [s for s in self.values() if not _alive(s)]
        for s in dead:
            self.reap(s)
        self.fd_server.expire()  # engine slabs deposited and never attached with
        self.expire_idle()
        self.rlog.flush()  # the summaries of windows that are over
        return len(dead)

    def expire_idle(self) -> int:
        """Drop the sessions not attached and without a request for ``idle_timeout_s`` (their
        connections stay; their next request is told why). Returns how many."""
        limit = time.monotonic() - self.idle_timeout_s
        idle = [s for s in self.values()
                if s.state is None and s.last_request_at <= limit and not self.heavy.busy(s.identity)]
        for s in idle:
            self.rlog.log("idle session", logging.INFO, "client %d (pid %d uid %d) dropped: no request for %g s and "
                          "not attached", s.client_id, s.pid, s.uid, self.idle_timeout_s)
            self.pop(s.identity, None)
            self.detach(s)
            self._expired[s.identity] = (f"client {s.client_id}'s session expired: no request for "
                                         f"{self.idle_timeout_s:g} s and not attached (idle_timeout_s); connect again")
            while len(self._expired) > EXPIRED_KEPT:
                self._expired.popitem(last=False)
        self.stats.add(sessions_expired=len(idle))
        return len(idle)

    def closed(self, identity: bytes) -> None:
        """Connection ``identity`` closed: its session goes (a client that closed without BYE
        must not hold a place, nor an attached rank, until its process exits)."""
        s = self.get(identity)
        if s is None:
            return
        self.rlog.log("closed without BYE", logging.INFO, "client %d (pid %d uid %d) dropped: its connection "
                      "closed without BYE", s.client_id, s.pid, s.uid)
        self.reap(s)
        self.stats.add(sessions_closed=1)

    # -- the operator's view ---------------------------------------------------------
    def sees_all(self, viewer: Peer | Session | None) -> bool:
        """Whether ``viewer`` (SO_PEERCRED of a stats or fd socket connection, or a session
        asking STATS; None: in process) may see every uid's clients: root, the daemon's own
        uid, and the admin group (primary, or supplementary: a Peer's ``groups``, read at
        accept while its process ran; a session's from ``/proc`` now)."""
        if viewer is None or viewer.uid in (0, os.getuid()):
            return True
        if self.admin_gid is None:
            return False
        groups = getattr(viewer, "groups", None)  # a Peer read at accept; a Session (STATS over control.sock): /proc
        if groups is None:
            groups = process_groups(viewer.pid)
        return viewer.gid == self.admin_gid or self.admin_gid in groups

    def client_lines(self, viewer: Peer | None = None) -> str:
        """One tab-separated line per client under a header line; columns may be added
        (``sparsekv top`` and tests read them by header name), ``name`` stays last. A
        ``viewer`` that may not see every uid's clients (:meth:`sees_all`) sees its own."""
        now = time.time()
        lines = ["id\tpid\trank\tdevice\tengine\tattached\trequests\terrors\tage_s\tuid\tname"]
        everyone = self.sees_all(viewer)
        for s in sorted(self.values(), key=lambda s: s.client_id):
            if not everyone and s.uid != viewer.uid:
                continue
            lines.append(f"{s.client_id}\t{s.pid}\t{s.rank}\t{_cell(s.device)}\t{_cell(s.engine)}\t"
                         f"{'yes' if s.state else 'no'}\t{s.requests}\t{s.errors}\t{now - s.connected_at:.0f}\t"
                         f"{s.uid}\t{_cell(s.name)}")
        return "\n".join(lines) + "\n"


def is_attacher(s: Session, pid: int, uid: int, gid: int) -> bool:
    """Whether process ``pid`` (uid, gid: SO_PEERCRED of the fd socket) is the one that
    said HELLO as ``s`` (SO_PEERCRED of control.sock) and still runs; an in-process
    session (no credentials) is the daemon's own process."""
    if not s.verified:
        return pid == os.getpid()
    if (pid, uid, gid) != (s.pid, s.uid, s.gid):
        return False
    return s.watch is None or not s.watch.exited()  # exited: the pid may be another's now


def opener_gone() -> ProtocolError:
    """The refusal of a HELLO or ATTACH on a connection whose opening process has exited:
    the pid SO_PEERCRED gave may be another process's by now."""
    return ProtocolError(ErrorCode.PERMISSION_DENIED, "the process that opened this connection has exited; connect again")


def started(pid: int) -> float | None:
    """Process ``pid``'s start time (psutil), None when it cannot be read."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, ValueError, OverflowError, OSError):  # OSError: EMFILE, say
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
        return alive and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # cannot tell (permissions): keep it


def _cell(text) -> str:
    """A client's string as one cell of a tab-separated line: what could break the line
    (tabs, newlines, U+2028: a forged line; ``proto.args.breaks_line``) becomes a space;
    empty is "-"."""
    return "".join(" " if breaks_line(ch) else ch for ch in str(text or "")) or "-"
