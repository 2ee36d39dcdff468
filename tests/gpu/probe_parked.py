"""Which CUDA calls of a process wait for a stream of that process parked on a stream
wait (a doorbell rank's stream between its engine's bells)?

    python3 tests/gpu/probe_parked.py [--timeout-s 3]

Each call runs in a fresh process: park a non-blocking stream on ``cuStreamWaitValue32``
over a word of mapped pinned memory, make the call on a thread, and see whether it returns
within the timeout; then release the word from the host and see whether it returns after.
One JSON line per call: ``{"call": ..., "parked": "returned" | "blocked", "ms": ...}``.
``*_beside`` calls make the blocked call (cudaHostUnregister) on one thread and the named
call on another: does a blocked call hold up the process's other CUDA calls?
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import threading
import time


def _ipc_child(conn):
    import cupy as cp

    buf = cp.zeros(1 << 20, dtype=cp.uint8)
    conn.send(bytes(cp.cuda.runtime.ipcGetMemHandle(buf.data.ptr)))
    conn.recv()  # hold the memory until the parent is done


def _calls(cp, state):
    rt = cp.cuda.runtime

    def host_register():
        m = mmap.mmap(-1, 1 << 21)
        state["mm"] = m
        addr = ctypes_addr(m)
        rt.hostRegister(addr, 1 << 21, 0)
        state["registered"] = addr

    def host_unregister():
        rt.hostUnregister(state["registered"])

    def host_alloc():  # cudaHostAlloc (CuPy's pinned pool takes a new size class so)
        state["hp"] = rt.hostAlloc(1 << 20, 0)

    def free_host():
        rt.freeHost(state["hp"])

    def malloc_free():
        p = rt.malloc(1 << 26)
        rt.free(p)

    def malloc():
        state["p"] = rt.malloc(1 << 26)

    def event_destroy():
        e = rt.eventCreateWithFlags(2)
        rt.eventDestroy(e)

    def stream_destroy():
        s = rt.streamCreateWithFlags(1)
        rt.streamDestroy(s)

    def ipc_open():
        state["ipc"] = rt.ipcOpenMemHandle(state["handle"], 1)

    def ipc_close():
        rt.ipcCloseMemHandle(state["ipc"])

    def kernel_launch():  # a module loaded before the stream parked
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            state["k"](state["x"])
        s.synchronize()

    def module_load():
        k = cp.ElementwiseKernel("float32 x", "float32 y", "y = x * 3.0f + 1.0f", "probe_new_module")
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            k(state["x"])
        s.synchronize()

    return {"host_register": host_register, "host_unregister": host_unregister, "malloc_free": malloc_free,
            "malloc": malloc, "event_destroy": event_destroy, "stream_destroy": stream_destroy,
            "ipc_open": ipc_open, "ipc_close": ipc_close, "kernel_launch": kernel_launch,
            "module_load": module_load, "host_alloc": host_alloc, "free_host": free_host}


def ctypes_addr(m) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(m))


# What runs before the stream parks: the calls the named one needs done first.
SETUP = {"host_unregister": ["host_register"], "ipc_close": ["ipc_open"], "free_host": ["host_alloc"]}
CALLS = ["host_register", "host_unregister", "malloc", "malloc_free", "event_destroy", "stream_destroy",
         "ipc_open", "ipc_close", "kernel_launch", "module_load", "kernel_launch_beside", "malloc_beside",
         "host_register_beside", "host_alloc", "free_host"]


def _probe(name: str, timeout_s: float, out) -> None:
    import cupy as cp

    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "proto" / "stream_ops.py"
    spec = importlib.util.spec_from_file_location("stream_ops", path)
    stream_ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stream_ops)
    wait32 = stream_ops.wait32

    state: dict = {}
    state["x"] = cp.ones(1024, dtype=cp.float32)
    state["k"] = cp.ElementwiseKernel("float32 x", "float32 y", "y = x * 2.0f", "probe_loaded")
    state["k"](state["x"])
    cp.cuda.Device().synchronize()
    child = None
    if name.startswith("ipc"):
        ctx = mp.get_context("spawn")
        parent, theirs = ctx.Pipe()
        child = ctx.Process(target=_ipc_child, args=(theirs,), daemon=True)
        child.start()
        state["handle"] = parent.recv()
    calls = _calls(cp, state)
    beside = name.endswith("_beside")
    base = name[: -len("_beside")] if beside else name
    for pre in SETUP.get(base, []) + (["host_register"] if beside else []):
        calls[pre]()
    word = cp.cuda.alloc_pinned_memory(4)
    flag = ctypes_u32(word.ptr)
    flag[0] = 0
    dptr = word.ptr  # pinned memory of cudaHostAlloc: the same address on the device (UVA)
    parked = cp.cuda.Stream(non_blocking=True)
    wait32(parked.ptr, dptr, 1)
    time.sleep(0.05)
    threads = []
    if beside:  # the blocking call on its own thread first
        tb = threading.Thread(target=calls["host_unregister"], daemon=True)
        tb.start()
        time.sleep(0.2)
        threads.append(tb)
    done = threading.Event()
    err: list = []

    def run():
        try:
            calls[base]()
        except Exception as e:  # noqa: BLE001 - reported
            err.append(repr(e))
        done.set()

    t0 = time.perf_counter()
    threading.Thread(target=run, daemon=True).start()
    returned = done.wait(timeout_s)
    ms = (time.perf_counter() - t0) * 1e3
    flag[0] = 1  # release the parked stream
    after = done.wait(timeout_s)
    ms_after = (time.perf_counter() - t0) * 1e3
    out.put({"call": name, "parked": "returned" if returned else "blocked", "ms": round(ms, 2),
             "after_release": "returned" if after else "blocked", "ms_after": round(ms_after, 2),
             "error": err[0] if err else None})
    if child is not None:
        parent.send(b"done")


def ctypes_u32(address: int):
    import ctypes

    return (ctypes.c_uint32 * 1).from_address(address)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout-s", type=float, default=3.0)
    ap.add_argument("--calls", default=",".join(CALLS))
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    for name in a.calls.split(","):
        q = ctx.Queue()
        p = ctx.Process(target=_probe, args=(name, a.timeout_s, q), daemon=True)
        p.start()
        try:
            print(json.dumps(q.get(timeout=4 * a.timeout_s + 30)), flush=True)
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"call": name, "probe_failed": repr(e)}), flush=True)
        p.join(5)
        if p.is_alive():
            p.kill()


if __name__ == "__main__":
    main()
