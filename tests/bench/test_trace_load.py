"""``Trace.load`` refuses what docs/TRACES.md does not allow, with a TraceError naming the
file and the array, never by wrapping a value or by reading a huge array first."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest

from sparsekv.bench.synth import synth
from sparsekv.bench.trace import Trace, TraceError


def _good() -> dict:
    t = synth(steps=4, batch=2, top_k=4, region_stride=8, max_reqs=4, host_rows=256, num_layers=2, seed=1)
    return {"topk": t.topk, "state_rows": t.state_rows, "reset": t.reset, "invalidate": t.invalidate,
            **{k: np.int64(getattr(t, k)) for k in ("region_stride", "host_rows", "max_reqs", "row_bytes",
                                                     "num_layers")}}


def _save(tmp_path, arrays: dict) -> str:
    path = str(tmp_path / "t.npz")
    np.savez(path, **arrays)
    return path


def _live(a: dict) -> tuple[int, int]:
    """(step, batch row) of a row with a request."""
    t, b = np.argwhere(a["state_rows"] >= 0)[0]
    return int(t), int(b)


@pytest.mark.parametrize("name, value", [("topk", 2**32 + 5), ("state_rows", 2**32 + 1), ("invalidate", -2**31 - 1)])
def test_an_id_outside_int32_is_refused_not_wrapped(tmp_path, name, value):
    a = _good()
    t, b = _live(a)
    arr = a[name].astype(np.int64)
    arr[t, b] = value  # (invalidate: the row's whole list)
    a[name] = arr
    with pytest.raises(TraceError, match=f"{name} holds {value}, outside int32"):
        Trace.load(_save(tmp_path, a))


def test_uint32_ids_are_refused_past_int32_and_taken_within_it(tmp_path):
    a = _good()
    a["topk"] = np.where(a["topk"] < 0, 0, a["topk"]).astype(np.uint32)
    assert (Trace.load(_save(tmp_path, a)).topk == a["topk"]).all()
    a["topk"][0, 0, 0] = 2**32 - 1  # would wrap to -1, "no id"
    with pytest.raises(TraceError, match="outside int32"):
        Trace.load(_save(tmp_path, a))


@pytest.mark.parametrize("name, value, words", [
    ("region_stride", np.float64(16.9), "region_stride must be an integer scalar"),
    ("num_layers", np.bool_(True), "num_layers must be an integer scalar"),
    ("host_rows", np.array([256]), "host_rows must be an integer scalar"),
    ("host_rows", np.array("256"), "host_rows must be an integer scalar, got <U3"),
])
def test_scalars_of_another_type_are_refused(tmp_path, name, value, words):
    a = _good()
    a[name] = value
    with pytest.raises(TraceError, match=words):
        Trace.load(_save(tmp_path, a))


def test_reset_must_be_bool(tmp_path):
    a = _good()
    a["reset"] = a["reset"].astype(np.float64)
    with pytest.raises(TraceError, match="reset must be bool, got float64"):
        Trace.load(_save(tmp_path, a))


def test_the_scalars_are_checked_before_any_array_is_read(tmp_path):
    """A bad layout is named even when an array's data is corrupt: the arrays were not read."""
    a = _good()
    a["host_rows"] = np.int64(-1)
    path = _save(tmp_path, a)
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    body = bytearray(members["topk.npy"])
    body[-8:] = b"\xff" * 8  # data after the header, not the header
    with zipfile.ZipFile(path, "w") as z:
        for n, data in members.items():
            z.writestr(n, bytes(body) if n == "topk.npy" else data)
    with pytest.raises(TraceError, match="host_rows must be a positive integer"):
        Trace.load(path)


def test_an_array_larger_than_the_memory_is_refused_from_its_header(tmp_path):
    a = _good()
    path = _save(tmp_path, a)
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<i4", "fortran_order": False, "shape": (1 << 40,)})
    with zipfile.ZipFile(path, "w") as z:
        for n, data in members.items():
            z.writestr(n, buf.getvalue() + b"\0" * 64 if n == "topk.npy" else data)
    with pytest.raises(TraceError, match="GiB loaded .* this machine has room for"):
        Trace.load(path)


