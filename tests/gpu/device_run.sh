#!/usr/bin/env bash
# One batched run on the GPU machine (see docs/PERF.md): install, test, time.
#   run from the repo root there; carries .whl: pyzmq (python 3.12) and setuptools>=77 (the
#   build needs it for the SPDX licence fields; the image may have an older one).
#   COMMIT=<hash from the developer machine> (the device has no .git) goes into latest.json.
# Writes logs under $OUT and prints a short table last.
set -uo pipefail
OUT=${OUT:-/tmp/skv-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SPARSEKV_KERNEL_CACHE_DIR=/tmp/skv-kernels SPARSEKV_TEST_DAEMON_LOG=$OUT/daemon.log SPARSEKV_GPU_MEMLOG=$OUT/gpu-mem.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog
nvidia-cuda-mps-control -d && echo "MPS started"
# At most 8 files come back from $OUT: the figures and the pytest log stay as they are,
# every other log goes into logs.tgz.
pack_logs() {
  (cd "$OUT" && ls | grep -vxE 'latest.json|decode.json|decode.png|pytest-cuda.log|bench-kernels.json|logs.tgz' \
     | tar czf logs.tgz --remove-files -T - 2>/dev/null)
}
trap 'echo quit | nvidia-cuda-mps-control; pack_logs' EXIT

status=0
what=${1:-all}  # one or several, comma-separated (e.g. test,kernels,signals)
has() { [[ ",$what," == *",$1,"* ]]; }
# what: all (tests, demo, kernel and transport benchmarks) | pytest (the cuda tests) | decode (sparsekv bench decode --quick) | test (tests, demo) |
#       e2e (tests, demo, transport benchmark) | bench (the benchmarks) | kernels (sparsekv bench kernels) |
#       signals (bench decode at batch 64 for each doorbell signalling and gather order)
# PYTEST_ARGS: more pytest options (e.g. "-n 3 --dist loadfile": pytest-xdist is on the
# machine; one file per worker keeps each file's daemons in order).
# SPARSEKV_STOP_TIMEOUT_S: how long a test's private daemon may take to stop on SIGTERM
# before its stacks are dumped to $OUT/daemon.log and it is killed (default 20).
# One test may not hang the whole run: pytest-timeout when the machine has it.
per_test=""
python3 -c "import pytest_timeout" 2>/dev/null && per_test="--timeout ${PER_TEST_TIMEOUT_S:-90}"
if has all || has test || has e2e || has pytest; then
  # (-m cuda takes the cuda chaos soak too: tests/soak/test_chaos.py[cuda], 30 s here)
  SPARSEKV_SOAK_S=${SPARSEKV_SOAK_S:-30} timeout ${PYTEST_TIMEOUT_S:-400} python3 -m pytest -q -rfE --tb=short --durations=15 --require-cuda -m cuda -p no:cacheprovider $per_test ${PYTEST_ARGS:-} ${PYTEST_SELECT:-tests} 2>&1 | tee "$OUT/pytest-cuda.log" | tail -25
  status=${PIPESTATUS[0]}
fi
if has all || has test || has e2e; then
  timeout 150 python3 -m sparsekv.client.cli demo --quiet 2>&1 | tee "$OUT/demo.log" | tail -14
  # The example model through the engine's handle on the GPU (doorbell), as a user runs it.
  timeout 150 python3 -m examples.dsa_decode.run --transport doorbell --device cuda:0 2>&1 | tee "$OUT/example-doorbell.log" | tail -6
  # ... with its hot region inside its own KV-cache tensor (issue 12).
  timeout 150 python3 -m examples.dsa_decode.run --transport doorbell --device cuda:0 --slab engine 2>&1 | tee "$OUT/example-engine-slab.log" | tail -3
fi
if has all || has bench || has e2e || has decode; then
  timeout ${DECODE_TIMEOUT_S:-240} python3 -m sparsekv.client.cli bench decode --quick --json "$OUT/decode.json" --plot "$OUT/decode.png" 2>&1 | tee "$OUT/bench-decode.log" | tail -12
fi
if has all || has bench || has kernels; then
  # Gather, resolve and pool start against the link (64 GiB pool): docs/PERF.md, issue 8's keys.
  timeout ${KERNELS_TIMEOUT_S:-200} python3 -m sparsekv.client.cli bench kernels --pool-gib ${POOL_GIB:-64} \
    --json "$OUT/bench-kernels.json" 2>&1 | tee "$OUT/bench-kernels.log" | tail -30
fi
if has signals; then
  # Batch 64, 90 % hits: the doorbell's signalling on each side, and the gather order (one
  # private daemon each; figures in decode-<variant>.json).
  for v in kernel:ops ops:ops kernel:kernel ops:kernel kernel:ops:request; do
    IFS=: read -r eng dmn order <<<"$v"
    SPARSEKV_DB_ENGINE_SIGNAL=$eng SPARSEKV_DB_DAEMON_SIGNAL=$dmn SPARSEKV_GATHER_ORDER=${order:-batch} \
      timeout ${DECODE_TIMEOUT_S:-120} python3 -m sparsekv.client.cli bench decode --batches 64 --hits 90 \
      --modes gpu,inproc,doorbell --json "$OUT/decode-${v//:/-}.json" 2>&1 | tee "$OUT/bench-decode-${v//:/-}.log" \
      | grep -E "^ +64 " | sed "s/^/$v /"
  done
fi
if has all || has bench || has e2e; then
  timeout 200 python3 tests/gpu/perf_latest.py "$OUT/latest.json" "${COMMIT:-unknown}" "$OUT/decode.json" 2>&1 | tee "$OUT/bench-transport.log" | tail -5
fi
exit $status
