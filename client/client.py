"""Client library for one engine rank (a rank's loop: client/README.md).

On the cpu backend the hot slab and staging buffer are shared-memory NumPy arrays; the
reply to a top-k batch arrives once the gather is done. Requests can be pipelined:
``submit_topk`` returns a :class:`Pending` whose ``wait()`` collects the result.
"""

from __future__ import annotations

import logging
import os
import re
import threading

import numpy as np

from sparsekv.proto import PROTOCOL_VERSION, ErrorCode, Layout, MsgType
from sparsekv.proto.cuda_ipc import EventRing, mps_running
from sparsekv.proto.settings import CLIENT_DEVICE_WAIT, RUN_DIR
from sparsekv.proto.args import engine_name, hello_text

from .blocks import Blocks, block_store
from .connection import Connection, open_wire, start_time
from .cuda_attach import CudaAttachment, bus_id_of, local_device
from .device_wait import DeviceWaits
from .doorbell import DoorbellSwapIn
from .errors import BadRequest, DaemonUnavailable, DeviceMappingFailed, ProtocolMismatch, SparseKVError
from .keys_load import KeysLoader
from .rank_memory import fetch_fds, map_shared, offer_slab
from .results import Attachment, AttachmentCaps, TopkResult  # noqa: F401 - Attachment: imported from here
from .step_driver import StepDriver
from .pending import Pending, Ready  # noqa: F401 - Ready: the device-wait result (tests import it here)
from .tensors import check_batch, check_layout, check_prefetch, device_ids, host_bytes, host_int32
from .tensors import layers_arg as _layers, on_gpu, step_arrays, whole as _whole, write_in_parts
from .wire import Wire

log = logging.getLogger("sparsekv.client")
GONE_CLOSE_WAIT_S = 5.0  # closing a rank whose daemon is gone: the GPU's time (CudaAttachment.close)
BYE_TIMEOUT_S = 0.5  # close() waits this long for the daemon's goodbye


def default_run_dir() -> str:
    return RUN_DIR.get()


