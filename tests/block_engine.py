"""An engine process that uses its engine's block store, driven by a test one JSON line at
a time on stdin (one JSON answer a line on stdout): the block store tests' real process.
Tests start it through :class:`Engine`:

    python tests/block_engine.py RUN_DIR ENGINE LAYOUT_JSON BLOCK_SIZE DEVICE [INDEX_BYTES]

The first line out is ``{"pid": ..., "client_id": ...}`` once attached (or the attach's
``{"err": CODE, "msg": ...}``, and the process ends). Commands (``op``):

* ``prefill`` (tokens): look the prompt's chain up, allocate the blocks it misses, write
  their rows (the bytes of :func:`block_bytes`, a function of the block's key alone, as KV
  is of its prefix), commit them; answers ``hit`` (blocks found), ``table`` (the
  request's block table: hits, then its own blocks) and ``duplicates`` (blocks another
  engine committed first: this one keeps its own); with INDEX_BYTES (an indexer keys
  plane) it writes its blocks' keys (:func:`key_bytes`) before it commits them;
* ``request`` (tokens, release): a whole request as a scheduler runs it: ``prefill`` with
  admission (look the prompt up, then ``reserve`` what it missed: ``{"refused": ...,
  "hit": n}`` on POOL_EXHAUSTED, the hits released again), ``verify`` (its keys too), and
  ``release`` the table if asked;
* ``verify`` (tokens, table): read every position of the prompt through the engine's
  handle (``HostSwapIn.swap_in`` with the request's block table, which points at the
  shared blocks: no copy), and count rows whose bytes are wrong (``bad``); with a keys
  plane, read the table's indexer keys and count positions whose keys are wrong
  (``bad_keys``);
* ``load_keys`` (tokens, table): have the daemon load the table's indexer keys into this
  engine's buffer (``Blocks.load_keys``: shared memory on cpu, a GPU tensor on cuda, the
  rank attached with fences), read them right after, and count positions whose keys
  are wrong (``bad_keys``);
* ``alloc`` (n), ``release`` (blocks): the store's requests as they are.
A typed error answers ``{"err": CODE, "detail": ...}``.
"""

import json
import os
import select
import subprocess
import sys

import numpy as np

from sparsekv.client import Client, PoolExhausted, SparseKVError
from sparsekv.client.engine_slab import EngineSlab
from sparsekv.client.swap_in import HostSwapIn
from sparsekv.proto import Layout


LAY = Layout(num_layers=2, row_bytes=32, top_k=4, region_stride=8, max_reqs=4, host_rows=64,
             index_groups=((0, 1),)).validate()  # the tests' store: 16 blocks of 4 rows
BS = 4
INDEX_BYTES = 12  # the tests' indexer keys plane: 12 bytes a position and layer
KEYS = (LAY.num_layers, BS, INDEX_BYTES)  # one block's keys


def attach_keys(c: Client, engine: str = "m", index_bytes: int = INDEX_BYTES):
    """``c`` attached to ``engine`` with a block store and a keys plane; its ``blocks``."""
    c.attach(LAY, engine=engine, block_size=BS, index_bytes=index_bytes)
    return c.blocks


def keys_of(seed: int, n: int) -> np.ndarray:
    """``n`` blocks' keys of random bytes."""
    return np.random.default_rng(seed).integers(0, 256, (n, *KEYS), dtype=np.uint8)


def tokens(seed: int, n_blocks: int) -> list[int]:
    """``n_blocks`` blocks of token ids, the same for the same seed."""
    return np.random.default_rng(seed).integers(0, 50_000, n_blocks * BS).tolist()


