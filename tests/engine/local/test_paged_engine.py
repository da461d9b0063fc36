"""PagedEngine (every request in one forward pass over a paged KV cache) on the demo
model at f32: greedy answers equal transformers' token for token alone, batched, and
when the pool is too small for all of them (preemption); logprobs and their
alternatives are transformers'; a follow-up prompt re-uses an ended answer's blocks
(prompt caching) with the same answer; speculation gives the plain answer; cancel
gives the blocks back, and cancelling one of two answers leaves the other as it was;
the local kind opens it, and falls back to the loop."""

from __future__ import annotations

import numpy as np
import pytest

from engine.protocol.messages import GenerateRequest, SamplingParams, SpeculativeParams
from engine.runtime.chat import chat_ids
from engine.local.paged import PagedEngine
from engine_helpers import CONVERSATION, chat, collect, reference_greedy, reference_model

N = 24
PROMPTS = [
    chat(("user", "Tell me a story about a robot.")),
    chat(("system", "Answer in one line."), ("user", "What is the capital of France?")),
    chat(*CONVERSATION),
    chat(("user", "List three colours. " * 12), ("assistant", "Red, green, blue."), ("user", "Three more?")),
]


@pytest.fixture(scope="module")
def demo_path(demo_dir):
    return demo_dir("demo")


@pytest.fixture(scope="module")
def engine(demo_path):
    eng = PagedEngine(demo_path, "demo", precision="f32")
    yield eng
    eng.close()


def req(rid, messages=PROMPTS[0], **kw):
    spec = kw.pop("speculative", None)
    return GenerateRequest(rid, messages=messages, sampling=SamplingParams(**{"max_tokens": N, **kw}),
                           speculative=spec)


def _together(engine, prompts, tag, **kw):
    rids = [engine.submit(req(f"{tag}{i}", m, **kw)) for i, m in enumerate(prompts)]
    return [collect(engine.stream(rid, timeout=120)) for rid in rids]


def test_info_is_the_local_engine(engine):
    info = engine.info
    assert (info.model_id, info.engine, info.device) == ("demo", "local", "CPU") and not info.unsupported


def test_greedy_matches_transformers_alone_and_batched(engine, demo_path):
    ids = chat_ids(engine.tokenizer, PROMPTS[2])
    out, _, final = collect(engine.generate(req("alone", PROMPTS[2])))
    assert out == reference_greedy(demo_path, ids, N)
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(ids), len(out))
    for (got, _, final), messages in zip(_together(engine, PROMPTS, "b"), PROMPTS):
        ref = reference_greedy(demo_path, chat_ids(engine.tokenizer, messages), N)
        assert got == ref
        assert final.finish_reason == ("length" if len(ref) == N else "stop")


def test_a_pool_too_small_for_every_request_preempts_and_the_answers_stay(demo_path):
    # 6 blocks of 32 positions; the four answers need 10 between them
    with PagedEngine(demo_path, "demo", precision="f32", max_blocks=6, prefill_chunk=64) as eng:
        results = _together(eng, PROMPTS, "p", ignore_eos=True)
        assert eng.preemptions > 0
        for (got, _, final), messages in zip(results, PROMPTS):
            assert got == reference_greedy(demo_path, chat_ids(eng.tokenizer, messages), N, ignore_eos=True)
            assert final.finish_reason == "length"
        assert eng.context_length == 6 * 32  # one request must fit the pool whole


def test_logprobs_and_their_alternatives_are_the_models(engine, demo_path):
    import torch

    ids = chat_ids(engine.tokenizer, PROMPTS[1])
    events = list(engine.generate(req("lp", PROMPTS[1], max_tokens=4, logprobs=3, ignore_eos=True)))
    got = [lp for e in events for lp in e.logprobs]
    out = [t for e in events for t in e.token_ids]
    with torch.inference_mode():
        logits = reference_model(demo_path)(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1]
    ref = torch.log_softmax(logits.float(), -1).numpy()
    assert len(got) == 4
    for lp, row, token in zip(got, ref, out):
        assert lp.token_id == token and lp.top_ids[0] == token  # greedy: the best one
        assert lp.logprob == pytest.approx(row[token], abs=1e-4)
        assert list(lp.top_ids) == list(np.argsort(-row, kind="stable")[:3])
        assert np.allclose(lp.top_logprobs, row[list(lp.top_ids)], atol=1e-4)


