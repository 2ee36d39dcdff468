"""sparsekv under Hugging Face transformers: DeepSeek-V3.2 and GLM-5 (DSA) models decode
with their per-token rows in sparsekv's host pool (README.md beside this file)."""

try:
    import transformers  # noqa: F401
except ImportError as e:  # one line for a user without the extra
    raise ImportError("sparsekv.hf needs transformers and torch: pip install 'sparsekv[transformers]'") from e

from .cache import SparseKVCache
from .enable import disable, enable
from .errors import OutOfRows, UnsupportedGeneration, UnsupportedModel
from .runtime import Runtime

__all__ = ["OutOfRows", "Runtime", "SparseKVCache", "UnsupportedGeneration", "UnsupportedModel", "disable", "enable"]
