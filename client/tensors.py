"""What an argument is when it may be a torch tensor, asked without importing torch (a
tensor implies torch is imported already: ``sys.modules`` answers)."""

from __future__ import annotations

import sys

from sparsekv.proto import LIMITS, ErrorCode, MsgType
from sparsekv.proto.args import (INT32_MAX, carried_number, int32_array, layer_numbers, layers_in, repeated,
                                 reset_flags, whole_number)

from .errors import BadRequest, DaemonUnavailable, SparseKVError


def is_torch(a) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(a, torch.Tensor)


def on_gpu(a) -> bool:
    """A CUDA tensor: copying it to the host waits for the current stream."""
    return is_torch(a) and a.is_cuda


def is_int_dtype(dtype) -> bool:
    """Whether a torch dtype holds integers (not floating, complex or bool): what a
    top-k, a block table or request ids must be."""
    return not (dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool")


def device_ids(topk):
    """A top-k tensor on a GPU as a step block takes it: 2-D, int32, contiguous (else
    BadRequest)."""
    if topk.dim() != 2 or not is_int_dtype(topk.dtype):
        raise BadRequest(f"topk must be integers [batch, top_k], got {topk.dtype} {tuple(topk.shape)}",
                         ErrorCode.BAD_ARGUMENT)
    import torch  # noqa: PLC0415 - a tensor was passed

    return topk.to(torch.int32).contiguous()


def host_int32(name: str, a, ndim: int | None = None):
    """``a`` (a NumPy array, a CPU tensor, a list) as a host int32 array (of ``ndim``
    dimensions when given: a scalar is no array of rows), or BadRequest naming it: its
    values must be integers (not floats or bools, which a cast would truncate) within int32
    (not wrapped)."""
    if is_torch(a):
        a = a.detach().cpu().numpy()
    try:
        return int32_array(name, a, ndim)
    except ValueError as e:
        raise BadRequest(str(e), ErrorCode.BAD_ARGUMENT) from None


def host_array(name: str, a, what: str):
    """``np.asarray(a)``, or BadRequest naming ``name`` for what NumPy cannot read as one
    array (a ragged list: NumPy's own ValueError)."""
    import numpy as np  # noqa: PLC0415

    try:
        return np.asarray(a)
    except (TypeError, ValueError, OverflowError) as e:
        raise BadRequest(f"{name} must be {what}: {e}", ErrorCode.BAD_ARGUMENT) from None


def check_prefetch(prefetch) -> None:
    """BadRequest unless ``prefetch`` is True or False (its truth value took "no" for True)."""
    import numpy as np  # noqa: PLC0415

    if type(prefetch) not in (bool, np.bool_):
        raise BadRequest(f"prefetch must be True or False, got {prefetch!r:.40}", ErrorCode.BAD_ARGUMENT)


def check_layout(layout) -> None:
    """``layout`` a :class:`~sparsekv.proto.Layout` with valid fields (``Layout.validate``'s
    LayoutError), or BadRequest: anything else has no fields to send."""
    from sparsekv.proto import Layout  # noqa: PLC0415

    if not isinstance(layout, Layout):
        raise BadRequest(f"layout must be a sparsekv.proto.Layout, got {type(layout).__name__}", ErrorCode.BAD_ARGUMENT)
    layout.validate()


def host_bytes(name: str, a):
    """``a`` as a host uint8 array (a NumPy array, a CPU tensor), or BadRequest: bytes are
    not converted from another dtype (a cast would change the values)."""
    import numpy as np  # noqa: PLC0415

    if is_torch(a):
        a = a.detach().cpu().numpy()
    arr = host_array(name, a, "an array of bytes (uint8)")
    if arr.dtype != np.uint8:
        raise BadRequest(f"{name} must be uint8 (the rows' bytes), got {arr.dtype}: view it as uint8",
                         ErrorCode.BAD_ARGUMENT)
    return arr


def layers_arg(layers) -> list[int]:
    """A request's ``layers`` as a list of ints (BadRequest for a float, bool or text: a
    cast would take 1.9 for layer 1)."""
    try:
        return list(layer_numbers(layers))
    except ValueError as e:
        raise BadRequest(str(e), ErrorCode.BAD_ARGUMENT) from None


def whole(name: str, v, carried: bool = False) -> int:
    """An exact integer argument (BadRequest for a float, bool or text: a cast took 1.9 for 1);
    with ``carried``, one a request can carry (``proto.args.carried_number``)."""
    try:
        return (carried_number if carried else whole_number)(name, v)
    except ValueError as e:
        raise BadRequest(str(e), ErrorCode.BAD_ARGUMENT) from None


def reset_arg(reset):
    """``reset`` as a bool array [batch] (``reset_flags``: a cast made 2, NaN and 0.5 resets)."""
    try:
        r = reset_flags(reset)
    except ValueError as e:
        raise BadRequest(str(e), ErrorCode.BAD_ARGUMENT) from None
    if r.ndim != 1:
        raise BadRequest(f"reset must have 1 dimension(s), got shape {r.shape}", ErrorCode.BAD_ARGUMENT)
    return r


def check_batch(att, rows, topk, begin) -> None:
    """Shapes only (the daemon's kernels check every value), before a block is written."""
    lay = att.layout
    if rows.ndim != 1 or topk.ndim != 2 or topk.shape[0] != rows.shape[0]:
        raise BadRequest(f"state_rows must be [batch] and topk [batch, top_k]; got {rows.shape} and {topk.shape}",
                         ErrorCode.BAD_ARGUMENT)
    if topk.shape[1] > lay.top_k:
        raise BadRequest(f"topk has {topk.shape[1]} columns, layout top_k is {lay.top_k}", ErrorCode.BAD_ARGUMENT)
    if rows.shape[0] > lay.max_batch:
        raise BadRequest(f"batch {rows.shape[0]} exceeds max_batch {lay.max_batch} of the layout", ErrorCode.TOO_LARGE)
    if begin is not None:  # (the step's reset and invalidate fit its batch: step_arrays)
        inv = begin[1]
        if inv is not None and inv.shape[1] > lay.top_k:
            raise BadRequest(f"invalidate must be [batch, n <= top_k], got {inv.shape}", ErrorCode.BAD_ARGUMENT)


def write_in_parts(call, att, layers, rows, data, settle=None) -> dict:
    """WRITE ``rows`` (int32 [n]) of ``data`` (uint8 [layers, n, row_bytes]) through ``call``
    (a client's request call), ``att`` the client's attachment or None: one request when it
    fits one frame, else several of whole rows, in order, once the whole is checked as the
    daemon checks each part (a part refused half way would leave the parts before it
    written), and once ``settle`` (the client's flush) has raised any earlier request's
    error (else one could come out of a part's call, after that part was written); the
    replies' counts summed. With a block store a later part may still be refused for rows
    outside the client's own blocks: the parts before it went into its own, and the error
    (a part's: not DaemonUnavailable, after which a part sent may or may not have run)
    says how many rows that was (``written_rows``)."""
    per_row = data.nbytes // max(1, data.shape[1]) if data.ndim == 3 else 0
    if not per_row or (data.nbytes <= LIMITS.max_frame_bytes and rows.shape[0] <= LIMITS.max_write_rows):
        return call(MsgType.WRITE, {"layers": layers}, {"rows": rows, "data": data})[0]
    n_layers = att.layout.num_layers if att is not None and layers is None else len(layers or ())
    if data.shape[1] != rows.shape[0] or (n_layers and data.shape[0] != n_layers):
        raise BadRequest(f"data must be [{n_layers or 'layers'}, {rows.shape[0]}, row_bytes] for {rows.shape[0]} "
                         f"rows, got {list(data.shape)}", ErrorCode.BAD_ARGUMENT)
    if att is not None:
        check_split_write(att.layout, layers, rows, data)
    if (twice := repeated(rows)) is not None:  # (the daemon sees one part at a time)
        raise BadRequest(f"a write names host row {twice} more than once: name each row once", ErrorCode.BAD_ARGUMENT)
    if settle is not None:
        settle()
    step = max(1, min(LIMITS.max_frame_bytes // per_row, LIMITS.max_write_rows))
    total: dict = {}
    for i in range(0, rows.shape[0], step):
        try:
            part = call(MsgType.WRITE, {"layers": layers}, {"rows": rows[i:i + step], "data": data[:, i:i + step]})[0]
        except SparseKVError as e:
            if isinstance(e, DaemonUnavailable):
                raise
            e.written_rows = i
            if i:
                e.args = (f"{e.args[0]} (the write's first {i} rows, its parts before this one, were written)",
                          *e.args[1:])
            raise
        for k, v in part.items():
            total[k] = total.get(k, 0) + v if isinstance(v, int) else v
    return total


def check_split_write(lay, layers, rows, data) -> None:
    """What the daemon checks of each part of a write (``EngineSpace.check_write``), checked
    for the whole before the first part is sent: the layers, every row in the pool, the
    rows' bytes."""
    if layers is not None:
        try:
            layers_in(layers, lay.num_layers)
        except ValueError as e:
            raise BadRequest(str(e), ErrorCode.BAD_ARGUMENT) from None
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= lay.host_rows):
        raise BadRequest(f"write rows must lie in [0, {lay.host_rows})", ErrorCode.BAD_ARGUMENT)
    if data.shape[2] != lay.row_bytes:
        raise BadRequest(f"write data must be uint8 [{data.shape[0]}, {rows.shape[0]}, {lay.row_bytes}], got "
                         f"{data.dtype} {list(data.shape)}", ErrorCode.BAD_ARGUMENT)


def step_arrays(state_rows, reset=None, invalidate=None) -> dict:
    """A STEP's arrays, checked: ``state_rows`` int32 [batch], ``reset`` bool [batch],
    ``invalidate`` int32 [batch, n] (a reset or invalidate of another batch would have the
    TOPK the STEP rides on refused, neither running)."""
    arrays = {"state_rows": host_int32("state_rows", state_rows, 1)}
    batch = arrays["state_rows"].shape
    if reset is not None:
        arrays["reset"] = reset_arg(reset)
        if arrays["reset"].shape != batch:
            raise BadRequest(f"reset must be [batch]={batch}, got {arrays['reset'].shape}", ErrorCode.BAD_ARGUMENT)
    if invalidate is not None:
        arrays["invalidate"] = host_int32("invalidate", invalidate, 2)
        if arrays["invalidate"].shape[0] != batch[0]:
            raise BadRequest(f"invalidate must be [batch, n] with batch {batch[0]}, got {arrays['invalidate'].shape}",
                             ErrorCode.BAD_ARGUMENT)
    # Copies: the STEP is sent later (with the step's first request), and the caller may
    # reuse its arrays meanwhile.
    return {name: a.copy() for name, a in arrays.items()}
