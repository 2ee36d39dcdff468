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

import logging
import mmap
import os
import socket
import stat
import struct
import sys
import time
from dataclasses import dataclass

import numpy as np
import psutil
import zmq

from sparsekv.proto import LIMITS, PROTOCOL_VERSION, ErrorCode, Layout, MsgType, ProtocolError, decode, encode
from sparsekv.proto.cpus import check_cpus_usable, parse_cpu_list, pin_io_threads
from sparsekv.proto.frames import send_copy
from sparsekv.proto.settings import CLIENT_DEVICE_WAIT, CLIENT_IO_CPUS, RUN_DIR

from .errors import BadRequest, DaemonUnavailable, DeviceMappingFailed, ProtocolMismatch, SparseKVError, error_for
from .device_wait import DeviceWaitWatch
from .results import TopkResult


log = logging.getLogger("sparsekv.client")
_ENVELOPE = frozenset({"v", "t", "id", "ok", "tr", "tx"})
# While waiting for a reply, check this often that the daemon still lives: a client
# learns within about this long that its daemon died or was restarted, not at timeout_s.
LIVENESS_SLICE_S = 0.25
# Closing a cuda rank whose daemon is gone: how long the GPU may take to finish the work
# that read the rank's memory before the memory is left mapped instead (cuda_attach.py).
GONE_CLOSE_WAIT_S = 5.0
BYE_TIMEOUT_S = 0.5  # close() waits this long for the daemon's goodbye
# The daemon renames its socket to this while it is short of file descriptors
# (daemon/connguard.py): no new connection, the existing ones go on.
BUSY_SUFFIX = ".busy"


def default_run_dir() -> str:
    return RUN_DIR.get()


@dataclass
class Attachment:
    """What attach gives a rank: its layout and the hot slab it reads rows from."""

    layout: Layout
    engine: str
    slab: np.ndarray  # uint8 [num_layers, max_reqs, region_stride, row_bytes]
    staging: np.ndarray | None  # uint8 [num_layers, staging_rows, row_bytes]
    _mm: mmap.mmap | None = None
    # An engine-owned slab (client/engine_slab.py): the hot rows live there; ``slab`` is None.
    engine_slab: object = None

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


class Ready(Pending):
    """A request whose result needs no reply (device wait): ``wait()`` returns it at once;
    the reply is read later, and an error in it is raised by a later call."""

    def __init__(self, result):
        self._result, self._done = result, True


