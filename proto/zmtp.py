"""ZMTP 3.1 (rfc.zeromq.org spec 37, NULL mechanism), the pieces both ends use: the
greeting, frame headers, commands and their properties, and a message's buffers.

The daemon reads its control connections with its own decoder (``daemon/zmtp.py``) and
the Python client writes and reads its connection with its own (``client/wire.py``); any
ZeroMQ DEALER (libzmq, another language's binding) speaks to the daemon as well: the
wire is plain ZMTP.
"""

from __future__ import annotations

import struct

SIGNATURE_LEN = 10
GREETING_LEN = 64
# Signature, version 3.1, mechanism NULL, as-server 0, filler: both ends send this one.
GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + bytes(32)
MORE, LONG, COMMAND = 0x01, 0x02, 0x04
MAX_COMMAND_BYTES = 4096  # READY's properties, PING's context: small


class ZmtpError(Exception):
    """The peer broke the protocol (or a limit this end sets): close the connection."""


def check_greeting(g) -> None:
    """ZmtpError unless ``g`` (a peer's greeting, the first bytes of it so far) is ZMTP 3.x
    with the NULL mechanism; checks as much as has arrived."""
    if g[0] != 0xFF or (len(g) >= SIGNATURE_LEN and not g[9] & 1):
        raise ZmtpError("not a ZMTP peer (bad signature)")
    if len(g) > SIGNATURE_LEN and g[10] < 3:
        raise ZmtpError(f"ZMTP version {g[10]} (3 or later needed)")
    if len(g) == GREETING_LEN and bytes(g[12:32]).rstrip(b"\x00") != b"NULL":
        raise ZmtpError(f"security mechanism {bytes(g[12:32]).rstrip(bytes(1))!r} (NULL needed)")


def frame_header(size: int, flags: int = 0) -> bytes:
    """A frame's flags byte and size (one byte up to 255, else eight)."""
    if size > 255:
        return _LONG_HEAD(flags | LONG, size)
    return _SHORT_HEADS[flags][size] if flags <= MORE else bytes((flags, size))


_LONG_HEAD = struct.Struct(">BQ").pack
# The headers of short frames, built once: [MORE or not][size].
_SHORT_HEADS = ([bytes((0, n)) for n in range(256)], [bytes((MORE, n)) for n in range(256)])
COALESCE_BYTES = 4096  # encode_message copies frames up to this into the buffer before them


def command(name: bytes, body: bytes = b"") -> bytes:
    """One command frame: ``name`` and its ``body``."""
    data = bytes([len(name)]) + name + body
    return frame_header(len(data), COMMAND) + data


def properties(**props: bytes) -> bytes:
    """READY's metadata: ``Socket_Type=b"DEALER"`` is the property ``Socket-Type``."""
    out = b""
    for name, value in props.items():
        key = name.replace("_", "-").encode()
        out += bytes([len(key)]) + key + struct.pack(">I", len(value)) + value
    return out


def parse_properties(body: memoryview) -> dict[str, bytes]:
    """A READY command's metadata (names in lower case); ZmtpError when it does not parse."""
    props, i, n = {}, 0, len(body)
    while i < n:
        klen = body[i]
        if i + 1 + klen + 4 > n:
            raise ZmtpError("a READY property is cut short")
        key = bytes(body[i + 1:i + 1 + klen]).decode("ascii", "replace")
        (vlen,) = struct.unpack_from(">I", body, i + 1 + klen)
        i += 1 + klen + 4
        if i + vlen > n:
            raise ZmtpError("a READY property's value is cut short")
        props[key.lower()] = bytes(body[i:i + vlen])
        i += vlen
    return props


def split_command(body) -> tuple[bytes, memoryview]:
    """A command frame's body: (its name, the rest)."""
    body = memoryview(body)
    nlen = body[0] if len(body) else 0
    return bytes(body[1:1 + nlen]), body[1 + nlen:]


def encode_message(frames) -> list:
    """The buffers that carry ``frames`` (bytes-like, NumPy arrays) as one message, for
    ``sendmsg``: a header before each body, MORE on all but the last. Frames up to
    ``COALESCE_BYTES`` are copied together with the headers around them (a request's
    msgpack header and the array frame's header make one buffer); larger ones are not
    copied."""
    out = []
    pre = b""
    last = len(frames) - 1
    for i, f in enumerate(frames):
        if type(f) is not bytes and type(f) is not bytearray:
            f = memoryview(f).cast("B")
        n = len(f)
        head = frame_header(n, MORE if i < last else 0)
        if n <= COALESCE_BYTES:
            pre = pre + head + f if n else pre + head
        else:
            out.append(pre + head)
            out.append(f)
            pre = b""
    if pre:
        out.append(pre)
    return out
