"""What an argument is when it may be a torch tensor, asked without importing torch (a
tensor implies torch is imported already: ``sys.modules`` answers)."""

from __future__ import annotations

import sys

from sparsekv.proto import ErrorCode
from sparsekv.proto.args import INT32_MAX, int32_array, layer_numbers, reset_flags, whole_number

from .errors import BadRequest


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


def host_int32(name: str, a):
    """``a`` (a NumPy array, a CPU tensor, a list) as a host int32 array, or BadRequest
    naming it: its values must be integers (not floats or bools, which a cast would
    truncate) within int32 (not wrapped)."""
    if is_torch(a):
        a = a.detach().cpu().numpy()
    try:
        return int32_array(name, a)
    except ValueError as e:
        raise BadRequest(str(e), ErrorCode.BAD_ARGUMENT) from None


def host_bytes(name: str, a):
    """``a`` as a host uint8 array (a NumPy array, a CPU tensor), or BadRequest: bytes are
    not converted from another dtype (a cast would change the values)."""
    import numpy as np  # noqa: PLC0415

    if is_torch(a):
        a = a.detach().cpu().numpy()
    arr = np.asarray(a)
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


def whole(name: str, v) -> int:
    """An exact integer argument (BadRequest for a float, bool or text: a cast took 1.9 for 1)."""
    try:
        return whole_number(name, v)
    except ValueError as e:
        raise BadRequest(str(e), ErrorCode.BAD_ARGUMENT) from None


def reset_arg(reset):
    """``reset`` as a bool array (``reset_flags``: a cast made 2, NaN and 0.5 resets)."""
    try:
        return reset_flags(reset)
    except ValueError as e:
        raise BadRequest(str(e), ErrorCode.BAD_ARGUMENT) from None
