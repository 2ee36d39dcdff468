"""The fd socket: how a client gets the descriptors of its rank's shared memory.

A rank's host memory that both sides map (the cpu backend's slab + staging buffer, the
cuda backend's pinned step blocks) is an anonymous memfd, which no other process can open.
The ATTACH reply's handles name the descriptors a rank gets (``fd``: cpu, ``blocks_fd``:
cuda) and carry ``fd_socket``, a UNIX stream socket in the run dir (:data:`FD_SOCKET`,
mode 0660), and ``fd_token`` (:data:`TOKEN_BYTES` random bytes, good for one connection,
withdrawn when the rank detaches).

The client connects, sends the token and a newline (at most :data:`MAX_REQUEST_BYTES`),
and reads one answer: a JSON line ``{"ok": true, "fds": [names]}`` with the descriptors,
in that order, as ``SCM_RIGHTS``; or ``{"ok": false, "code": "<ErrorCode name>", "msg":
...}`` without any. Only the process that attached (``SO_PEERCRED`` pid and uid) gets
them; anything else is refused and counted (``fd_refusals``). A request brings at most
one descriptor (a deposit's, :func:`deposit_fd`): one bringing more is refused
``BAD_ARGUMENT``, none of them kept.

The daemon serves a bounded number of connections at once, a share of them to each uid
(``daemon/fd_server.py``); a connection beyond is answered at once, its request unread,
``{"ok": false, "code": "QUOTA_EXCEEDED", "msg": "busy: ...", "busy": true}``, which
:func:`fetch_fds` and :func:`deposit_fd` try again for up to :data:`BUSY_RETRY_S` before
raising it. A request must come within :data:`REQUEST_TIMEOUT_S` of the connection.
"""

from __future__ import annotations

import json
import os
import socket
import time

from .messages import ErrorCode, ProtocolError

FD_SOCKET = "fds.sock"
TOKEN_BYTES = 16  # sent as 32 hex digits
MAX_REQUEST_BYTES = 128  # the token line; the daemon reads no more
MAX_ANSWER_BYTES = 4096
MAX_FDS = 8  # descriptors an answer brings at most (a request: one, a deposit's)
TIMEOUT_S = 5.0  # a client gives up on a daemon that does not answer after this
# The daemon closes a connection whose request has not come after this: clients send it
# in the call that connected, so a second is ample on a loaded host, and a silent
# connection holds its slot 1 s.
REQUEST_TIMEOUT_S = 1.0
# A busy answer is tried again, after 1 ms doubling to 50 ms, for up to this long: past
# the daemon's REQUEST_TIMEOUT_S, so every connection that held the slots at the first
# refusal has been answered or closed by the last try.
BUSY_RETRY_S = 2.0


DEPOSIT = "deposit"  # the request line that brings an engine-owned slab's descriptor


def answer(ok: bool, *, fds: list[str] | None = None, code: ErrorCode | None = None, msg: str = "",
           deposit: str | None = None, busy: bool = False) -> bytes:
    """The daemon's answer line (the descriptors travel beside it); ``busy``: a refusal
    for want of a free connection, which the client may try again."""
    if not ok:
        body = {"ok": False, "code": code.name, "msg": msg, **({"busy": True} if busy else {})}
    elif deposit is not None:
        body = {"ok": True, "deposit": deposit}
    else:
        body = {"ok": True, "fds": list(fds or [])}
    return json.dumps(body).encode() + b"\n"


def deposit_fd(path: str, fd: int, timeout_s: float = TIMEOUT_S) -> str:
    """Give the daemon the descriptor ``fd`` (an engine-owned slab: a sealed memfd) over
    the fd socket ``path``; return the deposit's id, which this process's next ATTACH
    names (``slab``: ``{"deposit": id, ...}``). Raises ``ProtocolError`` with the
    daemon's code when it refuses (busy: after :data:`BUSY_RETRY_S` of tries), ``OSError``
    when the socket cannot be reached."""
    head, _ = _exchange(path, lambda s: socket.send_fds(s, [DEPOSIT.encode() + b"\n"], [fd]), timeout_s)
    dep = head.get("deposit")
    if not isinstance(dep, str):
        raise ProtocolError(ErrorCode.BAD_FRAME, f"the fd socket answered a deposit with {head!r}")
    return dep


def _read_answer(s: socket.socket, data: bytes) -> dict:
    """The answer line (``data`` and the rest) as a dict; ``ProtocolError`` for a refusal or garbage."""
    while not data.endswith(b"\n") and len(data) < MAX_ANSWER_BYTES:
        more = s.recv(MAX_ANSWER_BYTES - len(data))
        if not more:
            break
        data += more
    if not data:
        raise ProtocolError(ErrorCode.INTERNAL, "the daemon closed the fd socket without an answer (stopping, "
                            "or an older daemon busy: see its log)")
    try:
        head = json.loads(data)
    except ValueError:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"the fd socket answered {data[:60]!r}, not a JSON line; "
                            "check the client and daemon versions") from None
    if not isinstance(head, dict) or not head.get("ok"):
        head = head if isinstance(head, dict) else {}
        code = ErrorCode.__members__.get(str(head.get("code")), ErrorCode.INTERNAL)
        raise ProtocolError(code, str(head.get("msg", "refused")), {"busy": True} if head.get("busy") is True else None)
    return head


def fetch_fds(path: str, token: str, timeout_s: float = TIMEOUT_S) -> dict[str, int]:
    """Connect to the fd socket ``path``, present ``token``; return the descriptors by name
    (the caller closes them). Raises ``ProtocolError`` with the daemon's code when it
    refuses (busy: after :data:`BUSY_RETRY_S` of tries), ``OSError`` when the socket
    cannot be reached."""
    head, fds = _exchange(path, lambda s: s.sendall(token.encode("ascii") + b"\n"), timeout_s)
    try:
        names = head.get("fds")
        if not isinstance(names, list) or len(names) != len(fds):
            raise ProtocolError(ErrorCode.BAD_FRAME, f"the fd socket named {names!r} but sent {len(fds)} descriptor(s)")
        out = dict(zip(map(str, names), fds))
        fds = []
        return out
    finally:
        for fd in fds:
            os.close(fd)


def _exchange(path: str, send, timeout_s: float) -> tuple[dict, list[int]]:
    """One request (``send(sock)``) and its answer with the descriptors beside it; a busy
    answer tried again for up to :data:`BUSY_RETRY_S` (within ``timeout_s``)."""
    start = time.monotonic()
    pause = 0.001
    while True:
        left = timeout_s - (time.monotonic() - start)
        try:
            return _exchange_once(path, send, max(left, 0.01))
        except ProtocolError as e:
            spent = time.monotonic() - start
            if not e.detail.get("busy") or spent + pause > min(BUSY_RETRY_S, timeout_s):
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _exchange_once(path: str, send, timeout_s: float) -> tuple[dict, list[int]]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    fds: list[int] = []
    try:
        s.settimeout(timeout_s)
        s.connect(path)
        try:
            send(s)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered busy and closed before the request was read: that answer is there to read
        # The descriptors come with the first bytes of the answer.
        data, fds, flags, _ = socket.recv_fds(s, MAX_ANSWER_BYTES, MAX_FDS, socket.MSG_CMSG_CLOEXEC)
        if flags & socket.MSG_CTRUNC:
            raise ProtocolError(ErrorCode.INTERNAL, "the daemon's descriptors were cut off (more than "
                                f"{MAX_FDS}, or this process is out of descriptors)")
        head = _read_answer(s, data)
        out, fds = fds, []
        return head, out
    finally:
        for fd in fds:
            os.close(fd)
        s.close()