def test_a_follow_up_prompt_reuses_the_ended_answers_blocks(engine, demo_path):
    first = PROMPTS[3]
    out, text, final = collect(engine.generate(req("turn1", first)))
    follow = first + chat(("assistant", text), ("user", "And one more?"))
    ids = chat_ids(engine.tokenizer, follow)
    again, _, final = collect(engine.generate(req("turn2", follow)))
    held = len(chat_ids(engine.tokenizer, first))  # the first prompt's ids at least are shared
    assert final.usage.cached_tokens >= (held // 32) * 32 > 0 and final.usage.cached_tokens % 32 == 0
    assert again == reference_greedy(demo_path, ids, N)
    engine.set_prompt_cache(0)
    try:
        assert collect(engine.generate(req("turn2-off", follow)))[2].usage.cached_tokens == 0
    finally:
        engine.set_prompt_cache(1)


def test_speculation_gives_the_plain_answer(engine, demo_path):
    messages = chat(("user", "one two three one two three one two three one two three"))
    events = list(engine.generate(req("spec", messages, ignore_eos=True,
                                      speculative=SpeculativeParams("lookup", 4))))
    out = [t for e in events for t in e.token_ids]
    assert out == reference_greedy(demo_path, chat_ids(engine.tokenizer, messages), N, ignore_eos=True)
    assert len(events) < N  # some verify steps kept more than one token


def test_cancel_gives_the_blocks_back(engine):
    free = engine.pool.available
    rid = engine.submit(req("cancel", max_tokens=400, ignore_eos=True))
    for ev in engine.stream(rid, timeout=60):
        if ev.token_ids:
            engine.cancel(rid)
        if ev.final:
            assert ev.finish_reason == "cancelled" and ev.usage.completion_tokens < 400
    assert engine.pool.available == free
    assert collect(engine.generate(req("after", max_tokens=3, ignore_eos=True)))[2].finish_reason == "length"


def test_cancelling_one_of_two_answers_ends_its_stream_and_leaves_the_other_as_it_was(engine, demo_path):
    # a pass's events are sent while the next pass computes: a cancel between two passes must
    # still end the stream after every token it had, and the other answer must not notice
    keep = engine.submit(req("keep", PROMPTS[2], ignore_eos=True))
    drop = engine.submit(req("drop", PROMPTS[1], max_tokens=400, ignore_eos=True))
    events = []
    for ev in engine.stream(drop, timeout=60):
        events.append(ev)
        if len(events) == 3:
            engine.cancel(drop)
    assert events[-1].final and events[-1].finish_reason == "cancelled"
    assert not any(e.final for e in events[:-1]) and 3 <= len(events) - 1 < 400
    assert events[-1].usage.completion_tokens == sum(len(e.token_ids) for e in events)
    got, _, final = collect(engine.stream(keep, timeout=120))
    ids = chat_ids(engine.tokenizer, PROMPTS[2])
    assert got == reference_greedy(demo_path, ids, N, ignore_eos=True) and final.finish_reason == "length"


def test_the_local_kind_opens_it_and_falls_back_to_the_loop(demo_path, monkeypatch):
    from engine.runtime import ov_paged
    from engine.local.factory import open_whole_model
    from engine.scheduler.loop import LocalEngine

    with open_whole_model(demo_path, "demo", precision="f32") as eng:
        assert isinstance(eng, PagedEngine)

    def no_paged_form(*_a, **_k):
        raise ov_paged.PagedUnsupported("no paged attention here")

    monkeypatch.setattr(ov_paged.PagedModel, "__init__", no_paged_form)
    with open_whole_model(demo_path, "demo", precision="f32") as eng:
        assert isinstance(eng, LocalEngine)
        assert collect(eng.generate(req("loop", max_tokens=3, ignore_eos=True)))[2].finish_reason == "length"
