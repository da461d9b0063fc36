"""Keys and values kept at 16 bits in transformers' DynamicCache.

The MoE engine's KV pool and llama.cpp keep K and V in float16; transformers'
DynamicCache keeps them in the activations' dtype, float32 in the sparse engine,
which makes a context twice as big (an 8B Llama's 4 096 positions: 1 GiB in f32,
0.5 GiB in f16). `new_cache(config, torch.float16)` keeps them at float16 and
hands attention float32 copies of what it reads, as the MoE engine's attention does:
only storage is narrowed, the attention itself runs at the activations' dtype.

KV_DTYPES names the choices (the engines' `kv_precision` option); tests that
compare with transformers ask "f32", which leaves the cache as transformers builds it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

KV_DTYPES = {"f16": torch.float16, "f32": torch.float32}


class _Narrow:
    """Mixin for a DynamicLayer: store new keys/values at `kv_dtype`, return them widened."""

    kv_dtype: torch.dtype

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        narrow_k, narrow_v = key_states.to(self.kv_dtype), value_states.to(self.kv_dtype)
        keys, values = super().update(narrow_k, narrow_v, *args, **kwargs)  # type: ignore[misc]
        return keys.to(key_states.dtype), values.to(value_states.dtype)  # [b, kv_heads, T, d] each


class NarrowLayer(_Narrow, DynamicLayer):
    def __init__(self, kv_dtype: torch.dtype) -> None:
        super().__init__()
        self.kv_dtype = kv_dtype


class NarrowSlidingLayer(_Narrow, DynamicSlidingWindowLayer):
    def __init__(self, sliding_window: int, kv_dtype: torch.dtype) -> None:
        super().__init__(sliding_window)
        self.kv_dtype = kv_dtype


def new_cache(config: Any, kv_dtype: torch.dtype | None = None) -> DynamicCache:
    """transformers' DynamicCache for `config`; with `kv_dtype`, its attention layers keep
    their keys and values at that dtype (other layer kinds stay as they are)."""
    cache = DynamicCache(config=config)
    if kv_dtype is None or kv_dtype == torch.float32:
        return cache
    narrowed = []
    for layer in cache.layers:
        if type(layer) is DynamicSlidingWindowLayer:
            narrowed.append(NarrowSlidingLayer(layer.sliding_window, kv_dtype))
        elif type(layer) is DynamicLayer:
            narrowed.append(NarrowLayer(kv_dtype))
        else:
            narrowed.append(layer)
    cache.layers = narrowed
    return cache


def asked_kv_precision(options: Any) -> dict[str, str]:
    """The engines' rule for their KV when the user named none: exact math asked for
    (`--precision f32`) keeps exact keys and values too. As MoEConfig / SparseConfig fields."""
    if getattr(options, "precision", "default") == "f32" and "kv_precision" not in (options.extra or {}):
        return {"kv_precision": "f32"}
    return {}
