"""Packaging: torch and CuPy belong to the ``cuda`` extra. The cpu backend, the cpu
client, the daemon and the CLI import and run without them (every ``import torch`` /
``import cupy`` is lazy, on a cuda path only)."""

import importlib.util
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from sparsekv.client.cuda_attach import bus_id_of

ROOT = Path(__file__).resolve().parents[1]

# A child process in which torch and cupy cannot be imported, whether installed or not.
BLOCK = textwrap.dedent("""
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "cupy"):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
    sys.meta_path.insert(0, Block())
""")


def run_blocked(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)


def test_cpu_paths_import_and_run_without_torch_or_cupy(tmp_path):
    r = run_blocked("""
        import importlib, sys
        for m in ["sparsekv.proto", "sparsekv.proto.cuda_ipc", "sparsekv.proto.step_block",
                  "sparsekv.daemon.main", "sparsekv.daemon.server", "sparsekv.daemon.backends",
                  "sparsekv.daemon.registry", "sparsekv.daemon.stats", "sparsekv.daemon.residency.cpu",
                  "sparsekv.client", "sparsekv.cli.main", "sparsekv.bench.replay", "sparsekv.cli.demo",
                  "sparsekv.bench.bench", "sparsekv.embedded.inproc", "sparsekv.client.cuda_attach"]:
            importlib.import_module(m)
        from sparsekv.cli.main import main
        from sparsekv.daemon.backends import make_backend
        from sparsekv.daemon.config import Config
        assert main(["trace", "synth", "--out", "t.npz", "--steps", "5"]) == 0
        assert main(["replay", "t.npz", "--out", "r.npz", "--transport", "inproc", "--verify"]) == 0
        be = make_backend(Config(backend="cpu", run_dir=".", shm_dir="."), None)
        assert be.name == "cpu"
        be.close()
        assert not {"torch", "cupy"} & set(sys.modules), sorted(sys.modules)
        print("no torch: ok")
    """, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no torch: ok" in r.stdout


def test_a_cuda_rank_without_the_cuda_extra_is_told_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in ("torch", "cupy") else real(n, *a))
    with pytest.raises(ImportError, match=r"a cuda rank needs cupy and torch: pip install 'sparsekv\[cuda\]'"):
        bus_id_of(0)


def test_torch_and_cupy_come_only_with_the_cuda_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {r.split(">")[0].split("=")[0].split("[")[0].strip().lower() for r in reqs}  # noqa: E731
    base = names(project["dependencies"])
    assert not {"torch", "cupy-cuda13x"} & base and "prometheus-client" in base
    assert {"torch", "cupy-cuda13x"} <= names(project["optional-dependencies"]["cuda"])
    assert project["license"] == "Apache-2.0" and (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")


def test_every_folder_of_modules_is_in_the_distribution():
    """A folder of modules under a room (daemon/, client/, ...) that pyproject's
    ``packages`` does not list is left out of ``pip install .`` and ``make wheel``."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {"sparsekv"}
    for name, folder in tool["package-dir"].items():
        if folder != ".":  # the root holds only the package's __init__.py; the rooms are mapped
            found |= {".".join([name, *p.parent.relative_to(ROOT / folder).parts]) for p in (ROOT / folder).rglob("*.py")}
    assert found == set(tool["packages"])
