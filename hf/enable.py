"""``enable(model, client)``: a loaded DeepSeek-V3.2 or GLM-5 (DSA) transformers model
decodes with its rows in sparsekv; ``disable(model)`` undoes it."""

from __future__ import annotations

import copy
import itertools
import os

import torch

from sparsekv.proto import Layout

from . import attention
from .cache import SparseKVCache
from .errors import UnsupportedGeneration, UnsupportedModel
from .geometry import Geometry
from .runtime import Runtime

ENGINE = "transformers"  # the default engine name's prefix: "transformers-<pid>-<n>", one per enable()
_ENGINE_NUMBERS = itertools.count()
# generate() options the cache cannot serve, and why (each raises UnsupportedGeneration).
REFUSED = {
    "num_beams": (lambda v: v is not None and v > 1, "beam search (num_beams > 1)"),
    "num_return_sequences": (lambda v: v is not None and v > 1, "several sequences per prompt "
                             "(num_return_sequences > 1): repeat the prompts in the batch"),
    "cache_implementation": (lambda v: v is not None, "another cache (cache_implementation, e.g. 'static')"),
    "prompt_lookup_num_tokens": (lambda v: v is not None, "prompt lookup decoding"),
    "use_cache": (lambda v: v is False, "use_cache=False (the rows are only kept in the cache)"),
    "assistant_early_exit": (lambda v: v is not None, "self-speculative decoding (assistant_early_exit)"),
    "output_attentions": (lambda v: v is True, "output_attentions=True (the sparse attention returns no "
                          "attention weights)"),
}
_ENABLED: set[int] = set()  # id() of each client serving an enabled model: one enabled model per client


def enable(model, client, *, max_batch: int | None = None, host_rows: int | None = None, block_size: int = 64,
           region_stride: int | None = None, transport: str = "zmq", engine: str | None = None) -> Runtime:
    """Serve ``model``'s sparse attention from sparsekv; return the :class:`Runtime`.

    Args:
        model: a transformers ``DeepseekV32ForCausalLM`` or ``GlmMoeDsaForCausalLM``.
        client: a connected sparsekv client: ``sparsekv.client.Client`` (the cpu backend,
            or a cuda rank ``Client(run_dir, device="cuda:N")`` on the model's GPU) or
            ``sparsekv.embedded.inproc.InprocClient``; the caller keeps and closes it.
            Attached already (its layout must fit the model), or attached here with
            ``max_batch`` and ``host_rows``.
        max_batch: most sequences of one ``generate`` (the layout's ``max_reqs``).
        host_rows: token rows per layer in the pool, shared by the sequences of a
            generation (each takes its prompt plus ``max_new_tokens``, in whole blocks).
        block_size: host rows per block of the allocator.
        region_stride: hot rows per sequence and index group (default twice the top-k).
        transport: ``"zmq"`` (the portable handle, any client) or ``"doorbell"`` (a cuda
            rank: the device handle, every step's hand-off on the model's stream).
        engine: the engine name to attach under (ranks of one engine share its host rows:
            another model, or another process, must not use it); default one of this call
            alone, ``transformers-<pid>-<n>``.
    """
    geo = Geometry.of(model)
    if transport not in ("zmq", "doorbell"):
        raise ValueError(f"transport must be 'zmq' or 'doorbell', got {transport!r}")
    if getattr(model, "sparsekv", None) is not None:
        raise UnsupportedModel("sparsekv is already enabled on this model: disable(model) first")
    if id(client) in _ENABLED:  # its state rows and host rows would be shared by two allocators
        raise UnsupportedModel("this sparsekv client serves another enabled model: disable(that model) first, "
                               "or give each model a client of its own")
    attention.check_projections(model, geo)
    model_device = torch.device(model.device)
    client_device = torch.device(getattr(client, "device", "cpu"))  # InprocClient: the cpu backend
    if model_device.type != client_device.type or (model_device.type == "cuda" and
                                                   (model_device.index or 0) != (client_device.index or 0)):
        raise UnsupportedModel(f"the model is on {model_device} but the client's hot rows are on {client_device}: "
                               "a model on a GPU needs Client(run_dir, device='cuda:N') of a cuda daemon, on its GPU")
    if transport == "doorbell" and model_device.type != "cuda":
        raise UnsupportedModel("transport='doorbell' is the device handle: the model and client on a GPU")
    if getattr(client, "attachment", None) is None:
        if max_batch is None or host_rows is None:
            raise ValueError("the client is not attached: pass max_batch and host_rows (or attach it yourself)")
        layout = geo.layout(max_batch, host_rows, region_stride)
        if engine is None:
            engine = f"{ENGINE}-{os.getpid()}-{next(_ENGINE_NUMBERS)}"
        _attach(client, layout, engine, transport, on_gpu=model_device.type == "cuda")
    runtime = Runtime(client, geo, block_size, doorbell=transport == "doorbell")
    attention.register()
    # Every forward starts with no cache of this runtime running it: the cache's update
    # (each layer's, before its attention) names itself, so a forward without one (another
    # cache, use_cache=False) is refused rather than served another generation's rows.
    hooks = [model.model.register_forward_pre_hook(lambda module, args: runtime.forget_active())]
    for layer_idx, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        attn.sparsekv_runtime = runtime
        hooks.append(attn.kv_a_layernorm.register_forward_hook(_keep_latent(runtime, layer_idx)))
    previous = model.config._attn_implementation
    model.set_attn_implementation(attention.NAME)
    original = model.generate

    def generate(inputs=None, generation_config=None, **kwargs):
        past = kwargs.get("past_key_values")
        if past is not None and not isinstance(past, SparseKVCache):
            raise UnsupportedGeneration(f"past_key_values must be a SparseKVCache of this model's runtime, got "
                                        f"{type(past).__name__}")
        if kwargs.get("assistant_model") is not None:
            raise UnsupportedGeneration("assisted decoding (assistant_model) is not supported with sparsekv")
        gc, default_length = _resolved(model, generation_config, kwargs)
        for name, (refused, what) in REFUSED.items():
            if refused(getattr(gc, name, None)):
                raise UnsupportedGeneration(f"{what} is not supported with sparsekv")
        if past is not None:
            return original(inputs, generation_config, **kwargs)
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        if ids is None or ids.dim() != 2:
            raise UnsupportedGeneration("generate needs input_ids [batch, length] (inputs_embeds are not supported "
                                        "with sparsekv)")
        batch, length = ids.shape
        cache = SparseKVCache(runtime, batch, length, _max_length(model, gc, default_length, length))
        try:
            return original(inputs, generation_config, past_key_values=cache, **kwargs)
        finally:
            cache.release()

    def undo() -> None:
        _ENABLED.discard(id(client))
        for h in hooks:
            h.remove()
        for layer in model.model.layers:
            del layer.self_attn.sparsekv_runtime
        model.set_attn_implementation(previous)
        del model.generate
        del model.sparsekv
        runtime.close()

    model.generate = generate
    runtime.undo = undo
    model.sparsekv = runtime
    _ENABLED.add(id(client))
    return runtime


