"""deploy/: the systemd units, the sysusers file, the Dockerfile and the Kubernetes
manifest say what the deploy guide says they say, and agree with each other and with the
code (setting names, environment variables, paths).

CPU only, no network, no new dependency: the units are read by a small systemd-style
parser, the manifest by a small YAML subset parser (cross-checked against PyYAML when it
happens to be installed). `tests/deploy/verify-units.sh` is run when systemd-analyze exists.

Longer than 600 lines: every deploy file is checked against the others (units, sysusers,
Dockerfile, manifest, config): one module, so each cross-check reads the files once.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest

from sparsekv.daemon import config as config_mod
from sparsekv.daemon import kernels

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RUN_DIR = "/run/sparsekv"
MPS_PIPE = "/run/nvidia-mps"
CONFIG_PATH = "/etc/sparsekv/sparsekvd.toml"


# -- systemd units -------------------------------------------------------------------------
def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> every value assigned (in order), as systemd reads a unit file:
    '#'/';' comments, backslash continuation, repeated keys accumulate."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip() if pending else raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path.name}: {line!r} outside a section"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not a key=value line: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def one(unit, section: str, key: str) -> str:
    values = unit[section].get(key)
    assert values, f"[{section}] {key}= is missing"
    return values[-1]


def environment(unit) -> dict[str, str]:
    env = {}
    for value in unit["Service"].get("Environment", []):
        for item in value.split():
            k, _, v = item.strip('"').partition("=")
            env[k] = v
    return env


def timespan_s(text: str) -> float:
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600, "ms": 1e-3}
    total = 0.0
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text):
        total += float(num) * units[unit]
    return total


def resolve_specifiers(value: str) -> str:
    """The system-unit values of the specifiers the units use."""
    return value.replace("%t", "/run").replace("%C", "/var/cache").replace("%L", "/var/log").replace("%S", "/var/lib")


@pytest.fixture(scope="module")
def skvd():
    return parse_unit(DEPLOY / "sparsekvd.service")


@pytest.fixture(scope="module")
def mps():
    return parse_unit(DEPLOY / "nvidia-mps.service")


HARDENING = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "DevicePolicy": "closed",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "ProtectClock": "yes",
    "ProtectHostname": "yes",
    "RestrictNamespaces": "yes",
    "RestrictRealtime": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
    "SystemCallArchitectures": "native",
    "CapabilityBoundingSet": "",
    "RestrictAddressFamilies": "AF_UNIX",
    "RemoveIPC": "no",
}

# Options that break the daemon; the unit explains each in a comment.
FORBIDDEN = {
    "ProtectProc": {"invisible", "noaccess", "ptraceable"},  # the reaper reads /proc/<engine pid>
    "ProcSubset": {"pid"},  # psutil /proc/meminfo, CUDA /proc/driver/nvidia
    "MemoryDenyWriteExecute": {"yes", "true", "1"},  # CUDA JIT, libffi
    "PrivateDevices": {"yes", "true", "1"},  # hides /dev/nvidia*
    "RemoveIPC": {"yes", "true", "1"},  # deletes engines' / MPS shared memory
    "PrivateIPC": {"yes", "true", "1"},
    "PrivateNetwork": {"yes", "true", "1"},
}


@pytest.mark.parametrize("name", ["sparsekvd.service", "nvidia-mps.service"])
def test_units_carry_the_hardening_lines_and_none_that_break_cuda(name):
    unit = parse_unit(DEPLOY / name)
    svc = unit["Service"]
    for key, want in HARDENING.items():
        assert one(unit, "Service", key) == want, f"{name}: {key}="
    for key, bad in FORBIDDEN.items():
        assert not set(v.lower() for v in svc.get(key, [])) & bad, f"{name}: {key}= breaks the daemon"
    assert one(unit, "Service", "User") == "sparsekv" and one(unit, "Service", "Group") == "sparsekv"
    assert any("nvidia" in v and v.endswith("rw") for v in svc["DeviceAllow"])
    assert "/dev/shm" in " ".join(svc["ReadWritePaths"]).split()
    assert svc["SystemCallFilter"][0] == "@system-service"
    assert one(unit, "Service", "SystemCallErrorNumber") == "EPERM"
    assert one(unit, "Service", "IPAddressDeny") == "any"
    assert one(unit, "Service", "Restart") == "on-failure"
    assert int(one(unit, "Unit", "StartLimitBurst")) >= 1
    assert timespan_s(one(unit, "Unit", "StartLimitIntervalSec")) > 0


def test_sparsekvd_unit_is_a_notify_service_with_watchdog_pinning_and_its_run_dir(skvd):
    assert one(skvd, "Service", "Type") == "notify"
    assert one(skvd, "Service", "NotifyAccess") == "main"
    assert timespan_s(one(skvd, "Service", "WatchdogSec")) > 0
    # Pinning a large pool takes minutes.
    assert timespan_s(one(skvd, "Service", "TimeoutStartSec")) >= 15 * 60
    assert one(skvd, "Service", "LimitMEMLOCK") == "infinity"
    assert int(one(skvd, "Service", "LimitNOFILE")) >= 65536
    assert one(skvd, "Service", "RuntimeDirectory") == "sparsekv"
    assert one(skvd, "Service", "RuntimeDirectoryMode") == "0750"
    assert one(skvd, "Service", "UMask") == "0007"  # sockets and files group-accessible
    assert one(skvd, "Service", "CacheDirectory") == "sparsekv"
    assert "~@privileged" in skvd["Service"]["SystemCallFilter"]
    exec_start = one(skvd, "Service", "ExecStart").split()
    assert exec_start[0] == "/opt/sparsekv/bin/sparsekvd"
    assert exec_start[exec_start.index("--config") + 1] == CONFIG_PATH
    assert one(skvd, "Install", "WantedBy") == "multi-user.target"


def test_a_bad_setting_is_not_restarted(skvd, tmp_path):
    """Found by a review of the deploy files: a typo'd setting exits 2, and Restart=on-failure
    repeated it five times before the unit failed."""
    r = subprocess.run([sys.executable, "-m", "sparsekv.daemon.main", "--run-dir", str(tmp_path / "run"),
                        "--pool-size", "2G"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "pool_size" in r.stderr
    assert one(skvd, "Service", "Restart") == "on-failure"
    assert one(skvd, "Service", "RestartPreventExitStatus").split() == [str(r.returncode)]


def test_the_daemon_run_dir_from_systemd_is_the_documented_one(monkeypatch):
    monkeypatch.setenv("RUNTIME_DIRECTORY", RUN_DIR)
    assert config_mod.default_run_dir() == RUN_DIR


def test_sparsekvd_environment_names_are_read_by_the_code(skvd):
    env = environment(skvd)
    assert kernels.CACHE_ENV == "SPARSEKV_KERNEL_CACHE_DIR"
    assert resolve_specifiers(env[kernels.CACHE_ENV]).startswith("/var/cache/sparsekv")
    known = {kernels.CACHE_ENV, "SPARSEKV_CONFIG"} | {"SPARSEKV_" + f.upper() for f in config_mod.Config.__dataclass_fields__}
    for name in env:
        if name.startswith("SPARSEKV_"):
            assert name in known, f"{name} is read by nothing"
    for name in ("CUPY_CACHE_DIR", "CUDA_CACHE_PATH"):  # writable: under the cache dir
        assert resolve_specifiers(env[name]).startswith("/var/cache/sparsekv/")


def test_both_units_and_every_container_use_one_mps_pipe_directory(skvd, mps):
    a = environment(skvd)["CUDA_MPS_PIPE_DIRECTORY"]
    b = environment(mps)["CUDA_MPS_PIPE_DIRECTORY"]
    assert a == b == "%t/nvidia-mps"
    assert resolve_specifiers(a) == MPS_PIPE
    assert dockerfile_env()["CUDA_MPS_PIPE_DIRECTORY"] == MPS_PIPE
    ds = manifest()["DaemonSet"]
    for c in containers(ds):
        if c["name"] in ("sparsekvd", "nvidia-mps"):
            assert env_of(c)["CUDA_MPS_PIPE_DIRECTORY"] == MPS_PIPE
    assert host_paths(ds)["mps-pipe"] == MPS_PIPE


def test_sparsekvd_wants_mps_and_starts_after_it(skvd, mps):
    assert "nvidia-mps.service" in " ".join(skvd["Unit"]["Wants"]).split()
    assert "nvidia-mps.service" in " ".join(skvd["Unit"]["After"]).split()
    assert "sparsekvd.service" in " ".join(mps["Unit"]["Before"]).split()
    assert "-/run/nvidia-mps" in " ".join(skvd["Service"]["ReadWritePaths"]).split()


def test_mps_unit_runs_the_control_daemon_for_user_sparsekv_in_the_foreground(mps):
    assert one(mps, "Unit", "ConditionPathExists") == "/proc/driver/nvidia/version"  # not a file ExecStartPre makes
    assert one(mps, "Service", "Type") == "simple"
    assert one(mps, "Service", "ExecStart").split() == ["/usr/bin/nvidia-cuda-mps-control", "-f"]
    stop = one(mps, "Service", "ExecStop")
    assert "echo quit" in stop and "nvidia-cuda-mps-control" in stop
    assert one(mps, "Service", "RuntimeDirectory") == "nvidia-mps"
    assert one(mps, "Service", "RuntimeDirectoryMode") == "0700"
    assert one(mps, "Service", "LogsDirectory") == "nvidia-mps"
    env = environment(mps)
    assert env["CUDA_MPS_LOG_DIRECTORY"] == "%L/nvidia-mps"
    assert not any("/tmp" in v for v in env.values())
    # The control daemon calls set*id() for its own uid when it starts a server.
    assert "~@privileged" not in mps["Service"]["SystemCallFilter"]


def test_mps_unit_counts_as_started_only_once_its_control_pipe_exists(mps, tmp_path):
    """Type=simple: without a wait, sparsekvd (After=) could make its CUDA context before
    the control daemon's pipe exists, and run without MPS. ExecStartPost, run here with %t
    pointing at a scratch directory: it waits for the pipe, and gives up at its timeout;
    ExecStartPre removes a stale pipe first (found by a review: a control daemon that died
    left its socket, and the wait after the restart ended at once)."""
    post = one(mps, "Service", "ExecStartPost")
    assert post.startswith("/usr/bin/timeout 30 ") and "%t/nvidia-mps/control" in post
    assert "$" not in post  # systemd would expand a shell variable itself
    argv = shlex.split(post.replace("%t", str(tmp_path)))
    assert argv[0] == "/usr/bin/timeout" and argv[2:4] == ["/bin/sh", "-c"]
    (tmp_path / "nvidia-mps").mkdir()
    pipe = tmp_path / "nvidia-mps" / "control"
    threading.Timer(0.4, lambda: os.mkfifo(pipe)).start()
    t0 = time.monotonic()
    assert subprocess.run(["timeout", "10", *argv[2:]], timeout=20).returncode == 0
    assert 0.3 < time.monotonic() - t0 < 5  # it waited for the pipe, and not much longer
    pipe.unlink()
    t0 = time.monotonic()
    assert subprocess.run(["timeout", "1", *argv[2:]], timeout=20).returncode != 0  # no pipe: fails
    assert time.monotonic() - t0 < 5
    # A pipe a dead control daemon left (the directory outlives a restart) is removed before
    # the start, as the user the unit runs as, or the wait would end at once on it.
    os.mkfifo(pipe)
    pre = [v for v in mps["Service"]["ExecStartPre"] if "nvidia-mps/control" in v]
    assert len(pre) == 1 and pre[0][0] not in "+!-", pre  # no privilege, and a failure counts
    assert subprocess.run(shlex.split(pre[0].replace("%t", str(tmp_path))), timeout=20).returncode == 0
    assert not pipe.exists()


def test_sysusers_file_creates_user_and_group_sparsekv():
    lines = [ln.split() for ln in (DEPLOY / "sparsekv.sysusers.conf").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    assert ["u", "sparsekv"] in [ln[:2] for ln in lines]


def test_metrics_drop_in_adds_only_ipv4_loopback():
    unit = parse_unit(DEPLOY / "sparsekvd.service.d" / "metrics.conf")
    assert one(unit, "Service", "RestrictAddressFamilies").split() == ["AF_UNIX", "AF_INET"]
    assert one(unit, "Service", "IPAddressAllow") == "localhost"


def test_config_file_loads_and_names_every_setting():
    cfg = config_mod.load(argparse.Namespace(config=str(DEPLOY / "sparsekvd.toml")))
    assert cfg.pool_size > 0
    text = (DEPLOY / "sparsekvd.toml").read_text()
    for name in config_mod.Config.__dataclass_fields__:
        assert re.search(rf"^#? ?{name} = ", text, re.M), f"deploy/sparsekvd.toml does not mention {name}"


# -- verify-units.sh -----------------------------------------------------------------------
needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")


def run_verify(env_extra=None, path=None):
    env = dict(os.environ, **(env_extra or {}))
    if path is not None:
        env["PATH"] = path
    return subprocess.run(["bash", str(Path(__file__).parent / "verify-units.sh")], capture_output=True, text=True, env=env,
                          timeout=120)


@needs_analyze
def test_verify_units_passes_and_prints_the_exposure():
    r = run_verify()
    assert r.returncode == 0, r.stdout + r.stderr
    figures = re.findall(r"Overall exposure level for (\S+): (\d+\.\d+)", r.stdout)
    assert {u for u, _ in figures} == {"sparsekvd.service", "nvidia-mps.service", "sparsekv-warm-cpus@62-63.service"}
    assert all(float(x) <= 5.0 for _, x in figures)


@needs_analyze
@pytest.mark.parametrize("edit", [
    ("sparsekv-warm-cpus@.service", "\nCPUWeight=idle", "\nCPUWeight=idl"),  # the template's instance is checked
    ("sparsekvd.service", "ProtectHome=yes", "ProtectHome=yess"),  # a bad value
    ("nvidia-mps.service", "ProtectSystem=strict", "ProtectSytem=strict"),  # an unknown key
    ("sparsekvd.service", "ExecStart=/opt/sparsekv/bin/sparsekvd", "ExecStart=opt/sparsekvd"),  # not absolute
    ("sparsekv.sysusers.conf", "u sparsekv", "x sparsekv"),
])
def test_verify_units_fails_on_a_broken_file(tmp_path, edit):
    name, old, new = edit
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    text = (copy / name).read_text()
    assert old in text
    (copy / name).write_text(text.replace(old, new, 1))
    r = run_verify({"DEPLOY_DIR": str(copy)})
    assert r.returncode != 0, r.stdout
    assert "FAIL" in r.stdout


@needs_analyze
def test_verify_units_fails_when_the_exposure_rises(tmp_path):
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    unit = copy / "sparsekvd.service"
    unit.write_text("\n".join(ln for ln in unit.read_text().splitlines()
                              if not ln.startswith(("CapabilityBoundingSet=", "SystemCallFilter=", "User="))) + "\n")
    r = run_verify({"DEPLOY_DIR": str(copy)})
    assert r.returncode != 0 and "exposure is above" in r.stdout, r.stdout


def test_verify_units_skips_without_systemd_analyze(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "bash").symlink_to(shutil.which("bash"))
    r = run_verify(path=str(bindir))
    assert r.returncode == 0
    assert "skipped" in r.stdout


# -- Dockerfile ----------------------------------------------------------------------------
def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined, comments dropped."""
    out, buf = [], ""
    for raw in (DEPLOY / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def dockerfile_args() -> dict[str, str]:
    return dict(a.split("=", 1) for i, a in dockerfile() if i == "ARG" and "=" in a)


def dockerfile_env() -> dict[str, str]:
    env = {}
    for ins, args in dockerfile():
        if ins == "ENV":
            for k, v in re.findall(r"(\w+)=(\S+)", args):
                env[k] = v
    return env


def test_dockerfile_runs_sparsekvd_as_a_non_root_user():
    steps = dockerfile()
    args = dockerfile_args()
    assert "runtime" in args["CUDA_IMAGE"] and args["CUDA_IMAGE"].startswith("nvidia/cuda:13.")
    users = [a for i, a in steps if i == "USER"]
    assert users, "no USER: the daemon would run as root"
    user = users[-1].split(":")[0]
    user = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], user)
    assert user not in ("root", "0") and (not user.isdigit() or int(user) > 0)
    entry = json.loads([a for i, a in steps if i == "ENTRYPOINT"][-1])
    assert Path(entry[0]).name == "sparsekvd"
    assert entry[entry.index("--run-dir") + 1] == RUN_DIR
    assert any("pip install" in a and "/src[cuda]" in a for i, a in steps if i == "RUN")
    assert dockerfile_env()[kernels.CACHE_ENV].startswith("/var/cache/sparsekv")


