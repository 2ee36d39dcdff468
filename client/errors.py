"""Typed exceptions raised by the client; each carries the daemon's code and message."""

from __future__ import annotations

from sparsekv.proto import ErrorCode


class SparseKVError(Exception):
    """A request failed. ``code`` is a :class:`~sparsekv.proto.ErrorCode`; ``earlier``:
    the type name of the earlier request, not waited for, whose refusal this is (raised by
    the next request in its place), or None (the request's own); ``earlier_step``: that
    request's step number when it was a STEP sent alone."""

    code: ErrorCode = ErrorCode.INTERNAL
    earlier: str | None = None
    earlier_step: int | None = None

    def __init__(self, message: str, code: ErrorCode | None = None):
        super().__init__(message)
        if code is not None:
            self.code = ErrorCode(code)

    def __str__(self) -> str:
        return f"{self.code.name}: {self.args[0]}"


class DaemonUnavailable(SparseKVError):
    """No daemon answered in time (not running, wrong --run-dir, or stuck). Not a code
    the daemon sent: the message says what happened, without a code name."""

    def __str__(self) -> str:
        return self.args[0]


class DeviceMappingFailed(SparseKVError):
    """An attach got its rank but this process could not map the daemon's device memory
    (a CUDA IPC open failed); the rank was given back. Not a code the daemon sent.
    ``status``: the CUDA error's code, where there was one."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status

    def __str__(self) -> str:
        return self.args[0]


class ProtocolMismatch(SparseKVError):
    code = ErrorCode.BAD_VERSION


class LayoutMismatch(SparseKVError):
    code = ErrorCode.LAYOUT_MISMATCH


class PoolFull(SparseKVError):
    code = ErrorCode.POOL_FULL


class QuotaExceeded(SparseKVError):
    """This user holds its share of the daemon's clients or pool bytes (per-uid quotas)."""

    code = ErrorCode.QUOTA_EXCEEDED


class PoolExhausted(SparseKVError):
    """The engine's block store cannot promise the blocks asked for now. ``wanted``,
    ``free``, ``evictable`` (cached, pinned by nobody) and ``reserved`` (promised to
    clients already) are the store's figures at that moment, for a scheduler to admit by."""

    code = ErrorCode.POOL_EXHAUSTED

    def __init__(self, message: str, code: ErrorCode | None = None, detail: dict | None = None):
        super().__init__(message, code)
        detail = detail or {}
        self.wanted, self.free = detail.get("wanted", 0), detail.get("free", 0)
        self.evictable, self.reserved = detail.get("evictable", 0), detail.get("reserved", 0)


class BadRequest(SparseKVError):
    """The request was malformed or out of range (BAD_* , DUPLICATE_IDS, TOO_LARGE...)."""


class ClientInUse(BadRequest):
    """A request from a second thread while another thread's is being sent or awaited on
    the same client (a client serves one thread at a time): refused before anything was
    sent; the same call from the thread holding the client, or later, goes through."""


class TpMismatch(BadRequest):
    """This rank's step or top-k batch differs from its TP group's peers' at the same point
    (``attach(..., tp_size=n)``): nothing ran and the rank stays where it was (a ``topk()``
    that carried its step's ``step()``: neither ran; call ``step()`` again)."""

    code = ErrorCode.TP_MISMATCH


class TpLag(BadRequest):
    """A peer of this rank's TP group is too far behind (the daemon's ``tp_max_lag``): it
    stopped or sends something else; this request did not run (a ``topk()`` that carried
    its step's ``step()``: neither did; call ``step()`` again)."""

    code = ErrorCode.TP_LAG


class NotAttached(SparseKVError):
    code = ErrorCode.NOT_ATTACHED


class PermissionDenied(SparseKVError):
    """The engine belongs to another user (attach as its owner, as root or as a member of
    the daemon's admin group, or pick another engine name), or the daemon could not read
    this connection's credentials. The message never names the other engine's owner."""

    code = ErrorCode.PERMISSION_DENIED


_BY_CODE = {
    ErrorCode.BAD_VERSION: ProtocolMismatch,
    ErrorCode.LAYOUT_MISMATCH: LayoutMismatch,
    ErrorCode.POOL_FULL: PoolFull,
    ErrorCode.QUOTA_EXCEEDED: QuotaExceeded,
    ErrorCode.NOT_ATTACHED: NotAttached,
    ErrorCode.NOT_HELLO: NotAttached,
    ErrorCode.PERMISSION_DENIED: PermissionDenied,
    ErrorCode.TP_MISMATCH: TpMismatch,
    ErrorCode.TP_LAG: TpLag,
}


def error_for(code: int, message: str, detail: dict | None = None) -> SparseKVError:
    """The typed error of a failed reply (``detail``: its figures, POOL_EXHAUSTED's)."""
    try:
        code = ErrorCode(code)
    except ValueError:
        return SparseKVError(f"unknown error code {code}: {message}")
    if code == ErrorCode.POOL_EXHAUSTED:
        return PoolExhausted(message, code, detail if isinstance(detail, dict) else None)
    cls = _BY_CODE.get(code, BadRequest if code != ErrorCode.INTERNAL else SparseKVError)
    return cls(message, code)
