"""client/swap_in_kernels.py without a GPU: its launches pass what the kernels of
csrc/handle.cu declare (count, order, width), and the cases it answers without a launch.

The kernels themselves run in tests/client/test_swap_in_cuda.py (marked cuda).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from sparsekv.proto.positions import UNMAPPED

torch = pytest.importorskip("torch")
from sparsekv.client import swap_in_kernels  # noqa: E402 - after the skip

HANDLE_CU = Path(__file__).resolve().parents[2] / "csrc" / "handle.cu"


def _params(text: str) -> list[str]:
    """A parameter list's entries, whitespace folded, macro line ends dropped."""
    return [" ".join(p.replace("\\", " ").split()) for p in text.split(",")]


def declared(name: str) -> list[str]:
    src = HANDLE_CU.read_text()
    if name.startswith("skv_map_positions_"):  # instances of the SKV_MAP_POSITIONS macro
        m = re.search(r"#define SKV_MAP_POSITIONS\(NAME, P, T\)\s*\\?\s*extern \"C\" __global__ void NAME\((.*?)\)\s*\{",
                      src, re.S)
        assert re.search(rf"SKV_MAP_POSITIONS\({name}, ", src), f"{name} is not instantiated"
    else:
        m = re.search(rf"extern \"C\" __global__ void {name}\((.*?)\)\s*\{{", src, re.S)
    assert m, f"{name} not found in {HANDLE_CU}"
    return _params(m.group(1))


def expected_type(param: str):
    """What a launch must pass for a parameter: a pointer as an address (int), an int as
    np.int32, an i64 as np.int64."""
    if "*" in param:
        return int
    if re.search(r"\bi64\b", param):
        return np.int64
    assert re.search(r"\bint\b", param), param
    return np.int32


@pytest.fixture
def launches(monkeypatch):
    seen = []
    monkeypatch.setattr(swap_in_kernels, "_launch", lambda name, device, grid, args: seen.append((name, grid, args)))
    return seen


def check_against_declaration(name: str, args) -> None:
    params = declared(name)
    assert len(args) == len(params), f"{name}: {len(args)} arguments for {len(params)} parameters"
    for a, p in zip(args, params):
        want = expected_type(p)
        if want is int:
            assert type(a) is int, f"{name}: {p!r} takes an address, got {type(a).__name__}"
        else:
            assert type(a) is want, f"{name}: {p!r} takes {want.__name__}, got {type(a).__name__}"


@pytest.mark.parametrize("pos_dtype, table_dtype", [(torch.int32, torch.int32), (torch.int64, torch.int32),
                                                    (torch.int32, torch.int64), (torch.int64, torch.int64)])
def test_map_positions_launches_the_instance_of_its_dtypes_with_its_declared_arguments(launches, pos_dtype,
                                                                                        table_dtype):
    topk = torch.zeros((3, 5), dtype=pos_dtype)
    table = torch.zeros((4, 2), dtype=table_dtype)
    out = swap_in_kernels.map_positions(topk, table, 16, torch.zeros(3, dtype=torch.int32))
    assert out.shape == (3, 5) and out.dtype == torch.int32
    (name, grid, args), = launches
    assert name == f"skv_map_positions_{str(pos_dtype)[-5:].replace('int', 'i')}_{str(table_dtype)[-5:].replace('int', 'i')}"
    assert grid == 3
    check_against_declaration(name, args)
    by_name = {p.split()[-1].lstrip("*"): a for p, a in zip(declared(name), args)}
    assert by_name["out"] == out.data_ptr() and by_name["topk"] == topk.data_ptr()
    assert by_name["table"] == table.data_ptr() and by_name["tokens"] == 3 and by_name["k"] == 5
    assert by_name["table_rows"] == 4 and by_name["max_blocks"] == 2 and by_name["block_size"] == 16


@pytest.mark.parametrize("dtype, kernel", [(torch.int8, "i32"), (torch.uint8, "i32"), (torch.int16, "i32")])
def test_narrow_integers_are_widened_on_the_gpu_and_mapped_by_the_kernel(launches, dtype, kernel):
    topk = torch.arange(15, dtype=dtype).reshape(3, 5)
    out = swap_in_kernels.map_positions(topk, torch.zeros((4, 2), dtype=dtype), 16, torch.zeros(3, dtype=torch.int32))
    assert out is not None and [name for name, _, _ in launches] == [f"skv_map_positions_{kernel}_{kernel}"]


def test_map_positions_answers_without_a_launch_where_it_can(launches):
    reqs = torch.zeros(3, dtype=torch.int32)
    assert swap_in_kernels.map_positions(torch.zeros((3, 5), dtype=torch.uint64), torch.zeros((4, 2), dtype=torch.int32),
                                         16, reqs) is None  # int64 cannot hold it: the host maps it
    assert swap_in_kernels.map_positions(torch.zeros((0, 5), dtype=torch.int32), torch.zeros((4, 2), dtype=torch.int32),
                                         16, reqs[:0]).shape == (0, 5)
    empty = swap_in_kernels.map_positions(torch.zeros((3, 5), dtype=torch.int32), torch.zeros((4, 0), dtype=torch.int32),
                                          16, reqs)
    assert (empty == UNMAPPED).all()
    assert launches == []


def test_indices_passes_skv_db_indices_its_declared_arguments(launches):
    slots = torch.zeros((8, 6), dtype=torch.int32)[:3, :4]  # a view of a ring entry: ld 6
    out, valid = torch.empty((3, 4), dtype=torch.int32), torch.empty(3, dtype=torch.int32)
    swap_in_kernels.indices(slots, torch.zeros(3, dtype=torch.int32), 8, 100, 5, out, valid)
    (name, grid, args), = launches
    assert name == "skv_db_indices" and grid == 3
    check_against_declaration(name, args)
    params = declared(name)
    by_name = {p.split()[-1].lstrip("*"): a for p, a in zip(params, args)}
    assert by_name["ld"] == 6 and by_name["k"] == 4 and by_name["tokens"] == 3 and by_name["region_stride"] == 8
    assert by_name["hot_base"] == 100 and by_name["table_rows"] == 5
    assert by_name["topk"] == 0 and by_name["resident"] == 0  # the kernel reads topk only with resident blocks
    assert by_name["out"] == out.data_ptr() and by_name["valid"] == valid.data_ptr()
    swap_in_kernels.indices(slots[:0], torch.zeros(0, dtype=torch.int32), 8, 0, 5, out[:0], None)
    assert len(launches) == 1  # no tokens: no launch
