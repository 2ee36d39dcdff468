"""``SparseKVCache``: the transformers ``Cache`` of one generation whose per-token rows live
in sparsekv's host pool.

Per layer it keeps only what must stay on the model's device: the indexer's keys (the
indexer scores every past position each step) and, while the prompt is being prefilled,
the prompt's rows (a prefill forward attends over many positions of its own sequence at
once, which ``swap_in``'s hot regions are not sized for). Every new row goes to the pool
through the write path once the forward's last layer has made it; decode forwards read
past rows only through ``swap_in``. The expanded per-head keys and values transformers
hands to ``update`` are never stored.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .errors import UnsupportedGeneration
from .runtime import Runtime


class SparseKVLayer(CacheLayerMixin):
    """One layer's device state: the positions seen and the indexer keys."""

    is_compileable = False
    is_sliding = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, max_length: int):
        super().__init__()
        self.max_length = max_length
        self.length = 0  # positions (columns) with rows
        self.index_keys: torch.Tensor | None = None  # [batch, max_length, index_dim]
        self.index_length = 0
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("SparseKVCache.update handles every layer")

    def update_indexer(self, keys: torch.Tensor) -> torch.Tensor:
        """New indexer keys [batch, n, dim] appended; all of them so far (a view)."""
        b, n, d = keys.shape
        if self.index_keys is None:
            self.index_keys = keys.new_empty((b, self.max_length, d))
        end = self.index_length + n
        self.index_keys[:, self.index_length:end] = keys
        self.index_length = end
        return self.index_keys[:, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_length

    def reset(self) -> None:
        raise UnsupportedGeneration("a SparseKVCache serves one generation; make a new one")

    def reorder_cache(self, beam_idx) -> None:
        raise UnsupportedGeneration("beam search is not supported with sparsekv (num_beams must be 1)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise UnsupportedGeneration("several sequences per prompt (num_return_sequences > 1) are not supported "
                                    "with sparsekv: repeat the prompts in the batch instead")

    def batch_select_indices(self, indices) -> None:
        raise UnsupportedGeneration("selecting batch rows of a sparsekv cache is not supported")

    def crop(self, tokens_to_remove: int) -> None:
        raise UnsupportedGeneration("cropping a sparsekv cache (assisted decoding) is not supported")


class SparseKVCache(Cache):
    """The cache of one generation of ``batch`` sequences (state rows 0..batch-1) of at
    most ``max_length`` positions, the first ``prompt_length`` of them the (left-padded)
    prompt. Its host rows are allocated here and given back by :meth:`release`."""

    def __init__(self, runtime: Runtime, batch: int, prompt_length: int, max_length: int):
        if prompt_length < 1 or max_length < prompt_length:
            raise UnsupportedGeneration(f"need 1 <= prompt_length ({prompt_length}) <= max_length ({max_length})")
        if runtime.in_use:
            raise UnsupportedGeneration("this model's sparsekv state rows are held by another generation: one "
                                        "generation at a time per enabled model")
        geo = runtime.geometry
        super().__init__(layers=[SparseKVLayer(max_length) for _ in range(geo.num_layers)])
        self.runtime, self.batch = runtime, batch
        self.prompt_length, self.max_length = prompt_length, max_length
        table, self._blocks = runtime.allocate(batch, max_length)
        runtime.in_use = True
        self._table_host = table
        self.table = torch.from_numpy(table).to(runtime.device) if runtime.doorbell else table
        self._prompt: list[torch.Tensor | None] = [None] * geo.num_layers  # [batch, prompt_length, row_dim]
        self._new: list[torch.Tensor | None] = [None] * geo.num_layers  # this forward's rows [batch, n, row_dim]
        self._decode_steps = 0
        self._filled = False  # positions came through fill(), not a prefill forward
        self.released = False

    # -- what transformers calls ---------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Record layer ``layer_idx``'s new rows (its latent from the module's
        ``kv_a_layernorm``, its rope key from ``key_states``); after the last layer,
        write every layer's new rows to the pool. Returns the new states unchanged
        (the attention reads rows, not these)."""
        rt, geo, layer = self.runtime, self.runtime.geometry, self.layers[layer_idx]
        if self.released:
            raise UnsupportedGeneration("this SparseKVCache was released; a generation makes a new one")
        rt.active = self
        b, n = key_states.shape[0], key_states.shape[2]
        if b != self.batch:
            raise UnsupportedGeneration(f"the cache holds {self.batch} sequences, the forward has {b}")
        past = layer.length
        if self._filled and past < self.prompt_length:
            raise UnsupportedGeneration(f"the cache was filled to {past} of the prompt's {self.prompt_length} "
                                        "positions: fill() the whole prompt, then generate")
        if past < self.prompt_length and past + n > self.prompt_length:
            raise UnsupportedGeneration(f"a forward of {n} positions at {past} crosses the prompt's end "
                                        f"({self.prompt_length})")
        if past >= self.prompt_length and n != 1:
            raise UnsupportedGeneration(f"{n} new positions per sequence after the prompt (assisted or speculative "
                                        "decoding) are not supported: one token per step")
        if past + n > self.max_length:
            raise UnsupportedGeneration(f"position {past + n} passes the cache's max_length {self.max_length}")
        latent = rt.latents.pop(layer_idx)  # [b, n, kv_lora_rank]
        rope = key_states[:, 0, :, geo.nope_dim:]  # the rotated rope key (every head holds the same)
        rows = torch.cat([latent.to(rope.dtype), rope], dim=-1)  # [b, n, row_dim]
        if past < self.prompt_length:
            if self._prompt[layer_idx] is None:
                self._prompt[layer_idx] = rows.new_empty((b, self.prompt_length, geo.row_dim))
            self._prompt[layer_idx][:, past:past + n] = rows
        elif self._prompt[layer_idx] is not None:
            self._prompt[layer_idx] = None  # the prompt is in the pool: decode reads it through swap_in
        self._new[layer_idx] = rows
        layer.length = past + n
        if layer_idx == geo.num_layers - 1:
            self._write(past, n)
        return key_states, value_states

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return self.layers[layer_idx].update_indexer(indexer_key_states)

    def fill(self, rows: torch.Tensor, index_keys: torch.Tensor) -> None:
        """Positions made elsewhere, appended to every sequence without a forward: every
        layer's rows ``[layers, batch, n, row_dim]`` (the latent after ``kv_a_layernorm``,
        then the rotated rope key) into the pool through the write path, and the indexer
        keys ``[layers, batch, n, index_dim]`` kept on the device, as a prefill of those
        positions leaves them. Call it until the prompt is filled; the generation then
        starts at the prompt's end (its forwards are decode steps)."""
        geo = self.runtime.geometry
        if self.released:
            raise UnsupportedGeneration("this SparseKVCache was released; a generation makes a new one")
        want = (geo.num_layers, self.batch)
        if tuple(rows.shape[:2]) != want or rows.shape[-1] != geo.row_dim or rows.ndim != 4:
            raise UnsupportedGeneration(f"rows must be [layers {want[0]}, batch {want[1]}, n, row_dim {geo.row_dim}], "
                                        f"got {list(rows.shape)}")
        if index_keys.ndim != 4 or tuple(index_keys.shape[:3]) != tuple(rows.shape[:3]):
            raise UnsupportedGeneration(f"index_keys must be [layers, batch, n, index_dim] with rows' first three "
                                        f"dims {list(rows.shape[:3])}, got {list(index_keys.shape)}")
        past, n = self.layers[0].length, rows.shape[2]
        if self._decode_steps or self._prompt[0] is not None or past + n > self.prompt_length:
            raise UnsupportedGeneration(f"fill() appends prompt positions before any forward: {n} at {past} pass the "
                                        f"prompt's {self.prompt_length}, or a forward has run")
        self._new = list(rows.to(geo.dtype).unbind(0))
        for layer, keys in zip(self.layers, index_keys.unbind(0)):
            layer.update_indexer(keys)
            layer.length = past + n
        self._write(past, n)
        self._new = [None] * geo.num_layers
        self._filled = True

    # -- what the attention calls --------------------------------------------------------
    def in_prefill(self, layer_idx: int) -> bool:
        """The forward running now is (part of) the prompt's prefill."""
        return self.layers[layer_idx].length <= self.prompt_length and self._prompt[layer_idx] is not None

    def prompt_rows(self, layer_idx: int, pos: torch.Tensor) -> torch.Tensor:
        """The prompt's rows (on the device during prefill) of positions ``pos`` int
        [batch, q, k]: [batch, q, k, row_dim]."""
        src = self._prompt[layer_idx]
        b, q, k = pos.shape
        flat = pos.clamp(min=0).reshape(b, q * k, 1).expand(-1, -1, src.shape[-1])
        return src.gather(1, flat).view(b, q, k, -1)

    def decode_rows(self, layer_idx: int, pos: torch.Tensor, allowed: torch.Tensor):
        """The rows of the indexer's top-k ``pos`` int [batch, k] of layer ``layer_idx``
        in a decode step, and where they may be read: ``(rows [batch, k, row_dim], ok
        [batch, k])``. ``allowed``: what the padding mask allows. Past positions come
        through ``swap_in`` from the hot slab; the token's own row from this forward."""
        rt = self.runtime
        past = self.layers[layer_idx].length - 1
        if layer_idx == 0:
            rt.begin_step(self.batch, reset=self._decode_steps == 0)  # new sequences: their regions start empty
            self._decode_steps += 1
        own = allowed & (pos == past)  # made by this forward: not in the pool yet
        fetch = torch.where(allowed & ~own, pos, -1).to(torch.int32)
        idx = rt.swap_in(fetch, self.table, layer_idx)  # int32 [batch, k] into kv(layer)
        hot = rt.kv(layer_idx)[idx.clamp(min=0).long()]  # [batch, k, row_dim]
        rows = torch.where(own[..., None], self._new[layer_idx], hot)
        return rows, (idx >= 0) | own

    # -- the write path and the end ------------------------------------------------------
    def _write(self, past: int, n: int) -> None:
        """Every layer's rows of positions ``past .. past + n - 1`` into the pool."""
        cols = np.arange(past, past + n)
        bs = self.runtime.block_size
        host = self._table_host[:, cols // bs] * bs + cols % bs  # [batch, n]
        rows = torch.stack(self._new)  # [layers, batch, n, row_dim]
        self.runtime.write(host.reshape(-1), rows.reshape(rows.shape[0], -1, rows.shape[-1]))

    def release(self) -> None:
        """Give the generation's host rows and state rows back (idempotent). The hot
        copies are dropped when the next generation's first step resets its regions."""
        if self.released:
            return
        self.released = True
        if self._decode_steps:
            self.runtime.handle.finish_step()  # a step an exception cut short: the next one may begin
        self.runtime.release(self._blocks)
        self.runtime.in_use = False
        if self.runtime.active is self:
            self.runtime.active = None
        self._prompt = [None] * len(self._prompt)
        self._new = [None] * len(self._new)
        for layer in self.layers:
            layer.index_keys = None

    def kv_bytes(self) -> int:
        """Device bytes this cache holds for KV now (indexer keys, prompt rows)."""
        held = [t for t in self._prompt if t is not None]
        held += [layer.index_keys for layer in self.layers if layer.index_keys is not None]
        return sum(t.numel() * t.element_size() for t in held)