@pytest.mark.parametrize("damage, words", [
    (lambda b: b[: len(b) // 2], "is not an .npz archive"),
    (lambda b: b"", "is not an .npz archive"),
])
def test_a_damaged_archive_is_a_trace_error(tmp_path, damage, words):
    path = _save(tmp_path, _good())
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(damage(data))
    with pytest.raises(TraceError, match=words):
        Trace.load(path)


def test_a_member_with_a_bad_crc_names_the_array(tmp_path):
    path = str(tmp_path / "t.npz")
    np.savez_compressed(path, **_good())
    with open(path, "rb") as f:
        data = bytearray(f.read())
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("topk.npy")
    at = info.header_offset + 30 + len(info.filename) + len(info.extra) + info.compress_size // 2
    data[at] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(TraceError, match="topk"):
        Trace.load(path)


@pytest.mark.parametrize("block_size", [257, 2**31, 2**63 + 1])
def test_a_block_size_past_host_rows_is_refused(tmp_path, block_size):
    """A block_size the pool holds no block of (up to uint64 2**63 + 1: its position
    arithmetic raised OverflowError, not a TraceError) is refused, naming it."""
    a = _good()
    s, b = a["topk"].shape[:2]
    a["block_table"] = np.full((s, b, 2), -1, np.int32)
    a["block_size"] = np.uint64(block_size)
    with pytest.raises(TraceError, match=f"block_size {block_size} exceeds host_rows 256"):
        Trace.load(_save(tmp_path, a))


def test_the_memory_check_counts_arrays_as_loaded(tmp_path, monkeypatch):
    """Found by a review: an int8 top-k was counted at a byte an id, then loaded as int32
    beside the replay's slots of its shape (~8x): a trace under the bound was killed."""
    import psutil

    a = _good()
    a["topk"] = a["topk"].astype(np.int8)
    stored = sum(v.nbytes for v in a.values())
    loaded = stored + a["topk"].size * (4 * 2 - 1)  # the top-k as int32, twice
    path = _save(tmp_path, a)

    class Mem:
        available = 4 * (stored + loaded) // 2  # a quarter of it lies between the two counts

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Mem)
    with pytest.raises(TraceError, match="loaded"):
        Trace.load(path)


def test_an_encrypted_member_or_an_unknown_compression_is_a_trace_error(tmp_path):
    """Found by a review: zipfile's RuntimeError (encrypted) and NotImplementedError
    (deflate64) escaped as other errors, naming neither the file nor the array."""
    path = _save(tmp_path, _good())
    with open(path, "rb") as f:
        data = f.read()
    with zipfile.ZipFile(path) as z:
        local = z.getinfo("topk.npy").header_offset
    central = data.find(b"PK\x01\x02", local)
    while data[central + 46:central + 46 + len(b"topk.npy")] != b"topk.npy":
        central = data.find(b"PK\x01\x02", central + 4)
    # (local header offset, central header offset) of the general-purpose flags and the method
    for what, (lo, ce), change in (("encrypted", (6, 8), lambda b: b | 1), ("deflate64", (8, 10), lambda b: 9)):
        d = bytearray(data)
        d[local + lo] = change(d[local + lo])
        d[central + ce] = change(d[central + ce])
        p = tmp_path / f"{what}.npz"
        p.write_bytes(bytes(d))
        with pytest.raises(TraceError, match=f"trace {p}: topk"):
            Trace.load(str(p))


def test_a_batch_wider_than_max_reqs_replays_its_rows_of_one_state_row(tmp_path):
    """Found by a review: two rows of one state row (speculative decoding) with max_reqs 1
    were refused as exceeding max_batch 1, which the trace format does not have."""
    from sparsekv.bench.replay import replay

    t = Trace(topk=np.array([[[0, 1], [2, 3]], [[0, 4], [2, 5]]], np.int32),
              state_rows=np.zeros((2, 2), np.int32), reset=np.array([[True, False], [False, False]]),
              invalidate=np.full((2, 2, 1), -1, np.int32), region_stride=4, host_rows=32, max_reqs=1, row_bytes=16,
              num_layers=1).check()
    _, result = replay(t, transport="inproc", backend="cpu", verify=True)
    assert result["slots"].shape == (2, 2, 2) and (result["slots"] >= 0).all()
    assert result["misses"].tolist() == [[2, 2], [1, 1]]


def test_save_writes_the_path_it_is_given(tmp_path):
    """Found by a review: NumPy added .npz to a name without it, and the CLI reported a
    file it had not written."""
    t = Trace.load(_save(tmp_path, _good()))
    t.save(str(tmp_path / "plain"))
    assert (tmp_path / "plain").exists() and not (tmp_path / "plain.npz").exists()
    assert Trace.load(str(tmp_path / "plain")).topk.tolist() == t.topk.tolist()


def test_a_shape_error_names_the_file_and_prefetchs_doubled_layers_say_so(tmp_path):
    """Found by a review: the shape checks named the array but not the file, and a trace of
    600 layers under --prefetch failed on "num_layers 1200" without naming --prefetch."""
    from sparsekv.bench.replay import ahead_layout

    a = _good()
    a["reset"] = a["reset"][:, :1]
    path = _save(tmp_path, a)
    with pytest.raises(TraceError, match=f"trace {path}: reset must be"):
        Trace.load(path)
    a = _good()
    a["num_layers"] = np.int64(600)
    t = Trace.load(_save(tmp_path, a))
    with pytest.raises(TraceError, match="--prefetch doubles the trace's 600 layers"):
        ahead_layout(t)


def test_a_save_that_fails_leaves_the_trace_that_was_there(tmp_path):
    """Found by a review: the exact-path save opened (emptied) the file before its arrays
    were made, so a failing save destroyed a good trace at that path."""
    path = _save(tmp_path, _good())
    good = Trace.load(path)
    good.save(path)
    before = open(path, "rb").read()
    bad = Trace.load(path)
    bad.host_rows = 2**64  # np.int64() of it raises while the arrays are made
    with pytest.raises(OverflowError):
        bad.save(path)
    assert open(path, "rb").read() == before and sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]


