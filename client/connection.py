"""The rank's connection to sparsekvd, the wire half of :class:`~sparsekv.client.Client`
(which sets up its state): requests out and replies in on one ZMTP connection
(:class:`~sparsekv.client.wire.Wire`, read and written by the caller's thread), awaited
in slices between which it checks that the daemon still lives (its process, its socket
file's identity); a daemon found gone, or a connection it closed, ends the session
(``_lost``).
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading
import time
from contextlib import contextmanager

import psutil

from sparsekv.proto import LIMITS, ErrorCode, MsgType, ProtocolError, decode, encode
from sparsekv.proto.args import CARRIED
from sparsekv.proto.run_dir import LOCK_FILE, lock_holder

from .errors import BadRequest, ClientInUse, DaemonUnavailable, SparseKVError, error_for
from .wire import Wire, WireClosed, connect_unix

_ENVELOPE = frozenset({"v", "t", "id", "ok", "tr", "tx"})
LIVENESS_SLICE_S = 0.25  # how often a client waiting for a reply checks that the daemon lives
CLOSED_LOOK_S = 0.5  # how long a closed connection's daemon is watched for its exit
BUSY_SUFFIX = ".busy"  # the socket's name while the daemon is short of descriptors (daemon/listener.py)


def _earlier(error: SparseKVError, what: str, step: int | None = None) -> SparseKVError:
    """``error``, marked as the refusal of an earlier request of type ``what`` (a STEP sent
    alone: of ``step``)."""
    error.earlier, error.earlier_step = what, step
    return error


class Connection:
    """Requests and replies on the rank's socket, and the daemon's liveness. One thread
    at a time: a request from another thread while one is being sent or waited for is
    refused (:meth:`_turn`)."""

    @contextmanager
    def _turn(self):
        """This thread's turn at the connection for a send, a wait, or both (a call):
        ClientInUse at once if another thread's is on (two threads' reads would race on the
        socket, and a request sent between another's send and its reply would leave its
        reply, e.g. the pins of a lookup, unread). Nested turns of one thread pass."""
        me = threading.get_ident()
        if self._turn_holder == me:
            yield
            return
        lock = self._turn_lock
        if not lock.acquire(blocking=False):
            raise ClientInUse(f"this Client is in use by another thread (thread {self._turn_holder}); a Client serves "
                              "one thread at a time: create one per thread, or hand it over between requests",
                              ErrorCode.BAD_ARGUMENT)
        try:  # (at once: an interruption after the acquire must not keep the lock)
            self._turn_holder = me
            yield
        finally:
            self._turn_holder = None
            lock.release()

    @property
    def control_path(self) -> str:
        return os.path.join(self.run_dir, "control.sock")

    def _lost(self, why: str, what: str = "session is"):
        """The daemon is gone: every request of this client fails from now on (the replies
        read before stay readable: their requests ran)."""
        self._gone = f"{why}; this client's {what} gone: create a new Client (and attach again)"
        self._drop_socket(keep_replies=True)
        raise DaemonUnavailable(self._gone)

    def _drop_socket(self, keep_replies: bool = False) -> None:
        """Close the connection; forget every request in flight (no reply will come for any)
        and, unless ``keep_replies``, the replies read and not yet taken."""
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        self._sent.clear()
        if keep_replies:  # (a deferred request's error among them is raised still, by flush)
            self._deferred[:] = [r for r in self._deferred if r in self._replies]
        else:
            self._replies.clear()
            self._deferred.clear()
        self._abandoned.clear()
        self._quiet.clear()

    def _send(self, msg_type: MsgType, fields=None, arrays=None) -> int:
        with self._turn():
            return self._send_now(msg_type, fields, arrays)

    def _send_now(self, msg_type: MsgType, fields=None, arrays=None) -> int:
        if self._sock is None:
            if self._gone is not None:
                raise DaemonUnavailable(self._gone)
            raise SparseKVError("client is not connected; call connect() or use it as a context manager",
                                ErrorCode.NOT_HELLO)
        self._check_owner()
        req = self._next_id
        self._next_id += 1
        ts = time.perf_counter_ns()
        if fields is None:
            fields = {"ts": ts}
        else:
            fields["ts"] = ts
        try:
            frames = encode(msg_type, req, fields, arrays)
        except OverflowError:  # msgpack carries integers in [-2**63, 2**64)
            raise BadRequest(f"{_too_wide(fields)} holds an integer outside what a request can carry "
                             f"({CARRIED})", ErrorCode.BAD_ARGUMENT) from None
        if len(frames[0]) > LIMITS.max_header_bytes:  # dropped unread: no reply could name the request
            raise BadRequest(f"a request header of {len(frames[0])} bytes exceeds the limit of "
                             f"{LIMITS.max_header_bytes} bytes (a name or a field too long)", ErrorCode.TOO_LARGE)
        if arrays:
            # The daemon would refuse it unread and close the connection: refuse it here.
            total = 0
            for f in frames[1:]:
                size = len(f)  # (encode's frames: bytes, or memoryviews of one byte an item)
                if size > LIMITS.max_frame_bytes:
                    raise BadRequest(f"an array of {size} bytes exceeds the frame limit of "
                                     f"{LIMITS.max_frame_bytes} bytes; split the request", ErrorCode.TOO_LARGE)
                total += size
            if total > LIMITS.max_message_bytes:
                raise BadRequest(f"arrays of more than {LIMITS.max_message_bytes} bytes in one request; split it",
                                 ErrorCode.TOO_LARGE)
        deadline = time.monotonic() + self.timeout_s

        def idle() -> None:  # the socket stayed full a slice: the daemon reads nothing of it
            self._still_there()
            if time.monotonic() > deadline:
                self._lost(f"sparsekvd at {self.run_dir} read none of a request for {self.timeout_s} s "
                           "(its connection is cut mid-message)")

        try:
            self._sock.send(frames, idle)
        except WireClosed as e:
            self._lost(self._closed_why(e))
        except BaseException as e:
            if self._sock is not None and self._sock.cut:  # the connection can carry nothing more
                try:
                    self._lost(f"a request to sparsekvd at {self.run_dir} was cut short by {type(e).__name__} "
                               "while being sent")
                except DaemonUnavailable:
                    pass  # the interruption is what the caller sees now; the next request says this
            raise
        self._sent[req] = (msg_type, ts)
        return req

    def _check_owner(self) -> None:
        """A forked child shares its parent's connection: its requests would mix with the
        parent's on the stream, its reads take the parent's replies, its goodbye ends the
        parent's session."""
        if os.getpid() != self._owner_pid:
            raise SparseKVError(f"this Client was connected by process {self._owner_pid}; a forked child must "
                                "create a Client of its own", ErrorCode.NOT_HELLO)

    def _closed_why(self, e: WireClosed) -> str:
        """Why the connection ended: the daemon gone or restarted, or it closed this one. A
        dying process closes its sockets before it is seen to exit: looked at for a while."""
        end = time.monotonic() + CLOSED_LOOK_S
        while True:
            why = self._check_daemon()
            if why is not None:
                return why
            if time.monotonic() > end:
                return (f"sparsekvd at {self.run_dir} closed this client's connection ({e}; its log says why: a limit "
                        "broken, replies not read, the daemon stopping)")
            time.sleep(0.01)

    def _receive_until(self, req_id: int) -> None:
        with self._turn():
            self._receive_now(req_id)

    def _receive_now(self, req_id: int) -> None:
        if self._sock is None and req_id not in self._replies:
            if self._gone is not None:
                raise DaemonUnavailable(self._gone)
            raise SparseKVError("client is not connected (closed since the request was made); no reply will come "
                                "for it", ErrorCode.NOT_HELLO)
        if req_id not in self._sent and req_id not in self._replies:  # (waited for it blocked until timeout_s)
            raise SparseKVError(f"request {req_id} was made on an earlier connection of this client, closed since: "
                                "no reply will come for it", ErrorCode.NOT_HELLO)
        self._check_owner()
        while req_id not in self._replies:
            if not self._spin() and not self._sock.wait(int(min(self.timeout_s, LIVENESS_SLICE_S) * 1000)):
                self._wait_slices()
            self._receive_one()

    def _receive_one(self) -> None:
        try:
            frames = self._sock.recv()
        except WireClosed as e:
            self._lost(self._closed_why(e))
        t_recv = time.perf_counter_ns()
        try:
            header, arrays = decode(frames)
        except ProtocolError as e:
            raise SparseKVError(f"undecodable reply: {e}") from None
        rid = header["id"]
        sent = self._sent.pop(rid, None)
        tr = header.get("tr")
        if sent is not None and tr is not None:
            self.timings[sent[0]] = (sent[1], tr, header.get("tx", tr), t_recv)
            if sent[0] == MsgType.TOPK:
                self.enqueued_at = header.get("tl")  # None from a cpu rank or an error reply
        if rid in self._quiet:
            self._quiet.discard(rid)
            return  # nobody reads it, and its caller had an error for it already
        if rid in self._abandoned:
            self._abandoned.discard(rid)
            if header.get("ok"):
                return  # nobody waits for it
            self._deferred.append(rid)  # its error: raised by the next request
        self._replies[rid] = (header, arrays)

    def _abandon(self, req_id: int, quietly: bool = False) -> None:
        """``req_id``'s Pending was dropped unread: drop its reply (here or to come), but
        raise its error at the next request (``quietly``: drop that too: its caller was
        raised an error for it already)."""
        got = self._replies.get(req_id)
        if got is not None:
            if got[0].get("ok") or quietly:
                del self._replies[req_id]
            elif req_id not in self._deferred:
                self._deferred.append(req_id)
        elif req_id in self._sent:
            (self._quiet if quietly else self._abandoned).add(req_id)

    def _receive_arrived(self) -> None:
        """Take every reply already here, without waiting."""
        with self._turn():
            while self._sock is not None and self._sock.ready():
                self._receive_one()

    def _spin(self) -> bool:
        """Poll without sleeping for up to ``spin_us``; True once a reply is waiting."""
        if not self.spin_ns:
            return False
        ready, now = self._sock.ready, time.perf_counter_ns  # a non-blocking read each turn
        end = now() + self.spin_ns
        while now() < end:
            if ready():
                return True
        return False

    def _wait_slices(self) -> None:
        """No reply within the first slice: poll on in slices until ``timeout_s``,
        checking between slices that the daemon still lives."""
        deadline = time.monotonic() + self.timeout_s - min(self.timeout_s, LIVENESS_SLICE_S)
        while True:
            self._still_there()
            left = deadline - time.monotonic()
            if left <= 0:
                # The session ends here, as for a lost daemon: the request may have run, and its
                # reply would come to a client that no longer waits for it (later replies too).
                self._lost(f"no reply from sparsekvd at {self.run_dir} within {self.timeout_s} s (the request may "
                           "have run)")
            if self._sock.wait(max(1, int(min(left, LIVENESS_SLICE_S) * 1000))):
                return

    def _await_reply(self, req_id: int):
        self._receive_until(req_id)
        self._check_deferred()
        header, arrays = self._replies.pop(req_id)
        if not header.get("ok"):
            code = header.get("code", int(ErrorCode.INTERNAL))
            raise error_for(code, header.get("msg", "no message"), header.get("detail"))
        return header, arrays

    def _check_deferred(self) -> None:
        """Raise the first error among deferred requests whose replies have arrived."""
        if not self._deferred:
            return
        for r in [r for r in self._deferred if r in self._replies]:
            self._deferred.remove(r)
            header, _ = self._replies.pop(r)
            step = self._lone_step_numbers.pop(r, None)
            if not header.get("ok"):
                try:
                    what = MsgType(header.get("t")).name
                except ValueError:
                    what = "request"
                # (not held in a local: the traceback's frame would keep it, and the Pending of
                # the request raising it, alive in a cycle: its reply kept for nobody)
                raise _earlier(error_for(header.get("code", int(ErrorCode.INTERNAL)),
                                         f"{header.get('msg', 'no message')} (the reply to an earlier {what} not "
                                         f"waited for, id {header.get('id')}; raised by the next request)"), what,
                               step)

    def _call(self, msg_type: MsgType, fields=None, arrays=None):
        """Send and wait, in one turn; return (reply fields without the envelope, reply arrays)."""
        with self._turn():
            req = self._send(msg_type, fields, arrays)
            try:
                header, arrays = self._await_reply(req)
            except SparseKVError:
                self._replies.pop(req, None)  # an earlier request's error was raised instead: nobody reads this one
                raise
        fields = header.copy()
        for k in _ENVELOPE:
            fields.pop(k, None)
        return fields, arrays

    def _check_daemon(self) -> str | None:
        """Why the daemon this client connected to is no longer there, or None while it
        seems to be: its process (when visible) and its socket file (a restart makes a new one)."""
        path = self.control_path
        if self._process_alive() is False:
            return f"sparsekvd is gone (pid {self._daemon_pid} exited)"
        st = None  # alive, or cannot tell (another pid namespace, permissions): the socket says more
        # The daemon renames control.sock <-> control.sock.busy (BUSY_SUFFIX): both names can
        # be missing between two stats. Gone only when neither exists three times over.
        for _ in range(3):
            for p in (path, path + BUSY_SUFFIX):
                try:
                    st = os.stat(p)
                    break
                except FileNotFoundError:
                    continue
                except OSError:
                    return None  # cannot tell
            if st is not None:
                break
        if st is None:
            return f"sparsekvd is gone: its socket {path} was removed"
        if self._socket_id is not None and file_id(st) != self._socket_id:
            return f"sparsekvd restarted: {path} is a new daemon's socket"
        return None

    def _process_alive(self) -> bool | None:
        """Whether the daemon's process lives: None when this process cannot see it. A new
        process under the same pid, or a zombie its parent has not reaped, is not it."""
        pid = self._daemon_pid
        if pid <= 0:
            return None
        try:
            p = psutil.Process(pid)
            return p.status() != psutil.STATUS_ZOMBIE and (self._daemon_started is None
                                                            or p.create_time() == self._daemon_started)
        except psutil.NoSuchProcess:
            return False
        except psutil.Error:
            return None

    def _daemon_dead(self) -> str | None:
        """Why the daemon is gone, only once its process is (or cannot be seen): a live
        process may still run its GPU work, and a release then would race with it."""
        if self._process_alive() is True:
            return None
        return self._check_daemon()

    def _still_there(self) -> None:
        """Raise DaemonUnavailable (and forget the session) if the daemon has gone."""
        why = self._check_daemon()
        if why is not None:
            self._lost(why)


