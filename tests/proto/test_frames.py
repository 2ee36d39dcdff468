"""Frame encoding: round trips, and every malformed message answered by a ProtocolError
with the right code before anything is allocated."""

import msgpack
import numpy as np
import pytest
import zmq

from sparsekv.proto import (
    LIMITS,
    PROTOCOL_VERSION,
    ErrorCode,
    Limits,
    MsgType,
    ProtocolError,
    decode,
    encode,
    reply_error,
    reply_ok,
)
from sparsekv.proto.messages import WIRE_DTYPES


def wire(frames):
    """What the peer receives: every frame as bytes."""
    return [bytes(f) for f in frames]


def header(**fields):
    h = {"v": PROTOCOL_VERSION, "t": int(MsgType.STEP), "id": 7}
    h.update(fields)
    return {k: v for k, v in h.items() if v is not ...}


def pack(h) -> bytes:
    return msgpack.packb(h, use_bin_type=True)


@pytest.mark.parametrize("dtype", sorted(WIRE_DTYPES))
def test_round_trip_of_every_wire_dtype(dtype):
    a = (np.arange(24) % 7).astype(dtype).reshape(2, 3, 4)
    h, arrays = decode(wire(encode(MsgType.TOPK, 5, {"step": 3}, {"x": a})))
    assert h["t"] == MsgType.TOPK and h["id"] == 5 and h["v"] == PROTOCOL_VERSION and h["step"] == 3
    assert "arrays" not in h
    assert arrays["x"].dtype == np.dtype(dtype) and arrays["x"].shape == (2, 3, 4)
    np.testing.assert_array_equal(arrays["x"], a)


def test_round_trip_of_several_arrays_fields_and_empty_arrays():
    arrays = {
        "state_rows": np.array([3, -1], np.int32),
        "reset": np.array([True, False]),
        "invalidate": np.zeros((2, 0), np.int32),
        "strided": np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2],  # not contiguous
    }
    fields = {"step": 9, "name": "é", "nested": {"a": [1, 2]}, "none": None}
    h, got = decode(wire(encode(MsgType.STEP, 1, fields, arrays)))
    for k, v in fields.items():
        assert h[k] == v
    assert list(got) == list(arrays)
    for k, v in arrays.items():
        np.testing.assert_array_equal(got[k], v)
        assert got[k].shape == v.shape
    assert not got["state_rows"].flags.writeable  # views of the frames, no copy


def test_decode_accepts_zmq_frames():
    frames = [zmq.Frame(f) for f in wire(encode(MsgType.TOPK, 2, None, {"topk": np.array([[1, 2]], np.int32)}))]
    _, arrays = decode(frames)
    assert arrays["topk"].tolist() == [[1, 2]]


def test_a_scalar_array_travels_as_shape_one():
    """A 0-d array (a scalar row, a scalar state row) goes as [1], as it always has: the
    daemon's checks want a 1-d array."""
    h, a = decode(wire(encode(MsgType.STEP, 1, None, {"rows": np.array(5, dtype=np.int32),
                                                      "more": np.arange(2, dtype=np.int32)})))
    assert a["rows"].shape == (1,) and int(a["rows"][0]) == 5 and a["more"].tolist() == [0, 1]


def test_message_without_arrays_has_only_the_header_frame():
    frames = encode(MsgType.DETACH, 4)
    assert len(frames) == 1
    assert decode(wire(frames)) == ({"v": PROTOCOL_VERSION, "t": int(MsgType.DETACH), "id": 4}, {})


def test_reply_helpers():
    h, arrays = decode(wire(reply_ok(MsgType.TOPK, 8, {"hits": 3}, {"slots": np.array([1], np.int32)})))
    assert h["ok"] is True and h["hits"] == 3 and h["id"] == 8 and arrays["slots"].tolist() == [1]
    h, _ = decode(wire(reply_error(MsgType.ATTACH, 9, ErrorCode.POOL_FULL, "no room")))
    assert h == {"v": PROTOCOL_VERSION, "t": int(MsgType.ATTACH), "id": 9, "ok": False,
                 "code": int(ErrorCode.POOL_FULL), "error": "POOL_FULL", "msg": "no room"}


I32 = np.arange(3, dtype=np.int32).tobytes()

