"""Probe (H200, under MPS): after a process that opened a CUDA IPC handle is SIGKILLed,
can a new process open the same handle, and a handle of a fresh allocation? The chaos
soak saw cudaIpcOpenMemHandle fail with cudaErrorInvalidResourceHandle for > 10 s right
after such a kill (docs/PERF.md, session 8). Prints one line per open.
Usage: python3 tests/gpu/probe_ipc_after_kill.py"""

import os
import signal
import subprocess
import sys
import time

CHILD = r"""
import sys, time
import cupy as cp
mode, deadline = sys.argv[1], float(sys.argv[3])
handles = [bytes.fromhex(h) for h in sys.argv[2].split(",")]
if mode == "hold":
    p = cp.cuda.runtime.ipcOpenMemHandle(handles[0], 1)
    cp.cuda.runtime.memset(p, 1, 1 << 20)
    cp.cuda.runtime.deviceSynchronize()
    print("opened", flush=True)
    time.sleep(3600)
for i, h in enumerate(handles):
    t0 = time.monotonic()
    tries = 0
    while True:
        tries += 1
        try:
            p = cp.cuda.runtime.ipcOpenMemHandle(h, 1)
            print(f"handle {i}: opened after {time.monotonic() - t0:.3f} s, {tries} tries", flush=True)
            cp.cuda.runtime.ipcCloseMemHandle(p)
            break
        except cp.cuda.runtime.CUDARuntimeError as e:
            if time.monotonic() - t0 > deadline:
                print(f"handle {i}: still {e} after {tries} tries, {time.monotonic() - t0:.1f} s", flush=True)
                break
            time.sleep(0.05)
"""


def child(mode, handles, deadline=15.0, **kw):
    return subprocess.Popen([sys.executable, "-c", CHILD, mode, ",".join(h.hex() for h in handles), str(deadline)],
                            stdout=subprocess.PIPE, text=True, **kw)


def main():
    import cupy as cp

    ptrs = [cp.cuda.runtime.malloc(64 << 20) for _ in range(2)]
    h = [bytes(cp.cuda.runtime.ipcGetMemHandle(p)) for p in ptrs]
    print("probe_ipc_after_kill: two allocations exported; a holder opens the first", flush=True)
    holder = child("hold", h[:1])
    line = holder.stdout.readline().strip()
    print(f"holder: {line}", flush=True)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    t_kill = time.monotonic()
    print("holder SIGKILLed; a new process opens the first handle, then the second (fresh)", flush=True)
    r = child("open", h)
    out, _ = r.communicate(timeout=60)
    print(out.strip(), f"(started {time.monotonic() - t_kill:.1f} s after the kill)", flush=True)
    r2 = child("open", h[:1])
    out, _ = r2.communicate(timeout=60)
    print("a second new process, first handle:", out.strip(), flush=True)


if __name__ == "__main__":
    main()
