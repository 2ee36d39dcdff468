"""A rank's view of a cuda-backend attachment: the daemon's device memory as torch tensors.

The slab, staging buffer and result ring live in the daemon's per-GPU arena, opened once
with ``cudaIpcOpenMemHandle``; nothing is copied. Readiness is stream-ordered: a top-k
reply names a ring entry, and the rank's current torch stream waits (on the GPU) for the
daemon's event of that entry before anything reads the rows. Optional "fence" events go
the other way: the rank records one before each top-k request and the daemon's copy
stream waits on it, so a gather never overwrites slots that earlier attention still reads.
"""

from __future__ import annotations

import importlib.util
import logging
import mmap
import threading
import time

import numpy as np

from sparsekv.proto import Layout
from sparsekv.proto.cuda_ipc import EventRing, ImportedArena, ImportedEvents, device_for_bus_id
from sparsekv.proto.step_block import BlockView, write_step, write_topk, write_topk_head
from sparsekv.proto.stream_ops import wait32_geq, write32

from .errors import DaemonUnavailable, SparseKVError
from .results import AttachmentCaps, TopkResult

EVENT_CHECK_S = 0.25  # while waiting for a daemon's event on the host: liveness checks

log = logging.getLogger("sparsekv.client")


def local_device(device: str) -> int:
    """``"cuda:N"`` -> N (this process's numbering)."""
    if not device.startswith("cuda:"):
        raise ValueError(f"a cuda rank needs device='cuda:N', got {device!r}")
    return int(device.split(":", 1)[1])


def require_cuda_extra() -> None:
    """A cuda rank needs CuPy and torch (the ``cuda`` extra; the cpu client and the CLI
    run without them). Raises ImportError saying what to install."""
    missing = [m for m in ("cupy", "torch") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"a cuda rank needs {' and '.join(missing)}: pip install 'sparsekv[cuda]'")


def bus_id_of(ordinal: int) -> str:
    require_cuda_extra()  # the first call of a cuda rank (Client.connect)
    import cupy as cp  # noqa: PLC0415

    return cp.cuda.runtime.deviceGetPCIBusId(ordinal).lower()


# Memory of lost daemons that work on the stream still waited on at close (anything with
# close()), each with an event marking that work's end.
_left_mapped: list = []


def sweep_left_mapped() -> int:
    """Unmap each left-mapped arena (or step blocks) whose marked work has ended; return
    how many stay. Each new attach sweeps first."""
    keep = []
    for arena, mark in _left_mapped:
        if mark.query():
            try:
                arena.close()
            except Exception as e:  # noqa: BLE001 - never let an old daemon's memory stop a new attach
                log.warning("could not unmap a lost daemon's memory: %s", e)
        else:
            keep.append((arena, mark))
    _left_mapped[:] = keep
    return len(keep)


class _RegisteredBlocks:
    """The rank's step blocks page-locked in this process too, so that a copy from the GPU
    (a top-k made there) lands in them on the stream, without a wait."""

    def __init__(self, mm, device: int):
        import cupy as cp  # noqa: PLC0415

        self._mm, self.device = mm, device
        self._buf = np.frombuffer(mm, dtype=np.uint8)
        self.ptr, self.nbytes = int(self._buf.ctypes.data), int(self._buf.nbytes)
        with cp.cuda.Device(device):
            cp.cuda.runtime.hostRegister(self.ptr, self.nbytes, 1)  # cudaHostRegisterPortable

    def close(self) -> None:
        import cupy as cp  # noqa: PLC0415

        try:
            with cp.cuda.Device(self.device):
                cp.cuda.runtime.hostUnregister(self.ptr)
        except Exception as e:  # noqa: BLE001 - a broken context: the mapping goes with the process
            log.warning("cuda:%d: could not unregister the step blocks: %s", self.device, e)
        self._buf = None
        try:
            self._mm.close()
        except BufferError:
            pass