# -- Kubernetes ----------------------------------------------------------------------------
def manifest() -> dict[str, dict]:
    docs = load_yaml_documents((DEPLOY / "k8s" / "daemonset.yaml").read_text())
    return {d["kind"]: d for d in docs if d}


def pod_spec(ds) -> dict:
    return ds["spec"]["template"]["spec"]


def containers(ds) -> list[dict]:
    spec = pod_spec(ds)
    return spec.get("initContainers", []) + spec["containers"]


def container(ds, name: str) -> dict:
    return next(c for c in containers(ds) if c["name"] == name)


def env_of(c) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def host_paths(ds) -> dict[str, str]:
    return {v["name"]: v["hostPath"]["path"] for v in pod_spec(ds)["volumes"] if "hostPath" in v}


def mounts(c) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}


def test_daemonset_shares_ipc_pids_run_dir_and_shm_with_the_node():
    ds = manifest()["DaemonSet"]
    spec = pod_spec(ds)
    assert spec["hostIPC"] is True and spec["hostPID"] is True
    hp = host_paths(ds)
    daemon = container(ds, "sparsekvd")
    m = mounts(daemon)
    assert hp[m[RUN_DIR]] == RUN_DIR
    assert hp[m["/dev/shm"]] == "/dev/shm"
    assert hp[m[MPS_PIPE]] == MPS_PIPE
    assert spec["nodeSelector"]  # GPU nodes only
    assert spec["terminationGracePeriodSeconds"] >= 60