def test_a_batch_past_a_top_k_batchs_limit_is_refused_naming_the_file(tmp_path):
    a = _good()
    a["topk"] = np.full((1, 65537, 1), -1, np.int32)
    a["state_rows"] = np.full((1, 65537), -1, np.int32)
    a["reset"] = np.zeros((1, 65537), bool)
    a["invalidate"] = np.full((1, 65537, 1), -1, np.int32)
    path = _save(tmp_path, a)
    with pytest.raises(TraceError, match=f"trace {path}: topk's batch of 65537 rows .*at most 65536 rows"):
        Trace.load(path)


def test_an_empty_float_array_is_refused_where_integers_are_required(tmp_path):
    """A file's arrays get no leniency for an empty Python list (NumPy reads ``[]`` as
    float64, which the clients take as no ids): an empty float32 ``invalidate`` is a type
    the trace format does not allow (found by a review of the one int32 rule)."""
    a = _good()
    a["invalidate"] = np.zeros(a["invalidate"].shape[:2] + (0,), np.float32)
    with pytest.raises(TraceError, match="invalidate must hold integers, got float32"):
        Trace.load(_save(tmp_path, a))


def _rewrite_member(path: str, name: str, data: bytes) -> None:
    """``path`` again with member ``name`` holding ``data`` (stored, its CRC computed)."""
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    members[name] = data
    with zipfile.ZipFile(path, "w") as z:
        for n, b in members.items():
            z.writestr(n, b)


def test_bytes_after_an_array_in_its_member_are_refused(tmp_path):
    """Found by an adversarial review: a member with bytes after its array was read up to
    the array's end only, so neither those bytes nor the member's CRC were checked (a bit
    flipped in the array of such a member loaded as good data)."""
    path = _save(tmp_path, _good())
    buf = io.BytesIO()
    np.lib.format.write_array(buf, _good()["topk"])
    _rewrite_member(path, "topk.npy", buf.getvalue() + b"\0" * 64)
    with pytest.raises(TraceError, match=f"trace {path}: topk could not be read: bytes follow the array"):
        Trace.load(path)


