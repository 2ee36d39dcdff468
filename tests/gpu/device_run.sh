#!/usr/bin/env bash
# One batched run on the GPU machine (see docs/PERF.md): install, test, time.
#   run from the repo root there; carries .whl: pyzmq (python 3.12) and setuptools>=77 (the
#   build needs it for the SPDX licence fields; the image may have an older one).
#   COMMIT=<hash from the developer machine> (the device has no .git) goes into latest.json.
# Writes logs under $OUT and prints a short table last.
set -uo pipefail
OUT=${OUT:-/tmp/skv-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SPARSEKV_KERNEL_CACHE_DIR=/tmp/skv-kernels SPARSEKV_TEST_DAEMON_LOG=$OUT/daemon.log SPARSEKV_BENCH_DAEMON_LOG=$OUT/bench-daemon.log SPARSEKV_GPU_MEMLOG=$OUT/gpu-mem.log \
  SPARSEKV_SOAK_SUMMARY_DIR=$OUT
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
# Logs first: stopping MPS waits for its clients (a daemon a test left behind, say), and
# the device tool's limit may come first. Then leftover daemons, then MPS, bounded.
finish() {
  pack_logs
  pkill -KILL -f 'sparsekv.daemon.main|sparsekvd' 2>/dev/null
  timeout 20 sh -c 'echo quit | nvidia-cuda-mps-control' || echo "MPS did not stop in 20 s"
}
trap finish EXIT

status=0
what=${1:-all}  # one or several, comma-separated (e.g. test,kernels,signals)
has() { [[ ",$what," == *",$1,"* ]]; }
# what: all (tests, demo, examples, kernel, decode and transport benchmarks) | pytest (the cuda
#       tests) | test (tests, demo, examples) | e2e (tests, demo, examples, decode, transport) |
#       bench (the benchmarks) | kernels (sparsekv bench kernels) | decode (sparsekv bench decode
#       --quick) | signals (bench decode at batch 64 for each doorbell signalling and gather order)
#       | latest (perf_latest.py: the transport bench, and latest.json from every figure) | demo |
#       (DECODE_ARGS: more options of the decode step, e.g. "--steps 60 --rounds 3 --paired") |
#       ab (bench decode for each of AB_VARIANTS: the daemon's switches against each other) |
#       profile (tests/gpu/profile_daemon.py: the daemon's host time per request) |
#       zmqprobe (tests/gpu/micro_zmq_affinity.py: a ZeroMQ hop's wake-ups) |
#       warmcpus (tests/gpu/warm_cpus.py: the transport bench as installed and with warm_io, ABBA) |
#       ncu (Nsight Compute on skv_resolve and skv_gather, tests/gpu/ncu_kernels.py) |
#       examples (the example model through the doorbell, its own KV and an engine-owned slab) |
#       probes (tests/gpu/pool_first_touch.py and tests/gpu/probe_ipc_after_kill.py) |
#       tma (tests/gpu/probe_tma_gather.py: the gather by TMA against the SM gather; TMA_POOL_GIB)
#       (NCU_SOURCE=1 with ncu: skv_resolve's stalls per SASS instruction, ncu-resolve-sass.csv)
# Steps run in this order, the ones that can hurt the GPU (spin kernels) last.
# BUDGET_S: seconds for all of it (default 540): each step's timeout is cut to what is left,
# so that the logs are packed before the device tool's limit.
# PYTEST_ARGS: more pytest options (split at spaces; PYTEST_K: a -k expression, kept whole). SPARSEKV_STOP_TIMEOUT_S: how long a test's private
# daemon may take to stop on SIGTERM before its stacks are dumped and it is killed.
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-540}
left() {  # left DEFAULT: DEFAULT, or what is left of the budget less 15 s, if that is less
  local l=$(( BUDGET_S - ($(date +%s) - T0) - 15 ))
  (( l < 1 )) && l=1
  (( $1 < l )) && echo "$1" || echo "$l"
}
per_test=""
python3 -c "import pytest_timeout" 2>/dev/null && per_test="--timeout ${PER_TEST_TIMEOUT_S:-90}"
pytest_cuda() {  # pytest_cuda LOG MARKERS DEFAULT_TIMEOUT
  SPARSEKV_SOAK_S=${SPARSEKV_SOAK_S:-30} timeout "$(left "$3")" python3 -m pytest -q -rfE --tb=short --durations=10 \
    --require-cuda -m "$2" -p no:cacheprovider $per_test ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-} ${PYTEST_SELECT:-tests} 2>&1 \
    | tee -a "$OUT/$1" | tail -25
  return "${PIPESTATUS[0]}"
}
if has all || has test || has e2e || has pytest; then
  pytest_cuda pytest-cuda.log "cuda and not spin" ${PYTEST_TIMEOUT_S:-300} || status=1
