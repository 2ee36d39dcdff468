"""CUDA backend: the residency contract (``residency.py``) and the byte mover
(``mover.py``) as kernels of ``csrc/``, with the interfaces and exact semantics of
``cpu.py``; ``device.py``: what they share. Importing this package needs no GPU.
"""

from .device import (  # noqa: F401 - the backend's public names
    COUNTERS_PER_GROUP,
    E_CORRUPT_STATE,
    E_DUPLICATE_IDS,
    E_TOO_MANY_TOKENS,
    ERR_BAD_STATE_ROW,
    ERR_CORRUPT_STATE,
    ERR_DUPLICATE_IDS,
    ERR_INTS,
    HITS,
    MISSES,
    OUT_OF_RANGE,
    PF_COUNTERS,
    PF_HITS,
    PF_PREFETCHED,
    PF_WASTED,
    error_bits,
    fresh_marks,
    make_desc,
    prefetch_workspace_bytes,
    resolve_workspace_bytes,
    rows_block,
)
from .mover import CudaMover, DeviceBuffers, SlabTarget, allocate_device_buffers  # noqa: F401
from .residency import CudaResidency  # noqa: F401
