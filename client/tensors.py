"""What an argument is when it may be a torch tensor, asked without importing torch (a
tensor implies torch is imported already: ``sys.modules`` answers)."""

from __future__ import annotations

import sys

from sparsekv.proto import ErrorCode

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