class Client(Connection, DeviceWaits):
    """One engine rank's connection to sparsekvd. One thread at a time: another thread's
    request while one is in flight raises ClientInUse (Connection._turn)."""

    def __init__(self, run_dir: str | None = None, *, rank: int = 0, device: str = "cpu",
                 name: str = "", timeout_s: float = 30.0, spin_us: int | None = None,
                 device_wait: bool | None = None):
        """``device``: ``"cpu"``, or ``"cuda:N"`` (this process's GPU numbering) for a rank
        whose slab lives on a GPU of a cuda-backend daemon. ``device_wait`` (cuda ranks;
        None: ``$SPARSEKV_CLIENT_DEVICE_WAIT`` is ``1``): ``topk`` returns once the request
        is sent, with the current stream waiting on the GPU for the result; an error in
        the reply is raised by a later call (the failed request's slots are -1).
        ``spin_us`` (None: 500 for a cuda rank, 0 on cpu): how long a wait for a reply
        reads the socket without sleeping before it sleeps in ``poll``."""
        self.run_dir = run_dir or default_run_dir()
        if not isinstance(device, str) or not (device == "cpu" or re.fullmatch(r"cuda:[0-9]+", device)):
            raise BadRequest(f"device must be 'cpu' or 'cuda:N', got {device!r:.40}", ErrorCode.BAD_ARGUMENT)
        if spin_us is not None and (type(spin_us) is not int or not 0 <= spin_us <= 10**6):
            raise BadRequest(f"spin_us must be an integer in [0, 1000000], got {spin_us!r:.40}", ErrorCode.BAD_ARGUMENT)
        try:
            name = hello_text("name", name)
        except ValueError as e:
            raise BadRequest(str(e), ErrorCode.BAD_ARGUMENT) from None
        self.rank, self.device, self.name = rank, device, name
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < 1e9:
            raise BadRequest(f"timeout_s must be a number of seconds in (0, 1e9), got {timeout_s!r}",
                             ErrorCode.BAD_ARGUMENT)
        self.timeout_s = timeout_s
        # Poll for a reply this long before sleeping on the socket (a wake-up costs more).
        self.spin_ns = (500 if device.startswith("cuda") else 0) * 1000 if spin_us is None else int(spin_us) * 1000
        self.info: dict = {}
        self.attachment: Attachment | None = None
        self._blocks: Blocks | None = None  # the attached engine's block store (attach's block_size)
        self._keys_loader: KeysLoader | None = None  # its BLOCK_LOAD_KEYS (client/keys_load.py)
        self._handles: list = []  # device handles made by doorbell_handle (closed at detach)
        self._sock: Wire | None = None
        self._owner_pid = 0  # the process that connected
        self._turn_lock = threading.Lock()  # held while a thread sends or waits (Connection._turn)
        self._turn_holder: int | None = None
        self._next_id = 1
        self._replies: dict[int, tuple] = {}
        self._abandoned: set[int] = set()  # requests whose Pending was dropped unread: an error raised later
        self._quiet: set[int] = set()  # the same whose waits raised already: their replies dropped
        self._deferred: list[int] = []  # requests sent without waiting (STEP; TOPK with device wait)
        if device_wait is None:
            device_wait = CLIENT_DEVICE_WAIT.get()
        self.device_wait = bool(device_wait)
        self._pending_step: tuple[int, dict] | None = None  # a STEP not sent yet (see step())
        self._lone_steps: list[int] = []  # STEPs sent alone whose replies were not read yet
        self._lone_step_numbers: dict[int, int] = {}  # their request ids -> step numbers (SparseKVError.earlier_step)
        self._step_rows: tuple[int, np.ndarray] | None = None  # the last step's state rows
        self._driver = StepDriver()  # a TP rank's one step driver (client/step_driver.py)
        self._block_requests: dict[int, int] = {}  # cuda: step-block entry -> its last request
        self._fence_requests: dict[int, int] = {}  # cuda: fence event -> the last request that carried it
        self._sent: dict[int, tuple[MsgType, int]] = {}  # request id -> (type, ts) until its reply
        # Per request type, the last reply's four times in perf_counter_ns (client/README.md).
        self.timings: dict[MsgType, tuple[int, int, int, int]] = {}
        # cuda TOPK: when the daemon had enqueued the last one's GPU work ("tl", same clock).
        self.enqueued_at: int | None = None
        # The daemon found at connect (_check_daemon); ``_gone``: why it is no longer there.
        self._daemon_pid = 0
        self._daemon_started: float | None = None
        self._socket_id: tuple[int, int, int] | None = None
        self._gone: str | None = None

    # -- connection --------------------------------------------------------------
    def connect(self) -> "Client":
        if self._sock is not None:  # a second session would end the first one's without a word
            raise BadRequest("this Client is connected already (client %s); close() it first" %
                             (self.info or {}).get("client_id", "?"), ErrorCode.BAD_ARGUMENT)
        self._owner_pid = os.getpid()  # (a forked child shares the connection: refused, _send)
        if self.attachment is not None:  # of a session lost since (not closed): the daemon dropped it
            self._close_attachment(wait_s=GONE_CLOSE_WAIT_S)
        self._drop_socket()  # an old session's replies and requests: made before this connection
        path = self.control_path
        # Says what is wrong with a missing, refused or forbidden socket, and names the
        # daemon (its pid, its socket file) that the liveness checks follow.
        self._sock, self._daemon_pid, self._socket_id = open_wire(path, self.run_dir, self.timeout_s)
        self._daemon_started = start_time(self._daemon_pid)
        self._gone = None
        try:
            device = self.device
            if device.startswith("cuda:"):
                device = bus_id_of(local_device(device))  # numbering differs between processes
            self.info = self._call(MsgType.HELLO, {"pid": os.getpid(), "rank": self.rank,
                                                   "device": device, "name": self.name})[0]
        except BaseException:
            self.close()
            raise
        if self.info.get("version") != PROTOCOL_VERSION:
            theirs = self.info.get("version")
            self.close()
            raise ProtocolMismatch(f"daemon speaks protocol {theirs}, client {PROTOCOL_VERSION}")
        return self

    def close(self) -> None:
        """Say goodbye (BYE: the daemon detaches this rank and forgets the connection),
        then close. Waits at most ``BYE_TIMEOUT_S`` and ignores every failure: the daemon's
        reaper frees what the client held once its process exits. ClientInUse while another
        thread's request is on (closing under it would pull its socket away)."""
        with self._turn():
            self._close_handles()  # before the daemon lets the rank's memory go
            if self._sock is not None and self.info:
                self._goodbye()
            if self.attachment is not None:
                # Once the daemon is gone its events may never complete: wait a bounded time.
                self._close_attachment(wait_s=GONE_CLOSE_WAIT_S if self._gone is not None else None)
            self._drop_socket()
            self.info = {}

    def _goodbye(self) -> None:
        timeout_s, self.timeout_s = self.timeout_s, min(self.timeout_s, BYE_TIMEOUT_S)
        self._pending_step = None  # a STEP not sent yet: nobody will use it
        self._lone_steps.clear()
        self._lone_step_numbers.clear()
        try:
            try:
                self._call(MsgType.BYE)
            except SparseKVError as e:
                if e.code != ErrorCode.UNKNOWN_TYPE or self.attachment is None:
                    raise
                self._call(MsgType.DETACH)  # a daemon without BYE: detach at least
        except (SparseKVError, OSError):
            pass
        finally:
            self.timeout_s = timeout_s

    def __enter__(self) -> "Client":
        return self.connect() if self._sock is None else self

    def __exit__(self, *exc) -> None:
        self.close()  # BYE detaches too

    # -- requests ----------------------------------------------------------------
    def attach(self, layout: Layout, engine: str = "default", fence: bool = False, transport: str = "zmq",
               slab=None, block_size: int = 0, index_bytes: int = 0, prefetch: bool = False, tp_size: int = 1,
               owner_uid: int | None = None):
        """Attach this rank to ``engine``; return its :class:`Attachment` (cpu) or
        ``CudaAttachment`` (cuda). ``fence`` (cuda): export events the daemon waits on
        before each gather, so attention still reading earlier rows is never overwritten.
        ``transport``: ``"zmq"`` (``step``/``topk`` messages) or ``"doorbell"`` (cuda:
        :meth:`doorbell_handle`). ``slab``: an engine-owned hot slab (``EngineSlab`` with its
        geometry) the daemon gathers into instead of a slab of its own. ``block_size``: the
        engine has a block store of ``host_rows // block_size`` blocks (``self.blocks``;
        DESIGN §9), kept while it caches blocks, for the next process that attaches;
        ``index_bytes`` (with ``block_size``): its blocks have a second plane of DSA's indexer
        keys, that many bytes a position and layer (``self.blocks.write_keys`` /
        ``read_keys`` / ``load_keys``); every rank of the engine names the same. ``prefetch``: after each index group's top-k, the daemon fetches its rows ahead into
        the next group's regions, off this rank's critical path (DESIGN §4; both backends,
        both transports; useful with ``region_stride`` above ``top_k``: the latest
        resolve's slots are kept). ``tp_size`` > 1 (cpu backend; cuda: with the doorbell
        transport, every rank on one GPU): this rank (the ``rank``
        of this client, in ``[0, tp_size)``) is one of the engine's TP group, whose ranks send
        the same steps and top-k batches: the daemon resolves each batch once for them all
        and gathers its rows into every rank's slab (DESIGN §5.6); every rank names the same
        ``tp_size`` and attaches before the group's first step; a request that differs from
        the peers' is refused (``TpMismatch``), as one that runs ``tp_max_lag`` requests
        ahead of the slowest rank (``TpLag``). ``owner_uid``: join an engine another user
        made (root and the daemon's admin group only): the uid that owns it, so that
        this rank never trusts another user's rows and cached blocks by accident; without
        it only an engine of this process's own uid is joined (a new one is created)."""
        check_layout(layout)
        try:
            engine = engine_name(engine)
        except ValueError as e:
            raise BadRequest(str(e), ErrorCode.BAD_ARGUMENT) from None
        check_prefetch(prefetch)
        fields = {"engine": engine, "layout": layout.to_wire()}
        if owner_uid is not None:
            if type(owner_uid) is not int or not 0 <= owner_uid < 1 << 32:
                raise BadRequest(f"owner_uid must be a uid (an integer in [0, 2**32)), got {owner_uid!r}",
                                 ErrorCode.BAD_ARGUMENT)
            fields["owner_uid"] = owner_uid
        if prefetch:
            fields["prefetch"] = True
        tp_size = _whole("tp_size", tp_size)
        if tp_size != 1:
            fields["tp_size"] = tp_size
        block_size, index_bytes = _whole("block_size", block_size), _whole("index_bytes", index_bytes)
        if index_bytes and not block_size:
            raise BadRequest("index_bytes needs a block_size: the indexer keys are a plane of the blocks",
                             ErrorCode.BAD_ARGUMENT)
        if block_size:
            fields["blocks"] = {"block_size": block_size}
            if index_bytes:
                fields["blocks"]["index_bytes"] = index_bytes
        if slab is not None:
            fields["slab"] = offer_slab(self.run_dir, self.device, layout, slab)
            slab = slab.frozen()  # (the geometry offered: a later with_geometry moves no index of this rank)
        if transport != "zmq":
            if transport != "doorbell":
                raise BadRequest(f"transport must be 'zmq' or 'doorbell', got {transport!r}", ErrorCode.BAD_ARGUMENT)
            if not self.device.startswith("cuda"):
                raise BadRequest("the doorbell transport needs a cuda rank (device='cuda:N')", ErrorCode.BAD_ARGUMENT)
            if not mps_running():
                log.warning("NVIDIA MPS is not running: each doorbell hand-off between this engine and sparsekvd "
                            "costs ~300 us instead of a few (DESIGN §2; start nvidia-cuda-mps-control -d)")
            fields["transport"] = transport
        fence_ring = None
        if fence and self.device.startswith("cuda"):
            fence_ring = EventRing(local_device(self.device), 16)
            fields["fence_events"] = fence_ring.handles
        reply, _ = self._call(MsgType.ATTACH, fields)
        self._end_blocks()
        self._driver.reset(tp_size)
        if block_size:
            self._keys_loader = KeysLoader(self)
            self._blocks = Blocks(self._call, engine, block_size, layout.num_layers, index_bytes,
                                 self._keys_loader, chain_refs=True)
        h = reply["handles"]
        if h.get("kind") not in ("cuda_ipc", "shm"):
            raise SparseKVError(f"unknown slab kind {h.get('kind')!r} from the daemon; upgrade the client")
        cuda = h["kind"] == "cuda_ipc"
        try:
            fds = fetch_fds(self.run_dir, h, self.timeout_s)
        except SparseKVError as e:
            why = self._check_daemon()
            if why is not None:  # restarted since its reply: the new daemon knows no token of it
                self._lost(f"{why} (the attach could not fetch the rank's memory: {e})")
            # No slab to read, or a doorbell rank, whose error record and stop word live in
            # the step blocks (without them its handle could neither report a device error
            # nor see its TP group stop): give the rank back.
            if not cuda or transport == "doorbell":
                self._detach_quietly()
                raise
            # cuda: only the pinned step blocks are missing; top-k batches go as arrays.
            log.warning("cannot get the daemon's step blocks (%s); sending top-k batches on the socket", e)
            fds = {}
        try:  # the mappings keep the memory; the descriptors are not needed past this
            if cuda:
                try:
                    self.attachment = CudaAttachment(layout, engine, h, fence_ring, fds=fds, engine_slab=slab)
                except SparseKVError:
                    self._detach_quietly()
                    raise
                except Exception as e:  # a CUDA call of this process: give the rank back, say what failed
                    self._mapping_failed(e, h)
                return self.attachment
            try:
                mm = map_shared(h, fds)
            except SparseKVError:
                self._detach_quietly()
                raise
        finally:
            for fd in fds.values():
                os.close(fd)
        if h.get("engine_slab"):  # the daemon's memory holds the staging buffer only (if any)
            staging = np.frombuffer(mm, dtype=np.uint8)[: layout.staging_bytes].reshape(layout.staging_shape) \
                if mm is not None and layout.staging_bytes else None
            self.attachment = Attachment(layout, engine, None, staging, mm, engine_slab=slab)
        else:
            hot, staging = layout.split_buffer(np.frombuffer(mm, dtype=np.uint8))
            self.attachment = Attachment(layout, engine, hot, staging, mm)
        return self.attachment

    def _mapping_failed(self, e: Exception, handles: dict):
        """The daemon's device memory could not be mapped: DaemonUnavailable if the daemon
        went meanwhile (an exited exporter's handle never opens), else give the rank back
        and raise DeviceMappingFailed, naming the GPU and CUDA's error."""
        why = self._check_daemon()
        if why is not None:
            self._lost(f"{why} (the attach could not map its device memory: {e})")
        self._detach_quietly()  # a round trip: one that finds the daemon gone says so (_gone)
        if self._gone is not None:
            raise DaemonUnavailable(f"{self._gone} (the attach could not map its device memory: {e})") from e
        raise DeviceMappingFailed(
            f"attached, but cannot map sparsekvd's memory on GPU {handles.get('bus_id')}: {e}; the rank was given "
            "back. Check that this process sees that GPU (CUDA_VISIBLE_DEVICES) and, under MPS, uses the daemon's "
            "MPS server (CUDA_MPS_PIPE_DIRECTORY)", getattr(e, "status", None)) from e

    @property
    def blocks(self) -> Blocks:
        """The attached engine's block store (``attach(block_size=n)``); NotAttached when
        this client has no attachment, or its engine no block store."""
        return block_store(self._blocks, self.attachment is not None)

    def _end_blocks(self) -> None:
        """The attachment's block store handle ends with it (``Blocks.close``)."""
        if self._blocks is not None:
            self._blocks.close()
        self._blocks = None

    def _detach_quietly(self) -> None:
        self._end_blocks()
        try:
            self._call(MsgType.DETACH)
        except (SparseKVError, OSError):
            pass

    def doorbell_handle(self, **kw):
        """The engine's handle of a rank attached with ``transport="doorbell"``
        (:class:`~sparsekv.client.doorbell.DoorbellSwapIn`); one at a time (two would ring
        the rank's bells each with its own count, and the daemon's stream would wait for ever)."""
        if any(isinstance(h, DoorbellSwapIn) and not h.closed for h in self._handles):
            raise BadRequest("this rank has a doorbell handle already: one a rank; close() it first",
                             ErrorCode.BAD_ARGUMENT)
        h = DoorbellSwapIn(self, **kw)
        self._handles.append(h)  # closed before the rank's memory is unmapped
        return h

    def _close_handles(self) -> None:
        """Close the rank's device handles: their threads write into its memory."""
        handles, self._handles = self._handles, []
        for h in handles:
            h.close()

    def detach(self) -> None:
        self._close_handles()
        req = self._send(MsgType.DETACH)
        try:
            self._await_reply(req)
        except SparseKVError:
            # An earlier request's error, raised in place of the DETACH's reply: when that
            # reply came and says detached, so is this client (its slab unmapped, its blocks
            # handle ended), as the daemon has it.
            reply = self._replies.pop(req, None)
            if reply is not None and reply[0].get("ok") and self.attachment is not None:
                self._close_attachment()
            raise
        if self.attachment is not None:
            self._close_attachment()

    def _close_attachment(self, wait_s: float | None = None) -> None:
        att, self.attachment = self.attachment, None
        self._driver.reset()
        self._end_blocks()
        if self._keys_loader is not None:  # (the rank is detached: the daemon mapped none of its buffers)
            self._keys_loader.close()
            self._keys_loader = None
        self._block_requests.clear()  # (entries and fence events of this attachment)
        self._fence_requests.clear()
        att.close(wait_s=wait_s)

    def step(self, step: int, state_rows, reset=None, invalidate=None) -> None:
        """Begin decode step ``step``: the batch's state rows (-1 = padding), which of them
        start a new request (``reset`` bool [batch]) and rows rewritten since the last step
        (``invalidate`` int32 [batch, n], -1 = none)."""
        self._step_as(self, step, state_rows, reset, invalidate)

    def _step_as(self, driver, step: int, state_rows, reset=None, invalidate=None) -> None:
        """:meth:`step` sent by ``driver`` (this client, or the handle driving its steps)."""
        step = _whole("step", step, carried=True)  # held, not sent yet: the request carrying it would fail
        arrays = step_arrays(state_rows, reset, invalidate)
        if self.attachment is not None:
            self._driver.claim(self, driver)
        # Not sent yet: it rides on this step's first TOPK (client/README.md).
        self._send_pending_step()
        self._pending_step = (step, arrays)
        self._step_rows = (step, arrays["state_rows"])
        self._driver.stepped(step)

    def _send_pending_step(self) -> None:
        """Send the STEP not sent yet alone (not waited for)."""
        pending, self._pending_step = self._pending_step, None
        if pending is not None:
            self._lone_steps.append(self._send(MsgType.STEP, {"step": pending[0]}, pending[1]))
            self._deferred.append(self._lone_steps[-1])
            self._lone_step_numbers[self._lone_steps[-1]] = pending[0]

    def _settle_steps(self, held: str = "request") -> None:
        """Send the STEP not sent yet; wait for every STEP sent alone and raise its refusal:
        a request (or its side effects: a keys buffer deposited) must not run and then raise
        a STEP's error as its own (a WRITE that raised had written; an ALLOC's blocks lost)."""
        self._send_pending_step()
        while self._lone_steps:
            req = self._lone_steps.pop(0)
            if req in self._deferred:  # (its reply may have been read and raised already)
                try:
                    self._receive_until(req)
                except DaemonUnavailable as e:  # (its "may have run" is the STEP's, not this request's)
                    raise DaemonUnavailable(f"{e.args[0]}; this {held} was not sent: it waited for the reply to a "
                                            f"STEP sent before it (request {req})") from None
                self._check_deferred()

    def _riding_step(self, step: int, state_rows) -> dict | None:
        """The arrays of the STEP not sent yet when the TOPK of ``step`` about to be sent
        carries it (it has no state rows of its own; it says ``begin``, and no STEP is sent)."""
        pending = self._pending_step
        return pending[1] if pending is not None and pending[0] == step and state_rows is None else None

    def _send(self, msg_type: MsgType, fields=None, arrays=None) -> int:
        """Send a request, after the STEP not sent yet (requests reach the daemon in the
        order they were made) unless this is the TOPK it rides on (``begin``); any request
        but a TOPK or a DETACH after :meth:`_settle_steps`."""
        self._raise_if_watch_gone()
        if msg_type == MsgType.TOPK and fields.get("begin"):
            self._pending_step = None  # the TOPK carries it
        if msg_type in (MsgType.TOPK, MsgType.DETACH, MsgType.STEP):  # (a STEP: the one being sent alone)
            self._send_pending_step()
        else:
            self._settle_steps(msg_type.name)
        return super()._send(msg_type, fields, arrays)

    def submit_topk(self, step: int, group: int, topk, state_rows=None) -> Pending:
        """``topk`` ids int [batch, k]: a host array, or on a cuda rank a torch tensor on
        the rank's GPU, copied into the rank's step block on the current stream without a
        wait (the daemon reads it after the fence behind the copy); a tensor on another
        GPU, or on a rank without step blocks or fence events, is copied to the host first."""
        return self._submit_as(self, step, group, topk, state_rows)

    def _submit_as(self, driver, step: int, group: int, topk, state_rows=None) -> Pending:
        """:meth:`submit_topk` sent by ``driver`` (see :meth:`_step_as`)."""
        fields = {"step": _whole("step", step), "group": _whole("group", group)}
        att = self.attachment
        if att is not None:
            self._driver.claim(self, driver)
        device = att is not None and att.caps.device
        if device:
            self._await_fence_free(att)
        begin = self._riding_step(fields["step"], state_rows)
        if on_gpu(topk):
            if device and att.takes_device_topk and topk.device == att.torch_device:
                return self._submit_topk_block(att, fields, device_ids(topk), state_rows, begin)
            topk = topk.cpu()
        arrays = {"topk": host_int32("topk", topk, 2)}
        if device and att.caps.step_blocks:
            return self._submit_topk_block(att, fields, arrays["topk"], state_rows, begin)
        if begin is not None:
            arrays.update(begin)  # state_rows, reset, invalidate of the step
            fields["begin"] = True
        elif state_rows is not None:
            arrays["state_rows"] = host_int32("state_rows", state_rows, 1)
        if device:
            fence = att.record_fence()
            if fence is not None:
                fields["fence"] = fence
            req = self._send(MsgType.TOPK, fields, arrays)
            self._fenced(fence, req)
            return Pending(self, req, lambda h, a: att.result(h["entry"], h["batch"], h["k"]))
        req = self._send(MsgType.TOPK, fields, arrays)
        return Pending(self, req, lambda h, a: TopkResult(a["slots"], a["misses"], h["hits"], h["out_of_range"]))

    def _submit_topk_block(self, att, fields, topk, state_rows, begin: dict | None) -> Pending:
        """cuda: the batch (and ``begin``, the STEP riding on it) goes into this rank's
        pinned step block; the message carries only the entry number."""
        step = fields["step"]
        if begin is not None:
            rows = begin["state_rows"]
            begin = (begin.get("reset"), begin.get("invalidate"))
        elif state_rows is not None:
            rows = host_int32("state_rows", state_rows, 1)
        elif self._step_rows is not None and self._step_rows[0] == step:
            rows = self._step_rows[1]
        else:
            last = self._step_rows[0] if self._step_rows is not None else -1
            raise BadRequest(f"top-k for step {step} but the last STEP was {last}; send STEP first",
                             ErrorCode.BAD_ARGUMENT)
        check_batch(att, rows, topk, begin)  # before anything is consumed or written
        device_wait = self.device_wait and att.caps.done_words
        if device_wait:
            self._raise_if_watch_gone()
            # An error in an earlier request's reply is raised before this one is sent.
            self._receive_arrived()
            self._check_deferred()
        if begin is not None:
            fields["begin"] = True
        e = att.next_entry()
        prev = self._block_requests.get(e)
        if prev is not None and prev in self._sent:
            # The daemon has not answered the entry's last request yet, so its graph may
            # not even be launched: its pinned block must not be rewritten before.
            self._receive_until(prev)
        fields["block"] = att.write_blocks(e, step, fields["group"], rows, topk, begin, self._still_there,
                                           self.timeout_s)
        fence = att.record_fence()  # after write_blocks: behind a top-k's copy from the GPU
        if fence is not None:
            fields["fence"] = fence
        batch, k = topk.shape
        if device_wait:
            fields["done"] = done = att.next_done(e)
        req = self._send(MsgType.TOPK, fields)
        self._block_requests[e] = req
        self._fenced(fence, req)
        if not device_wait:
            return Pending(self, req, lambda h, a: att.result(h["entry"], batch, k))
        self._deferred.append(req)
        self._watch_device_waits()
        return Ready(att.result_after(e, batch, k, done))

    def topk(self, step: int, group: int, topk, state_rows=None) -> TopkResult:
        """Resolve one index group's top-k batch; when this returns the rows are in the slab."""
        return self.submit_topk(step, group, topk, state_rows).wait()

    def write(self, rows, data, layers=None) -> dict:
        """Copy ``data`` uint8 [len(layers), n, row_bytes] into host ``rows`` (all layers when
        ``layers`` is None); hot copies of those rows are dropped in every rank. Larger than
        one frame may carry: in parts (``client.tensors.write_in_parts``)."""
        layers = None if layers is None else _layers(layers)
        rows, data = host_int32("rows", rows, 1), host_bytes("data", data)
        return write_in_parts(self._call, self.attachment, layers, rows, data, settle=self.flush)

    def write_staged(self, rows, layers=None) -> dict:
        """Write rows this rank put at the front of its staging buffer (``att.staging[layer,
        :len(rows)]`` for each of ``layers``, all when None) into host ``rows``; hot copies
        of those rows are dropped in every rank. cuda: ordered after the current stream
        (fence events); reuse the staging buffer only after a later request's reply."""
        fields = {"layers": None if layers is None else _layers(layers)}
        att = self.attachment
        if att is not None and att.caps.device:
            self._await_fence_free(att)
            fence = att.record_fence()
            if fence is not None:
                fields["fence"] = fence
        return self._call(MsgType.WRITE_STAGED, fields, {"rows": host_int32("rows", rows, 1)})[0]

    def stage(self, rows, layers=None) -> int:
        """Copy host ``rows`` (e.g. whole blocks) of ``layers`` to the staging buffer's front."""
        fields, _ = self._call(MsgType.STAGE, {"layers": None if layers is None else _layers(layers)},
                               {"rows": host_int32("rows", rows, 1)})
        return fields["bytes"]

    def stats(self) -> dict:
        return self._call(MsgType.STATS)[0]["stats"]

    def _await_fence_free(self, att) -> None:
        """Before the rank's next fence event is recorded again: the reply of the request
        that carried it last, so that the daemon's stream has taken its wait on that
        record (a wait taken after a newer record would wait for work behind it, which
        may wait on the daemon). Called before a request consumes or writes anything."""
        k = att.next_fence()
        prev = None if k is None else self._fence_requests.get(k)
        if prev is not None and prev in self._sent:
            self._receive_until(prev)

    def _fenced(self, fence: int | None, req: int) -> None:
        if fence is not None:
            self._fence_requests[fence] = req

    # -- plumbing ----------------------------------------------------------------
    def _lost(self, why: str):
        """The daemon is gone: release the rank's device waits, forget what was in flight
        and raise DaemonUnavailable (``Connection._lost``)."""
        self._release_device_waits()
        self._block_requests.clear()
        self._fence_requests.clear()
        self._pending_step = None
        self._lone_steps.clear()
        self._lone_step_numbers.clear()
        super()._lost(why, "session and attachment are" if self.attachment else "session is")

    def flush(self) -> None:
        """Wait for every deferred request (the last STEP); raise the first error (session lost: DaemonUnavailable)."""
        if self._sock is not None:
            self._check_owner()  # a forked child has nothing of its own to wait for
        self._send_pending_step()
        while self._deferred:
            self._receive_until(self._deferred[0])
            self._check_deferred()
        if self._sock is None and self._gone is not None:
            raise DaemonUnavailable(self._gone)
