"""Typed errors of the transformers integration: each names what was wrong."""

from __future__ import annotations


class UnsupportedModel(TypeError):
    """The model is not one whose sparse attention this integration serves (DeepSeek-V3.2
    or GLM-5 DSA through transformers), or its weights or config do not fit the layout."""


class UnsupportedGeneration(ValueError):
    """``generate`` was asked for something the sparsekv cache does not do (beam search,
    a static or other cache, assisted decoding, several sequences per prompt, ...)."""


class OutOfRows(RuntimeError):
    """The host pool (or the layout's request state rows) cannot hold this generation;
    raised before anything is allocated or written."""
