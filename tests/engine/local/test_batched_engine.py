"""BatchedEngine (openvino_genai continuous batching) on the demo model: greedy answers
equal transformers' token for token, alone and with 4 requests batched together; stops,
limits, cancel, logprobs; the fields it cannot honour are refused by name."""

import math

import pytest

from engine.protocol.messages import GenerateRequest, SamplingParams
from engine.protocol.structured import ToolSpec
from engine.runtime.chat import chat_ids
from engine.local.batched import BatchedEngine
from engine.core.refusal import engine_refusal
from engine_helpers import CONVERSATION, chat, collect, reference_greedy

N = 24
PROMPTS = [
    chat(("user", "Tell me a story about a robot.")),
    chat(("system", "Answer in one line."), ("user", "What is the capital of France?")),
    chat(*CONVERSATION),
    chat(("user", "List three colours."), ("assistant", "Red, green, blue."), ("user", "Three more?")),
]


@pytest.fixture(scope="module")
def demo_path(demo_dir):
    return demo_dir("demo")


@pytest.fixture(scope="module")
def engine(demo_path):
    eng = BatchedEngine(demo_path, "demo", precision="f32", kv_cache_gb=1)
    yield eng
    eng.close()


def req(rid, messages=PROMPTS[0], **sampling):
    return GenerateRequest(rid, messages=messages, sampling=SamplingParams(**{"max_tokens": N, **sampling}))


def test_info_names_what_it_refuses(engine):
    info = engine.info
    assert (info.model_id, info.engine) == ("demo", "batched")
    assert {"top_logprobs", "response_format", "tool_choice"} <= info.unsupported


def test_greedy_matches_transformers_alone_and_batched(engine, demo_path):
    ids = chat_ids(engine.tokenizer, PROMPTS[2])
    out, _, final = collect(engine.generate(req("alone", PROMPTS[2])))
    assert out == reference_greedy(demo_path, ids, N)
    assert final.usage.prompt_tokens == len(ids) and final.usage.completion_tokens == len(out)
    rids = [engine.submit(req(f"b{i}", m)) for i, m in enumerate(PROMPTS)]  # admitted in one turn
    got = {rid: collect(engine.stream(rid, timeout=120)) for rid in rids}
    for rid, messages in zip(rids, PROMPTS):
        ref = reference_greedy(demo_path, chat_ids(engine.tokenizer, messages), N)
        assert got[rid][0] == ref, rid
        assert got[rid][2].finish_reason == ("length" if len(ref) == N else "stop")


def test_length_stop_string_and_text(engine):
    ids, full, final = collect(engine.generate(req("len", max_tokens=6, ignore_eos=True)))
    assert final.finish_reason == "length" and len(ids) == 6
    assert full == engine.tokenizer.decode(ids, skip_special_tokens=True)
    _, longer, _ = collect(engine.generate(req("full", max_tokens=32, ignore_eos=True)))
    stop = longer[len(longer) // 2:len(longer) // 2 + 3]
    assert stop.strip(), f"unlucky stop string {stop!r}"
    _, text, final = collect(engine.generate(req("stop", max_tokens=32, ignore_eos=True, stop=(stop,))))
    assert final.finish_reason == "stop" and text == longer[:longer.index(stop)]


def test_cancel_mid_stream_and_the_engine_goes_on(engine):
    rid = engine.submit(req("cancel", max_tokens=400, ignore_eos=True))
    for ev in engine.stream(rid, timeout=60):
        if ev.token_ids:
            engine.cancel(rid)
        if ev.final:
            assert ev.finish_reason == "cancelled" and ev.usage.completion_tokens < 400
    _, _, final = collect(engine.generate(req("after", max_tokens=3, ignore_eos=True)))
    assert final.finish_reason == "length"


def test_logprobs_are_the_greedy_tokens(engine):
    events = engine.generate(req("lp", max_tokens=8, ignore_eos=True, logprobs=0))
    lps = [lp for e in events for lp in e.logprobs]
    ids = [t for e in events for t in e.token_ids]
    assert [lp.token_id for lp in lps] == ids
    assert all(lp.logprob <= 0 and math.isfinite(lp.logprob) and not lp.top_ids for lp in lps)


def test_fields_it_cannot_honour_are_refused_by_name(engine):
    schema = '{"type": "object"}'
    cases = {
        "top_logprobs": req("t", logprobs=3),
        "response_format": GenerateRequest("r", messages=PROMPTS[0], json_schema=schema),
        "tool_choice": GenerateRequest("c", messages=PROMPTS[0], tool_choice="required",
                                       tools=(ToolSpec("f", parameters=schema),)),
    }
    for field, request in cases.items():
        assert engine_refusal(request, engine.info.unsupported).param == field
        _, _, final = collect(engine.generate(request))
        assert final.finish_reason == "error" and field in final.error
    assert engine_refusal(req("plain"), engine.info.unsupported) is None


def test_api_serves_it_and_refuses_top_logprobs_with_a_400(engine):
    import openai

    from engine.serve.api import ApiServer, create_app

    with ApiServer(create_app(engine)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        ok = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=4, extra_body={"ignore_eos": True})
        assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 4
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=4, logprobs=True, top_logprobs=2)
        assert e.value.body["param"] == "top_logprobs"


def test_a_crashed_pipeline_process_ends_its_requests_with_an_error(demo_path):
    """The pipeline runs in a child process (its step() holds the GIL): if that process
    dies, the running answer ends with a one-line error and new ones are refused the same
    way -- the serving process lives on."""
    from engine.platform import process

    eng = BatchedEngine(demo_path, "demo", precision="f32", kv_cache_gb=1)
    try:
        assert eng._child.proc.pid != __import__("os").getpid()
        rid = eng.submit(req("doomed", max_tokens=4000, ignore_eos=True))
        events = eng.stream(rid, timeout=60)
        first = next(e for e in events if e.token_ids)
        assert first.finish_reason is None
        process.kill_tree(eng._child.proc)  # the child this test's engine started
        final = [e for e in events][-1]
        assert final.finish_reason == "error" and "process ended" in final.error and "\n" not in final.error
        _, _, after = collect(eng.generate(req("after", max_tokens=3)))
        assert after.finish_reason == "error" and "process ended" in after.error
    finally:
        eng.close()
