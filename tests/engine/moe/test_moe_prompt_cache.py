"""Prompt caching on the MoE engine: a request's KV slot keeps what it held once the answer
ends, and a follow-up prompt that starts the same way takes that slot and prefills only
what is new (cached_tokens), answering what transformers answers (greedy, f32). The kept
KV lives in free slots of the reserve: a slot is re-used for a new prompt, the oldest first."""

from __future__ import annotations

import pytest
from engine_helpers import WATER, ask_chat, chat, check_follow_up_prefills_only_what_is_new

from engine.moe.engine import MoEConfig, MoEEngine
from engine.moe.store import ExpertStore


def _engine(store_dir, slots: int) -> MoEEngine:
    budget = 8 * ExpertStore(store_dir).index.blob_bytes  # well below the experts: they stream from disk
    return MoEEngine(store_dir, "t", MoEConfig(cache_budget_bytes=budget, kv_precision="f32", fetch_threads=2,
                                               torch_threads=1, max_concurrent=slots))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_follow_up_turn_prefills_only_what_is_new(moe_model, arch):
    path, store_dir = moe_model(arch)
    with _engine(store_dir, 2) as engine:
        check_follow_up_prefills_only_what_is_new(engine, path)


def test_kept_kv_lives_in_free_slots_and_the_oldest_goes(moe_model):
    """Two slots: three conversations one after another leave the last two kept; the first
    one's slot was taken for the third, so its follow-up is prefilled in full."""
    _path, store_dir = moe_model("qwen3_moe")
    with _engine(store_dir, 2) as engine:
        convs = [chat(("system", f"Rule {i}. " + WATER[1]), ("user", "Tell me.")) for i in range(3)]
        ends = [ask_chat(engine, f"c{i}", c, 4)[2] for i, c in enumerate(convs)]
        assert engine.stats()["kv_kept_tokens"] > 0
        again = [ask_chat(engine, f"c{i}x", convs[i], 4)[2] for i in (2, 0)]
    assert again[0].usage.cached_tokens == ends[2].usage.prompt_tokens - 1  # kept, to the token
    assert again[1].usage.cached_tokens == 0  # evicted (its system turn differs from the first ids on)


def test_concurrent_requests_share_nothing_they_should_not(moe_model):
    """Two requests at once with the same long start: each runs in its own slot; the next
    request that starts the same way takes one of the kept slots."""
    import threading

    _path, store_dir = moe_model("qwen3_moe")
    with _engine(store_dir, 2) as engine:
        msgs = [chat(WATER, ("user", q)) for q in ("Name a river.", "Name a lake.")]
        out = [None, None]
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, ask_chat(engine, f"p{i}", msgs[i], 6)))
                   for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        alone = [ask_chat(engine, f"q{i}", msgs[i], 6) for i in range(2)]
    for i in range(2):
        assert out[i][0] == alone[i][0]  # same answer with or without a neighbour and a cache
        assert alone[i][2].usage.cached_tokens == alone[i][2].usage.prompt_tokens - 1
