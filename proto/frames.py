"""Encode and decode multipart messages: a msgpack header plus raw array frames."""

from __future__ import annotations

from typing import Any, Sequence

import msgpack
import numpy as np

from .messages import LIMITS, PROTOCOL_VERSION, WIRE_DTYPES, ErrorCode, Limits, MsgType, ProtocolError


def encode(msg_type: MsgType | int, req_id: int, fields: dict[str, Any] | None = None,
           arrays: dict[str, np.ndarray] | None = None) -> list:
    """Return the frames of one message. Arrays are sent without a copy when contiguous."""
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": int(msg_type), "id": int(req_id)}
    if fields:
        header.update(fields)
    if not arrays:
        return [_pack(header)]
    frames: list = [None]
    desc = []
    for name, a in arrays.items():
        if type(a) is not np.ndarray or not a.flags.c_contiguous or not a.ndim:
            a = np.ascontiguousarray(a)  # (a scalar travels as shape [1], as it always has)
        dt = a.dtype
        desc.append([name, _NAMES.get(dt) or dt.name, list(a.shape)])  # dtype.name costs microseconds
        frames.append(memoryview(a).cast("B") if a.size else b"")
    header["arrays"] = desc
    frames[0] = _pack(header)
    return frames


_ABSENT = object()  # no "arrays" in a header (its nil is refused, as any other non-list)


def _pack(header: dict) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def decode(frames: Sequence, limits: Limits = LIMITS) -> tuple[dict, dict[str, np.ndarray]]:
    """Parse ``frames`` into ``(header, arrays)``, the arrays read-only views of the
    received frames (no copy); raise :class:`ProtocolError` on any flaw."""
    if not frames:
        raise ProtocolError(ErrorCode.BAD_FRAME, "empty message")
    if len(frames) > limits.max_frames:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{len(frames)} frames exceed the limit of {limits.max_frames}")
    raw = frames[0]
    if type(raw) is not bytes:
        raw = _bytes(raw)
    if len(raw) > limits.max_header_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"header of {len(raw)} bytes exceeds {limits.max_header_bytes}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types
        raise ProtocolError(ErrorCode.BAD_FRAME, f"header is not msgpack: {type(e).__name__}") from None
    if type(header) is not dict:
        raise ProtocolError(ErrorCode.BAD_FRAME, "header must be a map")
    get = header.get
    if type(get("v")) is not int or type(get("t")) is not int or type(get("id")) is not int:
        for key in ("v", "t", "id"):
            if type(get(key)) is not int:  # exactly int: bool is an int subclass
                raise ProtocolError(ErrorCode.BAD_FRAME, f"header field {key!r} must be an integer")
    desc = header.pop("arrays", _ABSENT)
    if desc is _ABSENT:
        if len(frames) == 1:
            return header, {}
        desc = []
    if type(desc) is not list or len(desc) != len(frames) - 1:
        n = len(desc) if type(desc) is list else "?"
        raise ProtocolError(ErrorCode.BAD_FRAME, f"header describes {n} arrays but {len(frames) - 1} frames follow")
    arrays: dict[str, np.ndarray] = {}
    for i, item in enumerate(desc, 1):
        name, array = _array(item, frames[i], limits)
        if name in arrays:
            raise ProtocolError(ErrorCode.BAD_FRAME, f"array {name!r} sent twice")
        arrays[name] = array
    return header, arrays


# pyzmq's zero-copy send costs tens of microseconds per frame (a tracked zmq.Frame); below
# this size copying the bytes is cheaper.
ZERO_COPY_MIN_BYTES = 64 * 1024


def send_copy(frames) -> bool:
    """Whether to send ``frames`` by copy (small messages) rather than zero-copy."""
    return sum(len(f) if isinstance(f, (bytes, bytearray)) else f.nbytes for f in frames) < ZERO_COPY_MIN_BYTES


def _bytes(frame) -> bytes | memoryview:
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return frame
    return frame.buffer  # zmq.Frame


def _array(item, frame, limits: Limits) -> tuple[str, np.ndarray]:
    # The decode path of every request: plain type checks, no generators (each costs
    # microseconds per request in CPython).
    if type(item) is not list or len(item) != 3:
        raise ProtocolError(ErrorCode.BAD_FRAME, "array description must be [name, dtype, shape]")
    name, dtype, shape = item
    if type(name) is not str:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"array name must be a string, got {type(name).__name__}")
    # type() first: an unhashable dtype (a list) would make the set lookup raise TypeError.
    if type(dtype) is not str or dtype not in WIRE_DTYPES:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"array {name!r}: dtype {dtype!r} is not allowed on the wire")
    if type(shape) is not list or len(shape) > limits.max_array_dims:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"array {name!r}: bad shape {shape!r}")
    # Exact Python integers (bool, an int subclass NumPy refuses as a dimension, is not
    # int): an int64 product wraps around for huge shapes and could "match" a short frame.
    count = 1
    widest = 0
    for d in shape:
        if type(d) is not int or d < 0:
            raise ProtocolError(ErrorCode.BAD_FRAME, f"array {name!r}: bad shape {shape!r}")
        count *= d
        widest = d if d > widest else widest
    buf = frame if type(frame) is bytes or type(frame) is memoryview else _bytes(frame)
    nbytes = len(buf)
    if nbytes > limits.max_frame_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"array {name!r} of {nbytes} bytes exceeds {limits.max_frame_bytes}")
    # No dimension past the frame limit, even beside a 0 (an empty array of dimension 2**63
    # is no array NumPy can shape).
    if widest > limits.max_frame_bytes:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"array {name!r}: bad shape {shape!r}")
    dt = _DTYPES[dtype]
    want = count * dt.itemsize
    if want != nbytes:
        raise ProtocolError(ErrorCode.BAD_FRAME,
                            f"array {name!r}: shape {shape} of {dtype} needs {want} bytes, frame has {nbytes}")
    a = np.frombuffer(buf, dtype=dt) if nbytes else np.empty(0, dt)
    try:
        return name, a.reshape(shape)
    except ValueError:  # empty, but its other dimensions multiply past what NumPy indexes
        raise ProtocolError(ErrorCode.BAD_FRAME, f"array {name!r}: bad shape {shape!r}") from None


_DTYPES = {name: np.dtype(name) for name in WIRE_DTYPES}
_NAMES = {dt: name for name, dt in _DTYPES.items()}


def reply_ok(msg_type: int, req_id: int, fields=None, arrays=None, tr: int | None = None, tx: int | None = None) -> list:
    """A successful reply; ``tr`` / ``tx`` (messages.py's timestamps) sent when given."""
    head = {"ok": True, **fields} if fields else {"ok": True}
    if tr is not None:
        head["tr"], head["tx"] = tr, tx
    return encode(msg_type, req_id, head, arrays)


def reply_error(msg_type: int, req_id: int, code: ErrorCode, message: str,
                tr: int | None = None, tx: int | None = None, detail: dict | None = None) -> list:
    """A failed reply: ``code``, its name as ``error``, ``msg``, and ``detail`` (a map of
    figures, POOL_EXHAUSTED's) when given; ``tr`` / ``tx`` as in :func:`reply_ok`."""
    head = {"ok": False, "code": int(code), "error": ErrorCode(code).name, "msg": message}
    if detail:
        head["detail"] = detail
    if tr is not None:
        head["tr"], head["tx"] = tr, tx
    return encode(msg_type, req_id, head)
