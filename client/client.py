"""Client library for one engine rank.

    from sparsekv.client import Client
    with Client("/run/sparsekv", rank=0) as c:
        att = c.attach(layout, engine="llama-70b")
        c.step(step=0, state_rows=rows, reset=new)
        r = c.topk(step=0, group=0, topk=ids)   # rows are in att.slab when it returns
        att.slab[layer, state_row, r.slots[b, col]]  # the KV row of column col

On the cpu backend the hot slab and staging buffer are shared-memory NumPy arrays; the
reply to a top-k batch arrives once the gather is done. Requests can be pipelined:
``submit_topk`` returns a :class:`Pending` whose ``wait()`` collects the result.
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass

import numpy as np
import zmq

from sparsekv.proto import PROTOCOL_VERSION, ErrorCode, Layout, MsgType, ProtocolError, decode, encode
from sparsekv.proto.frames import send_copy

from .errors import BadRequest, DaemonUnavailable, ProtocolMismatch, SparseKVError, error_for
from .results import TopkResult


_ENVELOPE = frozenset({"v", "t", "id", "ok", "tr", "tx"})


def default_run_dir() -> str:
    runtime = os.environ.get("SPARSEKV_RUN_DIR") or os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    return runtime or "/run/sparsekv"


@dataclass
class Attachment:
    """What attach gives a rank: its layout and the hot slab it reads rows from."""

    layout: Layout
    engine: str
    slab: np.ndarray  # uint8 [num_layers, max_reqs, region_stride, row_bytes]
    staging: np.ndarray | None  # uint8 [num_layers, staging_rows, row_bytes]
    _mm: mmap.mmap | None = None

    def close(self) -> None:
        self.slab = self.staging = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a caller still holds a view; the OS unmaps at exit
            self._mm = None


class Pending:
    """A request on the wire; ``wait()`` returns its reply (or raises its error)."""

    def __init__(self, client: "Client", req_id: int, convert):
        self._client, self._id, self._convert = client, req_id, convert
        self._result = None
        self._done = False

    def wait(self):
        if not self._done:
            header, arrays = self._client._await_reply(self._id)
            self._result = self._convert(header, arrays)
            self._done = True
        return self._result


class Client:
    """One engine rank's connection to sparsekvd. Not thread-safe: one thread per Client."""

    def __init__(self, run_dir: str | None = None, *, rank: int = 0, device: str = "cpu",
                 name: str = "", timeout_s: float = 30.0, spin_us: int | None = None):
        """``device``: ``"cpu"``, or ``"cuda:N"`` (this process's GPU numbering) for a rank
        whose slab lives on a GPU of a cuda-backend daemon."""
        self.run_dir = run_dir or default_run_dir()
        self.rank, self.device, self.name = rank, device, name
        self.timeout_s = timeout_s
        # Poll for a reply this long before sleeping on the socket (a wake-up costs tens of
        # microseconds, in a VM more): default 500 for cuda ranks, 0 for cpu ones.
        self.spin_ns = (500 if device.startswith("cuda") else 0) * 1000 if spin_us is None else int(spin_us) * 1000
        self.info: dict = {}
        self.attachment: Attachment | None = None
        self._ctx = self._sock = None
        self._next_id = 1
        self._replies: dict[int, tuple] = {}
        self._deferred: list[int] = []  # requests sent without waiting (STEP)
        self._pending_step: tuple[int, dict] | None = None  # a STEP not sent yet (see step())
        self._step_rows: tuple[int, np.ndarray] | None = None  # the last step's state rows
        self._block_requests: dict[int, int] = {}  # cuda: step-block entry -> its last request
        self._sent: dict[int, tuple[MsgType, int]] = {}  # request id -> (type, ts) until its reply
        # Per request type, the last reply's (sent, daemon received, daemon replied,
        # received here) in perf_counter_ns: one clock (CLOCK_MONOTONIC) for the whole host.
        self.timings: dict[MsgType, tuple[int, int, int, int]] = {}

    # -- connection --------------------------------------------------------------
    def connect(self) -> "Client":
        path = os.path.join(self.run_dir, "control.sock")
        if not os.path.exists(path):
            raise DaemonUnavailable(f"no daemon socket at {path}; is sparsekvd running with --run-dir {self.run_dir}?")
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"ipc://{path}")
        try:
            device = self.device
            if device.startswith("cuda:"):
                from .cuda_attach import bus_id_of, local_device  # noqa: PLC0415

                device = bus_id_of(local_device(device))  # numbering differs between processes
            self.info = self._call(MsgType.HELLO, {"pid": os.getpid(), "rank": self.rank,
                                                   "device": device, "name": self.name})[0]
        except BaseException:
            self.close()
            raise
        if self.info.get("version") != PROTOCOL_VERSION:
            raise ProtocolMismatch(f"daemon speaks protocol {self.info.get('version')}, client {PROTOCOL_VERSION}")
        return self

    def close(self) -> None:
        if self.attachment is not None:
            self.attachment.close()
            self.attachment = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self._sent.clear()  # requests whose replies will never come

    def __enter__(self) -> "Client":
        return self.connect() if self._sock is None else self

    def __exit__(self, *exc) -> None:
        try:
            if self.attachment is not None and self._sock is not None:
                # Leaving: do not hang for the full timeout if the daemon is gone (the
                # daemon's reaper detaches a dead client's rank anyway).
                self.timeout_s = min(self.timeout_s, 5.0)
                self.detach()
        except DaemonUnavailable:
            pass
        finally:
            self.close()

    # -- requests ----------------------------------------------------------------
    def attach(self, layout: Layout, engine: str = "default", fence: bool = False):
        """Attach this rank to ``engine``; return its :class:`Attachment` (cpu) or
        ``CudaAttachment`` (cuda). ``fence`` (cuda): export events the daemon waits on
        before each gather, so attention still reading earlier rows is never overwritten."""
        layout.validate()
        fields = {"engine": engine, "layout": layout.to_wire()}
        fence_ring = None
        if fence and self.device.startswith("cuda"):
            from sparsekv.proto.cuda_ipc import EventRing  # noqa: PLC0415

            from .cuda_attach import local_device  # noqa: PLC0415

            fence_ring = EventRing(local_device(self.device), 16)
            fields["fence_events"] = fence_ring.handles
        reply, _ = self._call(MsgType.ATTACH, fields)
        h = reply["handles"]
        if h.get("kind") == "cuda_ipc":
            from .cuda_attach import CudaAttachment  # noqa: PLC0415

            self.attachment = CudaAttachment(layout, engine, h, fence_ring)
            return self.attachment
        if h.get("kind") != "shm":
            raise SparseKVError(f"unknown slab kind {h.get('kind')!r} from the daemon; upgrade the client")
        fd = os.open(h["path"], os.O_RDWR)
        try:
            mm = mmap.mmap(fd, max(h["bytes"], 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        slab, staging = layout.split_buffer(np.frombuffer(mm, dtype=np.uint8))
        self.attachment = Attachment(layout, engine, slab, staging, mm)
        return self.attachment

    def detach(self) -> None:
        self._call(MsgType.DETACH)
        if self.attachment is not None:
            self.attachment.close()
            self.attachment = None

    def step(self, step: int, state_rows, reset=None, invalidate=None) -> None:
        """Begin decode step ``step``: the batch's state rows (-1 = padding), which of them
        start a new request (``reset`` bool [batch]) and rows rewritten since the last step
        (``invalidate`` int32 [batch, n], -1 = none)."""
        arrays = {"state_rows": np.asarray(state_rows, dtype=np.int32)}
        if reset is not None:
            arrays["reset"] = np.asarray(reset, dtype=bool)
        if invalidate is not None:
            arrays["invalidate"] = np.asarray(invalidate, dtype=np.int32)
        # Not sent yet: it rides on this step's first TOPK (one message and one daemon
        # wake-up instead of two), or goes alone before any other request. Not waited
        # for either way: its error (if any) is raised by the next wait.
        self._send_pending_step()
        self._pending_step = (int(step), arrays)
        self._step_rows = (int(step), arrays["state_rows"])

    def _send_pending_step(self) -> None:
        pending, self._pending_step = self._pending_step, None
        if pending is not None:
            self._deferred.append(self._send(MsgType.STEP, {"step": pending[0]}, pending[1]))

    def submit_topk(self, step: int, group: int, topk, state_rows=None) -> Pending:
        arrays = {"topk": np.asarray(topk, dtype=np.int32)}
        fields = {"step": int(step), "group": int(group)}
        att = self.attachment
        pending = self._pending_step
        begins = pending is not None and pending[0] == fields["step"] and state_rows is None
        if att is not None and getattr(att, "has_blocks", False):
            return self._submit_topk_block(att, fields, arrays["topk"], state_rows, begins)
        if begins:
            self._pending_step = None
            arrays.update(pending[1])  # state_rows, reset, invalidate of the step
            fields["begin"] = True
        elif state_rows is not None:
            arrays["state_rows"] = np.asarray(state_rows, dtype=np.int32)
        if att is not None and hasattr(att, "record_fence"):
            fence = att.record_fence()
            if fence is not None:
                fields["fence"] = fence
            req = self._send(MsgType.TOPK, fields, arrays)
            return Pending(self, req, lambda h, a: att.result(h["entry"], h["batch"], h["k"]))
        req = self._send(MsgType.TOPK, fields, arrays)
        return Pending(self, req, lambda h, a: TopkResult(a["slots"], a["misses"], h["hits"], h["out_of_range"]))

    def _submit_topk_block(self, att, fields, topk, state_rows, begins) -> Pending:
        """cuda: the batch goes into this rank's pinned step block (shared with the
        daemon), the message carries only the entry number."""
        step = fields["step"]
        begin = None
        if begins:
            arrays = self._pending_step[1]
            rows = arrays["state_rows"]
            begin = (arrays.get("reset"), arrays.get("invalidate"))
        elif state_rows is not None:
            rows = np.asarray(state_rows, dtype=np.int32)
        elif self._step_rows is not None and self._step_rows[0] == step:
            rows = self._step_rows[1]
        else:
            last = self._step_rows[0] if self._step_rows is not None else -1
            raise BadRequest(f"top-k for step {step} but the last STEP was {last}; send STEP first",
                             ErrorCode.BAD_ARGUMENT)
        _check_batch(att, rows, topk, begin)  # before anything is consumed or written
        if begins:
            self._pending_step = None
            fields["begin"] = True
        e = att.next_entry()
        prev = self._block_requests.get(e)
        if prev is not None and prev in self._sent:
            # The daemon has not answered the entry's last request yet, so its graph may
            # not even be launched: its pinned block must not be rewritten before.
            self._receive_until(prev)
        fence = att.record_fence()
        if fence is not None:
            fields["fence"] = fence
        fields["block"] = att.write_blocks(e, step, fields["group"], rows, topk, begin)
        batch, k = topk.shape
        req = self._send(MsgType.TOPK, fields)
        self._block_requests[e] = req
        return Pending(self, req, lambda h, a: att.result(h["entry"], batch, k))

    def topk(self, step: int, group: int, topk, state_rows=None) -> TopkResult:
        """Resolve one index group's top-k batch; when this returns the rows are in the slab."""
        return self.submit_topk(step, group, topk, state_rows).wait()

    def write(self, rows, data, layers=None) -> dict:
        """Copy ``data`` uint8 [len(layers), n, row_bytes] into host ``rows`` (all layers when
        ``layers`` is None); hot copies of those rows are dropped in every rank."""
        fields, _ = self._call(MsgType.WRITE, {"layers": None if layers is None else [int(x) for x in layers]},
                               {"rows": np.asarray(rows, dtype=np.int32), "data": np.asarray(data, dtype=np.uint8)})
        return fields

    def write_staged(self, rows, layers=None) -> dict:
        """Write rows this rank put at the front of its staging buffer (``att.staging[layer,
        :len(rows)]`` for each of ``layers``, all when None) into host ``rows``; hot copies
        of those rows are dropped in every rank. On the cuda backend the copy is ordered
        after this rank's current stream (fence events) and the call returns once it is
        enqueued: reuse the staging buffer only after a later request's reply."""
        fields = {"layers": None if layers is None else [int(x) for x in layers]}
        att = self.attachment
        if att is not None and hasattr(att, "record_fence"):
            fence = att.record_fence()
            if fence is not None:
                fields["fence"] = fence
        return self._call(MsgType.WRITE_STAGED, fields, {"rows": np.asarray(rows, dtype=np.int32)})[0]

    def stage(self, rows, layers=None) -> int:
        """Copy host ``rows`` (e.g. whole blocks) of ``layers`` to the staging buffer's front."""
        fields, _ = self._call(MsgType.STAGE, {"layers": None if layers is None else [int(x) for x in layers]},
                               {"rows": np.asarray(rows, dtype=np.int32)})
        return fields["bytes"]

    def stats(self) -> dict:
        return self._call(MsgType.STATS)[0]["stats"]

    # -- plumbing ----------------------------------------------------------------
    def _send(self, msg_type: MsgType, fields=None, arrays=None) -> int:
        if self._sock is None:
            raise SparseKVError("client is not connected; call connect() or use it as a context manager")
        if self._pending_step is not None:
            self._send_pending_step()  # requests reach the daemon in the order they were made
        req = self._next_id
        self._next_id += 1
        ts = time.perf_counter_ns()
        # ``fields`` is always a dict this client built for this one request: extend it.
        if fields is None:
            fields = {"ts": ts}
        else:
            fields["ts"] = ts
        frames = encode(msg_type, req, fields, arrays)
        self._sock.send_multipart(frames, copy=send_copy(frames))
        self._sent[req] = (msg_type, ts)
        return req

    def _receive_until(self, req_id: int) -> None:
        while req_id not in self._replies:
            if not self._spin() and not self._sock.poll(int(self.timeout_s * 1000)):
                raise DaemonUnavailable(f"no reply from sparsekvd at {self.run_dir} within {self.timeout_s} s")
            frames = self._sock.recv_multipart(copy=False)
            t_recv = time.perf_counter_ns()
            try:
                header, arrays = decode(frames)
            except ProtocolError as e:
                raise SparseKVError(f"undecodable reply: {e}") from None
            rid = header["id"]
            sent = self._sent.pop(rid, None)
            tr = header.get("tr")
            if sent is not None and tr is not None:
                self.timings[sent[0]] = (sent[1], tr, header.get("tx", tr), t_recv)
            self._replies[rid] = (header, arrays)

    def _spin(self) -> bool:
        """Poll without sleeping for up to ``spin_us``; True once a reply is waiting."""
        if not self.spin_ns:
            return False
        # ZMQ_EVENTS, not poll(): a poll builds a Poller each call (microseconds).
        get, now = self._sock.getsockopt, time.perf_counter_ns
        end = now() + self.spin_ns
        while now() < end:
            if get(zmq.EVENTS) & zmq.POLLIN:
                return True
        return False

    def _await_reply(self, req_id: int):
        self._receive_until(req_id)
        self._check_deferred()
        header, arrays = self._replies.pop(req_id)
        if not header.get("ok"):
            raise error_for(header.get("code", int(ErrorCode.INTERNAL)), header.get("msg", "no message"))
        return header, arrays

    def _check_deferred(self) -> None:
        """Raise the first error among deferred requests whose replies have arrived."""
        for r in [r for r in self._deferred if r in self._replies]:
            self._deferred.remove(r)
            header, _ = self._replies.pop(r)
            if not header.get("ok"):
                raise error_for(header.get("code", int(ErrorCode.INTERNAL)), header.get("msg", "no message"))

    def flush(self) -> None:
        """Wait for every deferred request (e.g. the last STEP); raise the first error."""
        self._send_pending_step()
        while self._deferred:
            self._receive_until(self._deferred[0])
            self._check_deferred()

    def _call(self, msg_type: MsgType, fields=None, arrays=None):
        """Send and wait; return (reply fields without the envelope, reply arrays)."""
        header, arrays = self._await_reply(self._send(msg_type, fields, arrays))
        return {k: v for k, v in header.items() if k not in _ENVELOPE}, arrays


def _check_batch(att, rows: np.ndarray, topk: np.ndarray, begin) -> None:
    """Shapes only (the daemon's kernels check every value), before a block is written."""
    lay = att.layout
    if rows.ndim != 1 or topk.ndim != 2 or topk.shape[0] != rows.shape[0]:
        raise BadRequest(f"state_rows must be [batch] and topk [batch, top_k]; got {rows.shape} and {topk.shape}",
                         ErrorCode.BAD_ARGUMENT)
    if topk.shape[1] > lay.top_k:
        raise BadRequest(f"topk has {topk.shape[1]} columns, layout top_k is {lay.top_k}", ErrorCode.BAD_ARGUMENT)
    if rows.shape[0] > lay.max_batch:
        raise BadRequest(f"batch {rows.shape[0]} exceeds max_batch {lay.max_batch} of the layout", ErrorCode.TOO_LARGE)
    if begin is not None:
        reset, inv = begin
        if reset is not None and reset.shape != rows.shape:
            raise BadRequest(f"reset must be [batch]={rows.shape}, got {reset.shape}", ErrorCode.BAD_ARGUMENT)
        if inv is not None and (inv.ndim != 2 or inv.shape[0] != rows.shape[0] or inv.shape[1] > lay.top_k):
            raise BadRequest(f"invalidate must be [batch, n <= top_k], got {inv.shape}", ErrorCode.BAD_ARGUMENT)