class Client:
    """One engine rank's connection to sparsekvd. Not thread-safe: one thread per Client."""

    def __init__(self, run_dir: str | None = None, *, rank: int = 0, device: str = "cpu",
                 name: str = "", timeout_s: float = 30.0, spin_us: int | None = None,
                 device_wait: bool | None = None, io_cpus: str | int | None = None):
        """``device``: ``"cpu"``, or ``"cuda:N"`` (this process's GPU numbering) for a rank
        whose slab lives on a GPU of a cuda-backend daemon. ``device_wait`` (cuda ranks;
        None: ``$SPARSEKV_CLIENT_DEVICE_WAIT`` is ``1``): ``topk`` returns once the request
        is sent, with the current stream waiting on the GPU for the result (the daemon
        sets a word per ring entry); the reply is read later and an error in it raised by
        a later call (the failed request's result is empty: slots -1). ``io_cpus`` (None:
        ``$SPARSEKV_CLIENT_IO_CPUS``; "" : not pinned), e.g. ``"5"``: this client gets a
        ZeroMQ context of its own whose I/O thread runs on those CPUs; keep the engine's
        threads off them, and have the daemon keep them warm (its ``warm_cpus``;
        deploy/README.md "Warm CPUs"). ValueError for CPUs no thread of this process can
        run on."""
        self.run_dir = run_dir or default_run_dir()
        self.rank, self.device, self.name = rank, device, name
        self.timeout_s = timeout_s
        # Poll for a reply this long before sleeping on the socket (a wake-up costs tens of
        # microseconds, in a VM more): default 500 for cuda ranks, 0 for cpu ones.
        self.spin_ns = (500 if device.startswith("cuda") else 0) * 1000 if spin_us is None else int(spin_us) * 1000
        self.info: dict = {}
        self.attachment: Attachment | None = None
        self._handles: list = []  # device handles made by doorbell_handle (closed at detach)
        self._ctx = self._sock = None
        what = "io_cpus"
        if io_cpus is None:
            io_cpus, what = CLIENT_IO_CPUS.get(), f"${CLIENT_IO_CPUS.env}"
        if type(io_cpus) is int:
            io_cpus = str(io_cpus)
        if not isinstance(io_cpus, str):
            raise ValueError(f"{what}: a CPU list is text such as \"62\" or \"2-3\" (or one int), got {io_cpus!r}")
        self.io_cpus = parse_cpu_list(io_cpus, what)
        check_cpus_usable(self.io_cpus, what)
        self._next_id = 1
        self._replies: dict[int, tuple] = {}
        self._deferred: list[int] = []  # requests sent without waiting (STEP; TOPK with device wait)
        if device_wait is None:
            device_wait = CLIENT_DEVICE_WAIT.get()
        self.device_wait = bool(device_wait)
        self._pending_step: tuple[int, dict] | None = None  # a STEP not sent yet (see step())
        self._step_rows: tuple[int, np.ndarray] | None = None  # the last step's state rows
        self._block_requests: dict[int, int] = {}  # cuda: step-block entry -> its last request
        self._fence_requests: dict[int, int] = {}  # cuda: fence event -> the last request that carried it
        self._sent: dict[int, tuple[MsgType, int]] = {}  # request id -> (type, ts) until its reply
        # Per request type, the last reply's (sent, daemon received, daemon replied,
        # received here) in perf_counter_ns: one clock (CLOCK_MONOTONIC) for the whole host.
        self.timings: dict[MsgType, tuple[int, int, int, int]] = {}
        # cuda TOPK: when the daemon had enqueued the last one's GPU work ("tl", same clock).
        self.enqueued_at: int | None = None
        # The daemon this client talks to, found at connect (see _check_daemon): its pid as
        # this process sees it (0: in another pid namespace), its start time, and the
        # identity of its socket file (_file_id). ``_gone``: why it is no longer there.
        self._daemon_pid = 0
        self._daemon_started: float | None = None
        self._socket_id: tuple[int, int, int] | None = None
        self._gone: str | None = None

    # -- connection --------------------------------------------------------------
    @property
    def control_path(self) -> str:
        return os.path.join(self.run_dir, "control.sock")

    def connect(self) -> "Client":
        path = self.control_path
        # Connect once by hand first: libzmq retries a refused or forbidden connection
        # silently (the HELLO would only time out), this says at once what is wrong,
        # and the kernel names the daemon's process (SO_PEERCRED, in our pid namespace).
        self._daemon_pid, self._socket_id = probe_daemon(path, self.run_dir)
        self._daemon_started = _start_time(self._daemon_pid)
        self._gone = None
        if self._ctx is None:
            if self.io_cpus:
                # A context of its own: the I/O thread's CPU is set before it starts.
                self._ctx = zmq.Context(io_threads=1)
                pin_io_threads(self._ctx, self.io_cpus)
            else:
                self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A routing id of our own: if the connection drops (the daemon's heartbeat timed
        # out while this process was stopped), libzmq reconnects under the same name and
        # the daemon still knows this client.
        self._sock.setsockopt(zmq.ROUTING_ID, b"skv" + os.urandom(13))
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
            theirs = self.info.get("version")
            self.close()  # its socket and (with io_cpus) its own context and threads
            raise ProtocolMismatch(f"daemon speaks protocol {theirs}, client {PROTOCOL_VERSION}")
        return self

    def close(self) -> None:
        """Say goodbye (BYE: the daemon detaches this rank and forgets the connection,
        so a process may open and close clients for ever), then close. Waits at most
        ``BYE_TIMEOUT_S`` and ignores every failure: the daemon's reaper frees what a
        client that could not say goodbye held once its process exits."""
        self._close_handles()  # before the daemon lets the rank's memory go
        if self._sock is not None and self.info:
            self._goodbye()
        if self.attachment is not None:
            # Once the daemon is gone its events may never complete: wait a bounded time.
            self._close_attachment(wait_s=GONE_CLOSE_WAIT_S if self._gone is not None else None)
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self._drop_context()
        self._sent.clear()  # requests whose replies will never come
        self._replies.clear()
        self._deferred.clear()
        self.info = {}

    def _goodbye(self) -> None:
        timeout_s, self.timeout_s = self.timeout_s, min(self.timeout_s, BYE_TIMEOUT_S)
        self._pending_step = None  # a STEP not sent yet: nobody will use it
        try:
            try:
                self._call(MsgType.BYE)
            except SparseKVError as e:
                if e.code != ErrorCode.UNKNOWN_TYPE or self.attachment is None:
                    raise
                self._call(MsgType.DETACH)  # a daemon without BYE: detach at least
        except (SparseKVError, zmq.ZMQError):
            pass
        finally:
            self.timeout_s = timeout_s

    def __enter__(self) -> "Client":
        return self.connect() if self._sock is None else self

    def __exit__(self, *exc) -> None:
        self.close()  # BYE detaches too


    # -- requests ----------------------------------------------------------------
    def attach(self, layout: Layout, engine: str = "default", fence: bool = False, transport: str = "zmq",
               slab=None):
        """Attach this rank to ``engine``; return its :class:`Attachment` (cpu) or
        ``CudaAttachment`` (cuda). ``fence`` (cuda): export events the daemon waits on
        before each gather, so attention still reading earlier rows is never overwritten.
        ``transport``: ``"zmq"`` (steps as messages: ``step``/``topk``) or ``"doorbell"``
        (cuda: the engine's stream drives the steps through :meth:`doorbell_handle`).
        ``slab``: an engine-owned hot slab (:class:`~sparsekv.client.engine_slab.EngineSlab`
        with its geometry): the daemon gathers into it instead of a slab of its own."""
        layout.validate()
        fields = {"engine": engine, "layout": layout.to_wire()}
        if slab is not None:
            fields["slab"] = self._offer_slab(layout, slab)
        if transport != "zmq":
            if transport != "doorbell":
                raise BadRequest(f"transport must be 'zmq' or 'doorbell', got {transport!r}", ErrorCode.BAD_ARGUMENT)
            if not self.device.startswith("cuda"):
                raise BadRequest("the doorbell transport needs a cuda rank (device='cuda:N')", ErrorCode.BAD_ARGUMENT)
            from sparsekv.proto.cuda_ipc import mps_running  # noqa: PLC0415

            if not mps_running():
                log.warning("NVIDIA MPS is not running: each doorbell hand-off between this engine and sparsekvd "
                            "costs ~300 us instead of a few (DESIGN §2; start nvidia-cuda-mps-control -d)")
            fields["transport"] = transport
        fence_ring = None
        if fence and self.device.startswith("cuda"):
            from sparsekv.proto.cuda_ipc import EventRing  # noqa: PLC0415

            from .cuda_attach import local_device  # noqa: PLC0415

            fence_ring = EventRing(local_device(self.device), 16)
            fields["fence_events"] = fence_ring.handles
        reply, _ = self._call(MsgType.ATTACH, fields)
        h = reply["handles"]
        if h.get("kind") not in ("cuda_ipc", "shm"):
            raise SparseKVError(f"unknown slab kind {h.get('kind')!r} from the daemon; upgrade the client")
        cuda = h["kind"] == "cuda_ipc"
        try:
            fds = self._fetch_fds(h)
        except SparseKVError as e:
            if not cuda:  # no slab to read: give the rank back
                self._detach_quietly()
                raise
            # cuda: only the pinned step blocks are missing; top-k batches go as arrays.
            log.warning("cannot get the daemon's step blocks (%s); sending top-k batches on the socket", e)
            fds = {}
        try:  # the mappings keep the memory; the descriptors are not needed past this
            if cuda:
                from .cuda_attach import CudaAttachment  # noqa: PLC0415

                try:
                    self.attachment = CudaAttachment(layout, engine, h, fence_ring, fds=fds, engine_slab=slab)
                except SparseKVError:
                    self._detach_quietly()
                    raise
                except Exception as e:  # a CUDA call of this process: give the rank back, say what failed
                    self._mapping_failed(e, h)
                return self.attachment
            mm = None
            if h.get("fd") is not None or not h.get("engine_slab"):
                if h.get("fd") not in fds:
                    self._detach_quietly()
                    raise SparseKVError(f"the daemon sent no descriptor {h.get('fd')!r} for the slab; check the "
                                        "client and daemon versions")
                mm = mmap.mmap(fds[h["fd"]], max(h["bytes"], 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            for fd in fds.values():
                os.close(fd)
        if h.get("engine_slab"):  # the daemon's memory holds the staging buffer only (if any)
            staging = np.frombuffer(mm, dtype=np.uint8)[: layout.staging_bytes].reshape(layout.staging_shape) \
                if mm is not None and layout.staging_bytes else None
            self.attachment = Attachment(layout, engine, None, staging, mm, engine_slab=slab)
            return self.attachment
        slab, staging = layout.split_buffer(np.frombuffer(mm, dtype=np.uint8))
        self.attachment = Attachment(layout, engine, slab, staging, mm)
        return self.attachment

    def _offer_slab(self, layout: Layout, slab) -> dict:
        """The ATTACH field of an engine-owned slab: its geometry, and (cpu) the id of its
        descriptor deposited on the daemon's fd socket."""
        from sparsekv.proto import fd_socket  # noqa: PLC0415

        geo = slab.check(layout)
        if self.device.startswith("cuda") != slab.cuda:
            raise BadRequest("a cuda rank's engine slab is a GPU tensor (EngineSlab.from_tensor), a cpu rank's "
                             "shared memory (EngineSlab.shared_memory)", ErrorCode.BAD_ARGUMENT)
        if slab.cuda:
            from .cuda_attach import local_device  # noqa: PLC0415

            if slab.device != local_device(self.device):
                raise BadRequest(f"the engine slab is on cuda:{slab.device}, this rank on {self.device}",
                                 ErrorCode.BAD_ARGUMENT)
            ex = slab.export()
            return {"geometry": geo.to_wire(), "ipc_handle": ex["ipc_handle"], "ipc_offset": ex["ipc_offset"]}
        try:
            dep = fd_socket.deposit_fd(os.path.join(self.run_dir, fd_socket.FD_SOCKET), slab.fd)
        except ProtocolError as e:
            raise error_for(e.code, f"the daemon refused the engine's slab: {e.args[0]}") from None
        except OSError as e:
            raise DaemonUnavailable(f"cannot give the engine's slab to sparsekvd at {self.run_dir}: {e}") from None
        return {"deposit": dep, "geometry": geo.to_wire()}

    def _fetch_fds(self, handles: dict) -> dict[str, int]:
        """The descriptors of the rank's shared memory, by name, from the daemon's fd socket
        (``proto/fd_socket.py``): a one-time token for this process only. Empty when the
        handles offer none. The caller closes them."""
        token = handles.get("fd_token")
        if token is None:
            return {}
        from sparsekv.proto.fd_socket import fetch_fds  # noqa: PLC0415

        path = os.path.join(self.run_dir, os.path.basename(str(handles.get("fd_socket"))))
        try:
            return fetch_fds(path, str(token), min(self.timeout_s, 10.0))
        except ProtocolError as e:
            raise error_for(e.code, f"the fd socket {path} refused this process: {e.args[0]}") from None
        except OSError as e:
            raise DaemonUnavailable(f"cannot get the rank's memory from {path}: "
                                    f"{e.strerror or type(e).__name__}") from None

    def _mapping_failed(self, e: Exception, handles: dict):
        """The daemon's device memory could not be mapped: DaemonUnavailable if the daemon
        went meanwhile (the handle of an exited exporter never opens again: a daemon
        killed between its ATTACH reply and this process's IPC open), else give the rank
        back and raise DeviceMappingFailed, naming the GPU and CUDA's error."""
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

    def _detach_quietly(self) -> None:
        try:
            self._call(MsgType.DETACH)
        except (SparseKVError, zmq.ZMQError):
            pass

    def doorbell_handle(self, **kw):
        """The engine's handle of a rank attached with ``transport="doorbell"``:
        :class:`~sparsekv.client.doorbell.DoorbellSwapIn` (``begin_step``, ``swap_in``,
        ``kv``, ``check``)."""
        from .doorbell import DoorbellSwapIn  # noqa: PLC0415

        h = DoorbellSwapIn(self, **kw)
        self._handles.append(h)  # closed before the rank's memory is unmapped
        return h

    def _watch_device_waits(self) -> None:
        """Start (once per attachment) the thread that releases this rank's device waits
        if the daemon dies: a stream waiting on a done word must never wait for ever."""
        if any(isinstance(h, DeviceWaitWatch) for h in self._handles):
            return
        self._handles.append(DeviceWaitWatch(self._daemon_dead, self._release_device_waits))

    def _raise_if_watch_gone(self) -> None:
        """The device-wait watcher found the daemon gone: this client is lost (raises)."""
        for h in self._handles:
            if isinstance(h, DeviceWaitWatch) and h.gone is not None:
                self._lost(h.gone)

    def _daemon_dead(self) -> str | None:
        """Why the daemon is gone, only once its process is (or cannot be seen): a daemon
        whose socket went away but whose process lives may still run its GPU work, and a
        release then would race with it."""
        if self._process_alive() is True:
            return None
        return self._check_daemon()

    def _process_alive(self) -> bool | None:
        """Whether the daemon's process lives: None when this process cannot see it. A new
        process under the same pid, or a zombie its parent has not reaped, is not it."""
        pid = self._daemon_pid
        if pid <= 0:
            return None
        try:
            p = psutil.Process(pid)
            return p.status() != psutil.STATUS_ZOMBIE and (self._daemon_started is None
                                                            or p.create_time() == self._daemon_started)
        except psutil.NoSuchProcess:
            return False
        except psutil.Error:
            return None

    def _release_device_waits(self) -> None:
        """The daemon is gone: empty the results of this rank's device-wait entries and set
        their done words (``CudaAttachment.release_done``), unless its process still
        lives (then its own stream sets them)."""
        att = self.attachment
        if att is None or not hasattr(att, "release_done") or self._process_alive() is True:
            return
        try:
            att.release_done()
        except Exception as e:  # noqa: BLE001 - nothing more can be done for them
            log.error("could not release the device waits of a lost daemon: %r", e)

    def _close_handles(self) -> None:
        """Close the rank's device handles: their threads write into its memory."""
        handles, self._handles = self._handles, []
        for h in handles:
            h.close()

    def detach(self) -> None:
        self._close_handles()
        self._call(MsgType.DETACH)
        if self.attachment is not None:
            self._close_attachment()

    def _close_attachment(self, wait_s: float | None = None) -> None:
        att, self.attachment = self.attachment, None
        self._block_requests.clear()  # (entries and fence events of this attachment)
        self._fence_requests.clear()
        if wait_s is not None and hasattr(att, "_stream_done_within"):  # cuda: bounded
            att.close(wait_s=wait_s)
        else:
            att.close()

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
        """``topk`` ids int [batch, k]: a host array, or on a cuda rank a torch tensor on
        the rank's GPU. Such a tensor is copied into the rank's step block on the current
        stream, which nothing waits for on the host (the daemon's kernels read it after
        the fence recorded behind the copy); a tensor on another GPU, or on a rank that
        cannot take it so (no step blocks or no fence events), is copied to the host first."""
        fields = {"step": int(step), "group": int(group)}
        att = self.attachment
        if att is not None and hasattr(att, "next_fence"):
            self._await_fence_free(att)
        pending = self._pending_step
        begins = pending is not None and pending[0] == fields["step"] and state_rows is None
        if _on_gpu(topk):
            if getattr(att, "takes_device_topk", False) and topk.device == att.torch_device:
                return self._submit_topk_block(att, fields, _device_ids(topk), state_rows, begins)
            topk = topk.cpu()
        arrays = {"topk": np.asarray(topk, dtype=np.int32)}
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
            self._fenced(fence, req)
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
        device_wait = self.device_wait and att.has_done_words
        if device_wait:
            self._raise_if_watch_gone()
            # An error in an earlier request's reply is raised before this one is sent.
            self._receive_arrived()
            self._check_deferred()
        if begins:
            self._pending_step = None
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
        if not device_wait:
            req = self._send(MsgType.TOPK, fields)
            self._block_requests[e] = req
            self._fenced(fence, req)
            return Pending(self, req, lambda h, a: att.result(h["entry"], batch, k))
        fields["done"] = done = att.next_done(e)
        req = self._send(MsgType.TOPK, fields)
        self._block_requests[e] = req
        self._fenced(fence, req)
        self._deferred.append(req)
        self._watch_device_waits()
        return Ready(att.result_after(e, batch, k, done))

    def topk(self, step: int, group: int, topk, state_rows=None) -> TopkResult:
        """Resolve one index group's top-k batch; when this returns the rows are in the slab."""
        return self.submit_topk(step, group, topk, state_rows).wait()

    def write(self, rows, data, layers=None) -> dict:
        """Copy ``data`` uint8 [len(layers), n, row_bytes] into host ``rows`` (all layers when
        ``layers`` is None); hot copies of those rows are dropped in every rank."""
        layers = None if layers is None else [int(x) for x in layers]
        rows, data = np.asarray(rows, dtype=np.int32), np.asarray(data, dtype=np.uint8)
        per_row = data.nbytes // max(1, data.shape[1]) if data.ndim == 3 and rows.ndim == 1 else 0
        if not per_row or (data.nbytes <= LIMITS.max_frame_bytes and rows.shape[0] <= LIMITS.max_write_rows):
            return self._call(MsgType.WRITE, {"layers": layers}, {"rows": rows, "data": data})[0]
        # Larger than one frame may carry: several WRITEs of whole rows, each in order.
        step = max(1, min(LIMITS.max_frame_bytes // per_row, LIMITS.max_write_rows))
        total: dict = {}
        for i in range(0, rows.shape[0], step):
            part = self._call(MsgType.WRITE, {"layers": layers}, {"rows": rows[i:i + step], "data": data[:, i:i + step]})[0]
            for k, v in part.items():
                total[k] = total.get(k, 0) + v if isinstance(v, int) else v
        return total


    def write_staged(self, rows, layers=None) -> dict:
        """Write rows this rank put at the front of its staging buffer (``att.staging[layer,
        :len(rows)]`` for each of ``layers``, all when None) into host ``rows``; hot copies
        of those rows are dropped in every rank. On the cuda backend the copy is ordered
        after this rank's current stream (fence events) and the call returns once it is
        enqueued: reuse the staging buffer only after a later request's reply."""
        fields = {"layers": None if layers is None else [int(x) for x in layers]}
        att = self.attachment
        if att is not None and hasattr(att, "record_fence"):
            self._await_fence_free(att)
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

    def _await_fence_free(self, att) -> None:
        """Before the rank's next fence event is recorded again: the reply of the request
        that carried it last, so that the daemon's stream has taken its wait on that
        record. (A wait taken after a newer record would wait for work behind it, and
        that work may wait on the daemon: with device wait the host can run that far
        ahead.) Called before a request consumes or writes anything."""
        k = att.next_fence()
        prev = None if k is None else self._fence_requests.get(k)
        if prev is not None and prev in self._sent:
            self._receive_until(prev)

    def _fenced(self, fence: int | None, req: int) -> None:
        if fence is not None:
            self._fence_requests[fence] = req

    # -- plumbing ----------------------------------------------------------------
    def _send(self, msg_type: MsgType, fields=None, arrays=None) -> int:
        if self._sock is None:
            if self._gone is not None:
                raise DaemonUnavailable(self._gone)
            raise SparseKVError("client is not connected; call connect() or use it as a context manager")
        self._raise_if_watch_gone()
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
        if arrays:
            for f in frames[1:]:
                # The daemon would drop the connection unread (ZMQ_MAXMSGSIZE) and this
                # client would wait for a reply that never comes: refuse it here.
                if len(f) > LIMITS.max_frame_bytes:
                    raise BadRequest(f"an array of {len(f)} bytes exceeds the frame limit of "
                                     f"{LIMITS.max_frame_bytes} bytes; split the request", ErrorCode.TOO_LARGE)
        self._sock.send_multipart(frames, copy=send_copy(frames))
        self._sent[req] = (msg_type, ts)
        return req

    def _receive_until(self, req_id: int) -> None:
        if self._sock is None and req_id not in self._replies:
            raise DaemonUnavailable(self._gone or "client is not connected")
        while req_id not in self._replies:
            if not self._spin() and not self._sock.poll(int(min(self.timeout_s, LIVENESS_SLICE_S) * 1000)):
                self._wait_slices()
            self._receive_one()

    def _receive_one(self) -> None:
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
            if sent[0] == MsgType.TOPK:
                self.enqueued_at = header.get("tl")  # None from a cpu rank or an error reply
        self._replies[rid] = (header, arrays)

    def _receive_arrived(self) -> None:
        """Take every reply already here, without waiting."""
        while self._sock is not None and self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._receive_one()

    def _wait_slices(self) -> None:
        """No reply within the first slice: poll on in slices until ``timeout_s``,
        checking between slices that the daemon still lives (it may have died or been
        restarted: then no reply will ever come)."""
        deadline = time.monotonic() + self.timeout_s - min(self.timeout_s, LIVENESS_SLICE_S)
        while True:
            why = self._check_daemon()
            if why is not None:
                self._lost(why)
            left = deadline - time.monotonic()
            if left <= 0:
                raise DaemonUnavailable(f"no reply from sparsekvd at {self.run_dir} within {self.timeout_s} s")
            if self._sock.poll(max(1, int(min(left, LIVENESS_SLICE_S) * 1000))):
                return

    def _check_daemon(self) -> str | None:
        """Why the daemon this client connected to is no longer there, or None while it
        seems to be: its process (when this process can see it) and its socket file (a
        restarted daemon makes a new one)."""
        path = self.control_path
        if self._process_alive() is False:
            return f"sparsekvd is gone (pid {self._daemon_pid} exited)"
        st = None  # alive, or cannot tell (another pid namespace, permissions): the socket says more
        # The daemon renames control.sock <-> control.sock.busy while it holds off new
        # connections (daemon/connguard.py): both names can be missing between two stats.
        # Gone only when neither exists three times over.
        for _ in range(3):
            for p in (path, path + BUSY_SUFFIX):
                try:
                    st = os.stat(p)
                    break
                except FileNotFoundError:
                    continue
                except OSError:
                    return None  # cannot tell
            if st is not None:
                break
        if st is None:
            return f"sparsekvd is gone: its socket {path} was removed"
        if self._socket_id is not None and _file_id(st) != self._socket_id:
            return f"sparsekvd restarted: {path} is a new daemon's socket"
        return None

    def _drop_context(self) -> None:
        """Terminate this client's own context (io_cpus: its I/O thread goes); the
        process's shared instance stays. Its only socket is closed already."""
        if self._ctx is not None and self.io_cpus:
            self._ctx.term()
        self._ctx = None

    def _still_there(self) -> None:
        """Raise DaemonUnavailable (and forget the session) if the daemon has gone."""
        why = self._check_daemon()
        if why is not None:
            self._lost(why)

    def _lost(self, why: str):
        """The daemon is gone: every request of this client fails from now on."""
        self._gone = (f"{why}; this client's session{' and attachment are' if self.attachment else ' is'} "
                      "gone: create a new Client (and attach again)")
        self._release_device_waits()
        if self._sock is not None:
            self._sock.close(0)
        self._sock = None
        self._drop_context()
        # Nothing in flight will be answered (connect() again starts clean).
        self._sent.clear()
        self._replies.clear()
        self._deferred.clear()
        self._block_requests.clear()
        self._fence_requests.clear()
        self._pending_step = None
        raise DaemonUnavailable(self._gone)

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
            code = header.get("code", int(ErrorCode.INTERNAL))
            if code == ErrorCode.NOT_HELLO and self.info and self._sock is not None:
                # This connection said HELLO, yet the daemon does not know it: a new
                # daemon answers (libzmq reconnected to it by itself) if the socket changed.
                why = self._check_daemon()
                if why is not None:
                    self._lost(why)
            raise error_for(code, header.get("msg", "no message"))
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


def probe_daemon(path: str, run_dir: str) -> tuple[int, tuple[int, int]]:
    """Connect to the daemon's socket ``path`` once, as a plain UNIX socket, and hang up.
    Returns (the daemon's pid as this process sees it, 0 when it runs in another pid
    namespace; the socket file's identity, _file_id). Raises :class:`DaemonUnavailable`
    saying what is wrong: no socket, permission denied, connection refused (a daemon that
    died left it behind), or a daemon holding off new connections."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.exists(path + BUSY_SUFFIX):
            raise DaemonUnavailable(f"sparsekvd at {run_dir} refuses new connections for now: it is short of file "
                                    "descriptors (too many open connections; see its log); retry later") from None
        raise DaemonUnavailable(f"no daemon socket at {path}; is sparsekvd running with --run-dir {run_dir}?") from None
    except PermissionError:
        raise DaemonUnavailable(f"permission denied on {run_dir}: this user may not enter sparsekvd's run dir "
                                "(engines need the daemon's group, see deploy/README.md)") from None
    except OSError as e:
        raise DaemonUnavailable(f"cannot reach {path}: {e.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise DaemonUnavailable(f"{path} is not a socket; is --run-dir {run_dir} sparsekvd's run dir?")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(2.0)
        try:
            s.connect(path)
        except PermissionError:
            raise DaemonUnavailable(f"permission denied on {path}: this user may not connect to sparsekvd (connecting "
                                    "needs write permission on the socket: the daemon's group, see deploy/README.md)"
                                    ) from None
        except ConnectionRefusedError:
            raise DaemonUnavailable(f"connection refused on {path}: no sparsekvd listens there (it exited and left "
                                    "its socket behind, or it is starting)") from None
        except FileNotFoundError:
            return probe_daemon(path, run_dir)  # renamed away just now: say why
        except (BlockingIOError, TimeoutError):
            raise DaemonUnavailable(f"sparsekvd at {run_dir} does not accept connections: its queue is full "
                                    "(is it stuck?)") from None
        except OSError as e:
            raise DaemonUnavailable(f"cannot connect to {path}: {e.strerror}") from None
        try:
            pid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
        except OSError:
            pid = 0
    finally:
        s.close()
    return max(pid, 0), _file_id(st)


def _file_id(st: os.stat_result) -> tuple[int, int, int]:
    """What tells one socket file from the next at the same path: a file system may give
    a new file the inode number of one just deleted (ext4 does), but not its mtime too
    (set when the daemon binds it; chmod and rename leave it)."""
    return st.st_dev, st.st_ino, st.st_mtime_ns


def _start_time(pid: int) -> float | None:
    if pid <= 0:
        return None
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _on_gpu(a) -> bool:
    torch = sys.modules.get("torch")  # a tensor implies torch is imported: never import it here
    return torch is not None and isinstance(a, torch.Tensor) and a.is_cuda


def _device_ids(topk):
    """A top-k tensor on the rank's GPU as the step block takes it: 2-D, int32, contiguous
    (else BadRequest)."""
    import torch  # noqa: PLC0415 - a tensor was passed

    from .torch_positions import is_int_dtype  # noqa: PLC0415

    if topk.dim() != 2 or not is_int_dtype(topk.dtype):
        raise BadRequest(f"topk must be integers [batch, top_k], got {topk.dtype} {tuple(topk.shape)}",
                         ErrorCode.BAD_ARGUMENT)
    return topk.to(torch.int32).contiguous()


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
