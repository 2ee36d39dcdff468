"""sparsekv: a per-node daemon that keeps the KV cache of sparse-attention LLMs in pinned host
memory and streams the rows each decode step selects into GPU hot regions.

The engine's library is :mod:`sparsekv.client`; ``from sparsekv import Client`` is a short
way to it. The repository root is this package (``pyproject.toml`` maps each folder).
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("sparsekv")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str):
    # The client is imported on first use, so that ``import sparsekv.daemon`` does not pull it in.
    if name.startswith("__"):
        raise AttributeError(name)
    client = import_module("sparsekv.client")
    if name in client.__all__:
        return getattr(client, name)
    raise AttributeError(f"module 'sparsekv' has no attribute {name!r}")
