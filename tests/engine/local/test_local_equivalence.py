"""Acceptance: LocalEngine on OpenVINO (precision f32, greedy) equals
transformers generate(do_sample=False) token for token, for every demo
architecture, alone and with 4 concurrent requests."""

import pytest

from engine.protocol.messages import GenerateRequest, SamplingParams
from engine.runtime.chat import chat_ids
from engine.scheduler.loop import LocalEngine
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


def test_logprobs_are_transformers_log_softmax_at_each_answer_position(engine):
    """Each answer token's logprob and its 5 likeliest alternatives are the log-softmax of
    transformers' logits over the prompt and the answer so far (teacher-forced)."""
    import numpy as np
    import torch

    from engine_helpers import reference_model

    eng, path = engine
    messages = PROMPTS[1]
    req = GenerateRequest("lp", messages=messages, sampling=SamplingParams(max_tokens=12, logprobs=5))
    events = list(eng.generate(req))
    out = [t for e in events for t in e.token_ids]
    lps = [lp for e in events for lp in e.logprobs]
    assert [lp.token_id for lp in lps] == out and out  # one per token, in order
    ids = chat_ids(eng.tokenizer, messages)
    with torch.inference_mode():
        logits = reference_model(path)(input_ids=torch.tensor([ids + out])).logits[0].double()
    want = torch.log_softmax(logits, -1)[len(ids) - 1:len(ids) - 1 + len(out)].numpy()  # [answer, vocab]
    for pos, lp in enumerate(lps):
        assert lp.logprob == pytest.approx(want[pos, lp.token_id], abs=2e-3)
        assert len(lp.top_ids) == 5 and list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
        np.testing.assert_allclose(lp.top_logprobs, want[pos, list(lp.top_ids)], atol=2e-3)
        fifth = np.sort(want[pos])[-5]
        assert min(lp.top_logprobs) >= fifth - 2e-3  # they are the likeliest five, not any five
        assert lp.token_id == lp.top_ids[0]  # greedy: the pick is the likeliest
        assert lp.text == eng.tokenizer.decode([lp.token_id])
