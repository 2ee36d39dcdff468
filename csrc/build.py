"""Compile and cache the CUDA kernels of ``csrc/`` (CuPy ``RawModule``; no torch extension).

Each module is one ``csrc/*.cu`` file with its local ``#include "x.cuh"`` files inlined and
its constants prepended as ``#define`` lines, so the text that is hashed is exactly the
program that is compiled. The cache key is that text, the compiler options, the NVRTC
version and the GPU architecture; the cubin lands in :func:`cache_dir`. Builds are
serialised across processes (daemon workers and TP ranks start at once) by an ``flock`` on
``<cache_dir>/.lock``; a cubin is written to a temporary file and renamed.

Used by the daemon (``daemon/kernels.py``) and a cuda rank's handle (``client/doorbell.py``).
``cupy`` is imported only when a kernel is first needed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

from sparsekv.proto.settings import KERNEL_CACHE_DIR

log = logging.getLogger(__name__)

CACHE_ENV = KERNEL_CACHE_DIR.env  # the same name as the daemon setting kernel_cache_dir
DEFAULT_CACHE_DIR = KERNEL_CACHE_DIR.default
OPTIONS: tuple[str, ...] = ("-std=c++17",)
# Bump when the way sources are assembled changes (it is part of every cache key).
_SCHEMA = "sparsekv-kernels-2"
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.M)

DEFAULT_SMEM_BYTES = 48 << 10  # dynamic shared memory without an opt-in


def csrc_dir() -> Path:
    """The folder holding the kernel sources (this package)."""
    return Path(__file__).resolve().parent


def cache_dir(path: str | os.PathLike | None = None) -> Path:
    """The cache directory: argument, else ``$SPARSEKV_KERNEL_CACHE_DIR`` (the daemon's
    ``kernel_cache_dir``), else ``~/.cache/sparsekv/kernels``."""
    return Path(path if path is not None else KERNEL_CACHE_DIR.get()).expanduser()


def load_source(name: str, defines: Mapping[str, int | str] | None = None, root: Path | None = None) -> str:
    """Return the self-contained text of ``csrc/<name>``: defines first, each local header
    inlined once (NVRTC then needs to find none, and their text is part of the cache key)."""
    root = root or csrc_dir()
    seen: set[str] = set()

    def expand(fname: str) -> str:
        path = (root / fname).resolve()
        if path.parent != root:
            raise ValueError(f"kernel include {fname!r} leaves {root}")
        if fname in seen:
            return f"// {fname} already included\n"
        seen.add(fname)
        text = path.read_text().replace("#pragma once\n", "\n")  # keep line numbers

        def inline(m: re.Match) -> str:
            next_line = text.count("\n", 0, m.end()) + 2
            return f'{expand(m.group(1))}\n#line {next_line} "{fname}"'

        return f'#line 1 "{fname}"\n' + _INCLUDE.sub(inline, text)

    head = "".join(f"#define {k} {v}\n" for k, v in sorted((defines or {}).items()))
    return f"// sparsekv kernel module {name}\n{head}{expand(name)}"


class KernelCache:
    """Compiled modules of one process, backed by the on-disk cubin cache: each compiled
    (or loaded from disk) once per (source, defines, device)."""

    def __init__(self, cache_dir_: str | os.PathLike | None = None):
        self.cache_dir = cache_dir(cache_dir_)
        self._modules: dict[tuple, object] = {}
        self._smem: dict[tuple, int] = {}  # highest dynamic shared memory opted in, per function
        self._lock = threading.Lock()

    def function(self, source: str, name: str, defines: Mapping[str, int | str] | None = None,
                 smem_bytes: int = 0):
        """The kernel ``name`` of ``csrc/<source>`` built with ``defines``, allowed at least
        ``smem_bytes`` of dynamic shared memory.

        The opt-in limit is an attribute of the compiled function, which every user of the
        same module on this device shares (two engines with different layouts, say): it is
        only ever raised here, to the largest any caller asked for, never lowered.
        """
        fn = self.module(source, defines).get_function(name)
        if smem_bytes > DEFAULT_SMEM_BYTES:
            import cupy

            key = (source, tuple(sorted((defines or {}).items())), cupy.cuda.Device().id, name)
            with self._lock:
                if smem_bytes > self._smem.get(key, DEFAULT_SMEM_BYTES):
                    fn.max_dynamic_shared_size_bytes = int(smem_bytes)
                    self._smem[key] = int(smem_bytes)
        return fn

    def module(self, source: str, defines: Mapping[str, int | str] | None = None):
        import cupy

        dev = cupy.cuda.Device().id
        key = (source, tuple(sorted((defines or {}).items())), dev)
        with self._lock:
            mod = self._modules.get(key)
            if mod is None:
                mod = self._build(source, dict(defines or {}))
                self._modules[key] = mod
            return mod

    def _build(self, source: str, defines: dict):
        import cupy

        text = load_source(source, defines)
        cc = cupy.cuda.Device().compute_capability
        try:
            from cupy_backends.cuda.libs import nvrtc
        except ImportError:  # a CuPy without the private NVRTC binding: use its own cache
            log.warning("cupy_backends nvrtc binding not found; using CuPy's kernel cache")
            return cupy.RawModule(code=text, options=OPTIONS)
        major, minor = nvrtc.getVersion()
        options = OPTIONS + (f"-arch=sm_{cc}",)
        digest = hashlib.sha256(
            "\0".join((_SCHEMA, text, " ".join(options), f"nvrtc{major}.{minor}")).encode()
        ).hexdigest()[:24]
        path = self.cache_dir / f"{Path(source).stem}-sm{cc}-{digest}.cubin"
        if not path.exists():
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            with _file_lock(self.cache_dir / ".lock"):
                if not path.exists():  # another process may have built it meanwhile
                    log.info("compiling kernel module %s (%s)", source, path.name)
                    binary = _nvrtc_compile(nvrtc, text, source, options)
                    _write_atomic(path, binary)
        return cupy.RawModule(path=str(path))


def _nvrtc_compile(nvrtc, text: str, name: str, options: tuple[str, ...]) -> bytes:
    prog = nvrtc.createProgram(text, name, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(
                f"NVRTC failed to compile {name} with {options}:\n{nvrtc.getProgramLog(prog)}"
            ) from e
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


_default: dict[tuple[type, Path], "KernelCache"] = {}
_default_lock = threading.Lock()


def get_cache(cache_dir_: str | os.PathLike | None = None, cls: type | None = None) -> KernelCache:
    """The process-wide cache of class ``cls`` (default :class:`KernelCache`; the daemon's
    subclass adds ``warm``) for a cache directory."""
    cls = cls or KernelCache
    d = cache_dir(cache_dir_)
    with _default_lock:
        kc = _default.get((cls, d))
        if kc is None:
            kc = _default[(cls, d)] = cls(d)
        return kc