def _resolved(model, generation_config, kwargs: dict):
    """The generation config transformers' ``generate`` will run (the one passed, else a
    default one; its unset fields from the model's; then the keyword arguments:
    transformers' own resolution, so that the refusals and the cache's length see what
    runs), and whether ``max_length`` is nobody's (``generate`` then adds its default to
    the prompt)."""
    gc, _ = model._prepare_generation_config(copy.deepcopy(generation_config), **kwargs)
    unset = (kwargs.get("max_length") is None and (generation_config is None or generation_config.max_length is None)
             and model.generation_config.max_length is None)
    return gc, unset


def _max_length(model, gc, default_length: bool, length: int) -> int:
    """Positions a sequence reaches, as ``generate`` counts them: the prompt and
    ``max_new_tokens``; else ``max_length`` when set; else the prompt and the default
    ``max_length`` (20), within ``max_position_embeddings``."""
    if gc.max_new_tokens is not None:
        return length + gc.max_new_tokens
    if default_length:
        total = gc.max_length + length
        limit = getattr(model.config, "max_position_embeddings", None)
        return max(min(total, limit), length) if limit is not None else total
    return max(gc.max_length, length)


def disable(model) -> None:
    """Undo :func:`enable`: the model's own attention and cache again; the client stays
    attached and open (it is the caller's)."""
    runtime = getattr(model, "sparsekv", None)
    if runtime is None:
        raise UnsupportedModel("sparsekv is not enabled on this model")
    runtime.undo()


def _attach(client, layout: Layout, engine: str, transport: str, on_gpu: bool) -> None:
    if transport == "doorbell":
        client.attach(layout, engine=engine, transport="doorbell")
    elif on_gpu:  # the portable handle on a cuda rank: fence events, so no leader waits for the stream
        client.attach(layout, engine=engine, fence=True)
    else:
        client.attach(layout, engine=engine)


def _keep_latent(runtime: Runtime, layer_idx: int):
    def hook(module, args, output):
        if output.dtype != runtime.geometry.dtype:  # the pool's rows and the hot rows' view are of enable()'s dtype
            raise UnsupportedModel(f"the model runs in {output.dtype}, but sparsekv was enabled on it in "
                                   f"{runtime.geometry.dtype}: disable(model), then enable it again after the cast")
        runtime.latents[layer_idx] = output  # kv_a_layernorm's output: the latent the pool row starts with

    return hook
