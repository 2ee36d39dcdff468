"""Is the first large pool of a machine's life slow because of the pool's code or of the
host? Pre-faults a pool (HostPool: anonymous huge pages, 16 threads, no CUDA) of GIB
GiB three times: twice in this process, once in a child. A host whose memory is backed
on first touch (a VM's hypervisor) shows a slow first and fast later ones, whichever
process; docs/PERF.md, session 8. Usage: python3 tests/gpu/pool_first_touch.py [GIB]"""

import subprocess
import sys
import time

from sparsekv.daemon.pool import HostPool, vmstat, vmstat_delta

GIB = 1 << 30


def once(nbytes: int) -> str:
    before = vmstat()
    t0 = time.perf_counter()
    p = HostPool(nbytes, 16)
    dt = time.perf_counter() - t0
    p.close()
    moved = {k: v for k, v in vmstat_delta(before, vmstat()).items() if v}
    return f"{nbytes / GIB / dt:.1f} GiB/s ({dt:.2f} s) {moved}"


if __name__ == "__main__":
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 64.0
    n = int(gib * GIB) // (1 << 21) * (1 << 21)
    if len(sys.argv) > 2:  # the child
        print(once(n))
        sys.exit(0)
    print(f"pool_first_touch: {gib:.0f} GiB, first in this process: {once(n)}")
    print(f"pool_first_touch: second in this process: {once(n)}")
    child = subprocess.run([sys.executable, __file__, str(gib), "child"], capture_output=True, text=True)
    print(f"pool_first_touch: a new process: {child.stdout.strip() or child.stderr.strip()[-300:]}")
