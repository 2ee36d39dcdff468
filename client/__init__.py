"""The per-rank client library of sparsekv."""

from .client import Attachment, Client, Pending, TopkResult
from .errors import (
    BadRequest,
    DaemonUnavailable,
    DeviceMappingFailed,
    LayoutMismatch,
    NotAttached,
    PermissionDenied,
    PoolFull,
    ProtocolMismatch,
    QuotaExceeded,
    SparseKVError,
)

__all__ = [
    "Attachment", "BadRequest", "Client", "DaemonUnavailable", "DeviceMappingFailed", "LayoutMismatch", "NotAttached",
    "Pending", "PermissionDenied", "PoolFull", "ProtocolMismatch", "QuotaExceeded", "SparseKVError",
    "TopkResult",
]
