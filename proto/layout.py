"""The cache layout a client attaches with: a frozen value object shared by both ends."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

MAX_REGION_STRIDE = 32768
MAX_LAYERS = 1024
MAX_REQS = 65536
MAX_BATCH = 65536  # most rows of one top-k batch (Layout.max_batch)
ROW_ALIGN_BYTES = 16  # the cuda backend moves rows with 16-byte loads (it checks this)


class LayoutError(ValueError):
    """The layout is inconsistent; the message names the field at fault."""


@dataclass(frozen=True)
class Layout:
    """Shape of one engine's cache, identical on every tensor-parallel rank.

    Attributes:
        num_layers: attention layers whose KV rows the pool holds.
        row_bytes: bytes of one KV row of one layer (656 for DeepSeek ``fp8_ds_mla``); the
            cuda backend needs a multiple of 16, the cpu backend takes any size.
        top_k: columns of one top-k row.
        region_stride: hot slots per (index group, request state row); ``>= top_k``.
        max_reqs: request state rows (the engine's concurrent requests).
        host_rows: host rows per layer in the pool (token slots of the engine's allocator).
        index_groups: layers sharing one slot assignment, leader first; empty means one
            group per layer. Together the groups name every layer exactly once.
        staging_rows: rows per layer of the prefill staging buffer (0: none).
        max_batch: most rows of one top-k batch (0: ``max_reqs``); device buffers are
            sized by it. Several query tokens of one request need more than ``max_reqs``.
    """

    num_layers: int
    row_bytes: int
    top_k: int
    region_stride: int
    max_reqs: int
    host_rows: int
    index_groups: tuple[tuple[int, ...], ...] = field(default=())
    staging_rows: int = 0
    max_batch: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "index_groups", tuple(tuple(int(x) for x in g) for g in self.index_groups))
        if self.max_batch == 0 and isinstance(self.max_reqs, int):
            object.__setattr__(self, "max_batch", self.max_reqs)

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The index groups, with the one-group-per-layer default made explicit."""
        if self.index_groups:
            return self.index_groups
        return tuple((layer,) for layer in range(self.num_layers))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def pool_bytes(self) -> int:
        """Host bytes this layout needs in the shared pool (all layers)."""
        return self.num_layers * self.host_rows * self.row_bytes

    @property
    def slab_bytes(self) -> int:
        """Bytes of one rank's hot slab: every layer's hot regions."""
        return self.num_layers * self.max_reqs * self.region_stride * self.row_bytes

    @property
    def staging_bytes(self) -> int:
        return self.num_layers * self.staging_rows * self.row_bytes

    @property
    def slab_shape(self) -> tuple[int, int, int, int]:
        return (self.num_layers, self.max_reqs, self.region_stride, self.row_bytes)

    @property
    def staging_shape(self) -> tuple[int, int, int]:
        return (self.num_layers, self.staging_rows, self.row_bytes)

    def split_buffer(self, buf):
        """``(slab, staging or None)`` views of a byte array laid out slab | staging (the
        cpu backend's memfd, mapped by the daemon and the client alike)."""
        slab = buf[: self.slab_bytes].reshape(self.slab_shape)
        if not self.staging_rows:
            return slab, None
        return slab, buf[self.slab_bytes : self.slab_bytes + self.staging_bytes].reshape(self.staging_shape)

    def validate(self) -> "Layout":
        """Raise :class:`LayoutError` naming the first field at fault; return self."""

        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise LayoutError(msg)

        # type() is int, not isinstance(): True is an int to Python, not a layer count.
        for name in ("num_layers", "row_bytes", "top_k", "region_stride", "max_reqs", "host_rows"):
            value = getattr(self, name)
            need(type(value) is int and value > 0, f"{name} must be a positive integer, got {value!r}")
        need(self.row_bytes < 2**31, f"row_bytes {self.row_bytes} must fit in int32")
        need(self.num_layers <= MAX_LAYERS, f"num_layers {self.num_layers} exceeds {MAX_LAYERS}")
        need(self.top_k <= self.region_stride <= MAX_REGION_STRIDE,
             f"region_stride {self.region_stride} must lie in [top_k={self.top_k}, {MAX_REGION_STRIDE}]")
        need(self.max_reqs <= MAX_REQS, f"max_reqs {self.max_reqs} exceeds {MAX_REQS}")
        need(self.host_rows < 2**31 - 1, f"host_rows {self.host_rows} must be below 2**31 - 1")
        need(type(self.staging_rows) is int and 0 <= self.staging_rows < 2**31 - 1,
             f"staging_rows must be an integer in [0, 2**31 - 1), got {self.staging_rows!r}")
        need(type(self.max_batch) is int and 0 < self.max_batch <= MAX_BATCH,
             f"max_batch must lie in [1, {MAX_BATCH}], got {self.max_batch!r}")
        need(self.max_batch * self.top_k < 2**31, f"max_batch * top_k = {self.max_batch * self.top_k} must fit in "
             "int32 (the ids of one top-k batch)")
        seen = sorted(layer for g in self.groups for layer in g)
        need(all(len(g) > 0 for g in self.groups), "index_groups has an empty group")
        need(seen == list(range(self.num_layers)),
             f"index_groups must name every layer 0..{self.num_layers - 1} exactly once")
        return self

    def to_wire(self) -> dict:
        return {**asdict(self), "index_groups": [list(g) for g in self.index_groups]}

    @classmethod
    def from_wire(cls, d: dict) -> "Layout":
        if not isinstance(d, dict):
            raise LayoutError("layout must be a map")
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise LayoutError(f"unknown layout fields: {sorted(unknown)}")
        missing = known - set(d) - {"index_groups", "staging_rows", "max_batch"}
        if missing:
            raise LayoutError(f"layout is missing: {sorted(missing)}")
        raw = d.get("index_groups", ())
        # Exact integers: int() would take 1.5 for 1 and raise OverflowError on inf.
        if not isinstance(raw, (list, tuple)) or not all(
                isinstance(g, (list, tuple)) and all(type(x) is int for x in g) for g in raw):
            raise LayoutError(f"index_groups must be lists of layer numbers, got {str(raw)[:60]}")
        groups = tuple(tuple(g) for g in raw)
        return cls(**{**d, "index_groups": groups}).validate()
