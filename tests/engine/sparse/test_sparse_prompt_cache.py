"""Prompt caching on the sparse engine: an ended answer's KV is kept (within the KV
reserve of max_concurrent contexts) and a follow-up prompt that starts the same way
prefills only what is new (cached_tokens), answering what dense transformers answers at
threshold 0 (greedy)."""

from __future__ import annotations

from engine_helpers import WATER, ask_chat, chat, check_follow_up_prefills_only_what_is_new

from engine.sparse.engine import SparseConfig, SparseEngine

# the FFN streams from disk; keys and values kept as transformers keeps them
CFG = SparseConfig(mode="exact", sparsity=0.0, cache_budget_bytes=400_000, kv_precision="f32")


def test_a_follow_up_turn_prefills_only_what_is_new(demo_dir):
    path = demo_dir("demo")
    with SparseEngine(path, "demo", CFG) as engine:
        check_follow_up_prefills_only_what_is_new(engine, path)


def test_kept_kv_stays_within_the_reserve(demo_dir):
    """One request at a time reserves one context: a new conversation pushes the kept one out."""
    with SparseEngine(demo_dir("demo"), "demo", CFG) as engine:
        a = chat(WATER, ("user", "Tell me about rivers."))
        b = chat(("system", "You answer questions about mountains. " * 12), ("user", "Tell me."))
        end_a = ask_chat(engine, "a", a, 4)[2]
        assert ask_chat(engine, "a2", a, 4)[2].usage.cached_tokens == end_a.usage.prompt_tokens - 1
        ask_chat(engine, "b", b, 4)
        assert ask_chat(engine, "a3", a, 4)[2].usage.cached_tokens == 0
