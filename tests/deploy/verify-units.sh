#!/usr/bin/env bash
# CI check of the systemd files in deploy/, offline (no running systemd needed):
#   1. `systemd-analyze verify` of sparsekvd.service, nvidia-mps.service and an instance of
#      sparsekv-warm-cpus@.service inside a throw-away root that holds the units, stub
#      targets and stub executables at the paths the units name (verify refuses an
#      ExecStart= binary that does not exist); any warning about our units is a failure;
#   2. `systemd-sysusers --dry-run` of sparsekv.sysusers.conf;
#   3. `systemd-analyze security --offline=true`: prints the exposure of each unit and
#      fails when one is above MAX_EXPOSURE (default 2.0);
#   4. verify again with the metrics drop-in (sparsekvd.service.d/) and print its exposure.
# Skips (exit 0) with a message when systemd-analyze is not installed or older than 250.
# Usage: tests/deploy/verify-units.sh      (from anywhere)
#   DEPLOY_DIR=DIR checks the files in DIR instead (the tests use it on broken copies).
set -euo pipefail
if ! command -v systemd-analyze >/dev/null 2>&1; then
  echo "verify-units: systemd-analyze not found; skipped (apt-get install systemd to run it)"
  exit 0
fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../deploy" && pwd)
here=${DEPLOY_DIR:-$here}
files=(sparsekvd.service nvidia-mps.service sparsekv-warm-cpus@.service)
# What is verified: the units, the template as one instance.
units=(sparsekvd.service nvidia-mps.service sparsekv-warm-cpus@62-63.service)
max_exposure=${MAX_EXPOSURE:-2.0}
version=$(systemd-analyze --version | awk 'NR == 1 { print $2 }')
echo "verify-units: systemd $version"
# `verify --root=` and `security --offline` (both needed here, no systemd running) came in 250.
if [[ $version =~ ^[0-9]+$ ]] && ((version < 250)); then
  echo "verify-units: systemd $version is older than 250 (no offline verify/security); skipped"
  exit 0
fi

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
mkdir -p "$root/etc/systemd/system"
for u in "${files[@]}"; do
  cp "$here/$u" "$root/etc/systemd/system/$u"
done
# Every service depends on these by default; empty stubs keep the root self-contained.
for t in sysinit.target basic.target shutdown.target multi-user.target; do
  printf '[Unit]\nDescription=stub %s\n' "$t" >"$root/etc/systemd/system/$t"
done
# Stub executables for every absolute command path in the units (ExecStart=, ExecStop=, ...).
mapfile -t cmds < <(sed -nE 's/^Exec[A-Za-z]+=[-+@:!]*(\/[^ ]+).*/\1/p' "${files[@]/#/$here/}" | sort -u)
for c in "${cmds[@]}"; do
  mkdir -p "$root$(dirname "$c")"
  printf '#!/bin/sh\nexit 0\n' >"$root$c"
  chmod 0755 "$root$c"
done

fail=0
echo "== systemd-analyze verify ${units[*]}"
rc=0
out=$(systemd-analyze verify --root="$root" --man=no "${units[@]}" 2>&1) || rc=$?
[[ -n $out ]] && printf '%s\n' "$out"
if ((rc != 0)); then
  echo "verify-units: FAIL: systemd-analyze verify exited $rc"
  fail=1
elif grep -qE "(sparsekvd|nvidia-mps|sparsekv-warm-cpus@[^ ]*)\.service" <<<"$out"; then
  echo "verify-units: FAIL: systemd-analyze verify warned about our units (above)"
  fail=1
else
  echo "ok"
fi

if command -v systemd-sysusers >/dev/null 2>&1; then
  echo "== systemd-sysusers --dry-run sparsekv.sysusers.conf"
  mkdir -p "$root/etc"
  if out=$(systemd-sysusers --root="$root" --dry-run - <"$here/sparsekv.sysusers.conf" 2>&1); then
    echo "ok"
  else
    printf '%s\n' "$out"
    echo "verify-units: FAIL: systemd-sysusers refused sparsekv.sysusers.conf"
    fail=1
  fi
else
  echo "== systemd-sysusers not found; sysusers file not checked"
fi

echo "== systemd-analyze security (offline), fail above $max_exposure"
if ! systemd-analyze security --help 2>/dev/null | grep -q -- "--offline"; then
  echo "systemd $version has no 'security --offline' (needs 250+); exposure not measured"
else
  threshold=$(awk -v m="$max_exposure" 'BEGIN { printf "%d", m * 10 + 0.5 }')
  for u in "${units[@]}"; do
    rc=0
    out=$(systemd-analyze security --offline=true --root="$root" --threshold="$threshold" --no-pager "$u" 2>&1) ||
      rc=$?
    line=$(grep -E "Overall exposure level" <<<"$out" || true)
    if [[ -z $line ]]; then
      printf '%s\n' "$out"
      echo "verify-units: FAIL: no exposure figure for $u"
      fail=1
      continue
    fi
    echo "$line"
    if ((rc != 0)); then
      grep -E "^✗" <<<"$out" || true
      echo "verify-units: FAIL: $u exposure is above $max_exposure"
      fail=1
    fi
  done
fi

# The metrics drop-in (sparsekvd.service.d/metrics.conf) on top of the unit.
if [[ -d $here/sparsekvd.service.d ]]; then
  echo "== with sparsekvd.service.d/*.conf (the metrics drop-in)"
  cp -r "$here/sparsekvd.service.d" "$root/etc/systemd/system/"
  rc=0
  out=$(systemd-analyze verify --root="$root" --man=no sparsekvd.service 2>&1) || rc=$?
  [[ -n $out ]] && printf '%s\n' "$out"
  if ((rc != 0)) || grep -qE "sparsekvd\.service|metrics\.conf" <<<"$out"; then
    echo "verify-units: FAIL: systemd-analyze verify of sparsekvd.service with its drop-ins"
    fail=1
  elif systemd-analyze security --help 2>/dev/null | grep -q -- "--offline"; then
    systemd-analyze security --offline=true --root="$root" --no-pager sparsekvd.service 2>&1 |
      grep -E "Overall exposure level" || true
  fi
fi

if ((fail)); then
  echo "verify-units: FAILED"
  exit 1
fi
echo "verify-units: all checks passed"
