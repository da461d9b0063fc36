"""Fixtures of the sparse-engine tests: a tiny ReLU-fied Llama built from a recipe."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def relu_model(flotilla_cache):
    from engine.models.demo import DemoRecipe, ensure_recipe

    return ensure_recipe(DemoRecipe(
        "sparse-relu-llama", "LlamaConfig",
        dict(initializer_range=0.1, max_position_embeddings=4096, tie_word_embeddings=False,
             hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, hidden_act="relu"),
        seed=21, description="ReLU-fied Llama for sparse tests (random weights)", tokenizer_of="demo"))


@pytest.fixture(scope="session")
def wide_model(flotilla_cache):
    """Bundles of exactly 4 KiB (exact mode, f32): reads land straight in the cache's slots."""
    from engine.models.demo import DemoRecipe, ensure_recipe

    return ensure_recipe(DemoRecipe(
        "sparse-wide-llama", "LlamaConfig",
        dict(initializer_range=0.1, max_position_embeddings=4096, tie_word_embeddings=False,
             hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, rms_norm_eps=1e-5),
        seed=31, description="Llama with 4 KiB exact-mode bundles, for sparse tests (random weights)",
        tokenizer_of="demo"))


@pytest.fixture(scope="session")
def wide_model_bf16(wide_model):
    """The same model with bf16 weights (as real checkpoints ship)."""
    from engine.bench._sparse_model import with_dtype

    return with_dtype(wide_model, "bf16", lambda _m: None)
