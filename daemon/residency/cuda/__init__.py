"""CUDA backend: the residency contract and the byte mover as kernels (``csrc/``), with
the same interfaces and exact semantics as ``cpu.py``.

* ``device.py``: the error record and counters, the resolve's output buffers, the
  workspace size, launch helpers;
* ``residency.py``: :class:`CudaResidency` (resolve, reset, invalidate, begin step);
* ``mover.py``: :class:`CudaMover` (gather, staging, write mirror).

``cupy`` is imported lazily: importing this package needs no GPU.
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
    error_bits,
    make_desc,
    resolve_workspace_bytes,
    rows_block,
)
from .mover import CudaMover, DeviceBuffers, allocate_device_buffers  # noqa: F401
from .residency import CudaResidency  # noqa: F401
