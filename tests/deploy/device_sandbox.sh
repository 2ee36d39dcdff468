#!/usr/bin/env bash
# On the GPU machine (no systemd there), as root, from the repo root: emulate the sandbox
# of deploy/nvidia-mps.service and deploy/sparsekvd.service and run MPS, the demo and the
# cuda tests inside it:
#   user `sparsekv` (not root), umask 0007, RLIMIT_MEMLOCK unlimited, MPS pipe directory
#   /run/nvidia-mps (0700) and log directory /var/log/nvidia-mps, kernel caches under
#   /var/cache/sparsekv, NoNewPrivileges + each unit's SystemCallFilter= (syscalls-*.txt)
#   + RestrictAddressFamilies=AF_UNIX (tests/deploy/sandbox_exec.py).
# Seen on an H200 (driver 580): the cuda demo through MPS ran clean; ~@privileged on the
# MPS control daemon made it fail to start servers (hence its unit keeps @system-service).
# Not emulated: ProtectSystem/ProtectHome/PrivateTmp (mount namespaces), DevicePolicy.
# Needs .whl (pyzmq) like tests/gpu/device_run.sh; LIBSECCOMP=path if the image lacks it.
# Writes logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/skv-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
here=$(pwd)
echo "== machine"; uname -a; nvidia-smi -L
echo "== /proc/devices (nvidia)"; grep -i nvidia /proc/devices
echo "== /dev/nvidia*"; ls -l /dev/nvidia* 2>&1; ls -l /dev/nvidia-caps 2>&1 | head -5
echo "== tools"; command -v nvidia-cuda-mps-control nvidia-modprobe setpriv
ldconfig -p | grep -i seccomp || echo "libseccomp not in ldconfig"

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# SRC_TAR=x.tar (e.g. `git archive HEAD`): install that tree instead of this one.
rm -rf /tmp/src && mkdir /tmp/src
if [[ -n ${SRC_TAR:-} ]]; then tar -xf "$SRC_TAR" -C /tmp/src; else cp -r . /tmp/src && rm -rf /tmp/src/.whl; fi
python3 -m pip install -q --no-deps --no-build-isolation /tmp/src >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
chmod -R a+rX /tmp/site /tmp/src
id sparsekv >/dev/null 2>&1 || useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin sparsekv
install -d -o sparsekv -g sparsekv -m 0700 /run/nvidia-mps
install -d -o sparsekv -g sparsekv -m 0750 /var/log/nvidia-mps /var/cache/sparsekv /run/sparsekv
ulimit -l unlimited
# The sandbox helper where user sparsekv can read it.
rm -rf /tmp/skv-sandbox && install -d -m 0755 /tmp/skv-sandbox
cp tests/deploy/sandbox_exec.py tests/deploy/syscalls-*.txt /tmp/skv-sandbox/
if [[ -n ${LIBSECCOMP:-} ]]; then cp "$LIBSECCOMP" /tmp/skv-sandbox/ && LIBSECCOMP=/tmp/skv-sandbox/$(basename "$LIBSECCOMP"); fi
chmod -R a+rX /tmp/skv-sandbox
allowed=/tmp/skv-sandbox/syscalls-sparsekvd.txt
as_user() {  # as the units run: user sparsekv, umask 0007, the unit's environment, sandbox
  setpriv --reuid=sparsekv --regid=sparsekv --init-groups -- env -i PATH="$PATH" \
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HOME=/ LIBSECCOMP="${LIBSECCOMP:-}" \
    LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}" ${CUDA_VISIBLE_DEVICES:+CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES} \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
    CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/var/log/nvidia-mps \
    SPARSEKV_KERNEL_CACHE_DIR=/var/cache/sparsekv/kernels CUPY_CACHE_DIR=/var/cache/sparsekv/cupy \
    CUDA_CACHE_PATH=/var/cache/sparsekv/nv NCCL_NVLS_ENABLE=0 \
    bash -c 'umask 0007; exec "$@"' as_user python3 "$allowed_py" "$allowed" -- "$@"
}
allowed_py=/tmp/skv-sandbox/sandbox_exec.py

echo "== probe without a control daemon (rc expected non-zero)"
as_user /bin/sh -c 'echo get_server_list | nvidia-cuda-mps-control'; echo "probe rc=$?"

echo "== MPS control daemon -f as sparsekv, sandboxed like nvidia-mps.service"
allowed=/tmp/skv-sandbox/syscalls-mps.txt as_user nvidia-cuda-mps-control -f >"$OUT/mps-foreground.log" 2>&1 &
mps_pid=$!
sleep 3
ps -o pid,user,args -p $mps_pid || echo "MPS control daemon is not running"
ls -la /run/nvidia-mps
as_user /bin/sh -c 'echo get_server_list | nvidia-cuda-mps-control'; echo "probe rc=$?"

status=0
echo "== cuda demo (daemon + 2 ranks) as sparsekv, sandboxed like sparsekvd.service"
cd /tmp/src
timeout 200 bash -c "$(declare -f as_user); allowed=$allowed allowed_py=$allowed_py; as_user python3 -m sparsekv.cli.main demo --quiet --backend cuda" 2>&1 | tee "$OUT/demo.log" | tail -15
[[ ${PIPESTATUS[0]} == 0 ]] || status=1
echo "== MPS servers and clients after the demo"
as_user /bin/sh -c 'echo get_server_list | nvidia-cuda-mps-control'
ls -la /var/log/nvidia-mps /var/cache/sparsekv
tail -20 /var/log/nvidia-mps/control.log 2>/dev/null

echo "== cuda tests as sparsekv, sandboxed"
timeout ${PYTEST_TIMEOUT_S:-300} bash -c "$(declare -f as_user); allowed=$allowed allowed_py=$allowed_py; as_user python3 -m pytest -q -x --require-cuda -m cuda -p no:cacheprovider ${PYTEST_SELECT:-tests}" 2>&1 | tee "$OUT/pytest-cuda.log" | tail -25
[[ ${PIPESTATUS[0]} == 0 ]] || status=1
cd "$here"

echo "== stop MPS"
as_user /bin/sh -c 'echo quit | nvidia-cuda-mps-control'; echo "quit rc=$?"
wait $mps_pid; echo "control daemon exit=$?"
tail -20 "$OUT/mps-foreground.log"

echo "== -d: what it leaves in the pipe directory"
d=$(mktemp -d); chown sparsekv "$d"
setpriv --reuid=sparsekv --regid=sparsekv --init-groups env CUDA_MPS_PIPE_DIRECTORY=$d CUDA_MPS_LOG_DIRECTORY=$d nvidia-cuda-mps-control -d; echo "-d rc=$?"
sleep 1; ls -la "$d"; cat "$d"/*.pid 2>/dev/null
setpriv --reuid=sparsekv --regid=sparsekv --init-groups env CUDA_MPS_PIPE_DIRECTORY=$d sh -c 'echo quit | nvidia-cuda-mps-control'
exit $status
