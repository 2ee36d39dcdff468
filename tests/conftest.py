"""Test options and shared fixtures.

GPU tests are marked ``cuda``; ``--require-cuda`` makes their skip a failure. Tests that
need torch (its CPU build is enough) skip without it (``pytest.importorskip("torch")``);
``--torch-skips FILE`` lists them, for ``.ci/run`` to run once it has installed torch.
"""

import functools
import os
import sys
import tempfile

import pytest

import helpers
from sparsekv.bench.private_daemon import PrivateDaemon

# The suite starts a few hundred interpreters (daemons, CLI commands); where
# PYTHONDONTWRITEBYTECODE keeps bytecode out of the tree, each compiles the package anew
# (a tenth of the suite's CPU time). Cache it outside the tree instead, for this process
# and every one it starts.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    os.environ.setdefault("PYTHONPYCACHEPREFIX", os.path.join(tempfile.gettempdir(), f"sparsekv-pycache-{os.getuid()}"))
    sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"]
    sys.dont_write_bytecode = False


def pytest_addoption(parser):
    parser.addoption(
        "--require-cuda",
        action="store_true",
        help="fail (instead of skip) tests marked cuda when no usable GPU is found",
    )
    parser.addoption(
        "--torch-skips",
        metavar="FILE",
        help="write the ids of the tests (or modules) skipped because torch is not installed to FILE, one a line",
    )


def pytest_collection_modifyitems(items):
    """Tests marked ``waits`` first (the rest keep their order): a worker that sleeps
    through one at the start overlaps the others' work, one at the end is the run's tail."""
    items.sort(key=lambda item: item.get_closest_marker("waits") is None)


def pytest_terminal_summary(terminalreporter, config):
    path = config.getoption("--torch-skips")
    if path and not hasattr(config, "workerinput"):  # the controller: it sees every worker's reports
        skipped = terminalreporter.stats.get("skipped", [])
        ids = sorted({r.nodeid for r in skipped if "could not import 'torch'" in str(r.longrepr)})
        with open(path, "w") as f:
            f.writelines(f"{i}\n" for i in ids)


@functools.cache
def cuda_unavailable_reason():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as e:  # noqa: BLE001 - any import/driver failure means no GPU here
        return f"CUDA unavailable: {type(e).__name__}: {e}"
    return None


def pytest_runtest_setup(item):
    if "cuda" not in item.keywords:
        return
    reason = cuda_unavailable_reason()
    if reason is None:
        return
    if item.config.getoption("--require-cuda"):
        pytest.fail(f"--require-cuda: {reason}", pytrace=False)
    pytest.skip(reason)


def pytest_runtest_teardown(item):
    """``SPARSEKV_GPU_MEMLOG=FILE``: after each ``cuda`` test, the GPU's free memory (as
    this process sees it: under MPS, the whole GPU's) and this process's CuPy and torch
    pools, one line a test. For memory that outlives the tests that took it."""
    path = os.environ.get("SPARSEKV_GPU_MEMLOG")
    if not path or "cuda" not in item.keywords or cuda_unavailable_reason() is not None:
        return
    cp = sys.modules["cupy"]
    free, total = cp.cuda.runtime.memGetInfo()
    torch = sys.modules.get("torch")
    held = torch.cuda.memory_reserved() if torch is not None and torch.cuda.is_initialized() else 0
    with open(path, "a") as f:
        f.write(f"{item.nodeid} free_GiB={free / 2**30:.2f} of {total / 2**30:.1f} "
                f"cupy_pool_GiB={cp.get_default_memory_pool().total_bytes() / 2**30:.2f} "
                f"torch_reserved_GiB={held / 2**30:.2f}\n")


# -- fixtures shared by the suite (helpers live in tests/helpers.py) ----------------------
POOL_BYTES = 64 << 20  # small: the daemon starts in a fraction of a second


def private_daemon(log_dir) -> PrivateDaemon:
    return PrivateDaemon(pool_bytes=POOL_BYTES, backend="cpu", extra_args=["--reap-interval-s", "0.1"],
                         log_path=str(log_dir / "sparsekvd.log"), start_timeout_s=30)


@pytest.fixture
def daemon(tmp_path):
    """A private sparsekvd (cpu backend, 64 MiB pool) in its own process, stopped after
    the test. Dead clients are reaped every 0.1 s. Its log is ``tmp_path/sparsekvd.log``."""
    with private_daemon(tmp_path) as d:
        yield d


@pytest.fixture(scope="module")
def module_daemon(tmp_path_factory):
    """The ``daemon`` fixture's daemon, shared by the tests of one module (a test worker
    starts it once for the module's tests it runs): for tests that only read it, or that
    leave it as they found it."""
    with private_daemon(tmp_path_factory.mktemp("daemon")) as d:
        yield d


@pytest.fixture
def dm(tmp_path):
    """A ``Daemon`` (cpu backend, 8 MiB pool, at most 3 clients) driven in this process:
    ``helpers.request(dm, ident, ...)`` sends it one request (helpers.inproc_daemon)."""
    with helpers.inproc_daemon(tmp_path) as d:
        yield d


@pytest.fixture
def spawn_rank():
    """Factory ``spawn_rank(run_dir, rank)`` of rank processes (tests/helpers.RankProc);
    every one is stopped after the test, killed if it does not exit."""
    procs = []

    def make(run_dir, rank, name=""):
        p = helpers.RankProc(run_dir, rank, name)
        procs.append(p)
        return p

    yield make
    for p in procs:
        p.close()