class Engine:
    """This script in a process of its own (run by ``as_user``, a command prefix, when
    given), a rank on ``device`` attached to ``engine`` with :data:`LAY` and :data:`BS`;
    ``(op, **args)`` runs one command there and returns its answer; ``hello`` is its
    first line."""

    def __init__(self, run_dir: str, engine: str = "m", as_user=(), device: str = "cpu", index_bytes: int = 0):
        self.p = subprocess.Popen([*as_user, sys.executable, os.path.abspath(__file__), run_dir, engine,
                                   json.dumps(LAY.to_wire()), str(BS), device, str(index_bytes)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/tmp")
        self.hello = self._read()

    def __call__(self, op: str, **args):
        self.p.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.p.stdin.flush()
        return self._read()

    def _read(self):
        if not select.select([self.p.stdout], [], [], 30)[0]:
            raise AssertionError("the engine process did not answer within 30 s")
        line = self.p.stdout.readline()
        if not line:
            raise AssertionError(f"the engine process ended: {self.p.stderr.read()}")
        return json.loads(line)

    def kill(self):
        self.p.kill()
        self.p.wait()

    def close(self):
        if self.p.poll() is None:
            self.p.stdin.close()
            self.p.wait(10)


def block_bytes(key: np.ndarray, num_layers: int, block_size: int, row_bytes: int) -> np.ndarray:
    """What a block under ``key`` (int64 [2]) holds: uint8 [num_layers, block_size, row_bytes]."""
    rng = np.random.default_rng([int(k) & (2**63 - 1) for k in key])
    return rng.integers(0, 256, (num_layers, block_size, row_bytes), dtype=np.uint8)


def key_bytes(key: np.ndarray, num_layers: int, block_size: int, index_bytes: int) -> np.ndarray:
    """The indexer keys of a block under ``key``: uint8 [num_layers, block_size, index_bytes]."""
    rng = np.random.default_rng([int(k) & (2**63 - 1) for k in key] + [1])
    return rng.integers(0, 256, (num_layers, block_size, index_bytes), dtype=np.uint8)


def prefill(c: Client, tokens, admit: bool = False) -> dict:
    """Look ``tokens``' chain up, then allocate, write and commit the blocks it misses;
    with ``admit`` reserve those first (``PoolExhausted`` or QUOTA_EXCEEDED raised with
    the hits released)."""
    blocks, lay, bs = c.blocks, c.attachment.layout, c.blocks.block_size
    keys = blocks.hashes(np.asarray(tokens))
    hit = blocks.lookup(keys)
    if admit:
        try:
            blocks.reserve(len(keys) - hit.size)
        except SparseKVError as e:
            blocks.release(hit)
            e.hits = int(hit.size)  # looked up (and counted by the daemon) before the refusal
            raise
    new = blocks.alloc(len(keys) - hit.size)
    dup = 0
    if new.size:
        data = np.concatenate([block_bytes(k, lay.num_layers, bs, lay.row_bytes) for k in keys[hit.size:]], axis=1)
        c.write(blocks.rows(new), data)
        if blocks.index_bytes:
            blocks.write_keys(new, np.stack([key_bytes(k, *blocks.keys_shape) for k in keys[hit.size:]]))
        dup = int((blocks.commit(new, keys[hit.size:]) != new).sum())  # another engine's came first: ours stays
    return {"hit": int(hit.size), "table": [*hit.tolist(), *new.tolist()], "duplicates": dup}


def verify(c: Client, handle: HostSwapIn, tokens, table) -> int:
    """Rows with wrong bytes when the engine's handle reads every position of ``tokens``
    (top_k a step, state row 0 reset each step) through the request's block ``table``."""
    lay, bs = handle.layout, c.blocks.block_size
    keys = c.blocks.hashes(np.asarray(tokens))
    table = np.asarray(table, dtype=np.int32)[None, :]  # state row 0's
    want = np.concatenate([block_bytes(k, lay.num_layers, bs, lay.row_bytes) for k in keys], axis=1)
    bad = 0
    for p0 in range(0, keys.shape[0] * bs, lay.top_k):
        pos = np.arange(p0, p0 + lay.top_k)[None, :]
        handle.begin_step(np.array([0], np.int32), reset=np.array([True]))
        for layer in range(lay.num_layers):
            idx = handle.swap_in(np.array([0], np.int32), table, pos, layer=layer, block_size=bs)
            kv = handle.kv(layer)
            kv = kv if isinstance(kv, np.ndarray) else kv.cpu().numpy()  # a cuda rank's: a torch tensor
            bad += int((kv[idx[0]] != want[layer, pos[0]]).any(axis=1).sum())
    return bad


def verify_keys(c: Client, tokens, table) -> int:
    """Positions (of every layer) whose indexer keys, read from the store, are wrong."""
    keys = c.blocks.hashes(np.asarray(tokens))
    want = np.stack([key_bytes(k, *c.blocks.keys_shape) for k in keys])
    return int((c.blocks.read_keys(table) != want).any(axis=3).sum())


def load_keys(c: Client, dst, tokens, table) -> int:
    """Positions (of every layer) whose indexer keys, loaded into ``dst`` by the daemon, are
    wrong; a GPU ``dst`` is read on the current stream right after the call."""
    keys = c.blocks.hashes(np.asarray(tokens))
    want = np.stack([key_bytes(k, *c.blocks.keys_shape) for k in keys])
    assert c.blocks.load_keys(table, dst) == want.nbytes
    got = dst.array[:want.nbytes] if isinstance(dst, EngineSlab) else dst[:want.nbytes].cpu().numpy()
    return int((got.reshape(want.shape) != want).any(axis=3).sum())


def serve(run_dir: str, engine: str, layout: Layout, block_size: int, device: str, index_bytes: int) -> None:
    c = Client(run_dir, name="block-engine", device=device, timeout_s=20).connect()
    try:
        c.attach(layout, engine=engine, block_size=block_size, index_bytes=index_bytes,
                 fence=device.startswith("cuda"))
    except SparseKVError as e:
        print(json.dumps({"err": e.code.name, "msg": e.args[0]}), flush=True)
        return
    blocks, handle = c.blocks, HostSwapIn(c)
    dst = None  # the buffer keys are loaded into (every block's room), made at the first load
    print(json.dumps({"pid": os.getpid(), "client_id": c.info["client_id"]}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "prefill":
                out = prefill(c, cmd["tokens"])
            elif op == "verify":
                out = {"bad": verify(c, handle, cmd["tokens"], cmd["table"])}
                if blocks.index_bytes:
                    out["bad_keys"] = verify_keys(c, cmd["tokens"], cmd["table"])
            elif op == "request":
                try:
                    out = prefill(c, cmd["tokens"], admit=True)
                except PoolExhausted as e:
                    print(json.dumps({"refused": {"free": e.free, "evictable": e.evictable,
                                                  "reserved": e.reserved}, "hit": getattr(e, "hits", 0)}), flush=True)
                    continue
                out["bad"] = verify(c, handle, cmd["tokens"], out["table"])
                if blocks.index_bytes:
                    out["bad_keys"] = verify_keys(c, cmd["tokens"], out["table"])
                if cmd.get("release"):
                    blocks.release(out["table"])
            elif op == "load_keys":
                if dst is None:
                    n = layout.host_rows // block_size * int(np.prod(blocks.keys_shape))
                    if device.startswith("cuda"):
                        import torch  # noqa: PLC0415  (cuda engines only)

                        dst = torch.zeros(n, dtype=torch.uint8, device=device)
                    else:
                        dst = EngineSlab.shared_memory(n)
                out = {"bad_keys": load_keys(c, dst, cmd["tokens"], cmd["table"])}
            elif op == "alloc":
                out = {"blocks": blocks.alloc(cmd["n"]).tolist()}
            elif op == "release":
                blocks.release(cmd["blocks"])
                out = {}
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
    serve(sys.argv[1], sys.argv[2], Layout.from_wire(json.loads(sys.argv[3])), int(sys.argv[4]), sys.argv[5],
          int(sys.argv[6]))
