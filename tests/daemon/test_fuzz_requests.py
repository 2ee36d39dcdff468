"""Structured garbage to ``Daemon.handle`` (cpu backend, in process): requests of every
message type whose fields are random values (huge and negative integers, inf and nan,
bools, text, nested lists and maps) and whose arrays have random dtypes, shapes and
bytes. Every reply must be a typed error or a success, never INTERNAL, and an attached
client of another engine must keep working with correct bytes."""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import helpers
from helpers import request
from sparsekv.daemon.backends import CpuBackend
from sparsekv.daemon.pool import HostPool
from sparsekv.daemon.server import Daemon
from sparsekv.proto import LIMITS, REQUESTS, ErrorCode, Layout, MsgType
from sparsekv.proto.messages import WIRE_DTYPES

MiB = 1 << 20
FUZZ_LAYOUT = helpers.layout(num_layers=2, row_bytes=8, top_k=4, region_stride=8, max_reqs=3, host_rows=32,
                             staging_rows=4, index_groups=((0,), (1,)))
GOOD_LAYOUT = helpers.layout(num_layers=2, row_bytes=16, top_k=4, region_stride=8, max_reqs=2, host_rows=64)
OPTIONAL = ("fence", "block", "begin", "fence_events", "ts", "done", "blocks")

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.integers(-3, 70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6) | st.binary(max_size=6))
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)
# Values a real client might send, so that requests get past the first checks.
plausible = {
    "step": st.integers(-2, 3) | st.sampled_from([True, 2**63, 2**64 - 1, -(2**63), 0.0]),
    "group": st.integers(-1, 2) | st.sampled_from([True, 2**63]), "rank": st.integers(0, 3),
    "layers": st.none() | st.lists(st.integers(-1, 2) | st.sampled_from([True, 1.0, float("inf"), 2**63]), max_size=3),
    "engine": st.sampled_from(["fz", "good", ""]),
    "device": st.just("cpu"), "name": st.text(max_size=4), "pid": st.just(os.getpid()),
    "fence": st.none() | st.integers(0, 3), "begin": st.booleans(), "block": st.integers(0, 2),
    "done": st.none() | st.integers(-1, 3) | st.sampled_from([2**32, True, 1.5, "1"]),
    "blocks": st.fixed_dictionaries({"block_size": st.integers(-1, 40) | st.sampled_from([True, 2.0, 2**63])}),
    "n": st.integers(-40, 40) | st.sampled_from([True, 2**63, -(2**63), 1.5, 2**17]),
}


# Values that look almost right: bools are ints to Python, inf has no integer, ...
nasty = st.sampled_from([True, False, 0, -1, 2**31, 2**63, 2**64 - 1, 1.0, 1.5, float("inf"), float("nan"), "1",
                         [], [[]], [[0, 1]], [[0], [1.5]], [[float("inf")]], [[True], [False]], [[0], [2**63]],
                         {"a": 1}, [[0], [1], [1]]])


@st.composite
def layouts(draw):
    wire = FUZZ_LAYOUT.to_wire()
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from(sorted(wire) + ["extra"]))
        wire[key] = draw(nasty | junk | st.integers(-1, 2**40))
    return wire if draw(st.integers(0, 9)) else draw(junk)


def ints(draw, shape, lo=-2, hi=40, dtype=np.int32):
    n = int(np.prod(shape, dtype=np.int64))
    return np.array(draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n)), np.int64).astype(dtype).reshape(shape)


