"""Tiny random-weight MoE recipes for tests and the benchmark.

Built with engine.models.demo.ensure_recipe (deterministic, cached, atomic),
sharing demo's tokenizer. initializer_range stays 0.1 so that greedy decoding
of a random model does not collapse into one repeated token.
"""

from __future__ import annotations

from dataclasses import replace

from engine.models.demo import DemoRecipe

_COMMON = dict(initializer_range=0.1, max_position_embeddings=4096, tie_word_embeddings=False)

TINY_MIXTRAL = DemoRecipe(
    "moe-tiny-mixtral", "MixtralConfig",
    dict(_COMMON, hidden_size=64, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2,
         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5),
    seed=11, description="tiny Mixtral, 3 layers x 8 experts (top-2)", tokenizer_of="demo",
)

TINY_OLMOE = DemoRecipe(
    "moe-tiny-olmoe", "OlmoeConfig",
    dict(_COMMON, hidden_size=64, intermediate_size=80, num_experts=8, num_experts_per_tok=2,
         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5,
         norm_topk_prob=False),
    seed=12, description="tiny OLMoE, 3 layers x 8 experts (top-2), q/k norm", tokenizer_of="demo",
)

TINY_QWEN3_MOE = DemoRecipe(
    "moe-tiny-qwen3moe", "Qwen3MoeConfig",
    dict(_COMMON, hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_experts=8,
         num_experts_per_tok=2, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
         head_dim=16, norm_topk_prob=True, rms_norm_eps=1e-6),
    seed=13, description="tiny Qwen3-MoE, 3 layers x 8 experts (top-2)", tokenizer_of="demo",
)


# Saved in bf16, as real MoE checkpoints ship. Qwen3's expert width is 64 here so that an
# expert blob (3 x 64 x 64 x 2 bytes = 6 pages) needs no padding: the store's bytes on disk
# are then exactly the checkpoint's expert bytes.
TINY_QWEN3_MOE_BF16 = replace(
    TINY_QWEN3_MOE, demo_id="moe-tiny-qwen3moe-bf16", dtype="bf16",
    config=dict(TINY_QWEN3_MOE.config, moe_intermediate_size=64),
    description="tiny Qwen3-MoE in bf16, 3 layers x 8 experts (top-2)")
TINY_MIXTRAL_BF16 = replace(TINY_MIXTRAL, demo_id="moe-tiny-mixtral-bf16", dtype="bf16",
                            description="tiny Mixtral in bf16, 3 layers x 8 experts (top-2)")


def bench_recipe(layers: int, experts: int, hidden: int, moe_inter: int, top_k: int = 2) -> DemoRecipe:
    """The benchmark's Mixtral-style model: experts of 3*hidden*moe_inter f32
    weights each (hidden 256, inter 1024 -> 3 MiB), small attention so the
    experts dominate the bytes, as in real MoE models."""
    return DemoRecipe(
        f"moe-bench-{layers}x{experts}-h{hidden}-i{moe_inter}", "MixtralConfig",
        dict(_COMMON, hidden_size=hidden, intermediate_size=moe_inter, num_local_experts=experts,
             num_experts_per_tok=top_k, num_hidden_layers=layers, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5),
        seed=21, description=f"benchmark Mixtral, {layers} layers x {experts} experts", tokenizer_of="demo",
    )
