"""A decode step's attention in float32 under a CPU's reduced-precision autocast: what
:func:`pyppo.rollout.hf_generate.generate` samples with in a bf16 run on a CPU.

Under bf16 autocast a ``transformers`` decoder keeps its residual stream in float32, so its KV
cache holds the keys in float32 (rotary embeddings multiply them by float32 tables) and the values
in bf16 (``v_proj``'s output). Every decode step then casts the whole cache to bf16 for
``scaled_dot_product_attention``, and PyTorch's bf16 CPU kernel is slow at one query position: at
SmolLM2's ``[32 rows, 9 heads, 1 query, 72 keys, 64]`` it takes about 1.4 ms against 0.27 ms in
float32 (torch 2.13, 2 threads; docs/performance.md, "Sampling"). The cache here holds both in
float32 (a value's cast up is exact), and a step with one query position attends in float32.
The prefill's attention (more than one query position) is unchanged, bit for bit.

The decode steps' attention is then computed from the float32 keys and queries instead of their
bf16 roundings: the sampler's distribution differs from the trainer's forward by rounding, as it
already did (the trainer's ``old_logprobs`` come from its own forward, so the first ratio stays
exactly 1; ``tests/rollout/test_hf_generate.py`` bounds the difference).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..precision import autocast_dtype

__all__ = ["float32_decode_attention", "decode_attention_cache"]


_CPU = torch.device("cpu")


def _reduced_cpu_autocast() -> Optional[torch.dtype]:
    """The CPU autocast dtype when autocast is on for the CPU in a dtype narrower than float32."""
    dtype = autocast_dtype(_CPU)
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


@lru_cache(maxsize=None)
def _float32_kv_cache():
    # Built on first use: importing pyppo.rollout does not import transformers' cache module.
    from transformers import DynamicCache

    class Float32KVCache(DynamicCache):
        """A ``transformers`` ``DynamicCache`` that holds keys and values in float32."""

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(key_states.float(), value_states.float(), layer_idx, *args, **kwargs)

    return Float32KVCache


def decode_attention_cache(model: nn.Module, gen_config, kwargs: dict) -> Optional[Any]:
    """The cache ``generate`` should start from (a ``DynamicCache`` that holds keys and values in
    float32), or ``None`` to leave the cache
    to ``transformers``: a CPU model with a KV cache (not Mamba's state) under reduced-precision
    CPU autocast that samples with the default dynamic cache, and no cache, no other
    ``cache_implementation`` and no ``use_cache=False`` in the caller's ``kwargs``."""
    if _reduced_cpu_autocast() is None or "past_key_values" in kwargs:
        return None
    for where in (kwargs, vars(gen_config)):
        if where.get("cache_implementation") not in (None, "dynamic") or where.get("use_cache") is False:
            return None
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or getattr(model.config, "is_encoder_decoder", False):
        return None
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model  # PEFT
    supports = getattr(base, "_supports_default_dynamic_cache", None)
    if callable(supports) and not supports():
        return None
    # Mamba's family keeps a state of its own (`cache_params`), not a KV cache.
    if "mamba" in type(base).__name__.lower():
        return None
    try:
        takes_cache = "past_key_values" in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        takes_cache = False
    if not takes_cache:
        return None
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return _float32_kv_cache()(config=config)


@contextmanager
def float32_decode_attention() -> Iterator[None]:
    """Within it, ``torch.nn.functional.scaled_dot_product_attention`` called on CPU tensors with
    one query position under reduced-precision CPU autocast attends in float32 (its inputs cast
    up, autocast off for the call) and returns the autocast dtype, as autocast's call would; every
    other call passes through unchanged. Restored on exit, whatever happens inside."""
    functional = torch.nn.functional
    real = functional.scaled_dot_product_attention

    def attention(query, key, value, *args, **kwargs):
        dtype = _reduced_cpu_autocast()
        if dtype is None or query.dim() < 2 or query.shape[-2] != 1 or query.device.type != "cpu":
            return real(query, key, value, *args, **kwargs)
        mask = kwargs.get("attn_mask")
        if mask is not None and mask.is_floating_point():  # an additive mask takes the query's dtype
            kwargs["attn_mask"] = mask.float()
        with torch.autocast("cpu", enabled=False):
            return real(query.float(), key.float(), value.float(), *args, **kwargs).to(dtype)

    functional.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = real