fi
if has tma; then
  # The gather by the Tensor Memory Accelerator against the SM gather, in its own process
  # (a TMA fault would end the CUDA context): tests/gpu/probe_tma_gather.py.
  timeout "$(left 150)" python3 tests/gpu/probe_tma_gather.py ${TMA_POOL_GIB:-64} 2>&1 | tee "$OUT/probe-tma.log" | grep -v "^{"
fi
if has all || has bench || has kernels; then
  # Gather, resolve and pool start against the link (64 GiB pool): docs/PERF.md, issue 8's keys.
  timeout "$(left ${KERNELS_TIMEOUT_S:-150})" python3 -m sparsekv.cli.main bench kernels --pool-gib ${POOL_GIB:-64} ${KERNELS_ARGS:-} \
    --json "$OUT/bench-kernels.json" 2>&1 | tee "$OUT/bench-kernels.log" | tail -40
fi
if has all || has bench || has e2e || has decode; then
  # No batch size starts in the last third of its time (--budget-s); decode.json is
  # written after each batch size, so a cut run still leaves what it measured.
  dt=$(left ${DECODE_TIMEOUT_S:-150})
  timeout "$dt" python3 -m sparsekv.cli.main bench decode --quick --budget-s $(( dt * 2 / 3 + 1 )) ${DECODE_ARGS:-} \
    --daemon-log "$OUT/decode-daemon.log" --json "$OUT/decode.json" --plot "$OUT/decode.png" 2>&1 | tee "$OUT/bench-decode.log" | tail -12
fi
if has all || has bench || has e2e || has latest; then
  timeout "$(left ${LATEST_TIMEOUT_S:-200})" python3 tests/gpu/perf_latest.py "$OUT/latest.json" "${COMMIT:-unknown}" "$OUT/decode.json" \
    "$OUT/bench-kernels.json" 2>&1 | tee "$OUT/bench-transport.log" | tail -5
fi
if has all || has test || has e2e || has demo; then
  timeout "$(left 100)" python3 -m sparsekv.cli.main demo --quiet 2>&1 | tee "$OUT/demo.log" | tail -14
fi
if has all || has test || has e2e || has examples; then
  # The example model through the engine's handle on the GPU (doorbell), as a user runs it.
  timeout "$(left 100)" python3 -m examples.dsa_decode.run --transport doorbell --device cuda:0 2>&1 \
    | tee "$OUT/example-doorbell.log" | tail -3
  # ... with its hot region inside its own KV-cache tensor (issue 12).
  timeout "$(left 100)" python3 -m examples.dsa_decode.run --transport doorbell --device cuda:0 --slab engine 2>&1 \
    | tee "$OUT/example-engine-slab.log" | tail -3
fi
if has signals; then
  # Batch 64, 90 % hits: the doorbell's signalling on each side (engine:daemon) and the
  # gather order; one private daemon each; figures in decode-<variant>.json.
  for v in ${SIGNAL_VARIANTS:-kernel:ops ops:kernel kernel:kernel ops:ops:batch}; do
    IFS=: read -r eng dmn order <<<"$v"
    SPARSEKV_DB_ENGINE_SIGNAL=$eng SPARSEKV_DB_DAEMON_SIGNAL=$dmn SPARSEKV_GATHER_ORDER=${order:-request} \
      timeout "$(left 80)" python3 -m sparsekv.cli.main bench decode --batches 64 --hits 90 \
      --modes gpu,inproc,doorbell --json "$OUT/decode-${v//:/-}.json" 2>&1 | tee "$OUT/bench-decode-${v//:/-}.log" \
      | grep -E "^ +64 " | sed "s/^/$v /"
  done