@st.composite
def plausible_arrays(draw, kind):
    """Arrays of the right names, dtypes and nearly the right shapes."""
    b, k, n = draw(st.integers(0, 4)), draw(st.integers(0, 5)), draw(st.integers(0, 5))
    out = {}
    if kind in (MsgType.STEP, MsgType.TOPK):
        out["state_rows"] = ints(draw, (b,), -2, 3)
        if draw(st.booleans()):
            out["reset"] = ints(draw, (b,), 0, 1, bool)
        if draw(st.booleans()):
            out["invalidate"] = ints(draw, (b, n), -2, 33)
    if kind == MsgType.TOPK:
        out["topk"] = ints(draw, (b if draw(st.integers(0, 5)) else b + 1, k), -2, 33)
        for name in draw(st.lists(st.sampled_from(["state_rows", "reset", "invalidate"]), unique=True)):
            out.pop(name, None)
    if kind in (MsgType.WRITE, MsgType.STAGE, MsgType.WRITE_STAGED):
        out["rows"] = ints(draw, (n,), -1, 33)
    if kind == MsgType.WRITE:
        out["data"] = ints(draw, (draw(st.integers(0, 3)), n if draw(st.integers(0, 5)) else n + 1,
                                  8 if draw(st.integers(0, 5)) else 7), 0, 255, np.uint8)
    if kind in (MsgType.BLOCK_COMMIT, MsgType.BLOCK_RELEASE, MsgType.BLOCK_WRITE_KEYS, MsgType.BLOCK_READ_KEYS):
        out["blocks"] = ints(draw, (n,), -2, 34)
    if kind == MsgType.BLOCK_WRITE_KEYS:  # the store engine's keys: [n, 2 layers, 4 positions, 4 bytes]
        out["keys"] = ints(draw, (n if draw(st.integers(0, 5)) else n + 1, 2, 4, 4 if draw(st.integers(0, 5)) else 3),
                           0, 255, np.uint8)
    if kind in (MsgType.BLOCK_COMMIT, MsgType.BLOCK_LOOKUP):  # keys from a small set: hits and duplicates
        out["hashes"] = ints(draw, (n if draw(st.integers(0, 5)) else n + 1, 2 if draw(st.integers(0, 9)) else 3),
                             0, 3, np.int64)
    return out


