"""A rank's shared memory at attach: the engine-owned slab it offers, the descriptors and
the cpu mapping it takes (the cuda side maps in ``cuda_attach.py``)."""

from __future__ import annotations

import mmap
import os

from sparsekv.proto import ErrorCode, Layout, ProtocolError
from sparsekv.proto import fd_socket

from .cuda_attach import local_device
from .errors import BadRequest, DaemonUnavailable, SparseKVError, error_for


def offer_slab(run_dir: str, device: str, layout: Layout, slab) -> dict:
    """The ATTACH field of an engine-owned slab (``EngineSlab``) for a rank on ``device``:
    its geometry, and (cpu) the id of its descriptor deposited on the daemon's fd socket."""
    geo = slab.check(layout)
    if device.startswith("cuda") != slab.cuda:
        raise BadRequest("a cuda rank's engine slab is a GPU tensor (EngineSlab.from_tensor), a cpu rank's "
                         "shared memory (EngineSlab.shared_memory)", ErrorCode.BAD_ARGUMENT)
    if slab.cuda:
        if slab.device != local_device(device):
            raise BadRequest(f"the engine slab is on cuda:{slab.device}, this rank on {device}",
                             ErrorCode.BAD_ARGUMENT)
        ex = slab.export()
        return {"geometry": geo.to_wire(), "ipc_handle": ex["ipc_handle"], "ipc_offset": ex["ipc_offset"]}
    try:
        dep = fd_socket.deposit_fd(os.path.join(run_dir, fd_socket.FD_SOCKET), slab.fd)
    except ProtocolError as e:
        raise error_for(e.code, f"the daemon refused the engine's slab: {e.args[0]}") from None
    except OSError as e:
        raise DaemonUnavailable(f"cannot give the engine's slab to sparsekvd at {run_dir}: {e}") from None
    return {"deposit": dep, "geometry": geo.to_wire()}


def fetch_fds(run_dir: str, handles: dict, timeout_s: float) -> dict[str, int]:
    """The descriptors of the rank's shared memory, by name, from the daemon's fd socket
    for the handles' one-time token (empty without one). The caller closes them."""
    token = handles.get("fd_token")
    if token is None:
        return {}
    path = os.path.join(run_dir, os.path.basename(str(handles.get("fd_socket"))))
    try:
        return fd_socket.fetch_fds(path, str(token), min(timeout_s, 10.0))
    except ProtocolError as e:
        raise error_for(e.code, f"the fd socket {path} refused this process: {e.args[0]}") from None
    except OSError as e:
        raise DaemonUnavailable(f"cannot get the rank's memory from {path}: "
                                f"{e.strerror or type(e).__name__}") from None


def map_shared(handles: dict, fds: dict[str, int]) -> mmap.mmap | None:
    """A cpu rank's memory in the daemon (its slab and staging buffer; with an engine-owned
    slab the staging buffer only, if any), mapped shared; None when there is none.
    SparseKVError when its descriptor did not come."""
    if handles.get("fd") is None and handles.get("engine_slab"):
        return None
    if handles.get("fd") not in fds:
        raise SparseKVError(f"the daemon sent no descriptor {handles.get('fd')!r} for the slab; check the "
                            "client and daemon versions")
    return mmap.mmap(fds[handles["fd"]], max(handles["bytes"], 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
