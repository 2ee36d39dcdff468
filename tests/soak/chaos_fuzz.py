"""The hostile peer of tests/soak/test_chaos.py, run as its own process:
``python chaos_fuzz.py RUN_DIR SEED SUMMARY_PATH``.

Rounds of: a fresh DEALER socket on control.sock, a burst of frames (random bytes, random
multi-frame messages, random msgpack maps, then structurally valid messages with wrong
contents: every message type before HELLO, a HELLO with a wrong version or a lying pid,
ATTACH of junk layouts to its own engine names ``fz*``, STEP / TOPK / WRITE / STAGE with
wrong dtypes, shapes and values), each reply read and decoded. A reply whose code is
INTERNAL is counted. It never attaches to the verifying clients' engines. The daemon may
be killed under it: it just starts a new round. Totals go to SUMMARY_PATH (rewritten)."""

import json
import os
import sys
import time

import msgpack
import numpy as np
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import helpers  # noqa: E402
from sparsekv.proto import PROTOCOL_VERSION, MsgType, encode  # noqa: E402

GOOD = helpers.layout(num_layers=2, row_bytes=16, top_k=4, region_stride=8, max_reqs=2, host_rows=32)


def junk_value(rng):
    return [None, True, -1, 2**63, 2**64 - 1, 1.5, float("nan"), float("inf"), "x", b"\xff", [], [[1]], {"a": 1},
            0, 3, -(2**63)][int(rng.integers(16))]


def junk_array(rng):
    dtype = ["int32", "int64", "uint8", "bool", "float32", "float64"][int(rng.integers(6))]
    shape = tuple(int(x) for x in rng.integers(0, 6, int(rng.integers(0, 4))))
    a = rng.integers(-3, 300, shape if shape else ()).astype(dtype)
    return a


def messages(rng, req_id):
    """One burst: a list of frame lists."""
    out = []
    for _ in range(int(rng.integers(1, 4))):
        out.append([rng.bytes(int(rng.integers(0, 200)))])
    out.append([rng.bytes(int(rng.integers(1, 60))) for _ in range(int(rng.integers(2, 5)))])
    out.append([msgpack.packb({str(junk_value(rng))[:5]: junk_value(rng) for _ in range(3)}, use_bin_type=True)])
    out.append([msgpack.packb({"v": PROTOCOL_VERSION, "t": int(rng.integers(-1, 14)), "id": junk_value(rng)}, use_bin_type=True)])
    # Structurally valid, wrong contents.
    t = MsgType(int(rng.integers(1, 11)))
    out.append(encode(t, req_id, {"step": junk_value(rng), "group": junk_value(rng), "layers": junk_value(rng)},
                      {"topk": junk_array(rng), "state_rows": junk_array(rng)}))
    out.append(encode(MsgType.HELLO, req_id + 1, {"v": int(rng.integers(2, 9)), "pid": 1, "rank": 0,
                                                  "device": "cpu", "name": "fz"}))
    out.append(encode(MsgType.HELLO, req_id + 2, {"pid": int(rng.integers(1, 2**31)), "rank": junk_value(rng),
                                                  "device": junk_value(rng), "name": junk_value(rng)}))
    out.append(encode(MsgType.HELLO, req_id + 3, {"pid": os.getpid(), "rank": 0, "device": "cpu", "name": "fz"}))
    wire = GOOD.to_wire()
    if rng.random() < 0.7:
        key = sorted(wire)[int(rng.integers(len(wire)))]
        wire[key] = junk_value(rng)
    out.append(encode(MsgType.ATTACH, req_id + 4, {"engine": f"fz{int(rng.integers(3))}", "layout": wire}))
    for t in (MsgType.STEP, MsgType.TOPK, MsgType.WRITE, MsgType.STAGE, MsgType.WRITE_STAGED, MsgType.STATS):
        arrays = {name: junk_array(rng) for name in ("rows", "data", "topk", "state_rows", "reset", "invalidate")
                  if rng.random() < 0.5}
        out.append(encode(t, req_id + 5 + int(t), {"step": int(rng.integers(-2, 5)), "group": int(rng.integers(-1, 3)),
                                                  "layers": [int(x) for x in rng.integers(-1, 3, 2)]}, arrays))
    if rng.random() < 0.3:
        out.append(encode(MsgType.DETACH, req_id + 20))
    out.append(encode(MsgType.BYE, req_id + 21))
    return out


def main(run_dir: str, seed: int, summary_path: str) -> None:
    rng = np.random.default_rng(seed)
    ctx = zmq.Context.instance()
    tot = {"rounds": 0, "sent": 0, "replies": 0, "internal": 0, "codes": {}}
    req_id = 1
    while True:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"ipc://{os.path.join(run_dir, 'control.sock')}")
        try:
            burst = messages(rng, req_id)
            for frames in burst:
                sock.send_multipart(frames, copy=True)
                tot["sent"] += 1
            req_id += 30
            deadline, got = time.monotonic() + 0.3, 0
            while time.monotonic() < deadline and got < len(burst):
                if not sock.poll(50):
                    continue
                reply = sock.recv_multipart()
                tot["replies"] += 1
                got += 1
                try:
                    head = msgpack.unpackb(reply[0], raw=False)
                except Exception:  # noqa: BLE001
                    head = {"error": "UNDECODABLE_REPLY"}
                if not head.get("ok", False):
                    code = str(head.get("error"))
                    tot["codes"][code] = tot["codes"].get(code, 0) + 1
                    if code == "INTERNAL":
                        tot["internal"] += 1
        finally:
            sock.close()
        tot["rounds"] += 1
        tmp = summary_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(tot, f)
        os.replace(tmp, summary_path)
        time.sleep(0.01)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