@pytest.mark.parametrize("name", ["notes.txt", "extra.npy", "blocktable.npy"])
def test_a_member_that_is_not_one_of_the_arrays_is_refused(tmp_path, name):
    """docs/TRACES.md: a member that is not a NumPy array is refused; so is an array the
    format does not name (a misspelt block_table made a position trace replay as host rows)."""
    path = _save(tmp_path, _good())
    _rewrite_member(path, name, b"x")
    with pytest.raises(TraceError, match=f"trace {path}: member '{name}' is not one of its arrays"):
        Trace.load(path)


@pytest.mark.parametrize("value", [-2, 256, 2**31 - 1])
def test_an_invalidated_row_outside_the_pool_is_refused(tmp_path, value):
    """-1 is "none"; any other value outside [0, host_rows) is refused at load, naming where
    (the daemon refuses such a STEP too)."""
    a = _good()
    t, b = _live(a)
    inv = np.full(a["invalidate"].shape[:2] + (2,), -1, np.int32)
    inv[t, b, 1] = value
    a["invalidate"] = inv
    path = _save(tmp_path, a)
    with pytest.raises(TraceError, match=f"trace {path}: invalidate at step {t}, batch row {b} holds {value}"):
        Trace.load(path)


def test_many_empty_steps_are_refused_by_the_room_they_take(tmp_path, monkeypatch):
    """Found by an adversarial review: a 2 KB trace of 10**12 steps of an empty batch passed
    the size check (its arrays hold nothing) and then failed allocating 7 TiB, or ran for
    hours; each step counts what the replay keeps for it."""
    a = _good()
    steps = 10**12
    for k, tail in (("topk", (0, 4)), ("state_rows", (0,)), ("reset", (0,)), ("invalidate", (0, 1))):
        a[k] = np.lib.stride_tricks.as_strided(np.zeros(1, a[k].dtype), (steps, *tail), (0,) * (1 + len(tail)))
    path = str(tmp_path / "t.npz")
    with zipfile.ZipFile(path, "w") as z:
        for k, v in a.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, v)
            z.writestr(f"{k}.npy", buf.getvalue())
    with pytest.raises(TraceError, match="GiB loaded .* this machine has room for"):
        Trace.load(path)


@pytest.mark.parametrize("name", ["context", "lifetime"])
def test_synth_refuses_a_context_or_lifetime_past_int32_before_generating(name):
    """Found by an adversarial review: --lifetime 10**19 failed inside NumPy's generator."""
    with pytest.raises(TraceError, match=f"{name} must be < 2\\*\\*31, got {10**19}"):
        synth(steps=2, batch=2, top_k=4, region_stride=8, max_reqs=4, host_rows=256, num_layers=2, **{name: 10**19})


# Found by an adversarial review of the trace formats.
@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_a_trace_path_that_is_not_a_regular_file_is_refused_before_it_is_read(tmp_path, kind):
    """A FIFO blocked the load for ever and /dev/zero was read until the OOM killer came."""
    import os

    path = tmp_path / "t.npz"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path = "/dev/zero"
    with pytest.raises(TraceError, match=r"is not a regular file \(a (FIFO|character device|directory)\)"):
        Trace.load(str(path))


def test_a_member_named_twice_is_refused(tmp_path):
    """zipfile reads the last of two members of one name: the trace would be half another."""
    path = _save(tmp_path, _good())
    with zipfile.ZipFile(path) as z:
        members = [(n, z.read(n)) for n in z.namelist()]
    with pytest.warns(UserWarning, match="Duplicate name"), zipfile.ZipFile(path, "a") as z:
        z.writestr("topk.npy", dict(members)["topk.npy"])
    with pytest.raises(TraceError, match="member 'topk.npy' appears twice"):
        Trace.load(path)


