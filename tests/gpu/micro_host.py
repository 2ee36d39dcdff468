"""Host cost of the calls on the zmq decode path (GPU machine, under MPS): medians in us."""
import time

import cupy as cp
import numpy as np

from sparsekv.proto import MsgType, decode, encode
from sparsekv.proto.cuda_ipc import EventRing


def t(fn, n=2000):
    fn()
    xs = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        xs.append(time.perf_counter_ns() - t0)
    return np.median(xs) / 1e3


s = cp.cuda.Stream(non_blocking=True)
ring = EventRing(0, 8)
plain = cp.cuda.Event(block=False, disable_timing=True)
a = cp.zeros(16, cp.int32)
k = cp.ElementwiseKernel("int32 x", "int32 y", "y = x + 1", "inc")
with s:
    k(a, a)
s.begin_capture()
with s:
    k(a, a)
g = s.end_capture()
g.upload(s)
s.synchronize()
host = np.zeros(16 * 2048, np.int32)
src = np.ones((16, 2048), np.int32)
sr, rs, inv = np.arange(16, dtype=np.int32), np.zeros(16, bool), np.zeros((16, 0), np.int32)
step_frames = encode(MsgType.STEP, 1, {"step": 1}, {"state_rows": sr, "reset": rs, "invalidate": inv})
topk_frames = encode(MsgType.TOPK, 2, {"step": 1, "group": 0}, {"topk": src})
step_bytes = [bytes(f) for f in step_frames]
topk_bytes = [bytes(f) for f in topk_frames]
rows = {
    "event query (IPC event, done)": t(lambda: ring.events[0].done),
    "event record (IPC event)": t(lambda: ring.events[0].record(s)),
    "event record (plain event)": t(lambda: plain.record(s)),
    "graph launch (1 kernel)": t(lambda: g.launch(s)),
    "with cp.cuda.Device(0)": t(lambda: cp.cuda.Device(0).__enter__()),
    "numpy copy 128 KiB": t(lambda: host.__setitem__(slice(None), src.reshape(-1))),
    "decode STEP (3 arrays)": t(lambda: decode(step_bytes)),
    "decode TOPK (1 array)": t(lambda: decode(topk_bytes)),
    "encode reply": t(lambda: encode(MsgType.TOPK, 2, {"ok": True, "entry": 1, "batch": 16, "k": 2048})),
    "perf_counter_ns": t(time.perf_counter_ns),
}
s.synchronize()
for name, us in rows.items():
    print(f"{name:36s} {us:8.2f} us")
