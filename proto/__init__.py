"""Wire protocol shared by the daemon and its clients: message types, error codes,
limits, the layout value object and frame encoding. Imports nothing from the rest."""

from .frames import decode, encode, reply_error, reply_ok
from .layout import Layout, LayoutError
from .messages import ERROR_HINTS, LIMITS, PROTOCOL_VERSION, REQUESTS, ErrorCode, Limits, MsgType, ProtocolError

__all__ = [
    "ERROR_HINTS", "LIMITS", "PROTOCOL_VERSION", "REQUESTS", "ErrorCode", "Layout", "LayoutError",
    "Limits", "MsgType", "ProtocolError", "decode", "encode", "reply_error", "reply_ok",
]
