"""An engine process that uses its engine's block store, driven by a test one JSON line at
a time on stdin (one JSON answer a line on stdout): the block store tests' real process.

    python tests/block_engine.py RUN_DIR ENGINE LAYOUT_JSON BLOCK_SIZE

The first line out is ``{"pid": ..., "client_id": ...}`` once attached (or the attach's
``{"err": CODE, "msg": ...}``, and the process ends). Commands (``op``):

* ``prefill`` (tokens): look the prompt's chain up, allocate the blocks it misses, write
  their rows (the bytes of :func:`block_bytes`, a function of the block's key alone, as KV
  is of its prefix), commit them; answers ``hit`` (blocks found) and ``table`` (the
  request's block table: hits, then its own blocks);
* ``verify`` (tokens, table): read every position of the prompt through ``step`` /
  ``topk`` with the block table mapped by ``proto.positions.host_rows`` (the engine's
  block table pointing at the shared blocks), and count hot rows whose bytes are wrong;
* ``reserve`` (n), ``alloc`` (n), ``release`` (blocks), ``write`` (blocks): the store's
  requests as they are; ``stats``.
A typed error answers ``{"err": CODE, "detail": ...}``.
"""

import json
import os
import sys

import numpy as np

from sparsekv.client import Client, PoolExhausted, SparseKVError
from sparsekv.proto import Layout
from sparsekv.proto.positions import host_rows


def block_bytes(key: np.ndarray, num_layers: int, block_size: int, row_bytes: int) -> np.ndarray:
    """What a block under ``key`` (int64 [2]) holds: uint8 [num_layers, block_size, row_bytes]."""
    rng = np.random.default_rng([int(k) & (2**63 - 1) for k in key])
    return rng.integers(0, 256, (num_layers, block_size, row_bytes), dtype=np.uint8)


def serve(run_dir: str, engine: str, layout: Layout, block_size: int) -> None:
    c = Client(run_dir, name="block-engine", timeout_s=20).connect()
    try:
        att = c.attach(layout, engine=engine, block_size=block_size)
    except SparseKVError as e:
        print(json.dumps({"err": e.code.name, "msg": e.args[0]}), flush=True)
        return
    blocks, lay, bs = c.blocks, layout, block_size
    print(json.dumps({"pid": os.getpid(), "client_id": c.info["client_id"]}), flush=True)
    step = 0
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "prefill":
                keys = blocks.hashes(np.asarray(cmd["tokens"]))
                hit = blocks.lookup(keys)
                new = blocks.alloc(len(keys) - hit.size)
                if new.size:
                    data = np.concatenate([block_bytes(k, lay.num_layers, bs, lay.row_bytes) for k in keys[hit.size:]],
                                          axis=1)
                    c.write(blocks.rows(new), data)
                    held = blocks.commit(new, keys[hit.size:])
                    assert (held == new).all(), "another engine committed the same blocks meanwhile"
                out = {"hit": int(hit.size), "table": [*hit.tolist(), *new.tolist()]}
            elif op == "verify":
                keys = blocks.hashes(np.asarray(cmd["tokens"]))
                table = np.asarray(cmd["table"], dtype=np.int32)[None, :]
                want = np.concatenate([block_bytes(k, lay.num_layers, bs, lay.row_bytes) for k in keys], axis=1)
                bad = 0
                for p0 in range(0, keys.shape[0] * bs, lay.top_k):
                    pos = np.arange(p0, p0 + lay.top_k)[None, :]
                    rows = host_rows(pos, table, bs)
                    c.step(step, np.array([0], np.int32), reset=np.array([True]))
                    r = c.topk(step, 0, rows)
                    step += 1
                    for layer in lay.groups[0]:
                        got = att.slab[layer, 0, r.slots[0]]
                        bad += int((got != want[layer, pos[0]]).any(axis=1).sum())
                out = {"bad": bad}
            elif op == "reserve":
                out = blocks.reserve(cmd["n"])
            elif op == "alloc":
                out = {"blocks": blocks.alloc(cmd["n"]).tolist()}
            elif op == "release":
                blocks.release(cmd["blocks"])
                out = {}
            elif op == "write":
                rows = blocks.rows(cmd["blocks"])
                out = c.write(rows, np.full((lay.num_layers, rows.size, lay.row_bytes), 0x5A, np.uint8))
            elif op == "stats":
                out = c.stats()
            else:
                raise ValueError(f"unknown op {op}")
        except PoolExhausted as e:
            out = {"err": e.code.name, "detail": {"wanted": e.wanted, "free": e.free, "evictable": e.evictable,
                                                  "reserved": e.reserved}}
        except SparseKVError as e:
            out = {"err": e.code.name, "msg": e.args[0]}
        print(json.dumps(out), flush=True)
    c.close()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], Layout.from_wire(json.loads(sys.argv[3])), int(sys.argv[4]))
