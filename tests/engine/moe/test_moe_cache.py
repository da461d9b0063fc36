"""Expert cache: the budget floor, eviction by frequency and recency, pins,
and the engine's wiring (factory kind, EngineOptions.cache_budget_bytes)."""

from __future__ import annotations

import pytest

from engine.moe.cache import ExpertCache, min_budget_bytes
from engine.moe.store import ExpertStore
from engine.core.interface import EngineError


def test_budget_below_one_layers_top_k_is_refused(moe_model):
    _path, store_dir = moe_model("qwen2_moe")
    index = ExpertStore(store_dir).index
    need = min_budget_bytes(index)
    assert need == index.top_k * index.blob_bytes
    with pytest.raises(ValueError) as err:
        ExpertCache(index, need - 1)
    msg = str(err.value)
    assert "minimum" in msg and f"{need / 1e6:.1f} MB" in msg
    ExpertCache(index, need)  # exactly the floor works


def _resident_bytes() -> int:
    """This process's resident anonymous and shared-memory bytes (the cache's slots are either)."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    return sum(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssShmem"))


def test_the_budget_is_resident_when_the_cache_is_made(moe_model):
    # The cache's slots hold their pages from the start: a read into a slot does not pay the OS's
    # first touch of them in the middle of decoding, and the memory the budget promises is in use.
    _path, store_dir = moe_model("qwen2_moe")
    index = ExpertStore(store_dir).index
    slots = max(4 * 2**20 // index.blob_bytes, index.top_k)
    before = _resident_bytes()
    cache = ExpertCache(index, slots * index.blob_bytes)
    grown = _resident_bytes() - before
    assert cache.capacity == slots
    assert grown >= 0.95 * slots * index.blob_bytes, (grown, slots * index.blob_bytes)
    cache.close()


def test_factory_refuses_a_small_budget_with_the_minimum(moe_model):
    from engine.local.factory import ENGINE_KINDS, EngineOptions, open_engine

    assert "moe" in ENGINE_KINDS
    _path, store_dir = moe_model("qwen2_moe")
    need = min_budget_bytes(ExpertStore(store_dir).index)
    with pytest.raises(EngineError, match=r"minimum is [0-9.]+ MB"):
        open_engine("demo-moe", kind="moe", options=EngineOptions(cache_budget_bytes=need // 2))


def test_factory_opens_and_answers(moe_model):
    from engine.protocol.messages import GenerateRequest, SamplingParams
    from engine.local.factory import EngineOptions, open_engine

    moe_model("qwen2_moe")
    with open_engine("demo-moe", kind="moe", options=EngineOptions(cache_budget_bytes=8 * 2**20,
                                                                  extra={"scheduler": "bevy"})) as eng:
        assert eng.info.engine == "moe" and eng.info.context_length > 0
        events = eng.generate(GenerateRequest("a", prompt="Hello", sampling=SamplingParams(max_tokens=3)))
        assert events[-1].finish_reason in ("length", "stop") and events[-1].usage.completion_tokens >= 1
    with pytest.raises(EngineError, match="unknown moe engine setting"):
        open_engine("demo-moe", kind="moe", options=EngineOptions(extra={"shceduler": "bevy"}))


def test_eviction_keeps_frequent_experts_and_respects_pins(moe_model):
    _path, store_dir = moe_model("mixtral")
    store = ExpertStore(store_dir)
    cache = ExpertCache(store.index, 3 * store.index.blob_bytes)
    assert cache.capacity == 3
    hot, warm, cold, new = (0, 0), (0, 1), (0, 2), (0, 3)
    for _ in range(5):
        cache.demand(hot)
    for _ in range(2):
        cache.demand(warm)
    cache.demand(cold)
    cache.preload(store, [hot, warm, cold])
    assert all(cache.resident(k) for k in (hot, warm, cold))
    slot = cache.reserve(timeout=0)  # evicts the least demanded one
    assert not cache.resident(cold) and cache.resident(hot) and cache.resident(warm)
    store.read_into(new, cache.buffer(slot))
    cache.commit(slot, new, pins=1)  # held for its waiters
    assert cache.pin(hot) is not None  # hot is in use too
    slot = cache.reserve(timeout=0)  # only warm may go
    assert not cache.resident(warm) and cache.resident(hot) and cache.resident(new)
    assert cache.reserve(timeout=0.01) is None  # hot, new pinned and one slot filling: no room
    cache.release(slot)
    assert cache.reserve(timeout=0.01) == slot  # a released slot is free again


def test_cancel_mid_generation(moe_model):
    from engine.moe.engine import MoEConfig, MoEEngine
    from engine.protocol.messages import GenerateRequest, SamplingParams

    _path, store_dir = moe_model("mixtral")
    index = ExpertStore(store_dir).index
    with MoEEngine(store_dir, "t", MoEConfig(cache_budget_bytes=2 * index.blob_bytes)) as eng:
        rid = eng.submit(GenerateRequest("c", prompt="Once", sampling=SamplingParams(max_tokens=2000, ignore_eos=True)))
        other = eng.submit(GenerateRequest("d", prompt="Twice", sampling=SamplingParams(max_tokens=3)))
        stream = eng.stream(rid, timeout=30)
        next(stream)
        eng.cancel(rid)
        assert list(stream)[-1].finish_reason == "cancelled"
        assert list(eng.stream(other, timeout=30))[-1].finish_reason in ("length", "stop")


def test_eviction_follows_the_layer_order_of_the_requests(moe_model):
    """Decoding visits layers cyclically: with requests just routed at layer 1, the
    layer they reach last (1 itself, next pass) goes first; experts that routed
    requests wait for go last."""
    _path, store_dir = moe_model("mixtral")  # 3 layers x 8 experts
    store = ExpertStore(store_dir)
    cache = ExpertCache(store.index, 3 * store.index.blob_bytes)
    l0, l1, l2 = (0, 0), (1, 0), (2, 0)
    for key in (l1, l1, l1, l0, l2):  # l1 is the most frequent: frequency alone would keep it
        cache.demand(key)
    cache.preload(store, [l0, l1, l2])
    cache.plan({0: 2, 1: 3, 2: 1}, wanted=set())  # layers until a request needs each layer
    slot = cache.reserve(timeout=0)
    assert not cache.resident(l1) and cache.resident(l0) and cache.resident(l2)
    store.read_into(l1, cache.buffer(slot))
    cache.commit(slot, l1, pins=0)
    cache.plan({0: 2, 1: 3, 2: 1}, wanted={l1})  # a request waits for l1: keep it, evict l0 (farthest left)
    cache.reserve(timeout=0)
    assert cache.resident(l1) and cache.resident(l2) and not cache.resident(l0)
