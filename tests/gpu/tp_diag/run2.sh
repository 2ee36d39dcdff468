#!/usr/bin/env bash
# Not part of the suite: the one-GPU TP group's byte check under MPS and without (a two-rank run step by step, striped and not: DIAG_NOSTRIPE=1 through sitecustomize), and bench serve batch 1 with a cuBLAS SM carveout (DIAG_CARVEOUT=N). Run from the repository root on the GPU machine.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 || { tail /tmp/install.log; exit 1; }
export PYTHONPATH=$PWD/tests/gpu/tp_diag:/tmp/site CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog SPARSEKV_KERNEL_CACHE_DIR=/tmp/skv-kernels
mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d && echo MPS
for i in 1 2; do for c in 0 8; do
  if [[ $c == 0 ]]; then unset DIAG_CARVEOUT; else export DIAG_CARVEOUT=$c; fi
  timeout 50 python3 -m sparsekv.cli.main bench serve --quick --contexts 32k --batches 1 --overlaps none --hbm-gb 1 --modes gpu,inproc,daemon 2>&1 \
    | grep -E "^ *(gpu|inproc|daemon) |carveout" | cut -c1-200 | sed "s/^/c$c.$i /"
done; done
unset DIAG_CARVEOUT
echo "== striped, MPS"; timeout 40 python3 tests/gpu/tp_diag/diag_tp.py 2>&1 | tail -8
pkill -KILL -f sparsekv.daemon.main; timeout 10 sh -c 'echo quit | nvidia-cuda-mps-control'
