#!/usr/bin/env bash
# diag: TP striped gathers under MPS, then bench serve b1 with and without a cuBLAS SM carveout
PYTEST_SELECT="tests/client/test_doorbell_tp.py" PYTEST_K="two_ranks" PYTEST_TIMEOUT_S=60 BUDGET_S=100 bash tests/gpu/device_run.sh pytest 2>&1 | tail -2
grep -E "^E .*\[|FAILED|passed|failed" /tmp/skv-out/pytest-cuda.log $OUT/pytest-cuda.log 2>/dev/null | head -6
export PYTHONPATH=$PWD/tests/gpu/tp_diag:/tmp/site CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
nvidia-cuda-mps-control -d && echo MPS
echo "== striped, MPS"; timeout 45 python3 tests/gpu/tp_diag/diag_tp.py 2>&1 | tail -8
for i in 1 2; do for c in 0 8; do
  if [[ $c == 0 ]]; then unset DIAG_CARVEOUT; else export DIAG_CARVEOUT=$c; fi
  timeout 70 python3 -m sparsekv.cli.main bench serve --quick --contexts 32k --batches 1 --overlaps none --hbm-gb 1 --modes gpu,inproc,daemon 2>&1 \
    | grep -E "^ *(gpu|inproc|daemon) |carveout" | cut -c1-250 | sed "s/^/c$c.$i /"
done; done
unset DIAG_CARVEOUT
pkill -KILL -f sparsekv.daemon.main; timeout 15 sh -c 'echo quit | nvidia-cuda-mps-control'