fi
if has ncu; then
  # Nsight Compute on skv_resolve and skv_gather (tests/gpu/ncu_kernels.py), outside MPS
  # (ncu does not profile MPS clients); text reports in ncu-<kernel>.txt (logs.tgz).
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [[ -n "$NCU" ]]; then
    for k in skv_resolve skv_gather; do
      CUDA_MPS_PIPE_DIRECTORY=/tmp/no-mps timeout "$(left 120)" "$NCU" --clock-control none -k "$k" \
        --launch-skip 8 --launch-count 2 --section SpeedOfLight --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
        python3 tests/gpu/ncu_kernels.py >"$OUT/ncu-$k.txt" 2>&1
      grep -E "Duration|Warp Cycles Per Issued|Eligible Warps|Achieved Occupancy|Registers Per" "$OUT/ncu-$k.txt" | head -6
      # the stall reasons of the first profiled launch, largest first
      grep -E "issue_stalled" "$OUT/ncu-$k.txt" | awk '!seen[$1]++ {print $NF, $1}' | sort -rn | head -8
    done
    if [[ "${NCU_SOURCE:-0}" == 1 ]]; then
      # Where skv_resolve's warps stall, instruction by instruction (SASS; ncu-resolve-sass.csv).
      CUDA_MPS_PIPE_DIRECTORY=/tmp/no-mps timeout "$(left 120)" "$NCU" --clock-control none -k skv_resolve \
        --launch-skip 8 --launch-count 1 --section SourceCounters --section WarpStateStats -f -o "$OUT/ncu-resolve" \
        python3 tests/gpu/ncu_kernels.py >"$OUT/ncu-resolve-src.txt" 2>&1
      "$NCU" -i "$OUT/ncu-resolve.ncu-rep" --page source --csv --print-source sass >"$OUT/ncu-resolve-sass.csv" 2>&1
      wc -l "$OUT/ncu-resolve-sass.csv"; rm -f "$OUT/ncu-resolve.ncu-rep"
    fi
  else
    echo "ncu: not found"
  fi
fi
if has probes; then
  # The host's first touch against the pool code's (64 GiB, no CUDA), and an IPC open of a
  # handle whose holder was SIGKILLed (MPS is up): docs/PERF.md, session 8.
  timeout "$(left 90)" python3 tests/gpu/pool_first_touch.py ${POOL_GIB:-64} 2>&1 | tee "$OUT/pool-first-touch.log"
  timeout "$(left 90)" python3 tests/gpu/probe_ipc_after_kill.py 2>&1 | tee "$OUT/probe-ipc-after-kill.log"
fi
if has zmqprobe; then
  # Where a ZeroMQ hop's time goes on this VM: I/O threads placed by default, pinned with
  # their busy-polling thread, and a raw SOCK_SEQPACKET pair (tests/gpu/micro_zmq_affinity.py).
  timeout "$(left 90)" python3 tests/gpu/micro_zmq_affinity.py 2000 2>&1 | tee "$OUT/micro-zmq-affinity.log"
fi
if has warmcpus; then
  # The zmq hop with halted vCPUs against vCPUs kept running by SCHED_IDLE busy loops.
  timeout "$(left 300)" python3 tests/gpu/warm_cpus.py ${WARM_STEPS:-200} 2>&1 | tee "$OUT/warm-cpus.log" | grep -v "^{"
fi
if has profile; then
  # Where the daemon's host time goes per STEP + TOPK (handlers in process, then cProfile).
  timeout "$(left 90)" python3 tests/gpu/profile_daemon.py 300 >"$OUT/profile-daemon.log" 2>&1
  head -30 "$OUT/profile-daemon.log"
fi
if has ab; then
  # A/B of the daemon's measured switches on a decode step (batch 16 and 64, 90 % hits):
  # AB_VARIANTS "name:VAR=value,VAR=value ..." (an empty list after the colon: the defaults);
  # one private daemon each; figures in decode-ab-<name>.json; AB_ARGS: more options
  # (e.g. "--steps 40 --rounds 2").
  for v in ${AB_VARIANTS:-default: pin_start:SPARSEKV_PIN_POOL_AT_START=1 memfd:SPARSEKV_POOL_BACKING=memfd}; do
    name=${v%%:*}; vars=${v#*:}
    env ${vars//,/ } timeout "$(left 80)" python3 -m sparsekv.cli.main bench decode --batches ${AB_BATCHES:-16,64} \
      --hits 90 --modes inproc,doorbell ${AB_ARGS:-} --json "$OUT/decode-ab-$name.json" 2>&1 | tee "$OUT/bench-decode-ab-$name.log" \
      | grep -E "^ +(16|64|128) " | sed "s/^/$name /"
  done
fi
# Spin kernels last, and only when asked (SPIN=1): on the H200 under MPS they have hung and
# taken the MPS server down (docs/PERF.md, session 6 and 7).
if [[ "${SPIN:-0}" == 1 ]] && (has all || has test || has e2e || has pytest); then
  pytest_cuda pytest-cuda.log "cuda and spin" 120 || status=1
fi
echo "device_run: $(( $(date +%s) - T0 )) s"
exit $status