def test_daemonset_mounts_its_config_map_as_the_config_file():
    docs = manifest()
    ds, cm = docs["DaemonSet"], docs["ConfigMap"]
    daemon = container(ds, "sparsekvd")
    vol = mounts(daemon)[str(Path(CONFIG_PATH).parent)]
    source = next(v for v in pod_spec(ds)["volumes"] if v["name"] == vol)
    assert source["configMap"]["name"] == cm["metadata"]["name"]
    assert cm["metadata"]["namespace"] == ds["metadata"]["namespace"]
    args = daemon["args"]
    assert args[args.index("--config") + 1] == CONFIG_PATH
    toml_text = cm["data"][Path(CONFIG_PATH).name]
    for name in tomllib.loads(toml_text)["sparsekvd"]:
        assert name in config_mod.Config.__dataclass_fields__, f"ConfigMap: unknown setting {name}"


def test_daemonset_probes_use_sparsekv_health_and_allow_a_long_start():
    daemon = container(manifest()["DaemonSet"], "sparsekvd")
    health = ["sparsekv", "health"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        cmd = daemon[probe]["exec"]["command"]
        assert cmd[:2] == health and cmd[cmd.index("--run-dir") + 1] == RUN_DIR, probe
        assert ("--live" in cmd) == (probe == "livenessProbe"), probe
    start = daemon["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 15 * 60


def test_daemonset_runs_as_the_image_user_without_privilege_escalation():
    ds = manifest()["DaemonSet"]
    spec = pod_spec(ds)
    uid = int(dockerfile_args()["SPARSEKV_UID"])
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == uid
    daemon = container(ds, "sparsekvd")
    sc = daemon["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert "IPC_LOCK" in sc["capabilities"]["add"] and "ALL" in sc["capabilities"]["drop"]
    assert "privileged" not in sc
    for c in containers(ds):
        assert c.get("securityContext", {}).get("allowPrivilegeEscalation") is False, c["name"]
        assert c["image"] == daemon["image"]
    # The init container that chowns the host paths gives them to the image's uid.
    prep = container(ds, "prepare-dirs")
    assert f"{uid}:{uid}" in " ".join(prep["command"])
    # MPS serves one uid: its sidecar runs as the daemon's (the pod's) user.
    mps = container(ds, "nvidia-mps")
    assert mps["command"] == ["nvidia-cuda-mps-control", "-f"] and "runAsUser" not in mps.get("securityContext", {})


def test_daemonset_gets_every_gpu_without_requesting_one():
    ds = manifest()["DaemonSet"]
    assert pod_spec(ds)["runtimeClassName"] == "nvidia"
    daemon = container(ds, "sparsekvd")
    assert env_of(daemon)["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "nvidia.com/gpu" not in json.dumps(daemon["resources"])
    assert daemon["resources"]["requests"]["memory"] == daemon["resources"]["limits"]["memory"]


# -- a YAML subset: block mappings and sequences, flow collections, literal blocks -----------
def load_yaml_documents(text: str) -> list:
    docs = [_MiniYaml(chunk.splitlines()).parse() for chunk in re.split(r"^---\s*$", text, flags=re.M)]
    try:
        import yaml  # noqa: PLC0415 - optional: a cross-check of the subset parser
    except ImportError:
        return docs
    assert docs == list(yaml.safe_load_all(text)), "the subset parser disagrees with PyYAML"
    return docs


def _strip_comment(s: str) -> str:
    quote = None
    for i, ch in enumerate(s):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#" and (i == 0 or s[i - 1] in " \t"):
            return s[:i].rstrip()
    return s.rstrip()


def _scalar(s: str):
    s = s.strip()
    if len(s) >= 2 and s[0] == s[-1] == '"':
        return json.loads(s)
    if len(s) >= 2 and s[0] == s[-1] == "'":
        return s[1:-1].replace("''", "'")
    low = s.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("", "null", "~"):
        return None
    if re.fullmatch(r"[-+]?\d+", s):
        return int(s)
    if re.fullmatch(r"[-+]?(\d+\.\d*|\.\d+)([eE][-+]?\d+)?", s):
        return float(s)
    return s


class _Flow:
    def __init__(self, s: str):
        self.s, self.i = s, 0

    def ws(self):
        while self.i < len(self.s) and self.s[self.i] == " ":
            self.i += 1

    def value(self):
        self.ws()
        ch = self.s[self.i]
        if ch == "[":
            self.i += 1
            out = []
            while True:
                self.ws()
                if self.s[self.i] == "]":
                    self.i += 1
                    return out
                out.append(self.value())
                self.ws()
                if self.s[self.i] == ",":
                    self.i += 1
        if ch == "{":
            self.i += 1
            out = {}
            while True:
                self.ws()
                if self.s[self.i] == "}":
                    self.i += 1
                    return out
                key = self.atom(stop=":")
                assert self.s[self.i] == ":"
                self.i += 1
                out[key] = self.value()
                self.ws()
                if self.s[self.i] == ",":
                    self.i += 1
        return self.atom(stop=",]}")

    def atom(self, stop: str):
        self.ws()
        start = self.i
        if self.s[self.i] in "\"'":
            q = self.s[self.i]
            self.i += 1
            while self.s[self.i] != q or (q == '"' and self.s[self.i - 1] == "\\"):
                self.i += 1
            self.i += 1
            return _scalar(self.s[start:self.i])
        while self.i < len(self.s) and self.s[self.i] not in stop:
            self.i += 1
        return _scalar(self.s[start:self.i])


def _inline(text: str):
    text = text.strip()
    if text[:1] in "[{":
        v = _Flow(text)
        out = v.value()
        assert not text[v.i:].strip(), f"trailing text after a flow collection: {text!r}"
        return out
    return _scalar(text)


def _key_split(text: str):
    """'key: rest' -> (key, rest), or None when text is not a mapping entry."""
    if text[:1] in "[{\"'":
        return None
    m = re.match(r"([^:#]+?):(?:\s+(.*))?$", text)
    return (m.group(1).strip(), m.group(2) or "") if m else None


class _MiniYaml:
    def __init__(self, lines: list[str]):
        self.lines = lines
        self.i = 0

    def peek(self):
        while self.i < len(self.lines):
            raw = self.lines[self.i]
            body = _strip_comment(raw)
            if body.strip():
                return len(raw) - len(raw.lstrip(" ")), body.strip()
            self.i += 1
        return None

    def parse(self):
        p = self.peek()
        return None if p is None else self.node(p[0])

    def node(self, indent: int):
        p = self.peek()
        if p is None or p[0] < indent:
            return None
        return self.seq(p[0]) if p[1] == "-" or p[1].startswith("- ") else self.mapping(p[0])

    def mapping(self, indent: int) -> dict:
        out = {}
        while (p := self.peek()) and p[0] == indent and not (p[1] == "-" or p[1].startswith("- ")):
            kv = _key_split(p[1])
            assert kv, f"not a mapping entry: {p[1]!r}"
            self.i += 1
            out[kv[0]] = self.value(kv[1], indent, seq_ok=True)
        assert not (p and p[0] > indent), f"bad indentation at {p[1]!r}"
        return out

    def seq(self, indent: int) -> list:
        out = []
        while (p := self.peek()) and p[0] == indent and (p[1] == "-" or p[1].startswith("- ")):
            body = p[1][1:].strip()
            col = indent + 1 + (len(p[1]) - 1 - len(p[1][1:].lstrip()))
            if body == "-" or body.startswith("- "):
                # "- - x": a sequence in a sequence, its dashes where the inner one stands.
                self.lines[self.i] = " " * col + body
                out.append(self.seq(col))
            elif body and _key_split(body):
                # "- key: value": a mapping whose keys sit where "key" starts.
                self.lines[self.i] = " " * col + body
                out.append(self.mapping(col))
            else:
                self.i += 1
                out.append(self.value(body, indent, seq_ok=False))
        return out

    def value(self, rest: str, indent: int, seq_ok: bool):
        if rest in ("|", "|-"):
            return self.literal(indent, keep_newline=rest == "|")
        if rest:
            return _inline(rest)
        p = self.peek()
        if p and (p[0] > indent or (seq_ok and p[0] == indent and (p[1] == "-" or p[1].startswith("- ")))):
            return self.node(p[0])
        return None

    def literal(self, indent: int, keep_newline: bool) -> str:
        block: list[str] = []
        width = None
        while self.i < len(self.lines):
            raw = self.lines[self.i]
            if raw.strip():
                ind = len(raw) - len(raw.lstrip(" "))
                if ind <= indent:
                    break
                width = ind if width is None else width
            block.append(raw[width:] if width is not None and raw.strip() else "")
            self.i += 1
        while block and not block[-1]:
            block.pop()
        return "\n".join(block) + ("\n" if keep_newline and block else "")