@pytest.mark.parametrize("name, dtype, words", [
    ("topk", "<f8", "topk must hold integers, got float64"),
    ("invalidate", "|b1", "invalidate must hold integers, got bool"),
    ("reset", "<i4", "reset must be bool, got int32"),
])
def test_a_wrong_type_is_refused_from_the_header_before_the_data_is_read(tmp_path, name, dtype, words):
    """The member's data is cut short: only a refusal from its header names its type."""
    a = _good()
    path = _save(tmp_path, a)
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": dtype, "fortran_order": False, "shape": a[name].shape})
    with zipfile.ZipFile(path, "w") as z:
        for n, data in members.items():
            z.writestr(n, head.getvalue() + b"\0" * 3 if n == f"{name}.npy" else data)
    with pytest.raises(TraceError, match=words):
        Trace.load(path)


def test_a_position_traces_table_check_is_counted_in_the_room_it_takes(tmp_path, monkeypatch):
    """Checking that a request's rows share one block table takes ~58 bytes a (step, batch
    row) at once: a position trace counted without it peaked at 5.3 times its count."""
    from sparsekv.bench import trace as trace_mod

    t = synth(steps=4, batch=2, top_k=4, region_stride=8, max_reqs=4, host_rows=256, num_layers=2, block_size=4,
              seed=1)
    path = str(tmp_path / "p.npz")
    t.save(path)
    counted = []
    monkeypatch.setattr(trace_mod, "check_room", lambda total, *a: counted.append(total))
    Trace.load(path)
    monkeypatch.setattr(trace_mod, "SHARED_TABLE_CELL_BYTES", 0)
    Trace.load(path)
    assert counted[0] - counted[1] == 64 * t.steps * t.batch


def test_synth_counts_the_context_ids_it_draws_from_before_generating():
    """A request's context ids (int64, up to host_rows / max_reqs) and their copies while a
    top-k is drawn were not counted: a 34-byte trace of 2**26-row contexts took 4.4 GB."""
    with pytest.raises(TraceError, match=r"GiB of context ids of up to 2147483646 rows a request"):
        synth(steps=2, batch=1, max_reqs=1, top_k=1, region_stride=1, host_rows=2**31 - 2, context=2**31 - 1,
              lifetime=1)


def test_a_trace_made_in_code_takes_numpy_integer_scalars_and_names_other_types():
    t = synth(steps=3, batch=2, top_k=4, region_stride=8, max_reqs=4, host_rows=256, seed=1)
    arrays = (t.topk, t.state_rows, t.reset, t.invalidate)
    made = Trace(*arrays, np.int64(8), np.int32(256), np.uint16(4), np.int64(656), np.int64(2)).check()
    assert made.layout() == t.layout() and type(made.host_rows) is int
    with pytest.raises(TraceError, match="region_stride must be a positive integer, got 8.5"):
        Trace(*arrays, 8.5, 256, 4, 656, 2).check()


def test_a_central_directory_entry_swallowing_the_next_is_refused(tmp_path):
    """Found by an adversarial review: one byte of a directory entry (its comment's length)
    hid the members after it, and a position trace without its table loaded as a host-row
    trace. The end record's member count tells."""
    import struct

    t = synth(steps=4, batch=2, top_k=4, region_stride=8, max_reqs=4, host_rows=256, num_layers=2, block_size=4,
              seed=1)
    path = str(tmp_path / "p.npz")
    t.save(path)
    with zipfile.ZipFile(path) as z:
        cd, names = z.start_dir, z.namelist()
    data = bytearray(open(path, "rb").read())
    entry = cd
    for _ in range(names.index("block_table.npy") - 1):  # the entry before block_table's
        n, e, c = struct.unpack("<HHH", data[entry + 28:entry + 34])
        entry += 46 + n + e + c
    n, e, c = struct.unpack("<HHH", data[entry + 28:entry + 34])
    nxt = entry + 46 + n + e + c
    n2, e2, c2 = struct.unpack("<HHH", data[nxt + 28:nxt + 34])
    struct.pack_into("<H", data, entry + 32, c + 46 + n2 + e2 + c2)  # its comment covers the next entry
    with open(path, "wb") as f:
        f.write(data)
    with zipfile.ZipFile(path) as z:
        assert "block_table.npy" not in z.namelist()  # zipfile alone does not see it
    with pytest.raises(TraceError, match=rf"damaged .npz archive: its directory declares {len(names)} members, "
                                         rf"{len(names) - 1} can be read"):
        Trace.load(path)
