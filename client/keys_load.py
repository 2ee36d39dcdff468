"""``Client.blocks.load_keys``: the daemon copies blocks' indexer keys straight into a
buffer of the engine (BLOCK_LOAD_KEYS, DESIGN §9), block ``i`` of the list at byte ``i *
block_bytes`` (each block's ``[layers, block_size, index_bytes]``, as ``read_keys``
returns them), with no copy through the socket.

cuda rank: ``dst`` is a contiguous torch tensor on the rank's GPU, memory of ``cudaMalloc``
(torch's default allocator, not ``expandable_segments``), exported through CUDA IPC with
each call. The daemon imports an allocation once and keeps it while the rank is attached
(at most ``LIMITS.max_keys_targets``, 8, a rank: load into buffers the engine keeps), and
this client keeps a reference to the last tensor loaded into each, so that torch frees
none of them meanwhile (the daemon must close its mapping first).
The copies (one ``cudaMemcpyAsync`` a run of consecutive blocks, on the daemon's bulk
stream of the GPU) start after the work queued so far on the current stream (a fence event: attach
with ``fence=True``), and the current stream waits on the daemon's event behind them
before anything enqueued after ``load_keys`` returns; the host waits for the reply only,
never for the copies.

cpu rank: ``dst`` is an ``EngineSlab.shared_memory`` buffer (the cpu backend's stand-in
for device memory), deposited on the daemon's fd socket for the call; the bytes are there
when ``load_keys`` returns.
"""

from __future__ import annotations

import os

import numpy as np

from sparsekv.proto import LIMITS, ErrorCode, MsgType, ProtocolError
from sparsekv.proto import fd_socket
from sparsekv.proto.cuda_ipc import ImportedEvents, export_buffer

from .engine_slab import EngineSlab
from .errors import BadRequest, DaemonUnavailable, error_for


class KeysLoader:
    """A client's BLOCK_LOAD_KEYS: its checks, its ``dst`` field, the wait on the daemon's
    event (imported once a handle). ``close`` once the rank is detached (the daemon has
    closed its mappings of the tensors kept here)."""

    def __init__(self, client):
        self._client = client
        self._events: dict[bytes, ImportedEvents] = {}
        self._targets: dict[bytes, object] = {}  # IPC handle -> the last tensor loaded into its allocation

    def __call__(self, blocks: np.ndarray, need: int, dst) -> dict:
        """Load the keys of ``blocks`` (``need`` bytes) into ``dst``; returns the reply
        (``bytes``, ``copies``). BadRequest before anything is sent or allocated."""
        c = self._client
        att = c.attachment
        if att is None:
            raise BadRequest("load_keys needs an attached rank", ErrorCode.NOT_ATTACHED)
        c._settle_steps()  # before the buffer is deposited or a fence recorded for a request that would not go
        if not c.device.startswith("cuda"):
            return self._load_shared(blocks, need, dst)
        import torch  # noqa: PLC0415  (cuda ranks only)

        if not isinstance(dst, torch.Tensor) or not dst.is_cuda or not dst.is_contiguous():
            raise BadRequest("a cuda rank loads keys into a contiguous torch tensor on its GPU",
                             ErrorCode.BAD_ARGUMENT)
        if dst.device != att.torch_device:
            raise BadRequest(f"dst is on {dst.device}, this rank on {att.torch_device}", ErrorCode.BAD_ARGUMENT)
        nbytes = dst.numel() * dst.element_size()
        _check_size(need, nbytes)
        if att.next_fence() is None:
            raise BadRequest("a keys load is ordered after the engine's stream by a fence event: attach with "
                             "fence=True", ErrorCode.BAD_ARGUMENT)
        try:
            ex = export_buffer(dst.data_ptr(), nbytes, att.device)
        except (ValueError, RuntimeError) as e:  # not cudaMalloc memory (expandable_segments), ...
            raise BadRequest(f"cannot export dst through CUDA IPC: {e}", ErrorCode.BAD_ARGUMENT) from None
        if ex["ipc_handle"] not in self._targets and len(self._targets) >= LIMITS.max_keys_targets:
            raise BadRequest(f"this rank has loaded keys into {LIMITS.max_keys_targets} GPU allocations already "
                             "(each stays mapped by the daemon while attached): load into buffers you keep",
                             ErrorCode.BAD_ARGUMENT)
        self._targets[ex["ipc_handle"]] = dst  # the daemon may map its allocation from now on
        c._await_fence_free(att)
        fence = att.record_fence()  # the copies start after the work queued so far
        reply, _ = c._call(MsgType.BLOCK_LOAD_KEYS, {"dst": {"ipc_handle": ex["ipc_handle"], "offset": ex["ipc_offset"],
                                                             "bytes": nbytes, "bus_id": ex["bus_id"]},
                                                     "fence": fence}, {"blocks": blocks})
        handle = reply.pop("event")
        events = self._events.get(handle)
        if events is None:
            events = self._events[handle] = ImportedEvents([handle], att.device)
        events.wait(0, torch.cuda.current_stream(att.torch_device).cuda_stream)
        return reply

    def _load_shared(self, blocks: np.ndarray, need: int, dst) -> dict:
        c = self._client
        if not isinstance(dst, EngineSlab) or dst.cuda or dst.fd < 0:
            raise BadRequest("a cpu rank loads keys into shared memory: EngineSlab.shared_memory(nbytes)",
                             ErrorCode.BAD_ARGUMENT)
        _check_size(need, dst.nbytes)
        try:
            dep = fd_socket.deposit_fd(os.path.join(c.run_dir, fd_socket.FD_SOCKET), dst.fd)
        except ProtocolError as e:
            raise error_for(e.code, f"the daemon refused the keys buffer: {e.args[0]}") from None
        except OSError as e:
            raise DaemonUnavailable(f"cannot give the keys buffer to sparsekvd at {c.run_dir}: {e}") from None
        return c._call(MsgType.BLOCK_LOAD_KEYS, {"dst": {"deposit": dep, "offset": 0, "bytes": dst.nbytes}},
                       {"blocks": blocks})[0]

    def close(self) -> None:
        self._targets = {}
        events, self._events = self._events, {}
        for e in events.values():
            e.close()


def _check_size(need: int, have: int) -> None:
    if need > have:
        raise BadRequest(f"the keys take {need} bytes; dst has {have}", ErrorCode.BAD_ARGUMENT)
