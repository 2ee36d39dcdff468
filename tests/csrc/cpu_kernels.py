"""The CUDA kernels of ``csrc/``, compiled for the CPU and run through an emulation of the
few CUDA features they use (``emulator/``: each block is a set of fibers, one per thread,
switched at barriers and warp votes), so that their logic is checked on machines without
a GPU, against the NumPy engine, bit for bit. Not a model of the GPU's memory ordering or
speed: a check of what the kernels compute, the GPU run stays the final word.

``build(source, defines)`` compiles the kernels of one source with a C++ compiler
(``g++``/``c++``; tests skip without one) into a cache directory; :class:`Resolve` runs
``skv_resolve`` over NumPy arrays laid out as ``daemon/residency/cuda/`` lays them out.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from sparsekv.csrc.build import load_source
from sparsekv.daemon.kernels import resolve_defines
from sparsekv.daemon.residency.cuda import (PF_HITS, PF_PREFETCHED, PF_WASTED, error_bits, fresh_marks, make_desc,
                                            prefetch_workspace_bytes, resolve_workspace_bytes, rows_block)

HERE = Path(__file__).resolve().parent
EMU = HERE / "emulator"
P = ctypes.c_void_p


def compiler() -> str | None:
    for name in ("g++", "c++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


_built: dict[str, ctypes.CDLL] = {}
_FLAGS = ["-O1", "-std=c++17", "-fPIC", "-w"]


def _cache() -> Path:
    cache = Path(os.environ.get("SPARSEKV_EMU_CACHE", Path(tempfile.gettempdir()) / f"sparsekv-emu-{os.getuid()}"))
    cache.mkdir(parents=True, exist_ok=True)
    return cache


class BuildError(subprocess.CalledProcessError):
    """A compile of the emulated kernels failed; says the compiler's last words."""

    def __str__(self) -> str:
        return f"{super().__str__()}\n{(self.stderr or '')[-3000:]}"


def _once(out: Path, cmd: list[str], src_text: str | None = None) -> None:
    """``out`` made by ``cmd`` (``{out}``, ``{src}`` filled in) unless there; one process
    at a time builds it (test workers share the cache), the others wait and reuse it."""
    if out.exists():
        return
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            return
        tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"
        src = out.parent / f".{out.name}.{os.getpid()}.cpp"
        if src_text is not None:
            src.write_text(src_text)
        try:
            r = subprocess.run([a.format(out=tmp, src=src) for a in cmd], capture_output=True, text=True, timeout=300)
            if r.returncode:
                raise BuildError(r.returncode, r.args, r.stdout, r.stderr)
            os.replace(tmp, out)
        finally:
            src.unlink(missing_ok=True)


@functools.cache
def _emulator(cxx: str) -> tuple[Path, list[str]]:
    """``emu.cpp`` compiled once (an object every build links) and ``shim.h`` precompiled
    once (GCC; what each build's first line includes), not again in every build."""
    emu_src = (EMU / "emu.cpp").read_text() + (EMU / "shim.h").read_text()
    key = hashlib.sha256((emu_src + cxx + " ".join(_FLAGS)).encode()).hexdigest()[:16]
    cache = _cache()
    obj = cache / f"emu-{key}.o"
    _once(obj, [cxx, *_FLAGS, f"-I{EMU}", "-c", "-o", "{out}", str(EMU / "emu.cpp")])
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    if "clang" in version.lower():
        return obj, []
    pch = cache / f"pch-{key}"
    pch.mkdir(exist_ok=True)
    try:  # found before emulator/shim.h in the include path; a stale one GCC ignores
        _once(pch / "shim.h.gch", [cxx, *_FLAGS, "-x", "c++-header", "-o", "{out}", str(EMU / "shim.h")])
    except subprocess.CalledProcessError:
        return obj, []
    return obj, [f"-I{pch}"]