class CudaAttachment:
    def __init__(self, layout: Layout, engine: str, handles: dict, fence: EventRing | None,
                 fds: dict[str, int] | None = None, engine_slab=None):
        """``fds``: descriptors from the daemon's fd socket by name (the caller closes
        them). ``engine_slab``: the engine-owned slab this rank attached with (then
        ``slab`` is None)."""
        import torch  # noqa: PLC0415

        self.layout, self.engine, self.handles = layout, engine, handles
        self.device = device_for_bus_id(handles["bus_id"])
        self.torch_device = torch.device("cuda", self.device)
        R, B, K = handles["ring_depth"], handles["max_batch"], handles["top_k"]
        sweep_left_mapped()  # a lost daemon's arena whose waits have ended since
        self._arena = ImportedArena(handles["arena_handle"], handles["arena_bytes"], self.device)
        self._events = None
        try:
            self._open_rest(layout, handles, fence, fds, engine_slab, R, B, K)
        except BaseException:
            if self._events is not None:
                self._events.close()
            self._arena.close()  # nothing of it is in use yet
            raise

    def _open_rest(self, lay, handles, fence, fds, engine_slab, R, B, K) -> None:
        """Everything of __init__ after the arena is mapped (which it unmaps on a failure here)."""
        self.engine_slab = engine_slab if handles.get("engine_slab") else None
        self.slab = None if self.engine_slab is not None else self._arena.torch(handles["slab_offset"], lay.slab_shape)
        self.staging = self._arena.torch(handles["staging_offset"], lay.staging_shape) if lay.staging_rows else None
        self._slots = self._arena.torch(handles["slots_offset"], (R, B, K), "int32")
        self._misses = self._arena.torch(handles["misses_offset"], (R, B), "int32")
        self._events = ImportedEvents(handles["events"], self.device)
        self._fence = fence
        self._views: dict[tuple[int, int, int], tuple] = {}
        self._blocks_mm = None
        self._registered = None  # _RegisteredBlocks, at the first top-k copied from the GPU
        self._register_failed = False
        self.error_mirror = None  # the rank's pinned error record (in the blocks file)
        self.stop_mirror = None  # a doorbell rank's stop word's host copy (in the blocks file)
        self._next = 0
        self._used = [False] * R
        self._seq = 0
        # Device wait: per ring entry, the daemon's done word and how many TOPKs went on it.
        off = handles.get("done_offset")
        self._done_base = None if off is None else self._arena.ptr + int(off)
        self._done_sent = [0] * R
        self._release_stream = None
        self._release_lock = threading.Lock()  # the watcher's thread and the caller's
        # The rank's pinned step blocks (without them top-k batches go as arrays).
        fd = (fds or {}).get(handles.get("blocks_fd"))
        if fd is None and fds and handles.get("blocks_fd"):  # (Client.attach says why when none came)
            log.warning("the daemon's step blocks did not come; sending top-k batches on the socket")
        if fd is not None:
            self._blocks_mm = mmap.mmap(fd, handles["blocks_bytes"], mmap.MAP_SHARED,
                                        mmap.PROT_READ | mmap.PROT_WRITE)
            buf = np.frombuffer(self._blocks_mm, dtype=np.uint8)
            n = handles["block_ints"] * 4

            def view(off):
                return BlockView(buf[off: off + n].view(np.int32), B)

            if "err_offset" in handles:
                off = handles["err_offset"]
                self.error_mirror = buf[off: off + 128].view(np.int32)
            off = (handles.get("doorbell") or {}).get("stopped_host_offset")
            if off is not None:
                self.stop_mirror = buf[off: off + 4].view(np.int32)
            self._step_blocks = [view(o) for o in handles["client_step_offsets"]]
            self._topk_blocks = [view(o) for o in handles["client_topk_offsets"]]
        blocks = self._blocks_mm is not None
        self.caps = AttachmentCaps(device=True, fenced=fence is not None, step_blocks=blocks,
                                   done_words=blocks and self._done_base is not None)

    @property
    def takes_device_topk(self) -> bool:
        """Whether a top-k on the GPU can go as it is (:meth:`write_blocks`): step blocks,
        fence events, and the blocks page-locked in this process (tried at the first call;
        a failure is logged once and the top-k then goes through the host)."""
        if self._blocks_mm is None or self._fence is None or self._register_failed:
            return False
        if self._registered is None:
            try:
                self._registered = _RegisteredBlocks(self._blocks_mm, self.device)
            except Exception as e:  # noqa: BLE001 - any CUDA error: the host path still works
                self._register_failed = True
                log.warning("cuda:%d: could not page-lock the step blocks in this process (%s); top-k tensors "
                            "on the GPU go through the host", self.device, e)
                return False
        return True

    def next_done(self, entry: int) -> int:
        """The done value of the next TOPK on ``entry`` (a per-entry count, mod 2**32)."""
        self._done_sent[entry] = (self._done_sent[entry] + 1) & 0xFFFFFFFF
        return self._done_sent[entry]

    def result_after(self, entry: int, batch: int, k: int, done: int):
        """Like :meth:`result`, but the current stream waits until the entry's done word
        (set by the daemon after the TOPK's work) has reached ``done``: no reply needed."""
        wait32_geq(self._stream_ptr(), self._done_base + 4 * int(entry), done)
        return self._views_of(entry, batch, k)

    def release_done(self) -> int:
        """Once the daemon is gone (a reply does not mean the work ran): for every entry a
        device-wait TOPK used, empty its result, then set its done word to its last value on
        a side stream, so that a waiting stream goes on and reads no row. Returns their count."""
        waits = [(e, n) for e, n in enumerate(list(self._done_sent)) if n]
        if not waits or self._slots is None:
            return 0
        import cupy as cp  # noqa: PLC0415

        with self._release_lock, cp.cuda.Device(self.device):
            if self._release_stream is None:
                self._release_stream = cp.cuda.Stream(non_blocking=True)
            s = self._release_stream.ptr
            for entry, done in waits:
                slots, misses = self._slots[entry], self._misses[entry]
                cp.cuda.runtime.memsetAsync(slots.data_ptr(), 0xFF, slots.numel() * 4, s)
                cp.cuda.runtime.memsetAsync(misses.data_ptr(), 0, misses.numel() * 4, s)
                write32(s, self._done_base + 4 * int(entry), done)
        return len(waits)

    def next_entry(self) -> int:
        """The entry the next :meth:`write_blocks` should use (round robin)."""
        e = self._next
        self._next = (e + 1) % len(self._used)
        return e

    def write_blocks(self, e: int, step: int, group: int, state_rows, topk, begin=None, still_there=None,
                     timeout_s: float | None = None) -> int:
        """Write a TOPK (and, with ``begin`` = (reset, invalidate), its STEP) into entry
        ``e``'s pinned blocks; return ``e``. The caller has the entry's last reply; its GPU
        work must be done too (:meth:`_wait_event`: a dead daemon's event may never end)."""
        if self._used[e] and not self._events.done(e):
            self._wait_event(e, still_there, timeout_s)
        self._used[e] = True
        self._seq += 1
        if begin is not None:
            write_step(self._step_blocks[e], self._seq, step, state_rows, begin[0], begin[1])
        blk = self._topk_blocks[e]
        if isinstance(topk, np.ndarray):
            write_topk(blk, self._seq, step, group, state_rows, topk)
        else:
            write_topk_head(blk, self._seq, step, group, state_rows, *topk.shape)
            self._copy_from_device(blk.payload, topk)
        return e

    def _copy_from_device(self, dst, topk) -> None:
        """Enqueue the copy of ``topk`` (torch int32, contiguous, on this rank's GPU) into
        the front of ``dst`` (a view of the step blocks) on the current stream; the caller
        records the fence after it."""
        import cupy as cp  # noqa: PLC0415

        if not self.takes_device_topk:  # (it page-locks the blocks: a caller asked it first)
            raise SparseKVError(f"cuda:{self.device}: this rank cannot take a top-k from the GPU; copy it to the host")
        n = int(topk.numel()) * 4
        with cp.cuda.Device(self.device):
            cp.cuda.runtime.memcpyAsync(int(dst.ctypes.data), int(topk.data_ptr()), n, 2,  # device to host
                                        self._stream_ptr())

    def _wait_event(self, e: int, still_there, timeout_s: float | None = None) -> None:
        """Poll entry ``e``'s event until it is done, with ``still_there()`` (raises once
        the daemon is gone) every ``EVENT_CHECK_S``; DaemonUnavailable after ``timeout_s``."""
        t0 = time.monotonic()
        nap, next_check = 20e-6, t0 + EVENT_CHECK_S
        while not self._events.done(e):
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                raise DaemonUnavailable(f"sparsekvd's GPU work for ring entry {e} did not finish within {timeout_s} s")
            time.sleep(nap)
            nap = min(nap * 2, 1e-3)
            if still_there is not None and time.monotonic() >= next_check:
                still_there()
                next_check = time.monotonic() + EVENT_CHECK_S

    def _stream_mark(self):
        """An event recorded on the current stream: done once its work so far is."""
        import torch  # noqa: PLC0415

        mark = torch.cuda.Event()
        mark.record(torch.cuda.current_stream(self.torch_device))
        return mark

    def _stream_done_within(self, wait_s: float) -> bool:
        """Whether the current stream's work so far ends within ``wait_s`` seconds (polled)."""
        done = self._stream_mark()
        deadline = time.monotonic() + wait_s
        while not done.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def _stream_ptr(self) -> int:
        import torch  # noqa: PLC0415

        return torch.cuda.current_stream(self.device).cuda_stream

    def next_fence(self) -> int | None:
        """The index :meth:`record_fence` records next (None: no fence events)."""
        return None if self._fence is None else self._fence.next

    def record_fence(self) -> int | None:
        """Record the next fence event on the current stream; its index goes with TOPK."""
        if self._fence is None:
            return None
        import cupy as cp  # noqa: PLC0415

        k = self._fence.take()
        with cp.cuda.Device(self.device):
            cp.cuda.runtime.eventRecord(self._fence.events[k].ptr, self._stream_ptr())
        return k

    def result(self, entry: int, batch: int, k: int):
        """Make the current stream wait for ring ``entry``; return its slots and misses
        (torch int32 views, valid until ``ring_depth`` more top-k requests)."""
        self._events.wait(entry, self._stream_ptr())
        return self._views_of(entry, batch, k)

    def _views_of(self, entry: int, batch: int, k: int) -> TopkResult:
        key = (entry, batch, k)
        views = self._views.get(key)
        if views is None:  # torch slicing costs ~10 us a view: make each shape once
            if len(self._views) > 4096:
                self._views.clear()
            views = self._views[key] = (self._slots[entry, :batch, :k], self._misses[entry, :batch])
        return TopkResult(views[0], views[1], None, None)

    def close(self, wait_s: float | None = None) -> None:
        """Forget the rank's memory once the GPU is done with it: all of this device's work
        (``wait_s`` None), or the current stream's for at most ``wait_s`` seconds once the
        daemon is gone; else the arena stays mapped (warned) rather than a late kernel faulting."""
        if self._arena is not None and wait_s is not None and not self._stream_done_within(wait_s):
            log.warning("cuda:%d: work on the current stream still waits on sparsekvd (gone) after %.0f s; "
                        "its memory stays mapped in this process until that work ends", self.device, wait_s)
            _left_mapped.append((self._arena, self._stream_mark()))  # unmapped by a later sweep
            self._arena = None  # never unmapped under work that may still run
        if self._arena is not None and wait_s is None:  # (with wait_s: the stream's work has ended, above)
            import torch  # noqa: PLC0415

            torch.cuda.synchronize(self.torch_device)
        self.slab = self.staging = self._slots = self._misses = None
        self._views = {}
        self._step_blocks = self._topk_blocks = self.error_mirror = self.stop_mirror = None
        if self._registered is not None:  # copies from the GPU may still be queued into them
            if self._arena is None:  # work on the stream still waits: closed by a later sweep
                _left_mapped.append((self._registered, _left_mapped[-1][1]))
            else:
                self._registered.close()
            self._registered = self._blocks_mm = None
        if self._blocks_mm is not None:
            try:
                self._blocks_mm.close()
            except BufferError:
                pass
            self._blocks_mm = None
        if self._events is not None:
            self._events.close()
            self._events = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None
