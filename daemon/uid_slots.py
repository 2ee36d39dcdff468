"""A listener's connections shared out by uid, so that one local user cannot take them all.

The stats socket (``operator_requests.py``) and the fd socket (``fd_server.py``) bound the
connections they serve at once; each gives one uid (the kernel's SO_PEERCRED uid, never
what a client says) a share of them, and keeps a reserve for operators (root, the
daemon's own uid and ``admin_gid`` members: ``Sessions.sees_all``), used once their share
or the shared connections are taken. A connection refused is answered busy by its
listener, in its own protocol.
"""

from __future__ import annotations

import collections

from .peers import Peer


class UidSlots:
    """One listener's connections by uid: :meth:`take` one for a connection's kernel
    credentials (or say why not), :meth:`give` it back when the connection ends.

    Args:
        is_operator: ``peer -> bool``, asked only when a connection would otherwise be
            refused.
        max_open: the shared slots; ``per_uid``: at most this many of them one uid's;
            ``reserved``: the operators' own, beyond. At most ``max_open + reserved`` open.
        what: what the slots hold, for the refusal's text ("stats socket connections").
    """

    def __init__(self, is_operator, max_open: int, per_uid: int, reserved: int, what: str):
        self.is_operator = is_operator
        self.max_open, self.per_uid, self.reserved, self.what = max_open, per_uid, reserved, what
        self.shared = 0  # connections in the shared slots
        self.reserve = 0  # operators' connections beyond their share or the shared slots
        self.by_uid: collections.Counter[int] = collections.Counter()  # shared slots by uid

    @property
    def open(self) -> int:
        return self.shared + self.reserve

    def take(self, peer: Peer) -> tuple[bool | None, str]:
        """``(False, "")``: a shared slot; ``(True, "")``: one of the operators'; ``(None,
        why)``: refused, ``why`` the busy answer's text."""
        mine = self.by_uid[peer.uid]
        if mine < self.per_uid and self.shared < self.max_open:
            self.shared += 1
            self.by_uid[peer.uid] += 1
            return False, ""
        if self.reserve < self.reserved and self.is_operator(peer):
            self.reserve += 1
            return True, ""
        if mine >= self.per_uid:
            return None, f"uid {peer.uid} has {mine} {self.what} open, its share of the {self.max_open}"
        return None, f"{self.open} {self.what} open (at most {self.max_open}, {self.per_uid} a uid)"

    def give(self, peer: Peer, reserved: bool) -> None:
        if reserved:
            self.reserve -= 1
            return
        self.shared -= 1
        self.by_uid[peer.uid] -= 1
        if not self.by_uid[peer.uid]:
            del self.by_uid[peer.uid]
