"""The MoE engine's scheduler thread when a step raises (a bug, not one request's failure):
the running requests end with the error instead of waiting forever, and the engine serves
the next ones on a fresh scheduler, answering as an engine that never failed."""

from __future__ import annotations

from engine.moe.engine import MoEConfig, MoEEngine
from engine.moe.store import ExpertStore
from engine.protocol.messages import GenerateRequest, SamplingParams


def _engine(store_dir) -> MoEEngine:
    budget = 8 * ExpertStore(store_dir).index.blob_bytes  # experts stream from disk: reads in flight
    return MoEEngine(store_dir, "t", MoEConfig(cache_budget_bytes=budget, kv_precision="f32", fetch_threads=2,
                                               torch_threads=1, max_concurrent=2))


def _ask(engine: MoEEngine, rid: str):
    request = GenerateRequest(rid, prompt="The robot walked into", sampling=SamplingParams(max_tokens=6))
    return list(engine.stream(engine.submit(request), timeout=120))


def test_a_step_that_raises_ends_its_requests_and_the_next_one_is_answered_as_before(moe_model, monkeypatch):
    _path, store_dir = moe_model("qwen3_moe")
    with _engine(store_dir) as engine:
        expected = [t for e in _ask(engine, "before") for t in e.token_ids]
    with _engine(store_dir) as engine:
        real, calls = engine.model.attend, []

        def attend(b):  # the second layer's attention fails: the first layer's experts were asked for
            calls.append(b.layer)
            if len(calls) == 2:
                raise RuntimeError("attention bug\nsecond line")
            return real(b)

        monkeypatch.setattr(engine.model, "attend", attend)
        final = _ask(engine, "bug")[-1]
        assert final.finish_reason == "error" and final.error_code == "engine"
        assert "attention bug second line" in final.error
        monkeypatch.undo()
        events = _ask(engine, "after")
        assert events[-1].finish_reason == "length"
        assert [t for e in events for t in e.token_ids] == expected
