"""One model's connection to sparsekv: the client and its swap-in handle, the host rows
(blocks of ``block_size`` rows, handed to a generation and given back when it ends), and
the calls the cache and the attention make on the handle."""

from __future__ import annotations

import numpy as np
import torch

from sparsekv.client.swap_in import HostSwapIn

from .errors import OutOfRows, UnsupportedModel
from .geometry import Geometry


class Runtime:
    """Args:
        client: a connected, attached sparsekv client (``Client`` on the cpu backend or on
            a cuda rank, or ``embedded.inproc.InprocClient``); the caller owns it.
        geometry: the model's rows (``Geometry.of(model)``), checked against the layout.
        block_size: host rows per block of the allocator (the block table's unit).
        doorbell: the client's rank was attached with ``transport="doorbell"``: use its
            device handle (``client.doorbell_handle()``), every argument a device tensor.
    """

    def __init__(self, client, geometry: Geometry, block_size: int, doorbell: bool = False):
        att = client.attachment
        if att is None:
            raise UnsupportedModel("the sparsekv client is not attached: call client.attach(layout) first, "
                                   "or let enable() attach it")
        geometry.check(att.layout)
        if not (isinstance(block_size, int) and block_size > 0):
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.client, self.geometry, self.layout = client, geometry, att.layout
        self.block_size = block_size
        self.device = torch.device(att.torch_device) if att.caps.device else torch.device("cpu")
        self.doorbell = doorbell
        self.handle = client.doorbell_handle() if doorbell else HostSwapIn(client)
        self._free = list(range(self.layout.host_rows // block_size - 1, -1, -1))  # a stack: low blocks first
        self._kv = [self._typed(self.handle.kv(layer)) for layer in range(geometry.num_layers)]
        self.leaders = {g[0] for g in geometry.groups}
        self.latents: dict[int, torch.Tensor] = {}  # layer -> kv_a_layernorm's output of this forward
        self.active = None  # the cache of the forward running now (set by its update)
        self.in_use = False  # a generation holds the state rows

    def forget_active(self) -> None:
        """A forward begins: no cache runs it until one's update names itself."""
        self.active = None

    def _typed(self, kv) -> torch.Tensor:
        t = kv if isinstance(kv, torch.Tensor) else torch.from_numpy(kv)  # NumPy: a shared view, no copy
        return t.view(self.geometry.dtype)  # [rows, row_dim]

    # -- host rows -------------------------------------------------------------------
    @property
    def free_rows(self) -> int:
        return len(self._free) * self.block_size

    def allocate(self, batch: int, columns: int) -> tuple[np.ndarray, list[int]]:
        """Blocks for ``batch`` sequences of ``columns`` positions each: the block table
        int32 [batch, blocks] and the blocks (give them back with :meth:`release`)."""
        if batch > self.layout.max_reqs:
            raise OutOfRows(f"batch {batch} exceeds the layout's max_reqs {self.layout.max_reqs}: attach with a "
                            f"larger max_batch")
        per_seq = -(-columns // self.block_size)
        need = batch * per_seq
        if need > len(self._free):
            raise OutOfRows(f"{batch} sequence(s) of {columns} positions need {need * self.block_size} host rows "
                            f"per layer; the pool has {self.free_rows} free of {self.layout.host_rows}")
        blocks = [self._free.pop() for _ in range(need)]
        return np.asarray(blocks, dtype=np.int32).reshape(batch, per_seq), blocks

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    # -- the handle ------------------------------------------------------------------
    def begin_step(self, batch: int, reset: bool) -> None:
        rows = np.arange(batch, dtype=np.int32)
        flags = np.full(batch, reset, dtype=bool)
        if self.doorbell:
            self.handle.begin_step(torch.from_numpy(rows).to(self.device), torch.from_numpy(flags).to(self.device))
        else:
            self.handle.begin_step(rows, reset=flags)

    def swap_in(self, positions: torch.Tensor, table, layer: int) -> torch.Tensor:
        """Indices int32 [batch, k] into :meth:`kv` of ``positions`` int32 [batch, k]
        (-1: none) of the sequences in state rows 0..batch-1."""
        reqs = torch.arange(positions.shape[0], dtype=torch.int32, device=positions.device) if self.doorbell \
            else np.arange(positions.shape[0], dtype=np.int32)
        return self.handle.swap_in(reqs, table, positions.contiguous(), layer=layer, block_size=self.block_size)

    def kv(self, layer: int) -> torch.Tensor:
        """The layer's hot rows, typed: [max_reqs * region_stride, row_dim]."""
        return self._kv[layer]

    def write(self, host_rows: np.ndarray, rows: torch.Tensor) -> None:
        """``rows`` [layers, n, row_dim] (every layer's new rows) into ``host_rows`` [n]."""
        data = rows.detach().contiguous().view(torch.uint8).cpu().numpy()
        self.client.write(host_rows.astype(np.int32), data)

    def close(self) -> None:
        if self.doorbell:  # the stream must not wait on a ready word once the handle's watcher stops
            torch.cuda.synchronize(self.device)
        self.handle.close()
