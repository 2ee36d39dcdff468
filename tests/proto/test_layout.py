"""Layout: validation names the field at fault; wire round trip; derived sizes."""

import pytest

from sparsekv.proto import Layout, LayoutError
from sparsekv.proto.layout import MAX_REGION_STRIDE

GOOD = dict(num_layers=4, row_bytes=656, top_k=2048, region_stride=4096, max_reqs=8, host_rows=100_000)


def make(**kw) -> Layout:
    return Layout(**{**GOOD, **kw})


def test_a_good_layout_validates_and_returns_itself():
    lay = make()
    assert lay.validate() is lay


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(num_layers=0), "num_layers"),
        (dict(num_layers=1025), "num_layers"),
        (dict(num_layers="4"), "num_layers"),
        (dict(row_bytes=-16), "row_bytes"),
        (dict(row_bytes=0), "row_bytes"),
        (dict(top_k=0), "top_k"),
        (dict(region_stride=0), "region_stride"),
        (dict(region_stride=2047), "region_stride"),
        (dict(region_stride=MAX_REGION_STRIDE + 1, top_k=16), "region_stride"),
        (dict(max_reqs=0), "max_reqs"),
        (dict(max_reqs=65537), "max_reqs"),
        (dict(host_rows=0), "host_rows"),
        (dict(host_rows=2**31 - 1), "host_rows"),
        (dict(host_rows=2.5), "host_rows"),
        (dict(staging_rows=-1), "staging_rows"),
        (dict(index_groups=((0, 1), (2,))), "index_groups"),
        (dict(index_groups=((0, 1), (1, 2, 3))), "index_groups"),
        (dict(index_groups=((0, 1, 2, 3, 4),)), "index_groups"),
        (dict(index_groups=((0, 1, 2, 3), ())), "index_groups"),
        # a top-k batch's ids counted in int32 on the device (2**31 wrapped: nothing fetched)
        (dict(max_batch=65536, top_k=MAX_REGION_STRIDE, region_stride=MAX_REGION_STRIDE), "max_batch * top_k"),
    ],
)
def test_validation_message_names_the_field(kw, field):
    with pytest.raises(LayoutError) as ei:
        make(**kw).validate()
    assert field in str(ei.value)


def test_region_stride_bounds_are_inclusive():
    make(region_stride=2048).validate()
    make(top_k=16, region_stride=MAX_REGION_STRIDE).validate()
    make(max_batch=65535, top_k=MAX_REGION_STRIDE, region_stride=MAX_REGION_STRIDE).validate()


def test_wire_round_trip():
    lay = make(num_layers=4, index_groups=((0, 1), (2, 3)), staging_rows=64).validate()
    d = lay.to_wire()
    assert d["index_groups"] == [[0, 1], [2, 3]]
    assert Layout.from_wire(d) == lay


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda d: d.update(extra=1), "unknown layout fields: ['extra']"),
        (lambda d: d.pop("top_k"), "layout is missing: ['top_k']"),
        (lambda d: d.update(index_groups=[["a"]]), "index_groups must be lists of layer numbers"),
        (lambda d: d.update(index_groups=5), "index_groups must be lists of layer numbers"),
        (lambda d: d.update(region_stride=1), "region_stride"),
    ],
)
def test_from_wire_rejects_bad_maps_naming_the_field(mutate, words):
    d = make().to_wire()
    mutate(d)
    with pytest.raises(LayoutError) as ei:
        Layout.from_wire(d)
    assert words in str(ei.value)


def test_from_wire_rejects_a_non_map():
    with pytest.raises(LayoutError, match="must be a map"):
        Layout.from_wire([1, 2])


def test_optional_fields_default_on_the_wire():
    d = make().to_wire()
    del d["index_groups"], d["staging_rows"]
    lay = Layout.from_wire(d)
    assert lay.index_groups == () and lay.staging_rows == 0


def test_sizes_and_default_groups():
    lay = make(num_layers=3, row_bytes=16, top_k=2, region_stride=4, max_reqs=5, host_rows=7, staging_rows=6)
    assert lay.groups == ((0,), (1,), (2,)) and lay.num_groups == 3
    assert lay.pool_bytes == 3 * 7 * 16
    assert lay.slab_bytes == 3 * 5 * 4 * 16
    assert lay.staging_bytes == 3 * 6 * 16
    grouped = make(num_layers=4, index_groups=[[3, 1], [0, 2]])
    assert grouped.groups == ((3, 1), (0, 2)) and grouped.num_groups == 2  # leader first, as given
