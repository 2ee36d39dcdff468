#!/usr/bin/env bash
# One batched run on the GPU machine (docs/PERF.md): install, test, replay, time. Run from
# the repository root there:   [VAR=...] bash tests/gpu/device_run.sh [WHAT]
#   .whl/*.whl (`make gpu-wheels`): wheels carried along (pyzmq for the machine's python, setuptools>=77 for
#   the build's SPDX licence fields); installed into /tmp/site.
#   COMMIT=<hash> goes into latest.json (the machine has no .git).
# Logs go under $OUT; a short table of every step's result comes last.
#
# WHAT: one or several, comma-separated (default all):
#   all       every step below but ab
#   test      pytest, demo, examples, replay        e2e    test, decode, latest
#   bench     kernels, decode, latest
#   pytest    the tests marked cuda (PYTEST_ARGS: more options; PYTEST_K: a -k expression;
#             PYTEST_SELECT: paths, default tests; PYTEST_TIMEOUT_S)
#   kernels   sparsekv bench kernels (POOL_GIB, default 64; KERNELS_ARGS, e.g. --kernels-quick)
#   decode    sparsekv bench decode --quick (DECODE_ARGS, e.g. "--steps 60 --rounds 3 --paired")
#   decode_overlaps  bench decode with prefetch at each layer overlap of DECODE_OVERLAPS (default
#             "0.5 0.7 0.85 0.95"; DECODE_OVERLAP_ARGS, DECODE_OVERLAP_TIMEOUT_S); only when named
#   serve     sparsekv bench serve --quick (SERVE_ARGS; SERVE_TIMEOUT_S, default 240); only when named
#   hf        python -m sparsekv.bench.hf_long --quick (HF_ARGS; HF_TIMEOUT_S, default 200); only when named
#   prefix    sparsekv bench prefix: block store lookups on this host's CPUs, and the indexer keys
#             load against a bulk copy on the GPU (PREFIX_TIMEOUT_S, default 120); only when named
#   probe     tests/gpu/probe_parked.py: which CUDA calls wait for a stream parked on a stream wait
#             (PROBE_TIMEOUT_S, default 90); only when named
#   b1        tests/gpu/probe_b1.py: a batch-1 step's swap-ins alone, each kernel's time from torch's
#             profiler (B1_ARGS; B1_TIMEOUT_S, default 120); only when named
#   serve_b1  tests/gpu/probe_serve_b1.py: bench serve's batch-1 step, each mode alone (profiled and not)
#             and both in turn (SERVE_B1_ARGS; SERVE_B1_TIMEOUT_S, default 150); only when named
#   launch    tests/gpu/probe_launch.py: bench serve's configs (LAUNCH_ARGS, default batch 1, 32K, every
#             mode) with each step's graph launch timed and its GPU time with the launch hidden
#             (LAUNCH_TIMEOUT_S, default 200); only when named
#   resolve   tests/gpu/probe_resolve.py: skv_resolve at batch 1 alone as a CUDA graph, without and with the
#             prefetch marks (RESOLVE_ARGS, e.g. "--region-rows 4096"); only when named
#   lookup    tests/gpu/probe_lookup.py: where a repeated block lookup's time goes on this host's CPUs
#             (a timeline of both processes' stamps) and its p50 with the client and the daemon's loop
#             on free, sibling or separate CPUs (LOOKUP_TIMEOUT_S, default 120); only when named
#   latest    sparsekv bench latest: latest.json from the transport runs and the figures above
#   demo      sparsekv demo                          examples  the example model on the doorbell
#   replay    synthesized traces replayed on the cuda backend with --verify through zmq and
#             the doorbell (also with --ranks 2): each must be exact and equal to the in-process reference
#   ab        with BASE_DIR, an older checkout copied into the tree (git archive BASE
#             --prefix=base/ | tar -x; BASE_DIR=base): bench decode --quick and bench kernels
#             from the base and from this tree in turn, A B A B (AB_ROUNDS, default 2;
#             AB_DECODE_ARGS, default --batches 64; AB_KERNELS_ARGS, default "--kernels-quick
#             --pool-gib 16"; AB_BENCHES, default "decode kernels", may add serve: bench serve
#             --quick with AB_SERVE_ARGS, default the batch-1 32K configs), then each figure of
#             both side by side
# BUDGET_S: seconds for all of it (default 540): each step's timeout is cut to what is left,
# so that the logs are packed before the device tool's limit. SPARSEKV_STOP_TIMEOUT_S: how
# long a test's private daemon may take to stop on SIGTERM before it is killed.
set -uo pipefail
OUT=${OUT:-/tmp/skv-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SPARSEKV_KERNEL_CACHE_DIR=/tmp/skv-kernels SPARSEKV_TEST_DAEMON_LOG=$OUT/daemon.log \
  SPARSEKV_BENCH_DAEMON_LOG=$OUT/bench-daemon.log SPARSEKV_GPU_MEMLOG=$OUT/gpu-mem.log SPARSEKV_SOAK_SUMMARY_DIR=$OUT
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
  (cd "$OUT" && ls | grep -vxE 'latest.json|decode.json|serve.json|serve.png|hf.json|pytest-cuda.log|bench-kernels.json|probe.jsonl|probe-b1.json|probe-serve-b1.json|probe-lookup.json|probe-launch.json|logs.tgz' \
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
what=${1:-all}
has() { [[ ",$what," == *",$1,"* ]]; }
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-540}
left() {  # left DEFAULT: DEFAULT, or what is left of the budget less 15 s, if that is less
  local l=$(( BUDGET_S - ($(date +%s) - T0) - 15 ))
  (( l < 1 )) && l=1
  (( $1 < l )) && echo "$1" || echo "$l"
}
results=()
result() { results+=("$(printf '%-9s %s' "$1" "$2")"); }  # result STEP TEXT: a row of the last table
figures() {  # figures FILE KEY...: "KEY VALUE" of each KEY that the JSON FILE has
  python3 - "$@" 2>/dev/null <<'EOF' || echo "no figures ($1)"
import json, sys
d = json.load(open(sys.argv[1]))
print("  ".join(f"{k} {d[k]}" for k in sys.argv[2:] if k in d) or "none of the keys")
EOF
}
KERNEL_KEYS="gather_vs_bulk gather_vs_bulk_scattered gather_request_order_GBps bulk_h2d_GBps resolve_us_b64 resolve_us_b1 pool_ready_GiBps striped_gather_vs_per_rank_1gpu_2slabs striped_gather_vs_per_rank_2gpu"
DECODE_KEYS="doorbell_overhead_us_per_layer doorbell_handoff_us_per_layer decode_daemon_vs_inproc \
decode_b64_h90_inproc_p50_us decode_b64_h90_doorbell_p50_us"

per_test=""
python3 -c "import pytest_timeout" 2>/dev/null && per_test="--timeout ${PER_TEST_TIMEOUT_S:-90}"
if has all || has test || has e2e || has pytest; then
  SPARSEKV_SOAK_S=${SPARSEKV_SOAK_S:-30} timeout "$(left "${PYTEST_TIMEOUT_S:-300}")" python3 -m pytest -q -rfE \
    --tb=short --durations=10 --require-cuda -m cuda -p no:cacheprovider $per_test ${PYTEST_K:+-k "$PYTEST_K"} \
    ${PYTEST_ARGS:-} ${PYTEST_SELECT:-tests} 2>&1 | tee -a "$OUT/pytest-cuda.log" | tail -25
  rc=${PIPESTATUS[0]}
  (( rc == 0 )) || status=1
  result pytest "rc $rc: $(grep -E '(passed|failed|error)' "$OUT/pytest-cuda.log" | tail -1 | tr -d '=')"
fi
if has all || has bench || has kernels; then
  # Gather, resolve and pool start against the link (a 64 GiB pool).
  timeout "$(left "${KERNELS_TIMEOUT_S:-150}")" python3 -m sparsekv.cli.main bench kernels --pool-gib "${POOL_GIB:-64}" \
    ${KERNELS_ARGS:-} --json "$OUT/bench-kernels.json" 2>&1 | tee "$OUT/bench-kernels.log" | tail -40
  result kernels "$(figures "$OUT/bench-kernels.json" $KERNEL_KEYS)"
fi
if has all || has bench || has e2e || has decode; then
  # No batch size starts in the last third of its time (--budget-s); decode.json is
  # written after each batch size, so a cut run still leaves what it measured.
  dt=$(left "${DECODE_TIMEOUT_S:-150}")
  timeout "$dt" python3 -m sparsekv.cli.main bench decode --quick --budget-s $(( dt * 2 / 3 + 1 )) ${DECODE_ARGS:-} \
    --daemon-log "$OUT/decode-daemon.log" --json "$OUT/decode.json" --plot "$OUT/decode.png" 2>&1 \
    | tee "$OUT/bench-decode.log" | tail -12
  result decode "$(figures "$OUT/decode.json" $DECODE_KEYS)"
fi
if has decode_overlaps; then
  # The same bench once per layer overlap of DECODE_OVERLAPS (default "0.5 0.7 0.85 0.95",
  # commas or spaces), each with DECODE_OVERLAP_ARGS (default: batch 64, 90 % hits, gpu,
  # doorbell and prefetch): decode-oNN.json, whose keys named by the overlap (and only
  # those: its other keys would overwrite decode's) go into decode-oNN-keys.json for latest.
  overlaps=${DECODE_OVERLAPS:-0.5 0.7 0.85 0.95}
  for o in ${overlaps//,/ }; do
    tag=o$(python3 -c "print(round($o * 100))")
    dt=$(left "${DECODE_OVERLAP_TIMEOUT_S:-80}")
    timeout "$dt" python3 -m sparsekv.cli.main bench decode --quick --layer-overlap "$o" \
      ${DECODE_OVERLAP_ARGS:---batches 64 --hits 90 --modes gpu,doorbell,prefetch} \
      --daemon-log "$OUT/decode-$tag-daemon.log" --json "$OUT/decode-$tag.json" 2>&1 \
      | tee "$OUT/bench-decode-$tag.log" | tail -8
    python3 -c "import json, sys; d = json.load(open(sys.argv[1])); json.dump({k: v for k, v in d.items() \
if k.endswith('_' + sys.argv[2])}, open(sys.argv[3], 'w'))" "$OUT/decode-$tag.json" "$tag" "$OUT/decode-$tag-keys.json"
    result "decode $tag" "$(figures "$OUT/decode-$tag.json" decode_prefetch_hidden_share_$tag \
      decode_prefetch_vs_doorbell_$tag decode_prefetch_vs_gpu_$tag decode_doorbell_vs_gpu_$tag)"
  done
fi
SERVE_KEYS="serve_throughput_gain_128k serve_throughput_gain_128k_at_bound serve_offload_vs_gpu_tpot_b1 \
serve_daemon_vs_inproc serve_offload_vs_gpu_tpot_b64_32k prefetch_hidden_share prefetch_cost_overlap50 serve_daemon_vs_gpu_tpot_b1_32k"
if has serve; then
  # The serve figures go into latest.json when latest runs after it (serve,latest).
  timeout "$(left "${SERVE_TIMEOUT_S:-240}")" python3 -m sparsekv.cli.main bench serve --quick ${SERVE_ARGS:-} \
    --daemon-log "$OUT/serve-daemon.log" --json "$OUT/serve.json" --plot "$OUT/serve.png" 2>&1 \
    | tee "$OUT/bench-serve.log" | tail -30
  rc=${PIPESTATUS[0]}
  (( rc == 0 )) || status=1
  result serve "rc $rc: $(figures "$OUT/serve.json" $SERVE_KEYS)"
fi
HF_KEYS="hf_dsv32_kv_hbm_ratio_32k hf_dsv32_tokens_per_s_ratio_32k"
if has hf; then
  # transformers' DeepSeek-V3.2 (real attention dims, 4 layers) at 32K through sparsekv
  # against its own eager DynamicCache; into latest.json when latest runs after it.
  timeout "$(left "${HF_TIMEOUT_S:-200}")" python3 -m sparsekv.bench.hf_long --quick ${HF_ARGS:-} --json "$OUT/hf.json" \
    2>&1 | tee "$OUT/bench-hf.log" | tail -4
  rc=${PIPESTATUS[0]}
  (( rc == 0 )) || status=1
  result hf "rc $rc: $(figures "$OUT/hf.json" $HF_KEYS)"
fi
PREFIX_KEYS="prefix_lookup_us_128k prefix_lookup_us_p50 lookup_send_us lookup_daemon_us lookup_reply_us prefix_lookup_cold_us_p50 prefix_index_load_vs_bulk restart_s_median prefix_serve_ms prefix_recompute_ms_bound prefix_serve_vs_recompute_32k"
if has prefix; then
  timeout "$(left "${PREFIX_TIMEOUT_S:-120}")" python3 -m sparsekv.cli.main bench prefix 2>&1 \
    | tee "$OUT/bench-prefix.log" | tail -3
  rc=${PIPESTATUS[0]}
  grep '^{' "$OUT/bench-prefix.log" | tail -1 >"$OUT/prefix.json"
  (( rc == 0 )) || status=1
  result prefix "rc $rc: $(figures "$OUT/prefix.json" $PREFIX_KEYS)"
fi
if has b1; then  # where a batch-1 layer's swap-in goes (issue 34's batch-1 figure)
  timeout "$(left "${B1_TIMEOUT_S:-120}")" python3 tests/gpu/probe_b1.py --out "$OUT" ${B1_ARGS:-} >"$OUT/probe-b1.log" 2>&1
  rc=$?; tail -n 25 "$OUT/probe-b1.log"
  result b1 "rc $rc $(grep '^layer us' "$OUT/probe-b1.log" | tail -1)"
fi
if has serve_b1; then  # the serving bench's batch-1 step alone, profiled, and its modes in turn (issue 34)
  timeout "$(left "${SERVE_B1_TIMEOUT_S:-150}")" python3 tests/gpu/probe_serve_b1.py --out "$OUT" ${SERVE_B1_ARGS:-} \
    >"$OUT/probe-serve-b1.log" 2>&1
  rc=$?; grep -E '^(==|in turn)' "$OUT/probe-serve-b1.log"
  result serve_b1 "rc $rc $(grep '^in turn' "$OUT/probe-serve-b1.log" | tail -1)"
fi
if has launch; then  # a step's launch against its time on the GPU, per mode (issue 34)
  timeout "$(left "${LAUNCH_TIMEOUT_S:-200}")" python3 tests/gpu/probe_launch.py \
    ${LAUNCH_ARGS:---batches 1 --contexts 32k --overlaps none --modes gpu,inproc,daemon,prefetch --steps 30} \
    >"$OUT/probe-launch.log" 2>&1
  rc=$?; grep -E '^probe_launch' "$OUT/probe-launch.log"; tail -n 12 "$OUT/probe-launch.log"
  result launch "rc $rc"
fi
if has resolve; then  # the resolve's batch-1 latency alone (issue 34)
  for pf in "" --prefetch; do
    timeout "$(left 60)" python3 tests/gpu/probe_resolve.py $pf ${RESOLVE_ARGS:-} 2>&1 | tail -1 | tee -a "$OUT/probe-resolve.log"
  done
  result resolve "$(tr '\n' ' ' <"$OUT/probe-resolve.log" | grep -oE '[0-9.]+ us' | tr '\n' ' ')"
fi
if has lookup; then  # where a block lookup's time goes on this host's CPUs (issue 36's goal is a GPU host's)
  timeout "$(left "${LOOKUP_TIMEOUT_S:-120}")" python3 tests/gpu/probe_lookup.py --out "$OUT" >"$OUT/probe-lookup.log" 2>&1
  rc=$?; cat "$OUT/probe-lookup.log"
  result lookup "rc $rc $(grep '^placements' "$OUT/probe-lookup.log" | tail -1)"
fi
if has probe; then  # which CUDA calls wait for a parked stream (DESIGN §5.4; daemon/cuda/deferred.py)
  timeout "$(left "${PROBE_TIMEOUT_S:-90}")" python3 tests/gpu/probe_parked.py --timeout-s 2 2>&1 \
    | tee "$OUT/probe.log" | grep '^{' >"$OUT/probe.jsonl"
  result probe "$(python3 -c "import json, sys; print(' '.join(r['call'] + '=' + r.get('parked', 'failed') for r in map(json.loads, sys.stdin)))" <"$OUT/probe.jsonl")"
fi
if has all || has bench || has e2e || has latest; then
  timeout "$(left "${LATEST_TIMEOUT_S:-200}")" python3 -m sparsekv.cli.main bench latest --json "$OUT/latest.json" \
    --commit "${COMMIT:-unknown}" --merge "$OUT/decode.json" "$OUT/bench-kernels.json" \
    $( for f in serve hf prefix; do [[ -f "$OUT/$f.json" ]] && echo "$OUT/$f.json"; done ) \
    $( ls "$OUT"/decode-o*-keys.json 2>/dev/null ) 2>&1 \
    | tee "$OUT/bench-transport.log" | tail -5
  result latest "$(figures "$OUT/latest.json" zmq_handoff_p50_us zmq_handoff_cold_p50_us daemon_host_us_per_step)"
fi
if has all || has test || has e2e || has demo; then
  timeout "$(left 100)" python3 -m sparsekv.cli.main demo --quiet 2>&1 | tee "$OUT/demo.log" | tail -14
  rc=${PIPESTATUS[0]}
  (( rc == 0 )) || status=1
  result demo "rc $rc"
fi
if has all || has test || has e2e || has examples; then
  # The example model through the engine's handle on the GPU (doorbell), as a user runs it,
  # then with its hot region inside its own KV-cache tensor.
  for slab in daemon engine; do
    timeout "$(left 100)" python3 -m examples.dsa_decode.run --transport doorbell --device cuda:0 --slab $slab 2>&1 \
      | tee "$OUT/example-$slab-slab.log" | tail -3
    rc=${PIPESTATUS[0]}
    (( rc == 0 )) || status=1
    result example "--slab $slab: rc $rc"
  done
fi
if has all || has test || has e2e || has replay; then
  # A trace of host rows and one of positions (block tables, speculative rows), replayed on
  # the cuda backend with --verify through zmq and the doorbell; exact: every hot row
  # verified, and the slots and misses those of the in-process engine (the reference).
  R=$OUT/replay
  mkdir -p "$R"
  python3 -m sparsekv.cli.main trace synth --out "$R/rows.npz" --seed 7 >/dev/null
  python3 -m sparsekv.cli.main trace synth --out "$R/positions.npz" --block-size 16 --spec 0.1 --seed 8 >/dev/null
  # Then the host-row trace with --prefetch (each step's next rows fetched into group 1):
  # group 0's slots and misses and group 1's hit and miss counts equal the in-process run's;
  # and with two ranks of one engine (on GPU r modulo the GPUs), each verified, each
  # rank's slots equal rank 0's (ranks_differing 0: the exit status says so); and the two
  # ranks as a TP group (one resolve for both: the doorbell only, zmq TP is refused on cuda).
  for run in rows positions rows-prefetch rows-ranks2 rows-tp2; do
    tr=${run%%-*}
    pf=$([[ $run == *-prefetch ]] && echo --prefetch)
    rk=$([[ $run == *-ranks2 ]] && echo --ranks 2)
    [[ $run == *-tp2 ]] && rk="--ranks 2 --tp"
    timeout "$(left 120)" python3 -m sparsekv.cli.main replay "$R/$tr.npz" $pf --out "$R/$run-inproc.npz" \
      >"$R/$run-inproc.json" 2>&1
    transports="zmq doorbell"
    [[ $run == *-tp2 ]] && transports=doorbell
    for t in $transports; do
      timeout "$(left 120)" python3 -m sparsekv.cli.main replay "$R/$tr.npz" $pf $rk --backend cuda --transport $t \
        --verify --out "$R/$run-$t.npz" --daemon-log "$R/$run-$t-daemon.log" >"$R/$run-$t.json" 2>&1
      rc=$?
      same=$(python3 - "$R/$run-inproc" "$R/$run-$t" 2>&1 <<'EOF'
import json, sys
import numpy as np
a, b = (np.load(p + ".npz") for p in sys.argv[1:])
sa, sb = (json.loads([l for l in open(p + ".json") if l.startswith("{")][-1]) for p in sys.argv[1:])
keys = ("next_group_hits", "next_group_misses")
ok = all(np.array_equal(a[k], b[k]) for k in ("slots", "misses")) and all(sa.get(k) == sb.get(k) for k in keys)
print("equal to inproc" if ok else "DIFFERS from inproc")
EOF
)
      if (( rc == 0 )) && [[ "$same" == "equal to inproc" ]]; then
        result replay "$run $t: exact ($(grep -o '"mismatched_rows": [0-9]*' "$R/$run-$t.json"), $same)"
      else
        status=1
        result replay "$run $t: NOT EXACT (rc $rc, $same): $(tail -c 300 "$R/$run-$t.json" | tr '\n' ' ')"
      fi
    done
  done
fi
if has ab && [[ -z "${BASE_DIR:-}" ]]; then
  result ab "not run: BASE_DIR is not set"
elif has ab; then
  # The base tree installed on its own (/tmp/base-site first on PYTHONPATH), then the same
  # benches from the base (A) and from this tree (B) in turn, so that the machine's drift
  # lands on both alike. A failed base run costs its figures, nothing else.
  AB=$OUT/ab
  mkdir -p "$AB"
  ab_benches=${AB_BENCHES:-decode kernels}
  ab_benches=${ab_benches//,/ }
  if python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/base-site "$(realpath "$BASE_DIR")" \
      >"$AB/install-base.log" 2>&1; then
    for i in $(seq "${AB_ROUNDS:-2}"); do
      for side in A B; do
        if [[ $side == A ]]; then cmd=(env PYTHONPATH=/tmp/base-site:/tmp/site python3 /tmp/base-site/bin/sparsekv)
        else cmd=(python3 -m sparsekv.cli.main); fi
        if [[ " $ab_benches " == *" decode "* ]]; then
          timeout "$(left 200)" "${cmd[@]}" bench decode --quick ${AB_DECODE_ARGS:---batches 64} --json "$AB/decode-$side$i.json" \
            >"$AB/decode-$side$i.log" 2>&1
        fi
        if [[ " $ab_benches " == *" kernels "* ]]; then
          timeout "$(left 200)" "${cmd[@]}" bench kernels ${AB_KERNELS_ARGS:---kernels-quick --pool-gib 16} \
            --json "$AB/kernels-$side$i.json" >"$AB/kernels-$side$i.log" 2>&1
        fi
        if [[ " $ab_benches " == *" serve "* ]]; then
          timeout "$(left 240)" "${cmd[@]}" bench serve --quick ${AB_SERVE_ARGS:---contexts 32k --batches 1 --overlaps none --hbm-gb 1} \
            --json "$AB/serve-$side$i.json" >"$AB/serve-$side$i.log" 2>&1
          grep -E "^ *(gpu|inproc|daemon|prefetch) " "$AB/serve-$side$i.log" | sed "s/^/$side$i /" | cut -c1-400
        fi
      done
    done
    ab_keys=""
    for b in $ab_benches; do case $b in decode) ab_keys+=" $DECODE_KEYS";; kernels) ab_keys+=" $KERNEL_KEYS";;
      serve) ab_keys+=" $SERVE_KEYS";; esac; done
    python3 - "$AB" $ab_keys <<'EOF' | tee "$AB/table.txt"
import glob, json, os, statistics, sys
ab, keys = sys.argv[1], sys.argv[2:]
runs = {"A": [], "B": []}
for path in sorted(glob.glob(os.path.join(ab, "*-[AB]*.json"))):
    try:
        with open(path) as f:
            runs[os.path.basename(path).split("-")[1][0]].append(json.load(f))
    except ValueError as e:  # a run that wrote nothing usable: its figures are missing
        print(f"{path}: {e}")
print(f"{'figure':<36} {'base (A) runs':>24} {'tree (B) runs':>24} {'B/A':>6}")
for k in keys:
    a, b = ([r[k] for r in runs[s] if isinstance(r.get(k), (int, float))] for s in "AB")
    ratio = f"{statistics.median(b) / statistics.median(a):.3f}" if a and b and statistics.median(a) else "-"
    print(f"{k:<36} {' '.join(map(str, a)) or '-':>24} {' '.join(map(str, b)) or '-':>24} {ratio:>6}")
EOF
    result ab "$AB/table.txt (above)"
  else
    result ab "the base tree did not install (ab/install-base.log)"
  fi
fi
echo "== device_run: $(( $(date +%s) - T0 )) s"
for line in "${results[@]}"; do echo "$line"; done
exit $status
