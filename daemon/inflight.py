"""What requests in flight may cost the daemon: the budget of their bytes, the refusal of a
message over a limit, and the array frames a message's header declares (checked before
those frames are read; daemon/control_socket.py)."""

from __future__ import annotations

import threading

import msgpack
import numpy as np

from sparsekv.proto import LIMITS, ErrorCode
from sparsekv.proto.messages import WIRE_DTYPES

from .zmtp import ZmtpError

WIRE_ITEMSIZE = {name: np.dtype(name).itemsize for name in WIRE_DTYPES}


class Refused(ZmtpError):
    """A message over a limit: answered with ``code`` and ``message``, then the connection closes."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


class FrameBuffer(bytearray):
    """A large frame's bytes; its budget is given back when the last reference goes:
    ``give(uid, size)`` then, from whichever thread drops it (cheaper per frame than a
    ``weakref.finalize``)."""

    __slots__ = ("_give", "_uid", "_size")

    def __init__(self, size: int, give, uid: int):
        super().__init__(size)
        self._give, self._uid, self._size = give, uid, size

    def __del__(self):
        give = getattr(self, "_give", None)  # (unset when the allocation itself failed)
        if give is not None:
            give(self._uid, self._size)


class Budget:
    """Bytes of large frames held, in all and per uid (given back from any thread)."""

    def __init__(self, total: int, per_uid: int):
        self.total, self.per_uid = total, per_uid
        self.held = 0
        self.by_uid: dict[int, int] = {}  # uids holding any
        self.peak = 0
        self._lock = threading.Lock()

    def take(self, uid: int, n: int) -> bool:
        with self._lock:
            mine = self.by_uid.get(uid, 0) + n
            if self.held + n > self.total or mine > self.per_uid:
                return False
            self.held += n
            self.by_uid[uid] = mine
            if self.held > self.peak:
                self.peak = self.held
            return True

    def room_for(self, n: int) -> bool:
        """Whether ``n`` more bytes fit the whole budget (whatever any uid holds)."""
        with self._lock:
            return self.held + n <= self.total

    def give(self, uid: int, n: int) -> None:
        with self._lock:
            self.held -= n
            left = self.by_uid.get(uid, 0) - n
            if left:
                self.by_uid[uid] = left
            else:
                self.by_uid.pop(uid, None)


def message_ids(frames: list) -> tuple[int, int]:
    """(type, id) of a message, from its header frame when it has one (else 0, 0)."""
    try:
        head = msgpack.unpackb(bytes(frames[0]), raw=False) if frames else {}
        return int(head.get("t", 0)), int(head.get("id", 0))
    except Exception:  # noqa: BLE001 - not a header: answered as request 0
        return 0, 0


def declared(header) -> list[int] | None:
    """The sizes of the array frames a message header declares (``arrays``: [name, dtype,
    shape] each); None when they cannot be read (proto/frames.py says what is wrong once
    the message is whole)."""
    try:
        desc = msgpack.unpackb(header, raw=False).get("arrays")
        sizes = []
        for _, dtype, shape in desc:
            n = WIRE_ITEMSIZE[dtype]
            if len(shape) > LIMITS.max_array_dims:
                raise ValueError(shape)
            for d in shape:
                if type(d) is not int or d < 0:
                    raise ValueError(shape)
                n *= d
            sizes.append(n)
        return sizes
    except Exception:  # noqa: BLE001 - msgpack's errors, a wrong shape of any kind
        return None
