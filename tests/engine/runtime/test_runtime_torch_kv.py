"""16-bit keys and values in transformers' DynamicCache (engine/runtime/torch_kv.py): half the
bytes, exactly the f32 cache's values rounded to float16, the same logits within float16's
rounding, and the prompt cache's crop still works; sliding-window layers keep their window."""

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from engine.runtime.torch_backend import TorchStream
from engine.runtime.torch_kv import new_cache

IDS = [5, 17, 3, 99, 42, 7, 64, 11, 23, 81]


def _model(kind: str):
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    return MistralForCausalLM(MistralConfig(**common, sliding_window=4)).eval()


def _run(model, kv_dtype):
    stream = TorchStream(model, kv_dtype=kv_dtype)
    rows = [stream.prefill(IDS[:6])] + [stream.decode(t) for t in IDS[6:]]
    return stream, torch.from_numpy(np.stack(rows))  # [5, vocab]


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_f16_cache_keeps_the_f32_values_rounded_at_half_the_bytes(kind):
    model = _model(kind)
    wide, wide_logits = _run(model, None)
    narrow, narrow_logits = _run(model, torch.float16)
    for w, n in zip(wide.cache.layers, narrow.cache.layers):
        assert w.keys.dtype == torch.float32 and n.keys.dtype == torch.float16
        assert n.keys.shape == w.keys.shape  # a sliding layer keeps only its window either way
        assert n.keys.nbytes * 2 == w.keys.nbytes
    # the first layer's keys and values depend on the embeddings only: the 16-bit cache holds
    # exactly the f32 cache's, rounded once (later layers' inputs already saw rounded KV)
    first_w, first_n = wide.cache.layers[0], narrow.cache.layers[0]
    torch.testing.assert_close(first_n.keys, first_w.keys.half(), atol=0, rtol=0)
    torch.testing.assert_close(first_n.values, first_w.values.half(), atol=0, rtol=0)
    assert not torch.equal(narrow_logits, wide_logits)  # the rounding is really there ...
    torch.testing.assert_close(narrow_logits, wide_logits, atol=5e-3, rtol=0)  # ... and stays small
    assert narrow.past == wide.past == len(IDS)


def test_f32_or_none_is_transformers_own_cache():
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    config = _model("llama").config
    for dtype in (None, torch.float32):
        cache = new_cache(config, dtype)
        assert type(cache) is DynamicCache and all(type(x) is DynamicLayer for x in cache.layers)


def test_a_cropped_f16_cache_continues_like_a_fresh_one():
    """Prompt caching cuts a kept cache back to the shared prefix and feeds the rest."""
    model = _model("llama")
    kept, _ = _run(model, torch.float16)
    kept.cache.crop(4)
    resumed = TorchStream(model, kept.cache, IDS[:4], kv_dtype=torch.float16)
    got = resumed.prefill(IDS[4:8])
    fresh = TorchStream(model, kv_dtype=torch.float16)
    fresh.prefill(IDS[:4])
    want = fresh.prefill(IDS[4:8])
    assert resumed.past == fresh.past == 8
    torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), atol=1e-5, rtol=0)
