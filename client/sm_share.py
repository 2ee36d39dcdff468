"""``leave_sms``: the matmuls an engine launches beside a layer's swap-in leave SMs free
for it.

A layer's rows come in on their own stream while the engine's stream runs what does not
need them (the query's up-projection, say). A cuBLAS matmul of a decode step launches
blocks on every SM, each holding the SM's registers and shared memory whole, so the
swap-in's kernels (one block a token at batch 1) wait for one of those blocks to end
before they start, and again for each kernel of their chain. Inside ``leave_sms(n)``
torch's cuBLASLt matmuls (``torch.mm``, ``torch._scaled_mm``, ``F.linear``) are planned
for all but ``n`` SMs: the swap-in's kernels find those free.

The setting is torch's process-wide SM carveout (``torch._C._set_sm_carveout_experimental``),
read when a matmul is launched or captured into a CUDA graph: wrap the matmuls as the
step is captured; the graph keeps it. The previous setting comes back on leaving,
exceptions included. Not thread-safe (one global setting): wrap launches of one thread.
"""

from __future__ import annotations

from contextlib import contextmanager


def _carveout_api(torch):
    get = getattr(torch._C, "_get_sm_carveout_experimental", None)
    put = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if get is None or put is None:
        raise RuntimeError(f"leave_sms: this torch ({torch.__version__}) has no cuBLAS SM carveout "
                           "(torch._C._set_sm_carveout_experimental)")
    return get, put


def check_sms(n, sm_count: int) -> int:
    """``n`` as SMs to leave on a GPU of ``sm_count``: an int in [0, sm_count); else ValueError."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"leave_sms: SMs to leave must be an int, got {type(n).__name__}")
    if not 0 <= n < sm_count:
        raise ValueError(f"leave_sms: SMs to leave must be in [0, {sm_count}) on this GPU ({sm_count} SMs), got {n}")
    return n


@contextmanager
def leave_sms(n: int, device=None):
    """Within: torch's cuBLASLt matmuls use all but ``n`` SMs of ``device`` (default the
    current CUDA device). ``n = 0``: no carveout (matmuls as torch plans them)."""
    import torch  # noqa: PLC0415 - the cpu client runs without torch

    get, put = _carveout_api(torch)
    sm_count = torch.cuda.get_device_properties(torch.device("cuda") if device is None else device).multi_processor_count
    n = check_sms(n, sm_count)
    before = get()
    put(n or None)
    try:
        yield
    finally:
        put(before)