@st.composite
def arrays(draw, names):
    out = {}
    pool = sorted(names) + (["junk"] if not draw(st.integers(0, 9)) else [])
    for name in draw(st.lists(st.sampled_from(pool), max_size=4, unique=True)) if pool else []:
        dtype = np.dtype(draw(st.sampled_from(sorted(WIRE_DTYPES))))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if draw(st.booleans()):
            a = np.frombuffer(draw(st.binary(min_size=n, max_size=n)), dtype=np.uint8).view(dtype).reshape(shape)
        else:  # small integers: plausible ids, state rows, flags
            lo = 0 if dtype.kind in "ub" else -2
            a = np.array(draw(st.lists(st.integers(lo, 40), min_size=n // dtype.itemsize,
                                       max_size=n // dtype.itemsize)), dtype=np.int64).astype(dtype).reshape(shape)
        out[name] = a
    return out


@st.composite
def requests(draw):
    kind = draw(st.sampled_from(list(MsgType)))
    need, names = REQUESTS[kind]
    fields = {}
    for f in sorted(need) + list(OPTIONAL):
        if f not in need and (f == "ts" or draw(st.integers(0, 3))):
            continue
        if f in need and not draw(st.integers(0, 15)):
            continue  # a required field missing
        if f == "layout":
            fields[f] = draw(layouts())
        elif f in plausible and draw(st.booleans()):
            fields[f] = draw(plausible[f])
        else:
            fields[f] = draw(junk)
    return kind, fields, draw(plausible_arrays(kind) if draw(st.booleans()) else arrays(names))


@pytest.fixture(scope="module")
def dm(tmp_path_factory):
    with helpers.inproc_daemon(tmp_path_factory.mktemp("fuzz"), max_clients=8) as d:
        yield d


def ok(dm, ident, kind, fields=None, arrays=None):
    h, a = request(dm, ident, kind, fields, arrays)
    assert h["ok"], h
    return h, a


def good_step(dm, t):
    """The other engine's rank: a step and a top-k, every hot byte checked."""
    rng = np.random.default_rng(t)
    topk = np.stack([rng.choice(np.arange(32 * b, 32 * b + 32), 4, replace=False) for b in range(2)]).astype(np.int32)
    ok(dm, b"G", MsgType.STEP, {"step": t}, {"state_rows": np.array([0, 1], np.int32)})
    s = dm.sessions[b"G"].state
    for g in range(2):
        _, a = ok(dm, b"G", MsgType.TOPK, {"step": t, "group": g}, {"topk": topk})
        assert helpers.bad_rows(s.slab, GOOD_LAYOUT.groups[g], np.array([0, 1]), topk, a["slots"], 64) == 0


@given(st.lists(requests(), min_size=1, max_size=3), st.booleans(), st.booleans())
@settings(max_examples=helpers.examples(150, 5000), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_garbage_requests_get_typed_errors_and_others_go_on(dm, reqs, attached, store):
    if b"G" not in dm.sessions:
        ok(dm, b"G", MsgType.HELLO, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": "good"})
        ok(dm, b"G", MsgType.ATTACH, {"engine": "good", "layout": GOOD_LAYOUT.to_wire()})
        rows = np.arange(64, dtype=np.int32)
        ok(dm, b"G", MsgType.WRITE, {"layers": None},
           {"rows": rows, "data": np.stack([helpers.gen_pattern(layer, rows, 16) for layer in range(2)])})
    s = dm.sessions.get(b"F")
    if s is None:
        ok(dm, b"F", MsgType.HELLO, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": "fuzz"})
        s = dm.sessions[b"F"]
    if attached and s.state is None:  # to a plain engine, or to one with a block store (kept while it caches)
        store_field = {"block_size": 4, "index_bytes": 4}  # with an indexer keys plane
        ok(dm, b"F", MsgType.ATTACH, {"engine": "fzb", "layout": FUZZ_LAYOUT.to_wire(), "blocks": store_field}
           if store else {"engine": "fz", "layout": FUZZ_LAYOUT.to_wire()})
        ok(dm, b"F", MsgType.STEP, {"step": 0}, {"state_rows": np.array([0, 1, -1], np.int32)})
    for kind, fields, arrs in reqs:
        h, _ = request(dm, b"F", kind, fields, arrs)
        assert h.get("code") != ErrorCode.INTERNAL, (kind.name, fields, {k: (v.dtype, v.shape) for k, v in arrs.items()}, h)
    good_step(dm, 1 + dm.stats.c["requests"] % 1000)
    assert set(dm.sessions) <= {b"F", b"G"}
    # The fuzzed connection can always start over.
    if b"F" in dm.sessions and dm.sessions[b"F"].state is not None:
        ok(dm, b"F", MsgType.DETACH)


def _with(**kw):
    wire = FUZZ_LAYOUT.to_wire()
    wire.update(kw)
    return wire


ROWS = np.zeros(1, np.int32)


@pytest.mark.parametrize("kind, fields, arrays, code, words", [
    (MsgType.WRITE, {"layers": [float("inf")]}, {"rows": ROWS, "data": np.zeros((1, 1, 8), np.uint8)},
     ErrorCode.BAD_ARGUMENT, "layers must be null"),
    (MsgType.WRITE_STAGED, {"layers": []}, {"rows": ROWS}, ErrorCode.BAD_ARGUMENT, "non-empty list"),
    (MsgType.STAGE, {"layers": [True]}, {"rows": ROWS}, ErrorCode.BAD_ARGUMENT, "layers must be null"),
    (MsgType.STAGE, {"layers": [0, [1]]}, {"rows": ROWS}, ErrorCode.BAD_ARGUMENT, "layers must be null"),
    (MsgType.STAGE, {"layers": [0, 0]}, {"rows": ROWS}, ErrorCode.BAD_ARGUMENT, "names a layer twice"),
    (MsgType.WRITE_STAGED, {"layers": [0, 0]}, {"rows": ROWS}, ErrorCode.BAD_ARGUMENT, "names a layer twice"),
    (MsgType.STEP, {"step": 1.0}, {"state_rows": ROWS}, ErrorCode.BAD_ARGUMENT, "'step' must be an integer"),
    (MsgType.STEP, {"step": {"a": [1, {}]}}, {"state_rows": ROWS}, ErrorCode.BAD_ARGUMENT, "'step' must be an integer"),
    (MsgType.TOPK, {"step": 0, "group": 2**63}, {"topk": np.zeros((1, 4), np.int32), "state_rows": ROWS},
     ErrorCode.BAD_ARGUMENT, "group 9223372036854775808 out of range"),
    (MsgType.TOPK, {"step": 0, "group": 0}, {"topk": np.zeros((32768, 4), np.int32),
                                             "state_rows": np.full(32768, -1, np.int32)},
     ErrorCode.TOO_LARGE, "batch of 32768 rows exceeds max_batch 3"),
    (MsgType.STEP, {"step": 0}, {"state_rows": np.full(4, -1, np.int32)}, ErrorCode.TOO_LARGE, "exceeds max_batch 3"),
    (MsgType.WRITE, {"layers": None}, {"rows": np.zeros(LIMITS.max_write_rows + 1, np.int32),
                                       "data": np.zeros((0, 0, 8), np.uint8)}, ErrorCode.TOO_LARGE, "rows exceeds"),
    (MsgType.ATTACH, {"engine": "x", "layout": _with(num_layers=True)}, {}, ErrorCode.BAD_LAYOUT, "num_layers"),
    (MsgType.ATTACH, {"engine": "x", "layout": _with(max_batch=True)}, {}, ErrorCode.BAD_LAYOUT, "max_batch"),
    (MsgType.ATTACH, {"engine": "x", "layout": _with(host_rows=True)}, {}, ErrorCode.BAD_LAYOUT, "host_rows"),
    (MsgType.ATTACH, {"engine": "x", "layout": _with(index_groups=[[0], [float("inf")]])}, {}, ErrorCode.BAD_LAYOUT,
     "index_groups"),
    (MsgType.ATTACH, {"engine": "x", "layout": _with(index_groups=[[0], [1.5]])}, {}, ErrorCode.BAD_LAYOUT,
     "index_groups"),
    (MsgType.ATTACH, {"engine": "x", "layout": _with(staging_rows=2**63)}, {}, ErrorCode.BAD_LAYOUT, "staging_rows"),
    (MsgType.ATTACH, {"engine": "x", "layout": _with(row_bytes=2**62)}, {}, ErrorCode.BAD_LAYOUT, "row_bytes"),
    (MsgType.ATTACH, {"engine": "x", "layout": FUZZ_LAYOUT.to_wire(), "blocks": {"block_size": 0}}, {},
     ErrorCode.BAD_ARGUMENT, "blocks must be {'block_size': n} with 1 <= n <= host_rows (32)"),
    (MsgType.BLOCK_ALLOC, {"n": 1}, {}, ErrorCode.BAD_ARGUMENT, "engine 'fz' has no block store"),
    # a store of 2**21 + 1 blocks of one 1-byte row: ~50 bytes of bookkeeping a block, allocated at attach
    # (seen: 67M blocks from a 64 MiB range, 3.25 GiB and 7.9 s of the daemon's loop), refused before it
    (MsgType.ATTACH, {"engine": "x", "layout": Layout(num_layers=1, row_bytes=1, top_k=1, region_stride=1, max_reqs=1,
                                                      host_rows=LIMITS.max_store_blocks + 1).to_wire(),
                      "blocks": {"block_size": 1}}, {}, ErrorCode.BAD_ARGUMENT, "exceeds 2097152: use larger blocks"),
])
def test_client_mistakes_are_typed_errors(tmp_path, kind, fields, arrays, code, words):
    pool = HostPool(8 * MiB, threads=1)
    backend = CpuBackend(str(tmp_path), shm_dir=str(tmp_path))
    d = Daemon(str(tmp_path), backend, pool, max_clients=2)
    try:
        ok(d, b"A", MsgType.HELLO, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": ""})
        if kind != MsgType.ATTACH:
            ok(d, b"A", MsgType.ATTACH, {"engine": "fz", "layout": FUZZ_LAYOUT.to_wire()})
        h, _ = request(d, b"A", kind, fields, arrays)
        assert (h["ok"], h.get("error")) == (False, code.name), h
        assert words in h["msg"], h["msg"]
    finally:
        for s in list(d.sessions.values()):
            d.sessions.detach(s)
        backend.close()
        pool.close()