MALFORMED = {
    "empty message": ([], ErrorCode.BAD_FRAME, "empty message"),
    "not msgpack": ([b"\xc1\xc1"], ErrorCode.BAD_FRAME, "not msgpack"),
    "truncated msgpack": ([pack(header())[:-1]], ErrorCode.BAD_FRAME, "not msgpack"),
    "header is a list": ([pack([1, 1, 7])], ErrorCode.BAD_FRAME, "must be a map"),
    "header is an int": ([pack(5)], ErrorCode.BAD_FRAME, "must be a map"),
    "missing v": ([pack(header(v=...))], ErrorCode.BAD_FRAME, "'v'"),
    "missing t": ([pack(header(t=...))], ErrorCode.BAD_FRAME, "'t'"),
    "missing id": ([pack(header(id=...))], ErrorCode.BAD_FRAME, "'id'"),
    "v not an int": ([pack(header(v="1"))], ErrorCode.BAD_FRAME, "'v' must be an integer"),
    "v a bool": ([pack(header(v=True))], ErrorCode.BAD_FRAME, "'v' must be an integer"),
    "non-string key": ([b"\x81\x01\x02"], ErrorCode.BAD_FRAME, "not msgpack"),
    "array described, no frame": ([pack(header(arrays=[["a", "int32", [3]]]))], ErrorCode.BAD_FRAME,
                                  "describes 1 arrays but 0 frames"),
    "frame without description": ([pack(header()), I32], ErrorCode.BAD_FRAME, "describes 0 arrays but 1 frames"),
    "arrays not a list": ([pack(header(arrays="a")), I32], ErrorCode.BAD_FRAME, "describes ? arrays"),
    "arrays nil, no frame": ([pack(header(arrays=None))], ErrorCode.BAD_FRAME, "describes ? arrays"),
    "description not a triple": ([pack(header(arrays=[["a", "int32"]])), I32], ErrorCode.BAD_FRAME,
                                 "[name, dtype, shape]"),
    "bad dtype": ([pack(header(arrays=[["a", "complex128", [3]]])), I32], ErrorCode.BAD_FRAME,
                  "dtype 'complex128' is not allowed"),
    "object dtype": ([pack(header(arrays=[["a", "object", [3]]])), I32], ErrorCode.BAD_FRAME, "is not allowed"),
    "dtype not a string": ([pack(header(arrays=[["a", ["int32"], [3]]])), I32], ErrorCode.BAD_FRAME,
                           "is not allowed"),
    "name not a string": ([pack(header(arrays=[[1, "int32", [3]]])), I32], ErrorCode.BAD_FRAME,
                          "array name must be a string"),
    "negative dim": ([pack(header(arrays=[["a", "int32", [-3]]])), I32], ErrorCode.BAD_FRAME, "bad shape"),
    "dim not an int": ([pack(header(arrays=[["a", "int32", ["3"]]])), I32], ErrorCode.BAD_FRAME, "bad shape"),
    "shape not a list": ([pack(header(arrays=[["a", "int32", 3]])), I32], ErrorCode.BAD_FRAME, "bad shape"),
    "bool dim": ([pack(header(arrays=[["a", "int32", [True]]])), I32[:4]], ErrorCode.BAD_FRAME, "bad shape"),
    # 2**32 x 2**32 int32 wraps to 0 bytes in int64 arithmetic: must not match an empty frame
    "huge shape, empty frame": ([pack(header(arrays=[["a", "int32", [2**32, 2**32]]])), b""], ErrorCode.BAD_FRAME,
                                "bad shape"),
    "huge shape within the frame limit": ([pack(header(arrays=[["a", "int32", [2**16, 2**16]]])), b""],
                                          ErrorCode.BAD_FRAME, "frame has 0"),
    # Empty (a 0 beside): NumPy cannot shape a dimension past intp, nor dimensions whose
    # product is past it; each was an INTERNAL reply (and a traceback in the log) before.
    "empty, a dimension of 2**63": ([pack(header(arrays=[["a", "int32", [0, 2**63]]])), b""], ErrorCode.BAD_FRAME,
                                    "bad shape"),
    "empty, a dimension of 2**64 - 1": ([pack(header(arrays=[["a", "uint8", [0, 2**64 - 1]]])), b""],
                                        ErrorCode.BAD_FRAME, "bad shape"),
    "empty, dimensions past intp": ([pack(header(arrays=[["a", "int32", [2**25, 2**25, 2**25, 0]]])), b""],
                                    ErrorCode.BAD_FRAME, "bad shape"),
    "too many dims": ([pack(header(arrays=[["a", "int32", [1, 1, 1, 1, 3]]])), I32], ErrorCode.BAD_FRAME,
                      "bad shape"),
    "size mismatch": ([pack(header(arrays=[["a", "int32", [4]]])), I32], ErrorCode.BAD_FRAME,
                      "needs 16 bytes, frame has 12"),
    "array sent twice": ([pack(header(arrays=[["a", "int32", [3]], ["a", "int32", [3]]])), I32, I32],
                         ErrorCode.BAD_FRAME, "sent twice"),
    "too many frames": ([pack(header())] + [b""] * LIMITS.max_frames, ErrorCode.TOO_LARGE, "frames exceed"),
    "header too large": ([pack(header(pad="x" * LIMITS.max_header_bytes))], ErrorCode.TOO_LARGE,
                         f"exceeds {LIMITS.max_header_bytes}"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_message_raises_protocol_error_with_code(case):
    frames, code, words = MALFORMED[case]
    with pytest.raises(ProtocolError) as ei:
        decode(frames)
    assert ei.value.code == code
    assert words in str(ei.value)
    assert str(ei.value).startswith(code.name + ": ")


def test_frame_larger_than_the_limit_is_too_large():
    limits = Limits(max_frame_bytes=8)
    frames = [pack(header(arrays=[["a", "int32", [3]]])), I32]
    with pytest.raises(ProtocolError) as ei:
        decode(frames, limits)
    assert ei.value.code == ErrorCode.TOO_LARGE and "12 bytes exceeds 8" in str(ei.value)
    decode(frames, Limits(max_frame_bytes=12))  # at the limit: fine


def test_limits_are_checked_before_parsing_the_header():
    # 17 frames whose header is not even msgpack: the frame count is refused first
    with pytest.raises(ProtocolError) as ei:
        decode([b"\xc1"] * (LIMITS.max_frames + 1))
    assert ei.value.code == ErrorCode.TOO_LARGE
