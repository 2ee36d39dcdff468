"""The sparsekv wire protocol, declared once.

A message is a ZeroMQ multipart: one msgpack header (a map) followed by zero or more raw
array frames. The header carries ``v`` (protocol version, checked in HELLO), ``t`` (a
:class:`MsgType`), ``id`` (the client's request id, echoed in the reply), the fields of
that type, and ``arrays``: one ``[name, dtype, shape]`` per raw frame, in frame order.
Nothing is ever pickled. Optional timestamps (``time.perf_counter_ns()``, CLOCK_MONOTONIC,
one clock for every process of a host): ``ts`` in a request (when the client sent it),
``tr`` and ``tx`` in every reply (when the daemon received the request, and just before
it encoded the reply). A peer ignores header fields it does not know.

Rules for changing this file: :class:`MsgType` and :class:`ErrorCode` are append-only
(never reorder, never reuse a number); a change that an old peer cannot read bumps
:data:`PROTOCOL_VERSION`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

PROTOCOL_VERSION = 2


class MsgType(enum.IntEnum):
    """Request types; a reply carries the request's type. Append-only."""

    HELLO = 1  # version, pid, rank, device, name -> daemon pid, backend, devices
    ATTACH = 2  # engine, layout -> client slab/staging handles
    STEP = 3  # step, state_rows, reset, invalidate -> ack
    TOPK = 4  # step, group, topk [+ state_rows] -> slots, misses (cpu) / event (cuda)
    WRITE = 5  # layers, rows, data -> ack (rows copied into the pool, hot copies invalidated)
    STAGE = 6  # layers, rows -> ack (rows copied to the staging buffer)
    DETACH = 7  # -> ack
    STATS = 8  # -> counters
    WRITE_STAGED = 9  # layers, rows [+ fence] -> ack (rows the client put in its staging buffer -> pool)
    BYE = 10  # -> ack (detach if attached, and the daemon forgets this connection: Client.close)
    BLOCK_RESERVE = 11  # n -> reserved (+ the store's gauges), or POOL_EXHAUSTED
    BLOCK_ALLOC = 12  # n -> blocks [n] (zeroed, private to the caller)
    BLOCK_COMMIT = 13  # blocks [n], hashes [n, 2] -> held [n] (the block cached under each hash)
    BLOCK_LOOKUP = 14  # [chain] hashes [n, 2] -> blocks [m] (the longest cached prefix, pinned) [chain, head]
    BLOCK_RELEASE = 15  # blocks [n] -> ack (pins dropped, private blocks freed)
    BLOCK_WRITE_KEYS = 16  # blocks [n], keys uint8 [n, layers, block_size, index_bytes] -> bytes (own private blocks)
    BLOCK_READ_KEYS = 17  # blocks [n] -> keys uint8 [n, layers, block_size, index_bytes] (pinned or own blocks)
    BLOCK_LOAD_KEYS = 18  # blocks [n], dst (+ fence) -> bytes, copies (+ event: cuda): keys into the engine's buffer


class ErrorCode(enum.IntEnum):
    """Why a request failed. Append-only; each has a message a person can act on."""

    OK = 0
    BAD_FRAME = 1
    BAD_VERSION = 2
    UNKNOWN_TYPE = 3
    NOT_HELLO = 4
    NOT_ATTACHED = 5
    BAD_LAYOUT = 6
    LAYOUT_MISMATCH = 7
    POOL_FULL = 8
    BAD_ARGUMENT = 9
    BAD_STATE_ROW = 10
    DUPLICATE_IDS = 11
    TOO_LARGE = 12
    ALREADY_ATTACHED = 13
    TOO_MANY_CLIENTS = 14
    INTERNAL = 15
    SHUTTING_DOWN = 16
    PERMISSION_DENIED = 17
    QUOTA_EXCEEDED = 18
    POOL_EXHAUSTED = 19
    TP_MISMATCH = 20
    TP_LAG = 21


ERROR_HINTS: dict[ErrorCode, str] = {
    ErrorCode.BAD_FRAME: "the message could not be decoded; check the client and daemon versions",
    ErrorCode.BAD_VERSION: "client and daemon speak different protocol versions; upgrade one of them",
    ErrorCode.UNKNOWN_TYPE: "the daemon does not know this request type; upgrade the daemon",
    ErrorCode.NOT_HELLO: "send HELLO first (Client.connect does this)",
    ErrorCode.NOT_ATTACHED: "attach a layout before sending steps, top-k batches or writes",
    ErrorCode.BAD_LAYOUT: "the layout is inconsistent; the message names the field",
    ErrorCode.LAYOUT_MISMATCH: "every rank of one engine must attach with the same layout",
    ErrorCode.POOL_FULL: "the host pool, or the daemon's memory for block stores, has no room for this; raise --pool-size "
                          "(or --max-store-bytes), lower host_rows, or use larger blocks",
    ErrorCode.BAD_ARGUMENT: "a bad argument, or a request this client or engine may not make now; the message says "
                             "which",
    ErrorCode.BAD_STATE_ROW: "state rows must lie in [-1, max_reqs)",
    ErrorCode.DUPLICATE_IDS: "each host row at most once in a top-k row (-1 pads)",
    ErrorCode.TOO_LARGE: "past a protocol or daemon limit, which the message names: split the request, or lower what "
                          "it names",
    ErrorCode.ALREADY_ATTACHED: "this client is attached already; detach first",
    ErrorCode.TOO_MANY_CLIENTS: "the daemon serves its maximum number of clients",
    ErrorCode.INTERNAL: "the daemon hit a bug; see its log (journalctl -u sparsekvd)",
    ErrorCode.SHUTTING_DOWN: "the daemon is stopping",
    ErrorCode.TP_MISMATCH: "the ranks of a TP group (attach with tp_size) must send the same steps and top-k batches "
    "in the same order; this rank's request differs from its peers' and was not run",
    ErrorCode.TP_LAG: "a rank of a TP group is too far behind its peers (tp_max_lag, tp_max_lag_bytes): it "
    "stopped, or sends something else; this request was not run",
    ErrorCode.PERMISSION_DENIED: "another user's engine, or a connection whose credentials the daemon cannot read; "
    "attach as the engine's owner (root and the daemon's admin group: naming it, owner_uid), or pick another engine name",
    ErrorCode.QUOTA_EXCEEDED: "this user holds its share of the daemon (max_clients_per_uid, max_pool_bytes_per_uid, "
    "max_slab_share_per_uid, max_blocks_per_uid, max_store_share_per_uid in the daemon's config): release blocks "
    "this user's clients pin or hold, close or detach other clients of this user, or ask the operator to raise it",
    ErrorCode.POOL_EXHAUSTED: "the engine's block store cannot promise that many blocks now (the reply's detail "
    "names free, cached-evictable and reserved blocks): admit the request later, or release blocks",
}


