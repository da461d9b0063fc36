"""Acceptance: LocalEngine on OpenVINO (precision f32, greedy) equals
transformers generate(do_sample=False) token for token, for every demo
architecture, alone and with 4 concurrent requests."""

import pytest

from engine.protocol.messages import GenerateRequest, SamplingParams
from engine.runtime.chat import chat_ids
from engine.serve.local import LocalEngine
from engine_helpers import CONVERSATION, DEMOS, chat, collect, reference_greedy

N = 32

PROMPTS = [
    chat(("user", "Tell me a story about a robot.")),
    chat(("system", "Answer in one line."), ("user", "What is the capital of France?")),
    chat(*CONVERSATION),
    chat(("user", "List three colours."), ("assistant", "Red, green, blue."), ("user", "Three more?")),
]


@pytest.fixture(scope="module", params=DEMOS)
def engine(request, demo_dir):
    path = demo_dir(request.param)
    eng = LocalEngine(path, request.param, precision="f32")
    yield eng, path
    eng.close()


def greedy(rid, messages):
    return GenerateRequest(rid, messages=messages, sampling=SamplingParams(max_tokens=N))


def test_multi_turn_matches_transformers(engine):
    eng, path = engine
    messages = chat(*CONVERSATION)
    ids = chat_ids(eng.tokenizer, messages)
    ref = reference_greedy(path, ids, N)
    out, text, final = collect(eng.generate(greedy("multi", messages)))
    assert out == ref
    assert final.finish_reason == ("length" if len(ref) == N else "stop")
    assert final.usage.prompt_tokens == len(ids) and final.usage.completion_tokens == len(out)


def test_four_concurrent_requests_each_match_their_reference(engine):
    eng, path = engine
    rids = [eng.submit(greedy(f"c{i}", m)) for i, m in enumerate(PROMPTS)]
    results = {rid: collect(eng.stream(rid, timeout=60)) for rid in rids}
    for rid, messages in zip(rids, PROMPTS):
        ref = reference_greedy(path, chat_ids(eng.tokenizer, messages), N)
        assert results[rid][0] == ref, rid
