"""The protocol declaration: numbers are append-only, every request has a shape, every
error code a message a person can act on."""

from pathlib import Path

from sparsekv.proto import ERROR_HINTS, REQUESTS, ErrorCode, MsgType, ProtocolError


def test_message_type_numbers_are_pinned():
    # Append-only: a reorder or reuse breaks every deployed peer. Extend, never edit.
    assert {m.name: int(m) for m in MsgType} == {
        "HELLO": 1, "ATTACH": 2, "STEP": 3, "TOPK": 4, "WRITE": 5, "STAGE": 6, "DETACH": 7, "STATS": 8, "WRITE_STAGED": 9,
        "BYE": 10, "BLOCK_RESERVE": 11, "BLOCK_ALLOC": 12, "BLOCK_COMMIT": 13, "BLOCK_LOOKUP": 14, "BLOCK_RELEASE": 15,
        "BLOCK_WRITE_KEYS": 16, "BLOCK_READ_KEYS": 17, "BLOCK_LOAD_KEYS": 18,
    }


def test_error_code_numbers_are_pinned():
    want = ["OK", "BAD_FRAME", "BAD_VERSION", "UNKNOWN_TYPE", "NOT_HELLO", "NOT_ATTACHED", "BAD_LAYOUT",
            "LAYOUT_MISMATCH", "POOL_FULL", "BAD_ARGUMENT", "BAD_STATE_ROW", "DUPLICATE_IDS", "TOO_LARGE",
            "ALREADY_ATTACHED", "TOO_MANY_CLIENTS", "INTERNAL", "SHUTTING_DOWN", "PERMISSION_DENIED", "QUOTA_EXCEEDED", "POOL_EXHAUSTED",
            "TP_MISMATCH", "TP_LAG"]
    assert [(c.name, int(c)) for c in ErrorCode][: len(want)] == [(n, i) for i, n in enumerate(want)]


def test_every_error_code_has_a_hint():
    for code in ErrorCode:
        if code != ErrorCode.OK:
            assert ERROR_HINTS.get(code, "").strip(), code.name


def test_every_message_type_declares_its_fields_and_arrays():
    assert set(REQUESTS) == set(MsgType)
    for kind, (fields, _arrays) in REQUESTS.items():
        assert not ({"v", "t", "id", "arrays"} & fields), kind.name


def test_the_proto_readme_has_a_row_for_every_request_type():
    readme = (Path(__file__).resolve().parents[2] / "proto" / "README.md").read_text()
    rows = {line.split("|")[1].strip() for line in readme.splitlines() if line.startswith("| ")}
    assert not {m.name for m in MsgType} - rows, "proto/README.md's request table lacks a type"


def test_protocol_error_carries_code_and_message():
    e = ProtocolError(ErrorCode.TOO_LARGE, "header of 9 bytes exceeds 8")
    assert e.code is ErrorCode.TOO_LARGE
    assert str(e) == "TOO_LARGE: header of 9 bytes exceeds 8"
    assert ProtocolError(12, "x").code is ErrorCode.TOO_LARGE
