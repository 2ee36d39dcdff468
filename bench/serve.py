"""``sparsekv bench serve``: decode throughput at long context of a DeepSeek-V3.2-shaped
model on one GPU, offloaded through sparsekv against every KV row in HBM.

Each step is real compute at one GPU's shapes of a deployment (attention data-parallel,
the routed experts expert-parallel over 8 GPUs: 32 of 256 here; ``serve_model``), random
weights, one layer's weights serving every layer, each layer's KV rows and indexer keys
its own. The expert-parallel all-to-all cannot run on one GPU: it is left out of every
mode. Modes: ``gpu`` (every row in HBM), ``inproc`` (sparsekv in the engine's process),
``daemon`` (a private ``sparsekvd``, the doorbell transport); each step one CUDA graph per
(config, mode), the modes of a config timed step by step in turn over the same top-k
sequence. Configs: the offload penalty at equal batch (``--batches`` at the first
context), and each mode at its largest batch per context (``serve_capacity``).

The modules: ``serve_model`` (the layer), ``serve_triton`` (the indexer kernel),
``serve_capacity`` (capacity and bounds), ``serve_modes`` (sources of rows, pools,
timing), ``serve_run`` (the run), ``serve_report`` (figures, table, plot).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import psutil

from sparsekv.proto.layout import MAX_BATCH, MAX_REGION_STRIDE

from .decode import _csv
from .serve_capacity import PRESETS
from .serve_report import MODES, OFFLOADED, PENALTY_BATCHES

DEFAULT_CONTEXTS = (32768, 65536, 131072)
QUICK_CONTEXTS = (32768, 131072)
QUICK_BATCHES = (1, 64)
DEFAULT_OVERLAPS = (0.5, 0.7, 0.95)  # besides --layer-overlap, at the first context and the largest batch
QUICK_OVERLAPS = (0.5,)


@dataclass(frozen=True)
class Options:
    preset: str = "v32"
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    batches: tuple[int, ...] = PENALTY_BATCHES
    modes: tuple[str, ...] = MODES
    hits: float = 90.0
    steps: int = 30
    warmup: int = 5
    block_size: int = 64
    layer_overlap: float = 0.85
    overlaps: tuple[float, ...] = ()  # more layer overlaps for the first context's largest batch
    region_rows: int | None = None  # the offloaded modes' hot-region rows a layer (None: top_k + top_k / 4)
    host_pool_gib: float = 16.0
    hbm_gb: float = 141.0
    host_gib: float = 256.0
    activations_gb: float = 5.0
    gather_blocks: int | None = None
    seed: int = 0
    json_path: str | None = None
    plot_path: str | None = None
    daemon_log: str | None = None

    def validate(self, presets) -> "Options":
        """Raise ValueError naming the first bad option; return self."""
        if self.preset not in presets:
            raise ValueError(f"--preset must be one of {', '.join(presets)}, got {self.preset!r}")
        if any(m not in MODES for m in self.modes) or not self.modes:
            raise ValueError(f"--modes: choose from {', '.join(MODES)}, got {','.join(self.modes)}")
        top_k = presets[self.preset].top_k
        for name in ("contexts", "batches"):
            if any(v <= 0 for v in getattr(self, name)):
                raise ValueError(f"--{name} must be positive, got {list(getattr(self, name))}")
        if not 0 <= self.hits <= 100:
            raise ValueError(f"--hits must be a percentage, got {self.hits}")
        need = top_k + top_k - round(self.hits / 100 * top_k)
        if min(self.contexts) < need:
            raise ValueError(f"--contexts: {min(self.contexts)} is too short for top-k {top_k} at {self.hits:g} % "
                             f"hits (>= {need})")
        for name in ("steps", "warmup", "block_size", "host_pool_gib", "hbm_gb", "host_gib"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number, got {getattr(self, name)}")
        if not 0 <= self.activations_gb < math.inf:
            raise ValueError(f"--activations-gb must be a number >= 0, got {self.activations_gb}")
        if self.gather_blocks is not None and self.gather_blocks < 1:
            raise ValueError(f"--gather-blocks must be >= 1, got {self.gather_blocks}")
        if max(self.batches) > MAX_BATCH:
            raise ValueError(f"--batches: at most {MAX_BATCH} rows a batch, got {max(self.batches)}")
        if not 0 <= self.layer_overlap <= 1:
            raise ValueError(f"--layer-overlap must lie in [0, 1], got {self.layer_overlap}")
        if any(not 0 <= o <= 1 for o in self.overlaps):
            raise ValueError(f"--overlaps must lie in [0, 1], got {list(self.overlaps)}")
        region = self.region(top_k)
        if region < top_k:
            raise ValueError(f"--region-rows must be >= top-k {top_k}, got {region}")
        if region > MAX_REGION_STRIDE:
            raise ValueError(f"--region-rows must be <= {MAX_REGION_STRIDE}, got {region}")
        if "prefetch" in self.modes and region == top_k:
            raise ValueError(f"--region-rows {region}: the prefetch mode needs rows above top-k {top_k} (a prefetch "
                             "never evicts a row of the latest top-k)")
        ram = psutil.virtual_memory().total / 2**30  # (last: the other options' errors do not hang on the machine)
        if set(self.modes) & set(OFFLOADED) and self.host_pool_gib > ram:
            raise ValueError(f"--host-pool-gib {self.host_pool_gib:g}: this machine has {ram:.1f} GiB of RAM")
        return self

    def region(self, top_k: int) -> int:
        """Hot-region rows a layer of each offloaded mode."""
        return self.region_rows if self.region_rows is not None else top_k + top_k // 4


def _context(text: str) -> int:
    t = text.strip().lower()
    scale = {"k": 1 << 10, "m": 1 << 20}.get(t[-1:], 1)
    return int(t[:-1] if scale > 1 else t) * scale


def _overlaps(text: str) -> tuple[float, ...]:
    return () if text.strip().lower() == "none" else _csv(float, "--overlaps")(text)


def add_arguments(p) -> None:
    """The options of ``sparsekv bench serve`` (on a parser or an argument group)."""
    p.add_argument("--preset", default="v32", metavar="NAME",
                   help="shapes: v32 (DeepSeek-V3.2, one GPU of attention-DP + EP8) or tiny (a smoke run)")
    p.add_argument("--contexts", type=_csv(_context, "--contexts"), default=None, metavar="LIST",
                   help="contexts, e.g. 32k,64k,128k (default; --quick: 32k,128k; add 1m to ask for it); the "
                        "equal-batch configs run at the first")
    p.add_argument("--overlaps", type=_overlaps, default=None, metavar="LIST",
                   help="more layer overlaps (besides --layer-overlap) the first context's largest batch runs at "
                        "(default 0.5,0.7,0.95; --quick: 0.5; 'none': none)")
    p.add_argument("--region-rows", type=int, default=None, metavar="N",
                   help="hot-region rows a layer of every offloaded mode, >= top-k; the prefetch fills those "
                        "above top-k (default top-k + top-k / 4; decode reads it too, its default top-k, with its "
                        "prefetch mode top-k + top-k / 4)")
    p.add_argument("--host-pool-gib", type=float, default=16.0, metavar="GIB",
                   help="host pool of each offloaded mode on this machine; requests share host blocks beyond it "
                        "(default 16)")
    p.add_argument("--hbm-gb", type=float, default=141.0, metavar="GB",
                   help="the deployment's HBM per GPU, in 1e9 bytes (default 141: the H200's rated size; its driver "
                        "reports 143771 MiB, 150.8 GB, of which an engine keeps a share for itself)")
    p.add_argument("--host-gib", type=float, default=256.0, metavar="GIB",
                   help="the deployment's host memory per GPU (default 2 TiB / 8)")
    p.add_argument("--activations-gb", type=float, default=5.0, metavar="GB",
                   help="HBM per GPU for activations, CUDA graphs and workspaces (default 5)")


def options_from_args(a, presets) -> Options:
    """Options from parsed arguments; ``--batches``, ``--modes``, ``--steps``, ``--hits`` and
    the other options it shares with ``bench decode`` are read here with this bench's
    defaults."""
    quick = a.quick
    if a.hits and len(a.hits) != 1:
        raise ValueError(f"--hits: bench serve takes one hit rate, got {list(a.hits)}")
    return Options(
        preset=a.preset, contexts=a.contexts or (QUICK_CONTEXTS if quick else DEFAULT_CONTEXTS),
        batches=a.batches or (QUICK_BATCHES if quick else PENALTY_BATCHES),
        modes=tuple(dict.fromkeys(a.modes)) if a.modes else MODES, hits=a.hits[0] if a.hits else 90.0,
        steps=a.steps if a.steps is not None else (10 if quick else 30), warmup=3 if quick else 5, block_size=a.block_size,
        layer_overlap=a.layer_overlap,
        overlaps=tuple(a.overlaps) if a.overlaps is not None else (QUICK_OVERLAPS if quick else DEFAULT_OVERLAPS),
        region_rows=a.region_rows, host_pool_gib=a.host_pool_gib, hbm_gb=a.hbm_gb, host_gib=a.host_gib,
        activations_gb=a.activations_gb, gather_blocks=a.gather_blocks, seed=a.seed, json_path=a.json_path,
        plot_path=a.plot_path, daemon_log=a.daemon_log).validate(presets)


def run_args(a) -> int:
    """``sparsekv bench serve``: exit 0, 1 when a config failed, 2 for bad options or no GPU
    (the options checked first, without torch)."""
    try:
        opts = options_from_args(a, PRESETS)
    except ValueError as e:
        print(f"sparsekv bench serve: {e}", file=sys.stderr)
        return 2
    try:
        import torch  # noqa: PLC0415 - the CLI runs without torch; this bench needs it
    except ImportError:
        print("sparsekv bench serve: needs torch with CUDA and CuPy (pip install 'sparsekv[cuda]')", file=sys.stderr)
        return 2
    from . import serve_run  # noqa: PLC0415 - imports torch at its top

    if not torch.cuda.is_available():
        print("sparsekv bench serve: torch sees no CUDA device", file=sys.stderr)
        return 2
    return serve_run.main(opts)
