"""How many processes can start a CUDA context at once on this GPU (MPS diagnosis).

``python3 tests/gpu/mps_contexts.py N``: N spawned processes each create a context, an
interprocess event and a 1 MiB buffer at the same moment; prints how many succeeded and
the first error. Used on the GPU machine when spawned rank processes failed with
``cudaErrorMemoryAllocation`` at context creation under MPS.
"""

from __future__ import annotations

import multiprocessing as mp
import sys


def one(barrier, out):
    try:
        barrier.wait(60)
        import cupy as cp

        with cp.cuda.Device(0):
            cp.cuda.Event(block=False, disable_timing=True, interprocess=True)
            cp.zeros(1 << 18, cp.float32)
            cp.cuda.runtime.deviceSynchronize()
        out.put("ok")
    except BaseException as e:  # noqa: BLE001 - reported
        out.put(f"{type(e).__name__}: {e}")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=one, args=(barrier, out)) for _ in range(n)]
    for p in procs:
        p.start()
    res = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    errs = [r for r in res if r != "ok"]
    print(f"contexts at once: {n - len(errs)}/{n} ok" + (f"; first error: {errs[0]}" if errs else ""))


if __name__ == "__main__":
    main()