def build(source: str, defines: dict) -> ctypes.CDLL:
    """A shared library with ``run_<entry>(grid, block, smem, <params>)`` for every kernel
    ``entry`` of ``csrc/<source>`` in ``KERNELS`` (``defines`` prepended), each running it
    on the emulator. One build per source and set of defines: the kernels are plain
    ``extern "C"`` functions, each compiled whichever is run."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++, clang++) on this machine")
    text = "#include \"shim.h\"\n" + load_source(source, defines) + """
#include <functional>
void emu_launch(int grid, int block, int smem, std::function<void()> body);
""" + "".join(f"""extern "C" void run_{entry}(int grid, int block, int smem, {params}) {{
    emu_launch(grid, block, smem, [=] {{ {entry}({args}); }});
}}
""" for entry, (params, args) in KERNELS[source].items())
    obj, pch = _emulator(cxx)  # obj's name is the key of the emulator's sources, compiler and flags
    key = hashlib.sha256((text + obj.name + " ".join(pch)).encode()).hexdigest()[:16]
    if key in _built:
        return _built[key]
    lib = _cache() / f"{source.split('.')[0]}-{key}.so"
    _once(lib, [cxx, *_FLAGS, "-shared", *pch, f"-I{EMU}", "-o", "{out}", "{src}", str(obj)], text)
    _built[key] = ctypes.CDLL(str(lib))
    return _built[key]


_RESOLVE_PARAMS = ("const int* desc, int* owner, int* lru, int groups, int max_reqs, int S, int host_rows, int top_k, "
                   "int max_batch, const int* state_rows, const int* topk, int out_k, int* slots, int* misses, "
                   "int* prow, int* pslot, unsigned long long* counters, int cpg, int* err, unsigned char* ws, "
                   "long long ws_stride, unsigned int* clear, unsigned char* fresh, unsigned long long* pf")
_RESOLVE_ARGS = ("desc, owner, lru, groups, max_reqs, S, host_rows, top_k, max_batch, state_rows, topk, out_k, slots, "
                 "misses, prow, pslot, counters, cpg, err, ws, ws_stride, clear, fresh, pf")


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(P)


class Resolve:
    """``skv_resolve`` of one layout on the emulator, with its own owner/lru state
    (``[groups, max_reqs, region_stride]``, as :class:`CudaResidency` keeps it).

    ``resolve(group, state_rows, topk)`` returns what ``CudaResidency.resolve`` returns
    (slots, misses, hits, out_of_range, the plan concatenated and stable-sorted) plus
    ``misses_counted`` and the raw per-row outputs; ``err`` is the error record. With
    ``prefetch``, the prefetch marks ``fresh`` and counters (as ``CudaResidency(prefetch=True)``
    keeps them) and :meth:`prefetch` (``skv_prefetch`` of csrc/prefetch.cu)."""

    def __init__(self, lay, threads: int = 64, workspace: str = "shared", hash_scale: int = 2,
                 lru_smem: bool = False, owner_smem: bool = False, prefetch: bool = False):
        self.lay, self.threads = lay, int(threads)
        # the workspace's options (CudaResidency picks them), in the defines and its size
        self.opts = {"hash_scale": int(hash_scale), "lru_smem": bool(lru_smem), "owner_smem": bool(owner_smem)}
        self.workspace = workspace  # shared: built with SKV_WS_SMEM, as CudaResidency does
        self.lib = build("resolve.cu", resolve_defines(self.threads, **self.opts, ws_smem=self.workspace == "shared"))
        g, r, s = lay.num_groups, lay.max_reqs, lay.region_stride
        self.owner = np.full((g, r, s), -1, np.int32)
        self.lru = np.empty((g, r, s), np.int32)
        self.lru[...] = np.arange(s, dtype=np.int32)
        self.ws_bytes = resolve_workspace_bytes(lay.top_k, s, **self.opts)
        self.err = np.zeros(32, np.int32)
        self.fresh = fresh_marks((g, r, s)) if prefetch else None
        self.pf = np.zeros(4, np.uint64)
        if prefetch:
            self.pf_lib = build("prefetch.cu", resolve_defines(self.threads))

    @property
    def prefetched(self) -> int:
        return int(self.pf[PF_PREFETCHED])

    @property
    def prefetch_hits(self) -> int:
        return int(self.pf[PF_HITS])

    @property
    def prefetch_wasted(self) -> int:
        return int(self.pf[PF_WASTED])

    def prefetch(self, group: int, state_rows, topk, group_offset: int = 0):
        """One ``skv_prefetch`` launch into ``group``'s regions; returns the raw per-row
        plans (``prow``, ``pslot`` [max_batch, top_k], ``counts``) and the plan (``rows``,
        ``slots``) as CudaResidency.prefetch returns it (entries a later token dropped left
        out, sorted by host row, then slot); also kept as ``last_prefetch``."""
        lay = self.lay
        B, K = lay.max_batch, lay.top_k
        batch, k = topk.shape
        desc = make_desc(batch, k, group - group_offset)
        sr = np.full(B, -1, np.int32)
        sr[:batch] = state_rows
        tk = np.ascontiguousarray(topk, dtype=np.int32)
        out = SimpleNamespace(prow=np.full((B, K), -7, np.int32), pslot=np.full((B, K), -7, np.int32),
                              counts=np.full(B, -7, np.int32))
        i = ctypes.c_int
        self.pf_lib.run_skv_prefetch(
            i(B), i(self.threads), i(prefetch_workspace_bytes(K, lay.region_stride)), _ptr(desc), i(group_offset),
            _ptr(self.owner), _ptr(self.lru), _ptr(self.fresh), i(lay.num_groups), i(lay.max_reqs), i(lay.region_stride),
            i(lay.host_rows), i(K), i(B), _ptr(sr), _ptr(tk), i(K), _ptr(out.prow), _ptr(out.pslot),
            _ptr(out.counts), _ptr(self.pf), _ptr(self.err))
        take = np.arange(K)[None, :] < out.counts[:batch, None]
        rows, flat = out.prow[:batch][take], out.pslot[:batch][take]
        keep = flat >= 0
        rows, flat = rows[keep], flat[keep]
        by = np.lexsort((flat, rows))  # by host row, then slot: the NumPy engine's order
        out.rows, out.slots = rows[by], flat[by]
        self.last_prefetch = out
        return out

    # -- the other residency kernels (skv_reset, skv_invalidate, skv_begin_step), as CudaResidency
    # calls them: in self.lib, built with the same defines
    def reset(self, state_rows) -> None:
        rows = np.asarray(state_rows, dtype=np.int32)
        rows = np.ascontiguousarray(rows[rows >= 0])
        if not rows.size:
            return
        lay = self.lay
        i = ctypes.c_int
        self.lib.run_skv_reset(i(3), i(64), i(0), _ptr(self.owner), _ptr(self.lru), i(lay.num_groups),
                               i(lay.max_reqs), i(lay.region_stride), _ptr(rows), i(rows.size), _opt(self.fresh),
                               _ptr(self.pf))

    def _invalidate(self, rows, state_rows) -> int:
        block = np.ascontiguousarray(rows_block(rows))
        if not block[0]:
            return 0
        lay = self.lay
        counter = np.zeros(1, np.uint64)
        sr = None if state_rows is None else np.ascontiguousarray(state_rows, dtype=np.int32)
        i = ctypes.c_int
        self.lib.run_skv_invalidate(i(3), i(64), i(0), _ptr(self.owner), i(lay.num_groups), i(lay.max_reqs),
                                    i(lay.region_stride), _opt(sr), i(0 if sr is None else sr.size), _ptr(block),
                                    i(int(block[0])), _ptr(counter), _opt(self.fresh), _ptr(self.pf))
        return int(counter[0])

    def invalidate(self, state_row: int, rows) -> None:
        self._invalidate(rows, np.array([state_row], np.int32))

    def invalidate_everywhere(self, rows) -> int:
        return self._invalidate(rows, None)

    def begin_step(self, state_rows, reset, invalidate) -> None:
        """``skv_begin_step`` of a STEP block: ``state_rows`` int32 [n], ``reset`` [n] (0/1),
        ``invalidate`` int32 [n, m] (-1 = none)."""
        lay = self.lay
        inv = np.ascontiguousarray(invalidate, dtype=np.int32)
        n, m = inv.shape
        cap = max(1, lay.top_k)
        desc = make_desc(batch=n, inv_n=m)
        sr = np.full(lay.max_batch, -1, np.int32)
        sr[:n] = state_rows
        rs = np.zeros(lay.max_batch, np.int32)
        rs[:n] = np.asarray(reset, dtype=np.int32)
        smem = 4 * (1 << max(0, (cap - 1).bit_length()))
        i = ctypes.c_int
        self.lib.run_skv_begin_step(i(4), i(64), i(smem), _ptr(desc), _ptr(self.owner), _ptr(self.lru),
                                    i(lay.num_groups), i(lay.max_reqs), i(lay.region_stride), i(lay.max_batch),
                                    _ptr(sr), _ptr(rs), _ptr(inv), i(cap), _ptr(self.err), _opt(self.fresh),
                                    _ptr(self.pf))

    def state(self) -> tuple[np.ndarray, np.ndarray]:
        return self.owner.copy(), self.lru.copy()

    @property
    def last_errors(self) -> int:
        """Error bits counted so far (this emulated rank's whole record)."""
        return error_bits(self.err)

    def run(self, group: int, state_rows: np.ndarray, topk: np.ndarray, clear: np.ndarray | None = None):
        """One launch; ``clear``: a uint32 word the kernel sets to 0 (a doorbell bell)."""
        lay = self.lay
        B, K = lay.max_batch, lay.top_k
        batch, k = topk.shape
        desc = make_desc(batch, k, group)
        out = SimpleNamespace(slots=np.full((B, K), -7, np.int32), misses=np.full(B, -7, np.int32),
                              prow=np.full((B, K), -7, np.int32), pslot=np.full((B, K), -7, np.int32),
                              counters=np.zeros(4, np.uint64))
        sr = np.full(B, -1, np.int32)
        sr[:batch] = state_rows
        tk = np.ascontiguousarray(topk, dtype=np.int32)
        if self.workspace == "global":
            ws = np.zeros(B * self.ws_bytes + 16, np.uint8)
            ws_ptr, ws_stride, smem = _ptr(ws), self.ws_bytes, 0
        else:
            ws_ptr, ws_stride, smem = P(0), 0, self.ws_bytes
        i = ctypes.c_int
        self.lib.run_skv_resolve(
            i(B), i(self.threads), i(smem), _ptr(desc), _ptr(self.owner), _ptr(self.lru), i(lay.num_groups),
            i(lay.max_reqs), i(lay.region_stride), i(lay.host_rows), i(lay.top_k), i(B), _ptr(sr), _ptr(tk), i(K),
            _ptr(out.slots), _ptr(out.misses), _ptr(out.prow), _ptr(out.pslot), _ptr(out.counters), i(0),
            _ptr(self.err), ws_ptr, ctypes.c_longlong(ws_stride), _opt(clear), _opt(self.fresh), _ptr(self.pf))
        return out

    def resolve(self, group: int, state_rows: np.ndarray, topk: np.ndarray):
        batch, k = topk.shape
        out = self.run(group, state_rows, topk)
        m = out.misses[:batch]
        take = np.arange(self.lay.top_k)[None, :] < m[:, None]
        rows, flat = out.prow[:batch][take], out.pslot[:batch][take]
        by = np.argsort(rows, kind="stable")
        plan = SimpleNamespace(rows=rows[by].astype(np.int32), slots=flat[by].astype(np.int32))
        return SimpleNamespace(slots=out.slots[:batch, :k].copy(), misses=m.copy(), hits=int(out.counters[0]),
                               out_of_range=int(out.counters[2]), misses_counted=int(out.counters[1]), plan=plan,
                               raw=out)


_TOPK_PARAMS = ("int* blk, const int* counter, const int* req_ids, int tokens, const int* table, int table_rows, "
                "int max_blocks, const int* resident, int res_blocks, const int* topk, int k, int block_size, "
                "int group, int max_batch, unsigned* done, unsigned* bell, int local_bell")
_TOPK_ARGS = ("blk, counter, req_ids, tokens, table, table_rows, max_blocks, resident, res_blocks, topk, k, block_size, "
              "group, max_batch, done, bell, local_bell")
_INDICES_PARAMS = ("const int* slots, int ld, const int* req_ids, int tokens, const int* topk, int k, "
                   "const int* resident, int res_blocks, int table_rows, int block_size, int region_stride, "
                   "long long hot_base, long long resident_base, const int* dead, const unsigned int* stopped, "
                   "int* out, int* valid, unsigned int* clear, unsigned int* arrivals, const int* slots_ready")
_INDICES_ARGS = ("slots, ld, req_ids, tokens, topk, k, resident, res_blocks, table_rows, block_size, region_stride, "
                 "hot_base, resident_base, dead, stopped, out, valid, clear, arrivals, slots_ready")


def _opt(a):
    return _ptr(a) if a is not None else P(0)


def db_topk(grid: int, threads: int, blk, counter, req_ids, table, resident, topk, block_size: int, group: int,
            max_batch: int, done=None, bell=None, local_bell: bool = False):
    """``skv_db_topk`` (csrc/handle.cu) over NumPy arrays; ``table`` / ``resident`` None
    for none; ``local_bell``: the bell rung after a device-scope fence (the emulator has
    one memory: the same result)."""
    lib = build("handle.cu", {})
    i = ctypes.c_int
    tokens, k = topk.shape
    table_rows, max_blocks = table.shape if table is not None else (max_batch, 0)
    res_blocks = resident.shape[1] if resident is not None else 0
    lib.run_skv_db_topk(i(grid), i(threads), i(0), _ptr(blk), _ptr(counter), _ptr(req_ids), i(tokens), _opt(table),
                        i(table_rows), i(max_blocks), _opt(resident), i(res_blocks), _ptr(topk), i(k), i(block_size),
                        i(group), i(max_batch), _opt(done), _opt(bell), i(1 if local_bell else 0))


def db_topk_raw(grid: int, threads: int, args: tuple):
    """``skv_db_topk`` with an argument tuple as a launcher passes it: :func:`run_raw`
    (client/doorbell.py's argument builder against the kernel's parameter order)."""
    run_raw("handle.cu", "skv_db_topk", grid, threads, args)


def run_raw(source: str, entry: str, grid: int, threads: int, args: tuple, defines: dict | None = None) -> None:
    """Kernel ``entry`` of ``source`` with an argument tuple as a launcher passes it
    (NumPy arrays for device arrays, addresses as ints, NumPy scalars), converted by the
    kernel's parameter types: to run a caller's own argument builder against the
    kernel's parameter order."""
    lib = build(source, defines or {})
    params = [p.strip() for p in KERNELS[source][entry][0].split(",")]
    if len(args) != len(params):
        raise TypeError(f"{entry} takes {len(params)} arguments, got {len(args)}")

    def conv(p: str, a):
        # CuPy packs a NumPy scalar by its own width and a Python int as 8 bytes: each
        # must match the parameter's, or every later argument lands shifted on a GPU.
        width = 8 if "*" in p or p.startswith("long long") else 4
        if not isinstance(a, np.ndarray) and (np.dtype(type(a)).itemsize if isinstance(a, np.generic) else 8) != width:
            raise TypeError(f"{entry}: {type(a).__name__} {a!r} passed for parameter {p!r} ({width} bytes)")
        if "*" in p:
            return _ptr(a) if isinstance(a, np.ndarray) else P(int(a))
        if p.startswith("long long"):
            return ctypes.c_longlong(int(a))
        return ctypes.c_uint(int(a)) if p.startswith("unsigned") else ctypes.c_int(int(a))

    getattr(lib, f"run_{entry}")(ctypes.c_int(grid), ctypes.c_int(threads), ctypes.c_int(0),
                                 *(conv(p, a) for p, a in zip(params, args)))


def db_indices(grid: int, threads: int, slots, req_ids, topk, resident, table_rows: int, block_size: int,
               region_stride: int, hot_base: int, resident_base: int, dead, out, valid=None, clear=None, stopped=None,
               arrivals=None, slots_ready=None):
    """``skv_db_indices`` (csrc/handle.cu) over NumPy arrays; ``clear``: a uint32 word it
    sets to 0 (the layer's ready word); ``stopped``: the rank's uint32 stop word; with
    ``arrivals`` (uint32 [1]) it waits for the ready word first (set it before the call:
    blocks run one after another here); with ``slots_ready`` too (int32 [1], the TOPK
    block's SKV_D_SLOTS word) it makes the indices once that word is set, then waits for the
    ready word. ``topk`` None without ``resident`` (the kernel does not read it then); the
    shape [tokens, k] is ``out``'s."""
    lib = build("handle.cu", {})
    i = ctypes.c_int
    tokens, k = out.shape
    res_blocks = resident.shape[1] if resident is not None else 0
    lib.run_skv_db_indices(i(grid), i(threads), i(0), _ptr(slots), i(slots.shape[1]), _ptr(req_ids), i(tokens),
                           _opt(topk), i(k), _opt(resident), i(res_blocks), i(table_rows), i(block_size),
                           i(region_stride), ctypes.c_longlong(hot_base), ctypes.c_longlong(resident_base),
                           _opt(dead), _opt(stopped), _ptr(out), _opt(valid), _opt(clear), _opt(arrivals),
                           _opt(slots_ready))



def start(fn, *args, **kwargs) -> threading.Thread:
    """``fn(*args, **kwargs)`` on a thread of its own (a kernel that polls a word, which
    the caller may set while it runs)."""
    t = threading.Thread(target=fn, args=args, kwargs=kwargs, daemon=True)
    t.start()
    return t


def finish(t: threading.Thread, word, what: str, timeout_s: float = 10.0) -> None:
    """Wait for :func:`start`'s thread; one still running after ``timeout_s`` polls for
    ever: ``word[0]`` set to 1 to release it, then AssertionError(``what``)."""
    t.join(timeout_s)
    if t.is_alive():
        word[0] = 1
        t.join(timeout_s)
        raise AssertionError(what)

_PLAN_COPY_TAIL = ("const int* group_layers, int layers_stride, int groups, const int* plan_rows, "
                   "const int* plan_slots, const int* misses, int max_batch, int ld, const long long* layer_off, "
                   "long long block_rows, long long block_stride, int stripe, int stripes, unsigned* ready, "
                   "unsigned* arrivals, unsigned expect")
_PLAN_COPY_ARGS = ("group_layers, layers_stride, groups, plan_rows, plan_slots, misses, max_batch, ld, layer_off, "
                   "block_rows, block_stride, stripe, stripes, ready, arrivals, expect")
_GATHER_PARAMS = ("const int* desc, const unsigned char* pool, long long host_rows, int num_layers, "
                  "unsigned char* slab, long long slab_layer_rows, " + _PLAN_COPY_TAIL + ", int mark_slots")
_GATHER_ARGS = "desc, pool, host_rows, num_layers, slab, slab_layer_rows, " + _PLAN_COPY_ARGS + ", mark_slots"
_PUSH_PARAMS = ("const int* desc, long long host_rows, int num_layers, const unsigned char* src, unsigned char* dst, "
                "long long slab_layer_rows, " + _PLAN_COPY_TAIL)
_PUSH_ARGS = "desc, host_rows, num_layers, src, dst, slab_layer_rows, " + _PLAN_COPY_ARGS


def _plan_tail(group_layers, plan_rows, plan_slots, misses, layer_off, block_rows, block_stride, stripe, stripes,
               ready, arrivals, expect) -> tuple:
    B, ld = plan_rows.shape
    i, q = ctypes.c_int, ctypes.c_longlong
    return (_ptr(group_layers), i(group_layers.shape[1]), i(group_layers.shape[0]), _ptr(plan_rows),
            _ptr(plan_slots), _ptr(misses), i(B), i(ld), _opt(layer_off), q(block_rows), q(block_stride), i(stripe),
            i(stripes), _opt(ready), _opt(arrivals), ctypes.c_uint(expect))


def small_plan(seed: int):
    """A small gather case: pool [2, 50, 32] (uint8), both layers in group 0, 3 batch rows
    of ld 4 (host rows, slots mod 12, misses 4 / 0 / 2). Returns (pool, groups, rows, slots,
    misses, slots_n)."""
    rng = np.random.default_rng(seed)
    L, host_rows, rb, B, ld, slots_n = 2, 50, 32, 3, 4, 12
    pool = rng.integers(0, 256, size=(L, host_rows, rb), dtype=np.uint8)
    groups = np.array([[2, 0, 1]], np.int32)
    rows = rng.integers(0, host_rows, size=(B, ld)).astype(np.int32)
    slots = np.arange(B * ld, dtype=np.int32).reshape(B, ld) % slots_n
    return pool, groups, rows, slots, np.array([4, 0, 2], np.int32), slots_n


def gather(desc, pool, slab, slab_layer_rows: int, group_layers, plan_rows, plan_slots, misses, grid: int = 4,
           threads: int = 64, layer_off=None, block_rows: int = 1, block_stride: int = 0, ready=None, arrivals=None,
           defines: dict | None = None, stripe: int = 0, stripes: int = 1, expect: int = 0,
           mark_slots: bool = False):
    """``skv_gather`` (csrc/copy.cu): the per-row plans (of each row, stripe ``stripe`` of
    ``stripes``), pool ``[L, host_rows, row_bytes]`` (uint8) -> ``slab`` (uint8, laid out
    flat or by the engine-slab geometry); ``ready`` / ``arrivals``: uint32 [1] each, the
    word set once ``expect`` blocks arrived (0: this grid's) and their counter;
    ``mark_slots``: desc[D_SLOTS] set to 1; ``defines``: more constants (a variant of the kernel)."""
    L, host_rows, rb = pool.shape
    lib = build("copy.cu",
                {"SKV_ROW_VECS": rb // 16, "SKV_COPY_THREADS": threads, **(defines or {})})
    i, q = ctypes.c_int, ctypes.c_longlong
    lib.run_skv_gather(i(grid), i(threads), i(0), _ptr(desc), _ptr(pool), q(host_rows), i(L), _ptr(slab),
                       q(slab_layer_rows), *_plan_tail(group_layers, plan_rows, plan_slots, misses, layer_off,
                                                       block_rows, block_stride, stripe, stripes, ready, arrivals,
                                                       expect), i(1 if mark_slots else 0))


def push(desc, host_rows: int, src, dst, slab_layer_rows: int, group_layers, plan_rows, plan_slots, misses,
         stripe: int, stripes: int, grid: int = 4, threads: int = 64, layer_off=None, block_rows: int = 1,
         block_stride: int = 0, ready=None, arrivals=None, expect: int = 0):
    """``skv_push`` (csrc/copy.cu): stripe ``stripe`` of ``stripes`` of the per-row plans,
    ``src`` (uint8 ``[L, slab_layer_rows, row_bytes]``) -> ``dst`` at the same slots (flat
    or by the engine-slab geometry), entries whose row is outside [0, ``host_rows``)
    skipped; ``ready`` / ``arrivals`` / ``expect`` as for :func:`gather`."""
    L, _, rb = src.shape
    lib = build("copy.cu", {"SKV_ROW_VECS": rb // 16, "SKV_COPY_THREADS": threads})
    i, q = ctypes.c_int, ctypes.c_longlong
    lib.run_skv_push(i(grid), i(threads), i(0), _ptr(desc), q(host_rows), i(L), _ptr(src), _ptr(dst),
                     q(slab_layer_rows), *_plan_tail(group_layers, plan_rows, plan_slots, misses, layer_off,
                                                     block_rows, block_stride, stripe, stripes, ready, arrivals,
                                                     expect))


_INTS = {"i32": "int", "i64": "long long"}
_MAP_ARGS = "out, req_ids, tokens, table, table_rows, max_blocks, topk, k, block_size"


def _map_params(p: str, t: str) -> str:
    return (f"int* out, const int* req_ids, int tokens, const {_INTS[t]}* table, int table_rows, int max_blocks, "
            f"const {_INTS[p]}* topk, int k, long long block_size")


def map_positions(grid: int, threads: int, topk, table, block_size: int, req_ids):
    """``skv_map_positions_<P>_<T>`` (csrc/handle.cu) over NumPy arrays (int32 or int64
    positions and table); returns the int32 host rows."""
    lib = build("handle.cu", {})
    width = {4: "i32", 8: "i64"}
    name = f"skv_map_positions_{width[topk.dtype.itemsize]}_{width[table.dtype.itemsize]}"
    tokens, k = topk.shape
    out = np.full((tokens, k), -9, np.int32)
    getattr(lib, f"run_{name}")(ctypes.c_int(grid), ctypes.c_int(threads), ctypes.c_int(0), _ptr(out), _ptr(req_ids),
                                ctypes.c_int(tokens), _ptr(table), ctypes.c_int(table.shape[0]),
                                ctypes.c_int(table.shape[1]), _ptr(topk), ctypes.c_int(k),
                                ctypes.c_longlong(block_size))
    return out


# The kernels of each source the tests run: the C parameter list, the names passed on.
KERNELS = {
    "tp.cu": {
        "skv_tp_check_step": ("const int* lead, const int* foll, int max_batch, int inv_cap, unsigned int* bad, int* err",
                              "lead, foll, max_batch, inv_cap, bad, err"),
        "skv_tp_follow": ("const int* lead, const int* foll, const int* lead_slots, const int* lead_misses, int* slots, "
                          "int* misses, int out_k, int max_batch, const unsigned int* step_bad, int* err",
                          "lead, foll, lead_slots, lead_misses, slots, misses, out_k, max_batch, step_bad, err"),
    },
    "resolve.cu": {
        "skv_resolve": (_RESOLVE_PARAMS, _RESOLVE_ARGS),
        "skv_reset": ("int* owner, int* lru, int groups, int max_reqs, int S, const int* state_rows, int n, "
                      "unsigned char* fresh, unsigned long long* pf",
                      "owner, lru, groups, max_reqs, S, state_rows, n, fresh, pf"),
        "skv_invalidate": ("int* owner, int groups, int max_reqs, int S, const int* state_rows, int n_state, "
                           "const int* rows, int rows_cap, unsigned long long* counter, unsigned char* fresh, "
                           "unsigned long long* pf",
                           "owner, groups, max_reqs, S, state_rows, n_state, rows, rows_cap, counter, fresh, pf"),
        "skv_begin_step": ("const int* desc, int* owner, int* lru, int groups, int max_reqs, int S, int max_batch, "
                           "const int* state_rows, const int* reset, const int* inv, int inv_cap, int* err, "
                           "unsigned char* fresh, unsigned long long* pf",
                           "desc, owner, lru, groups, max_reqs, S, max_batch, state_rows, reset, inv, inv_cap, err, "
                           "fresh, pf"),
    },
    "prefetch.cu": {
        "skv_prefetch": ("const int* desc, int group_offset, int* owner, int* lru, unsigned char* fresh, int groups, int max_reqs, "
                         "int S, int host_rows, int top_k, int max_batch, const int* state_rows, const int* topk, "
                         "int ld, int* prow, int* pslot, int* counts, unsigned long long* pf, int* err",
                         "desc, group_offset, owner, lru, fresh, groups, max_reqs, S, host_rows, top_k, max_batch, state_rows, "
                         "topk, ld, prow, pslot, counts, pf, err"),
    },
    "handle.cu": {"skv_db_topk": (_TOPK_PARAMS, _TOPK_ARGS), "skv_db_indices": (_INDICES_PARAMS, _INDICES_ARGS),
                  **{f"skv_map_positions_{p}_{t}": (_map_params(p, t), _MAP_ARGS) for p in _INTS for t in _INTS}},
    "copy.cu": {"skv_gather": (_GATHER_PARAMS, _GATHER_ARGS), "skv_push": (_PUSH_PARAMS, _PUSH_ARGS)},
}
