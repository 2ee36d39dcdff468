#!/usr/bin/env bash
# Spawned rank processes failed to create CUDA contexts (cudaErrorMemoryAllocation) under
# MPS late in a device run: contexts at once on a fresh MPS server, the two-rank test
# alone, then again after a test that SIGKILLs a daemon whose doorbell stream is parked.
set -uo pipefail
OUT=${OUT:-/tmp/skv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SPARSEKV_KERNEL_CACHE_DIR=/tmp/skv-kernels SPARSEKV_TEST_DAEMON_LOG=$OUT/daemon.log
export SPARSEKV_STOP_TIMEOUT_S=6
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog
nvidia-cuda-mps-control -d && echo "MPS started"
trap 'echo quit | nvidia-cuda-mps-control; cp -r /tmp/mpslog "$OUT/" 2>/dev/null' EXIT
P="python3 -m pytest -q -rfE --tb=short --require-cuda -p no:cacheprovider --timeout 80"
step() { echo "== $*"; "$@" 2>&1 | tee -a "$OUT/diag.log" | tail -4; }
step python3 tests/gpu/mps_contexts.py 8
step python3 tests/gpu/mps_contexts.py 24
step $P tests/daemon/residency/test_cuda_kernels.py -k engine_owned_paged
step $P tests/daemon/test_cuda_backend.py -k two_rank_processes
step $P tests/client/test_doorbell.py -k killed_daemon
step python3 tests/gpu/mps_contexts.py 8
step $P tests/daemon/test_cuda_backend.py -k two_rank_processes
SPARSEKV_SOAK_S=20 step $P -m cuda tests/soak/test_chaos.py
nvidia-smi >"$OUT/smi.txt" 2>&1
