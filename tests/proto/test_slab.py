"""SlabGeometry (proto/slab.py): where an engine-owned slab's hot rows are, and the check
that keeps the daemon's writes inside the engine's buffer and off each other."""

import numpy as np
import pytest

import helpers
from sparsekv.proto.layout import LayoutError
from sparsekv.proto.slab import SlabGeometry

LAY = helpers.layout(num_layers=2, row_bytes=32, top_k=4, region_stride=8, max_reqs=4)  # 32 hot rows per layer


def test_a_paged_cache_with_gaps_maps_rows_block_by_block():
    # [layers][blocks of 4 rows, each block followed by 4 rows of something else]
    g = SlabGeometry.paged(LAY, layer_bases=[0, 4096], first_block=2, block_size=4, block_stride=256,
                           buffer_bytes=8192).check(LAY)
    assert not g.is_linear(LAY) and g.blocks(LAY) == 8
    assert g.row_offsets(LAY, 0, [0, 3, 4, 31]).tolist() == [512, 512 + 96, 768, 512 + 7 * 256 + 96]
    assert g.row_offsets(LAY, 1, [0])[0] == 4096 + 512


@pytest.mark.parametrize("kw,match", [
    (dict(layer_offsets=(0,)), "layer_offsets has 1 entries, the layout 2 layers"),
    (dict(block_rows=3), "block_rows 3 must divide the hot rows"),
    (dict(block_rows=0), "block_rows must be >= 1"),
    (dict(block_stride=64), "block_stride 64 is less than a block"),
    (dict(block_stride=136), "block_stride 136 must be a multiple of 16"),
    (dict(layer_offsets=(0, 4104)), "layer_offsets must be multiples of 16"),
    (dict(layer_offsets=(0, -16)), "layer_offsets must be integers >= 0"),
    (dict(buffer_bytes=4096 + 7 * 256 + 127), "reach byte 6016, past the buffer.s 6015"),
    (dict(layer_offsets=(0, 64)), "hot blocks overlap"),
    (dict(block_rows=True), "block_rows must be an integer"),
])
def test_bad_geometries_are_refused_naming_the_fault(kw, match):
    base = dict(layer_offsets=(0, 4096), block_rows=4, block_stride=256, buffer_bytes=8192)
    base.update(kw)
    with pytest.raises(LayoutError, match=match):
        SlabGeometry(**base).check(LAY)


def test_offsets_that_wrap_int64_are_refused():
    """Starts computed in int64 wrapped: with a stride of 2**63 - d, block 2 of a layer at
    offset d started at -d (before the buffer) and block 1 at a wrapped address, yet the
    largest start and the gaps between sorted starts passed. Each layer's last byte is
    now taken in exact integers, the stride and the buffer bounded first."""
    lay = helpers.layout(num_layers=1, row_bytes=64, top_k=4, region_stride=4, max_reqs=3)
    d = 1 << 20
    wrapped = SlabGeometry((d,), 4, (1 << 63) - d, d + 4 * 64)
    for align in (1, 16):
        with pytest.raises(LayoutError, match="block_stride 9223372036853727232 must be in"):
            wrapped.check(lay, align=align)
    # Values from the wire past int64 are named, not an OverflowError.
    with pytest.raises(LayoutError, match="block_stride 18446744073709551600 must be in"):
        SlabGeometry((0,), 4, (1 << 64) - 16, 1 << 20).check(lay)
    with pytest.raises(LayoutError, match="layer 0's hot rows reach byte 18446744073709552368"):
        SlabGeometry(((1 << 64) - 16,), 4, 256, 1 << 20).check(lay)
    with pytest.raises(LayoutError, match="buffer_bytes must be in"):
        SlabGeometry((0,), 4, 256, 1 << 63).check(lay)
    with pytest.raises(LayoutError, match="block_stride -256 is less than a block"):
        SlabGeometry((1024,), 4, -256, 1 << 20).check(lay)
    one_block = helpers.layout(num_layers=1, row_bytes=64, top_k=4, region_stride=4, max_reqs=1)
    with pytest.raises(LayoutError, match="block_stride -256 must be in"):  # its stride unused, yet bounded
        SlabGeometry((1024,), 4, -256, 1 << 20).check(one_block)
    # Every layer is checked, not only the one that reaches furthest.
    two = helpers.layout(num_layers=2, row_bytes=64, top_k=4, region_stride=4, max_reqs=3)
    with pytest.raises(LayoutError, match="layer 1's hot rows reach byte 1792, past the buffer's 1024"):
        SlabGeometry((0, 1024), 4, 256, 1024).check(two)


def test_narrow_numpy_fields_are_taken_as_exact_integers():
    """An int16 block_rows times 1 KiB rows wrapped to 0 bytes a block: four 64 KiB blocks
    16 bytes apart in a 4 KiB buffer passed (an engine's own process trusts its check)."""
    lay = helpers.layout(num_layers=1, row_bytes=1024, top_k=4, region_stride=64, max_reqs=4)
    g = SlabGeometry((np.int16(0),), np.int16(64), np.int16(16), np.int16(4096))
    assert type(g.block_rows) is int and g == SlabGeometry((0,), 64, 16, 4096)
    with pytest.raises(LayoutError, match="block_stride 16 is less than a block"):
        g.check(lay, align=1)
    with pytest.raises(LayoutError, match="block_rows must be an integer"):
        SlabGeometry((0,), np.bool_(True), 64, 4096).check(lay, align=1)


def test_interleaved_layers_that_do_not_overlap_are_accepted():
    # [blocks][layers][4 rows]: layer 1's block b follows layer 0's block b
    g = SlabGeometry((0, 128), 4, 256, 8 * 256).check(LAY)
    assert g.row_offsets(LAY, 1, [5])[0] == 128 + 256 + 32


def test_wire_round_trip_and_malformed_maps():
    g = SlabGeometry((0, 4096), 4, 256, 8192)
    assert SlabGeometry.from_wire(g.to_wire()) == g
    with pytest.raises(LayoutError, match="needs field 'block_rows'"):
        SlabGeometry.from_wire({"layer_offsets": [0, 1], "block_stride": 1, "buffer_bytes": 1})
    with pytest.raises(LayoutError, match="must be a map"):
        SlabGeometry.from_wire([1, 2])
    with pytest.raises(LayoutError, match="must be a list"):
        SlabGeometry.from_wire({"layer_offsets": 5, "block_rows": 1, "block_stride": 1, "buffer_bytes": 1})
