"""Client side of sparsekv: the per-rank client library, the in-process transport and the
``sparsekv`` command line."""

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
