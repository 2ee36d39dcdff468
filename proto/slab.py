"""Where a rank's hot rows live in a buffer the engine allocated (an engine-owned slab).

By default the daemon allocates a rank's hot slab (``Layout.slab_shape``, contiguous). An
engine that keeps its hot region inside its own KV cache (so that one attention call reads
hot and resident rows through one index array) brings the buffer instead, and describes
it with a :class:`SlabGeometry`: the hot rows of one layer, ``h = req * region_stride +
slot``, are cut into blocks of ``block_rows`` rows, so hot row ``h`` of layer ``l`` is at
byte ``layer_offsets[l] + (h // block_rows) * block_stride + (h % block_rows) * row_bytes``.

A cache ``[num_blocks, block_size, row]`` per layer whose hot region is the blocks from
``first`` on gives ``layer_offsets[l] = base_l + first * block_stride`` and ``block_stride
= block_size * row_bytes`` (:meth:`SlabGeometry.paged`); the engine then indexes hot row
``h`` as ``first * block_size + h`` (``swap_in``'s ``hot_base``). A cache with a layer (or
K and V) inside each block has a larger ``block_stride``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .layout import ROW_ALIGN_BYTES, Layout, LayoutError

MAX_SLAB_BLOCKS = 1 << 22  # layers * blocks a geometry may describe (the overlap check sorts them)
MAX_BUFFER_BYTES = 1 << 50  # an engine's slab buffer at most (1 PiB): every offset then fits int64 with room


def _exact(v):
    return int(v) if isinstance(v, np.integer) else v


@dataclass(frozen=True)
class SlabGeometry:
    """Where an engine-owned slab's hot rows are (the formula: module docstring).
    ``block_rows`` must divide ``max_reqs * region_stride``; ``buffer_bytes`` is the size of
    the buffer the ``layer_offsets`` are in."""

    layer_offsets: tuple[int, ...]
    block_rows: int
    block_stride: int
    buffer_bytes: int

    def __post_init__(self) -> None:
        # NumPy integers as Python ints: fixed-width arithmetic on them wraps (an int16
        # block_rows times 1 KiB rows was 0 bytes a block); anything else stays as given,
        # for check() to name.
        object.__setattr__(self, "layer_offsets", tuple(_exact(o) for o in self.layer_offsets))
        for name in ("block_rows", "block_stride", "buffer_bytes"):
            object.__setattr__(self, name, _exact(getattr(self, name)))

    @classmethod
    def paged(cls, layout: Layout, layer_bases, first_block: int, block_size: int, block_stride: int | None = None,
              buffer_bytes: int = 0) -> "SlabGeometry":
        """A paged cache: layer ``l``'s blocks start at byte ``layer_bases[l]``, block ``b``
        at ``+ b * block_stride`` (default ``block_size * row_bytes``); the hot region is
        the blocks from ``first_block`` on."""
        stride = block_size * layout.row_bytes if block_stride is None else int(block_stride)
        return cls(tuple(int(b) + first_block * stride for b in layer_bases), int(block_size), stride,
                   int(buffer_bytes))

    def is_linear(self, layout: Layout) -> bool:
        """Whether a layer's hot rows follow each other (blocks without gaps)."""
        return self.block_stride == self.block_rows * layout.row_bytes or \
            self.block_rows == layout.max_reqs * layout.region_stride

    def blocks(self, layout: Layout) -> int:
        """Blocks of one layer's hot rows."""
        return layout.max_reqs * layout.region_stride // self.block_rows

    def row_offsets(self, layout: Layout, layer: int, rows) -> np.ndarray:
        """Byte offsets of hot rows ``rows`` (int array) of ``layer``."""
        h = np.asarray(rows, dtype=np.int64)
        return self.layer_offsets[layer] + (h // self.block_rows) * self.block_stride \
            + (h % self.block_rows) * layout.row_bytes

    def check(self, layout: Layout, align: int = ROW_ALIGN_BYTES) -> "SlabGeometry":
        """Raise :class:`LayoutError` naming the fault unless every hot row of every layer
        lies inside the buffer, no two overlap, and (``align`` > 1) every row starts on an
        ``align``-byte boundary (the GPU's copies need 16). Returns self: the daemon then
        writes exactly these rows and nothing else of the engine's memory."""
        L, rb = layout.num_layers, layout.row_bytes
        rows = layout.max_reqs * layout.region_stride

        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise LayoutError(f"slab geometry: {msg}")

        for name in ("block_rows", "block_stride", "buffer_bytes"):
            v = getattr(self, name)
            need(isinstance(v, (int, np.integer)) and not isinstance(v, bool), f"{name} must be an integer, got {v!r}")
        need(len(self.layer_offsets) == L, f"layer_offsets has {len(self.layer_offsets)} entries, the layout "
             f"{L} layers")
        need(all(isinstance(o, (int, np.integer)) and not isinstance(o, bool) and o >= 0
                 for o in self.layer_offsets), "layer_offsets must be integers >= 0")
        need(self.block_rows >= 1, f"block_rows must be >= 1, got {self.block_rows}")
        need(rows % self.block_rows == 0, f"block_rows {self.block_rows} must divide the hot rows of a layer "
             f"(max_reqs * region_stride = {rows})")
        need(self.block_stride >= self.block_rows * rb or rows == self.block_rows,
             f"block_stride {self.block_stride} is less than a block ({self.block_rows} rows of {rb} bytes)")
        need(0 < self.buffer_bytes <= MAX_BUFFER_BYTES,
             f"buffer_bytes must be in [1, {MAX_BUFFER_BYTES}], got {self.buffer_bytes}")
        need(0 <= self.block_stride <= self.buffer_bytes,
             f"block_stride {self.block_stride} must be in [0, buffer_bytes {self.buffer_bytes}]")
        if align > 1:
            need(rb % align == 0, f"row_bytes {rb} must be a multiple of {align}")
            need(self.block_stride % align == 0, f"block_stride {self.block_stride} must be a multiple of {align}")
            need(all(o % align == 0 for o in self.layer_offsets), f"layer_offsets must be multiples of {align}")
        nb = rows // self.block_rows
        need(L * nb <= MAX_SLAB_BLOCKS, f"{L} layers of {nb} blocks: more than {MAX_SLAB_BLOCKS} blocks; use "
             "larger blocks")
        block_bytes = self.block_rows * rb
        # Each layer's last byte in exact integers first: every offset is then in [0,
        # buffer_bytes], so the int64 arithmetic below cannot wrap (a wrapped start once
        # passed both checks and pointed before the buffer).
        span = (nb - 1) * int(self.block_stride) + block_bytes
        for layer, o in enumerate(self.layer_offsets):
            end = int(o) + span
            need(end <= self.buffer_bytes, f"layer {layer}'s hot rows reach byte {end}, past the buffer's "
                 f"{self.buffer_bytes}")
        starts = (np.asarray(self.layer_offsets, np.int64)[:, None]
                  + np.arange(nb, dtype=np.int64)[None, :] * np.int64(self.block_stride)).ravel()
        order = np.sort(starts)
        if order.size > 1:
            gap = np.diff(order)
            bad = np.flatnonzero(gap < block_bytes)
            need(bad.size == 0, f"hot blocks overlap (at byte {int(order[bad[0]]) if bad.size else 0}: blocks of "
                 f"{block_bytes} bytes start {int(gap[bad[0]]) if bad.size else 0} bytes apart)")
        return self

    def to_wire(self) -> dict:
        return {"layer_offsets": [int(o) for o in self.layer_offsets], "block_rows": int(self.block_rows),
                "block_stride": int(self.block_stride), "buffer_bytes": int(self.buffer_bytes)}

    @classmethod
    def from_wire(cls, d) -> "SlabGeometry":
        if not isinstance(d, dict):
            raise LayoutError(f"slab geometry must be a map, got {type(d).__name__}")
        try:
            offsets = d["layer_offsets"]
            if not isinstance(offsets, (list, tuple)):
                raise LayoutError("slab geometry: layer_offsets must be a list")
            return cls(tuple(offsets), d["block_rows"], d["block_stride"], d["buffer_bytes"])
        except KeyError as e:
            raise LayoutError(f"slab geometry needs field {e.args[0]!r}") from None
