"""Prompt caching across a 2-stage pipeline: a finished stream stays parked on both
stages; a follow-up prompt takes it over, the stages drop what it holds past the
shared prefix (hide + compact) and prefill only the rest, and the answer is what
transformers answers from the whole prompt (greedy, f32)."""

from __future__ import annotations

import pytest

pytest.importorskip("openvino")
pytest.importorskip("zmq")

from engine_helpers import chat, check_follow_up_answers_as_uncached, collect, reference_greedy  # noqa: E402

from engine.protocol import GenerateRequest, SamplingParams  # noqa: E402
from engine.runtime.chat import chat_ids  # noqa: E402

SYSTEM = ("system", "You answer questions about the water of the world. " * 12)
N = 10


@pytest.fixture(scope="module")
def engine(demo_dir):
    from engine.local.factory import EngineOptions, open_engine

    demo_dir("demo")
    eng = open_engine("demo", "pipeline", EngineOptions(precision="f32", extra={"stages": 2, "max_concurrent": 2}))
    yield eng
    eng.close()


def _ask(engine, rid, messages, n=N):
    req = GenerateRequest(rid, messages=messages, sampling=SamplingParams(max_tokens=n))
    return collect(engine.stream(engine.submit(req), timeout=120))


def _same_as_transformers(engine, demo_dir, messages, got):
    ids = chat_ids(engine.tokenizer, messages)
    assert got == reference_greedy(demo_dir("demo"), ids, len(got))[:len(got)]


def test_a_follow_up_turn_reuses_the_parked_stream(engine, demo_dir):
    first = chat(SYSTEM, ("user", "Tell me about rivers."))
    ids1, text1, end1 = _ask(engine, "p1", first)
    second = first + chat(("assistant", text1), ("user", "And lakes?"))
    ids2, _, end2 = _ask(engine, "p2", second)
    assert end2.usage.cached_tokens >= end1.usage.prompt_tokens
    _same_as_transformers(engine, demo_dir, second, ids2)


def test_an_edited_turn_trims_the_parked_stream_on_every_stage(engine, demo_dir):
    _ask(engine, "q1", chat(SYSTEM, ("user", "Tell me about the sea.")))
    edited = chat(SYSTEM, ("user", "Tell me about the moon instead."))
    ids, _, end = _ask(engine, "q2", edited)
    assert len(chat_ids(engine.tokenizer, chat(SYSTEM))) <= end.usage.cached_tokens < end.usage.prompt_tokens
    _same_as_transformers(engine, demo_dir, edited, ids)


def test_parked_streams_stay_within_the_planned_streams(engine):
    """max_concurrent 2: running + parked streams never exceed it, so the stages never hold
    more KV than the plan counted; the oldest parked stream goes first."""
    for i in range(4):
        _ask(engine, f"b{i}", chat(SYSTEM, ("user", f"Question {i} about water?")), n=3)
        assert len(engine.parked) <= min(engine.config.prompt_cache, engine.config.max_concurrent)
    reqs = [GenerateRequest(f"c{i}", messages=chat(("user", f"Other {i}")), sampling=SamplingParams(max_tokens=4))
            for i in range(2)]
    for r in reqs:
        engine.submit(r)
    finals = [collect(engine.stream(r.request_id, timeout=120))[2] for r in reqs]
    assert all(f.finish_reason == "length" for f in finals)
    assert len(engine.parked) <= engine.config.max_concurrent


CHUNK = 32  # prefill tokens per step: the demo chat spans several chunks


@pytest.fixture(scope="module")
def exact_engine(demo_dir):
    """The device's default precision (bf16 compute where the CPU has it) with the exact prompt cache."""
    from engine.local.factory import EngineOptions, open_engine

    demo_dir("demo")
    eng = open_engine("demo", "pipeline", EngineOptions(extra={
        "stages": 2, "max_concurrent": 2, "prefill_chunk": CHUNK, "prompt_cache_exact": True}))
    yield eng
    eng.close()


def test_the_exact_prompt_cache_answers_as_a_fresh_request_at_the_default_precision(exact_engine):
    """Only whole prefill chunks are reused, computed as a fresh prefill computes them, and the
    stages keep a 16-bit KV cache (the take-over's read-back of a u8 one re-quantizes it): the
    follow-up's answer is the uncached one even where a re-split prefill rounds differently."""
    from engine.pipeline.prompt_cache import EXACT_CACHE_KV

    for link in exact_engine.stages:  # the workers were started with the lossless KV cache
        args = list(link.proc.args)
        assert args[args.index("--kv-precision") + 1] == EXACT_CACHE_KV
    check_follow_up_answers_as_uncached(exact_engine, lambda rid, m: _ask(exact_engine, rid, m),
                                        chat(SYSTEM, ("user", "Tell me about rivers.")), CHUNK)
