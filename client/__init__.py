"""The per-rank client library of sparsekv."""

from .blocks import Blocks
from .client import Attachment, Client, Pending, TopkResult
from .errors import (
    BadRequest,
    ClientInUse,
    DaemonUnavailable,
    DeviceMappingFailed,
    LayoutMismatch,
    NotAttached,
    PermissionDenied,
    PoolExhausted,
    PoolFull,
    ProtocolMismatch,
    QuotaExceeded,
    SparseKVError,
    TpLag,
    TpMismatch,
)

__all__ = [
    "Attachment", "BadRequest", "Blocks", "Client", "ClientInUse", "DaemonUnavailable", "DeviceMappingFailed", "LayoutMismatch", "NotAttached",
    "Pending", "PermissionDenied", "PoolExhausted", "PoolFull", "ProtocolMismatch", "QuotaExceeded", "SparseKVError",
    "TopkResult", "TpLag", "TpMismatch",
]