@dataclass(frozen=True)
class Limits:
    """Explicit size limits, checked on decode before anything is allocated."""

    max_frames: int = 16
    max_header_bytes: int = 64 * 1024
    # One raw array frame, and a message's arrays together. The daemon refuses a larger
    # one before reading it (daemon/control_socket.py): a client splits bigger writes.
    max_frame_bytes: int = 32 << 20
    max_message_bytes: int = 64 << 20
    max_array_dims: int = 4
    max_batch: int = 4096
    max_write_rows: int = 1 << 20
    max_blocks: int = 1 << 16  # blocks or hashes in one block store request (a 4M-token chain of 64)
    # Blocks of one engine's block store (host_rows // block_size, ATTACH's blocks field): its
    # bookkeeping (~50 bytes a block) is allocated at attach. A 2 TiB pool of DeepSeek-V3.2
    # blocks of 64 positions (2.56 MB) holds ~860,000.
    max_store_blocks: int = 1 << 21
    # Indexer keys in one BLOCK_WRITE_KEYS or BLOCK_READ_KEYS (one array frame): 65 blocks of
    # 64 positions of DeepSeek-V3.2 (61 layers, 132 bytes); ``Blocks.read_keys`` splits reads.
    max_keys_bytes: int = 32 << 20
    # GPU allocations one cuda rank may have had BLOCK_LOAD_KEYS copy into: each stays
    # imported by the daemon (and referenced by the client) while the rank is attached.
    max_keys_targets: int = 8
    # Ranks of one TP group (ATTACH tp_size): one residency and resolve for them all.
    max_tp_size: int = 64


LIMITS = Limits()

# Array dtypes allowed on the wire (NumPy names).
WIRE_DTYPES = frozenset({"int32", "int64", "uint8", "bool", "float32", "float64"})

# The fields each request must carry besides v/t/id/arrays (optional ones, such as ``ts`` or
# ``fence``, are not listed), and the arrays it may send; checked against the daemon's handlers at start.
REQUESTS: dict[MsgType, tuple[frozenset[str], frozenset[str]]] = {
    MsgType.HELLO: (frozenset({"pid", "rank", "device", "name"}), frozenset()),
    MsgType.ATTACH: (frozenset({"engine", "layout"}), frozenset()),
    MsgType.STEP: (frozenset({"step"}), frozenset({"state_rows", "reset", "invalidate"})),
    # A TOPK with "begin": true also carries its step's STEP arrays (reset, invalidate).
    MsgType.TOPK: (frozenset({"step", "group"}), frozenset({"topk", "state_rows", "reset", "invalidate"})),
    MsgType.WRITE: (frozenset({"layers"}), frozenset({"rows", "data"})),
    MsgType.STAGE: (frozenset({"layers"}), frozenset({"rows"})),
    MsgType.DETACH: (frozenset(), frozenset()),
    MsgType.STATS: (frozenset(), frozenset()),
    MsgType.WRITE_STAGED: (frozenset({"layers"}), frozenset({"rows"})),
    MsgType.BYE: (frozenset(), frozenset()),
    MsgType.BLOCK_RESERVE: (frozenset({"n"}), frozenset()),
    MsgType.BLOCK_ALLOC: (frozenset({"n"}), frozenset()),
    MsgType.BLOCK_COMMIT: (frozenset(), frozenset({"blocks", "hashes"})),
    MsgType.BLOCK_LOOKUP: (frozenset(), frozenset({"hashes"})),
    MsgType.BLOCK_RELEASE: (frozenset(), frozenset({"blocks"})),
    MsgType.BLOCK_WRITE_KEYS: (frozenset(), frozenset({"blocks", "keys"})),
    MsgType.BLOCK_READ_KEYS: (frozenset(), frozenset({"blocks"})),
    MsgType.BLOCK_LOAD_KEYS: (frozenset({"dst"}), frozenset({"blocks"})),
}


class ProtocolError(Exception):
    """A request or reply that breaks the protocol, with the code to answer it."""

    def __init__(self, code: ErrorCode, message: str, detail: dict | None = None):
        super().__init__(message)
        self.code = ErrorCode(code)
        self.detail = detail or {}  # figures a program acts on (POOL_EXHAUSTED's), in the reply's "detail"

    def __str__(self) -> str:
        return f"{self.code.name}: {self.args[0]}"
