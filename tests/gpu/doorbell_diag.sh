#!/usr/bin/env bash
# The doorbell tests alone on the GPU machine, stopping at the first failure; 45 s in,
# every sparsekvd gets SIGUSR2 (its threads' stacks land in $OUT/daemon.log): for a hang.
set -uo pipefail
OUT=${OUT:-/tmp/skv-out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1 SPARSEKV_KERNEL_CACHE_DIR=/tmp/skv-kernels SPARSEKV_TEST_DAEMON_LOG=$OUT/daemon.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >$OUT/install.log 2>&1 || { cat $OUT/install.log; exit 1; }
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
( sleep 45; pkill -USR2 -f sparsekv.daemon.main; sleep 1; pkill -USR2 -f sparsekv.daemon.main ) &
timeout 240 python3 -m pytest -x -q -s --require-cuda -p no:cacheprovider -o faulthandler_timeout=40 tests/client/test_doorbell.py "$@" 2>&1 | tee $OUT/pytest.log | tail -60
echo quit | nvidia-cuda-mps-control
