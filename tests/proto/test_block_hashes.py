"""The hash rule of the block store (DESIGN §9, proto/blocks.py): each full block's key is
BLAKE2b-128 of its parent's key and its token ids as little-endian int32, chained from the
namespace's root. Token ids a cast would change (floats, bools, ids past int32) and a parent
that is not a key are refused: found by a review, another prompt hashed to the same keys
and its lookup got the first prompt's rows."""

import hashlib

import numpy as np
import pytest

from sparsekv.client import BadRequest, Client
from sparsekv.embedded.inproc import InprocClient
from sparsekv.proto import ErrorCode
from sparsekv.proto.blocks import KEY_BYTES, chain_hashes, root_key

import helpers


def by_hand(namespace: str, tokens: list[int], bs: int, parent: bytes | None = None) -> np.ndarray:
    key = parent or hashlib.blake2b(b"sparsekv-blocks\0" + namespace.encode(), digest_size=16).digest()
    out = b""
    for i in range(len(tokens) // bs):
        key = hashlib.blake2b(key + np.array(tokens[i * bs:(i + 1) * bs], "<i4").tobytes(), digest_size=16).digest()
        out += key
    return np.frombuffer(out, np.int64).reshape(-1, 2)


def test_keys_follow_the_documented_rule_and_a_partial_block_has_none():
    toks = [5, 7, -3, 2**31 - 1, 0, 9, 11]
    for t in (toks, np.array(toks, np.int64), np.array(toks, np.int32), np.array([5, 7, 2**31 - 1, 0], np.uint32)):
        want = by_hand("ns", list(np.asarray(t).tolist()), 2)
        assert np.array_equal(chain_hashes("ns", t, 2), want)
    assert chain_hashes("ns", [], 4).shape == (0, 2)
    assert root_key("ns") == hashlib.blake2b(b"sparsekv-blocks\0ns", digest_size=16).digest()


def test_a_parent_is_a_key_as_bytes_or_a_row_of_hashes():
    first = chain_hashes("ns", [1, 2, 3, 4], 2)
    rest = chain_hashes("ns", [5, 6], 2, parent=first[-1])
    assert np.array_equal(rest, chain_hashes("ns", [5, 6], 2, parent=first[-1].tobytes()))
    assert np.array_equal(chain_hashes("ns", [1, 2, 3, 4, 5, 6], 2)[-1], rest[0])
    for bad, words in ((16, "got int"), ("x" * 16, "got str"), (b"x" * 15, "16-byte key, got 15"),
                       (np.zeros(2, np.int32), "got int32"), (np.zeros((1, 2), np.int64), r"\(1, 2\)")):
        with pytest.raises(ValueError, match=words):
            chain_hashes("ns", [1, 2], 2, parent=bad)
    assert KEY_BYTES == 16


@pytest.mark.parametrize("tokens, words", [
    ([11, 12, 13, 14 + 2**32], "tokens holds 4294967310, outside int32"),
    (np.array([11, 12, 13, 14 + 2**32]), "outside int32"),
    (np.array([2**64 - 2**32 + 4], np.uint64), "outside int32"),
    ([-(2**31) - 1, 1], "tokens holds -2147483649, outside int32"),
    ([11.0, 12.4, 13.9, 14.2], "tokens must hold integers, got float64"),
    (np.array([True, False]), "got bool"),
    (["a", "b"], "got <U1"),
    ([[1, 2], [3]], "tokens must be an array of integers"),
])
def test_token_ids_a_cast_would_change_are_refused(tokens, words):
    with pytest.raises(ValueError, match=words):
        chain_hashes("ns", tokens, 2)


def test_the_client_refuses_them_as_bad_argument_in_process_and_through_the_daemon(module_daemon):
    lay = helpers.layout(host_rows=64)
    with Client(module_daemon.run_dir, name="hash-rule") as d, InprocClient() as c:
        for x in (c, d):
            x.attach(lay, engine="hash-rule", block_size=4)
            for bad in (np.array([11, 12, 13, 14 + 2**32]), [11.0, 12.4, 13.9, 14.2]):
                with pytest.raises(BadRequest) as ei:
                    x.blocks.hashes(bad)
                assert ei.value.code == ErrorCode.BAD_ARGUMENT
            assert x.blocks.hashes([11, 12, 13, 14]).shape == (1, 2)
        d.detach()
