"""The OpenAI-compatible API end to end: the official `openai` client against a
live server (ApiServer on a free port) over the real LocalEngine running the
`demo` model on OpenVINO in f32 (greedy answers are then reproducible)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from engine.models.demo import ensure_demo
from engine.serve.api import ApiServer, create_app

CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Tell me about the little town by the river."}]
PROMPT = "Once upon a time there was a"
# The trained demo ends its turn when it has answered (often in a few tokens); tests of
# length and usage counts ask it to go on to max_tokens (the ignore_eos extension).
LONG = {"ignore_eos": True}


@pytest.fixture(scope="module")
def engine(demo_engine):
    return demo_engine


@pytest.fixture(scope="module")
def server(demo_server):
    return demo_server


@pytest.fixture(scope="module")
def client(demo_client):
    return demo_client


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_demo("demo"))


def _chat_len(tokenizer, messages) -> int:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)
    return len(out["input_ids"])


def test_models_list(client, engine):
    models = client.models.list().data
    assert [m.id for m in models] == ["demo"]
    assert models[0].owned_by == "flotilla" and models[0].context_length == engine.info.context_length
    assert client.models.retrieve("demo").id == "demo"


def test_chat_non_streaming_text_and_usage(client, tokenizer):
    out = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=8, temperature=0,
                                         extra_body=LONG)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion" and out.model == "demo"
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == _chat_len(tokenizer, CHAT)
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_chat_streaming_matches_non_streaming(client, tokenizer):
    kw = dict(model="demo", messages=CHAT, max_completion_tokens=12, temperature=0, extra_body=LONG)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    content = [c for c in chunks if c.choices]
    assert [c.choices[0].finish_reason for c in content][:-1] == [None] * (len(content) - 1)
    assert content[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == whole.choices[0].message.content
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.prompt_tokens == _chat_len(tokenizer, CHAT)
    assert usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.total_tokens == usage_chunk.usage.prompt_tokens + 12


def test_stream_without_include_usage_has_no_usage_chunk(client):
    chunks = list(client.chat.completions.create(model="demo", messages=CHAT, max_tokens=3,
                                                 temperature=0, stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_completions_non_streaming_and_streaming(client, tokenizer):
    kw = dict(model="demo", prompt=PROMPT, max_tokens=10, temperature=0, extra_body=LONG)
    whole = client.completions.create(**kw)
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion"
    assert whole.choices[0].text and whole.choices[0].finish_reason == "length"
    prompt_len = len(tokenizer(PROMPT, add_special_tokens=True)["input_ids"])
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_len, 10)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == prompt_len


def test_concurrent_requests_equal_alone(server, client, tokenizer):
    convs = [[{"role": "user", "content": f"Question number {i}: what did the {w} see?"}]
             for i, w in enumerate(["fox", "king", "child", "sailor"])]
    alone = [client.chat.completions.create(model="demo", messages=m, max_tokens=16, temperature=0, extra_body=LONG)
             for m in convs]

    async def together():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                                      timeout=60) as aclient:
            calls = [aclient.chat.completions.create(model="demo", messages=m, max_tokens=16,
                                                     temperature=0, extra_body=LONG) for m in convs]
            return await asyncio.gather(*calls)

    for m, one, many in zip(convs, alone, asyncio.run(together())):
        assert many.choices[0].message.content == one.choices[0].message.content
        assert many.usage.prompt_tokens == one.usage.prompt_tokens == _chat_len(tokenizer, m)
        assert many.usage.completion_tokens == one.usage.completion_tokens == 16


def test_malformed_json_is_400(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"model": "demo", "messages": [',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="no-such-model", messages=CHAT)
    assert exc.value.status_code == 404 and exc.value.code == "model_not_found"


@pytest.mark.parametrize("kw,param", [({"temperature": 5}, "temperature"),
                                      ({"temperature": -0.5}, "temperature"), ({"n": 2}, "n")])
def test_invalid_values_are_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="demo", messages=CHAT, max_tokens=4, **kw)
    assert exc.value.param == param


def test_api_key(engine):
    with ApiServer(create_app(engine, api_key="sekrit")) as srv:
        base = f"{srv.url}/v1"
        r = httpx.get(f"{base}/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(f"{base}/chat/completions", content=b"{oops")  # auth is checked first
        assert r.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=base, api_key="sekrit", max_retries=0)
        assert [m.id for m in good.models.list().data] == ["demo"]
        out = good.chat.completions.with_raw_response.create(model="demo", messages=CHAT, max_tokens=2)
        assert out.http_response.status_code == 200
        assert httpx.get(f"{srv.url}/openapi.json").status_code == 200  # docs stay open


def test_openapi_lists_endpoints(server):
    spec = httpx.get(f"{server.url}/openapi.json").json()
    assert spec["info"]["title"] == "Flotilla OpenAI-compatible API"
    assert {"/v1/models", "/v1/chat/completions", "/v1/completions"} <= set(spec["paths"])
    assert "post" in spec["paths"]["/v1/chat/completions"]
    assert "ChatCompletionRequest" in spec["components"]["schemas"]


def test_stream_disconnect_cancels_the_engine_request(server, engine, monkeypatch):
    cancelled: list[str] = []
    done = threading.Event()
    real_cancel = engine.cancel

    def spy(request_id: str) -> None:
        cancelled.append(request_id)
        real_cancel(request_id)
        done.set()

    monkeypatch.setattr(engine, "cancel", spy)
    body = {"model": "demo", "messages": CHAT, "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
        data = (line[6:] for line in r.iter_lines() if line.startswith("data: "))
        rid = json.loads(next(data))["id"]
        for _ in range(3):
            next(data)
    assert done.wait(10) and cancelled == [rid]
    t0 = time.monotonic()  # the engine is free again: a short request answers at once
    with httpx.Client(timeout=30) as c:
        r = c.post(f"{server.url}/v1/completions", json={"model": "demo", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200 and time.monotonic() - t0 < 10


def test_logprobs_through_the_openai_client(client):
    """Greedy: the pick is the likeliest token; streamed logprobs are the same list; the
    legacy completions shape holds the same figures in parallel arrays."""
    kw = dict(model="demo", messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    out = client.chat.completions.create(**kw)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens > 0
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        assert (t.token, t.logprob) == (t.top_logprobs[0].token, t.top_logprobs[0].logprob)
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    streamed = [t for c in client.chat.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in content]
    plain = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == out.choices[0].message.content

    comp = client.completions.create(model="demo", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == comp.usage.completion_tokens
    assert all(len(alt) <= 2 and max(alt.values()) == pytest.approx(v) for alt, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


@pytest.mark.parametrize("extra,param", [
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"logprobs": True, "speculative": "lookup"}, "speculative"),  # one verify pass keeps no rows per token
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_logprobs_that_cannot_be_given_are_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=CHAT, max_tokens=2, extra_body=extra)
    assert e.value.body["param"] == param