def open_wire(path: str, run_dir: str, timeout_s: float) -> tuple[Wire, int, tuple[int, int, int]]:
    """Connect to the daemon's socket ``path`` and speak ZMTP on it. Returns (the
    :class:`Wire`, the daemon's pid here (0 in another pid namespace: ``SO_PEERCRED``), the
    socket file's :func:`file_id`). A daemon whose queue of new connections is full (a
    flood) is waited for, ``timeout_s`` at most. Raises :class:`DaemonUnavailable` saying
    what is wrong: no socket, not a socket, permission, refused, busy, no handshake."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        pid = lock_holder(run_dir)
        if pid is not None and _busy_is_the_holders(path, run_dir):
            raise DaemonUnavailable(f"sparsekvd at {run_dir} refuses new connections for now: it is short of file "
                                    "descriptors (too many open connections; see its log); retry later") from None
        if pid is not None:
            raise DaemonUnavailable(f"sparsekvd (pid {pid or '?'}) holds {run_dir} but has no control socket: it is "
                                    "starting (pre-faulting its pool or starting its backend) or stopping; retry "
                                    "shortly") from None
        raise DaemonUnavailable(f"no daemon socket at {path}; is sparsekvd running with --run-dir {run_dir}?") from None
    except PermissionError:
        raise DaemonUnavailable(f"permission denied on {run_dir}: this user may not enter sparsekvd's run dir "
                                "(engines need the daemon's group, see deploy/README.md)") from None
    except OSError as e:
        raise DaemonUnavailable(f"cannot reach {path}: {e.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise DaemonUnavailable(f"{path} is not a socket; is --run-dir {run_dir} sparsekvd's run dir?")
    try:
        s = connect_unix(path, timeout_s)
    except PermissionError:
        raise DaemonUnavailable(f"permission denied on {path}: this user may not connect to sparsekvd (connecting "
                                "needs write permission on the socket: the daemon's group, see deploy/README.md)"
                                ) from None
    except ConnectionRefusedError:
        raise DaemonUnavailable(f"connection refused on {path}: no sparsekvd listens there (it exited and left "
                                "its socket behind, or it is starting)") from None
    except FileNotFoundError:
        return open_wire(path, run_dir, timeout_s)  # renamed away just now: say why
    except (BlockingIOError, TimeoutError):
        raise DaemonUnavailable(f"sparsekvd at {run_dir} did not accept a connection within {timeout_s} s: its queue "
                                "of new connections stayed full (is it stuck?)") from None
    except OSError as e:
        raise DaemonUnavailable(f"cannot connect to {path}: {e.strerror}") from None
    try:
        pid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
    except OSError:
        pid = 0
    try:
        wire = Wire(s, timeout_s)
    except OSError as e:  # closed, broken or silent (WireClosed, TimeoutError): Wire closed the socket
        raise DaemonUnavailable(f"sparsekvd at {run_dir} accepted a connection but its ZMTP handshake failed: {e}"
                                ) from None
    return wire, max(pid, 0), file_id(st)


def _busy_is_the_holders(path: str, run_dir: str) -> bool:
    """Whether ``path`` renamed to its busy name (a daemon short of descriptors) is the
    lock holder's: bound after it wrote the lock file, not left by a daemon that was killed
    while busy (the next daemon removes that once it holds the lock: a client may look
    before)."""
    try:
        busy = os.stat(path + BUSY_SUFFIX).st_mtime_ns
        lock = os.stat(os.path.join(run_dir, LOCK_FILE)).st_mtime_ns
    except OSError:
        return False
    return busy >= lock


def file_id(st: os.stat_result) -> tuple[int, int, int]:
    """What tells one socket file from the next at the same path: a file system may give
    a new file the inode number of one just deleted (ext4 does), but not its mtime too
    (set when the daemon binds it; chmod and rename leave it)."""
    return st.st_dev, st.st_ino, st.st_mtime_ns


def start_time(pid: int) -> float | None:
    if pid <= 0:
        return None
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _too_wide(fields) -> str:
    """The name of the first field of ``fields`` (nested maps and lists too) whose integer
    msgpack cannot carry (an entry of a list: the list's field)."""
    return _wide_in(fields, "a field") or "a field"


def _wide_in(value, name: str) -> str | None:
    if isinstance(value, int):  # (an IntEnum too; a bool is in range)
        return name if not -(1 << 63) <= value < 1 << 64 else None
    if isinstance(value, dict):
        return next((found for k, v in value.items() if (found := _wide_in(v, str(k)))), None)
    if isinstance(value, (list, tuple)):
        return next((found for v in value if (found := _wide_in(v, name))), None)
    return None
