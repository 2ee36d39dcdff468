"""Probe (H200, under MPS): after a process that opened a CUDA IPC handle is SIGKILLed,
can a new process open the same handle, and a handle of a fresh allocation? The chaos
soak saw cudaIpcOpenMemHandle fail with cudaErrorInvalidResourceHandle for > 10 s right
after such a kill (docs/PERF.md, session 8). Prints one line per case:

- idle:   the holder had the handle open, nothing queued, when it was killed;
- busy:   the holder had thousands of memsets on the mapped memory queued;
- two:    two holders, one killed; the survivor keeps it open while a new process opens;
- fresh:  an allocation nobody opened yet (after all the kills above);
- reopen: one process opens, closes and opens the same handle again;
- exporter: the exporter is killed while a holder maps its memory; a new exporter's fresh
  handle is opened by that holder (the daemon-restart case);
- dead exporter: a handle whose exporter was SIGKILLed, opened by a new process, while a
  holder still maps it and once nobody does (a client handed a lost daemon's handle).
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
handles = [bytes.fromhex(h) for h in sys.argv[2].split(",") if h]
rt = cp.cuda.runtime

def open_retry(h):
    t0, tries = time.monotonic(), 0
    while True:
        tries += 1
        try:
            p = rt.ipcOpenMemHandle(h, 1)
            return p, f"opened after {time.monotonic() - t0:.3f} s, {tries} tries"
        except rt.CUDARuntimeError as e:
            if time.monotonic() - t0 > deadline:
                return None, f"still {e} after {tries} tries, {time.monotonic() - t0:.1f} s"
            time.sleep(0.05)

if mode in ("hold", "busy"):
    p = rt.ipcOpenMemHandle(handles[0], 1)
    rt.memset(p, 1, 1 << 20)
    rt.deviceSynchronize()
    if mode == "busy":
        s = cp.cuda.Stream(non_blocking=True)
        a = cp.ndarray((16 << 20,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(p, 16 << 20, None), 0))
        with s:
            for _ in range(20000):
                a += 1
    print("opened", flush=True)
    time.sleep(3600)
elif mode == "export":  # allocate, export, print the handle, then wait
    ptr = rt.malloc(64 << 20)
    print(bytes(rt.ipcGetMemHandle(ptr)).hex(), flush=True)
    time.sleep(3600)
elif mode == "reopen":
    p, msg = open_retry(handles[0]); print("first open:", msg, flush=True)
    if p: rt.ipcCloseMemHandle(p)
    p, msg = open_retry(handles[0]); print("second open:", msg, flush=True)
elif mode == "holdthen":  # hold handle 0, then read handles from stdin and open each
    p = rt.ipcOpenMemHandle(handles[0], 1)
    rt.deviceSynchronize()
    print("opened", flush=True)
    for line in sys.stdin:
        p2, msg = open_retry(bytes.fromhex(line.strip()))
        print("new exporter's handle:", msg, flush=True)
        break
else:
    for i, h in enumerate(handles):
        p, msg = open_retry(h)
        print(f"handle {i}: {msg}", flush=True)
        if p: rt.ipcCloseMemHandle(p)
"""


def child(mode, handles, deadline=8.0, **kw):
    return subprocess.Popen([sys.executable, "-c", CHILD, mode, ",".join(h.hex() for h in handles), str(deadline)],
                            stdout=subprocess.PIPE, text=True, **kw)


def run(mode, handles, label):
    t0 = time.monotonic()
    out, _ = child(mode, handles).communicate(timeout=90)
    for line in out.strip().splitlines():
        print(f"  {label}: {line} (child ran {time.monotonic() - t0:.1f} s)", flush=True)


def hold_and_kill(mode, handle):
    holder = child(mode, [handle])
    line = holder.stdout.readline().strip()
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    return line


def main():
    import cupy as cp

    rt = cp.cuda.runtime
    ptrs = [rt.malloc(64 << 20) for _ in range(4)]
    h = [bytes(rt.ipcGetMemHandle(p)) for p in ptrs]
    print("probe_ipc_after_kill: four allocations exported (A, B, C, D)", flush=True)

    print(f"idle: holder of A {hold_and_kill('hold', h[0])!r}, SIGKILLed; a new process opens A", flush=True)
    run("open", h[:1], "idle A")
    run("open", h[:1], "idle A, again")

    print(f"busy: holder of B {hold_and_kill('busy', h[1])!r} (20000 kernels queued), SIGKILLed", flush=True)
    run("open", h[1:2], "busy B")

    survivor = child("hold", h[2:3])
    survivor.stdout.readline()
    print(f"two: a survivor holds C; a second holder {hold_and_kill('hold', h[2])!r}, SIGKILLed", flush=True)
    run("open", h[2:3], "two C")
    survivor.kill()
    survivor.wait()

    run("open", h[3:4], "fresh D")
    run("reopen", h[:1], "reopen A")

    exporter = child("export", [])
    eh = bytes.fromhex(exporter.stdout.readline().strip())
    holder = subprocess.Popen([sys.executable, "-c", CHILD, "holdthen", eh.hex(), "8"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    holder.stdout.readline()
    os.kill(exporter.pid, signal.SIGKILL)
    exporter.wait()
    exporter2 = child("export", [])
    eh2 = exporter2.stdout.readline().strip()
    out, _ = holder.communicate(eh2 + "\n", timeout=60)
    print(f"  exporter killed, holder kept its mapping: {out.strip()}", flush=True)
    exporter2.kill()
    exporter2.wait()

    exporter = child("export", [])
    dh = bytes.fromhex(exporter.stdout.readline().strip())
    holder = child("hold", [dh])
    holder.stdout.readline()
    os.kill(exporter.pid, signal.SIGKILL)
    exporter.wait()
    print("dead exporter: its handle, a holder still maps the memory", flush=True)
    run("open", [dh], "dead exporter, held")
    holder.kill()
    holder.wait()
    run("open", [dh], "dead exporter, nobody holds")


if __name__ == "__main__":
    main()
