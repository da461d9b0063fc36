"""The API's failure paths, against a scripted in-test Engine (faults a real
model cannot be made to produce on demand): engine errors, a closed engine,
client disconnects, and the OpenAI error shape for every kind of bad request."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from engine.protocol.messages import GenerateRequest, TokenEvent, Usage
from engine.serve.api import ApiServer, create_app
from engine.core.interface import Engine, EngineInfo


# prompt -> (error code, message): the category is in the code; the words are free to change
REWORDED = {
    "too-long": ("context_length_exceeded", "this conversation is more than the model can read at once"),
    "bad-grammar": ("bad_request", "cannot compile that schema"),
    "looks-like-a-refusal": ("engine", "the prompt has 5 tokens but the context holds 4 (a bug's words)"),
}


class ScriptedEngine(Engine):
    """Answers "w0 w1 ..." one word per token. The last message / prompt picks
    the fault: "fail" ends in an error after two tokens, "slow" emits a token
    every 20 ms until cancelled; anything else answers max_tokens words."""

    def __init__(self, model_id: str = "scripted") -> None:
        super().__init__()
        self.model_id = model_id
        self.cancelled: set[str] = set()
        self.seen: list[GenerateRequest] = []
        self._cancel_flags: dict[str, threading.Event] = {}

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(self.model_id, "scripted", "CPU", 4096)

    def _start(self, request: GenerateRequest) -> None:
        self.seen.append(request)
        flag = self._cancel_flags.setdefault(request.request_id, threading.Event())
        threading.Thread(target=self._run, args=(request, flag), daemon=True).start()

    def _run(self, req: GenerateRequest, flag: threading.Event) -> None:
        text = req.prompt if req.prompt is not None else req.messages[-1].content
        prompt_tokens = len(text.split())
        n = 0
        while True:
            if flag.is_set():
                self._emit(TokenEvent(req.request_id, finish_reason="cancelled",
                                      usage=Usage(prompt_tokens, n)))
                return
            if text == "fail" and n == 2:
                self._emit(TokenEvent(req.request_id, finish_reason="error", error="device lost"))
                return
            if text in REWORDED and n == 0:  # an admission error, its words unlike any engine's today
                self._emit(TokenEvent(req.request_id, finish_reason="error", error=REWORDED[text][1],
                                      error_code=REWORDED[text][0], usage=Usage(prompt_tokens, 0)))
                return
            if text != "slow" and n == req.sampling.max_tokens:
                self._emit(TokenEvent(req.request_id, finish_reason="length",
                                      usage=Usage(prompt_tokens, n)))
                return
            self._emit(TokenEvent(req.request_id, text=f" w{n}", token_ids=(n,)))
            n += 1
            if text == "slow":
                time.sleep(0.02)

    async def async_stream(self, request_id: str):
        if any(r.request_id == request_id and r.prompt == "boom" for r in self.seen):
            yield TokenEvent(request_id, text=" w0", token_ids=(0,))
            raise RuntimeError("a bug with a secret /home/path in it")
        async for event in super().async_stream(request_id):
            yield event

    def cancel(self, request_id: str) -> None:
        self.cancelled.add(request_id)
        flag = self._cancel_flags.get(request_id)
        if flag is not None:
            flag.set()

    def _shutdown(self) -> None:
        for flag in self._cancel_flags.values():
            flag.set()


@pytest.fixture(scope="module")
def served():
    engine, closed = ScriptedEngine(), ScriptedEngine("closed")
    closed.close()
    server = ApiServer(create_app({"scripted": engine, "closed": closed})).start()
    try:
        yield server, engine
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(served):
    server, _ = served
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _is_openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"] and "Traceback" not in body["error"]["message"]
    return body["error"]


def test_engine_error_non_streaming_is_500(client):
    with pytest.raises(openai.InternalServerError) as exc:
        client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "fail"}])
    assert "device lost" in str(exc.value)


def test_engine_error_streaming_sends_error_event_then_done(served):
    server, _ = served
    body = {"model": "scripted", "prompt": "fail", "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    err = json.loads(data[-2])["error"]
    assert "device lost" in err["message"] and err["type"] == "server_error"
    assert "".join(json.loads(d)["choices"][0]["text"] for d in data[:-2]) == " w0 w1"


@pytest.mark.parametrize("prompt,status,code", [("too-long", 400, "context_length_exceeded"),
                                                ("bad-grammar", 400, None),
                                                ("looks-like-a-refusal", 500, "engine_error")])
def test_an_errors_category_comes_from_its_code_not_its_words(served, prompt, status, code):
    """A refused prompt is a 400 however the engine words it, and an engine failure a 500
    even when its words read like a refusal: the API branches on TokenEvent.error_code."""
    server, _ = served
    resp = httpx.post(f"{server.url}/v1/completions", json={"model": "scripted", "prompt": prompt}, timeout=10)
    err = _is_openai_error(resp, status)
    assert err["code"] == code and REWORDED[prompt][1] in err["message"]
    body = {"model": "scripted", "prompt": prompt, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=10) as r:
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    streamed = json.loads(data[-2])["error"]
    assert streamed["type"] == ("invalid_request_error" if status == 400 else "server_error")
    assert streamed["code"] == code


def test_openai_client_raises_on_stream_error(client):
    with pytest.raises(openai.APIError):
        for _ in client.completions.create(model="scripted", prompt="fail", stream=True):
            pass


def test_unexpected_errors_hide_details(served):
    server, engine = served
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "scripted", "prompt": "boom"})
    err = _is_openai_error(r, 500)
    assert err["type"] == "server_error" and "secret" not in r.text
    body = {"model": "scripted", "prompt": "boom", "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=10) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and json.loads(data[-2])["error"]["type"] == "server_error"
    assert "secret" not in "".join(data)
    rid = json.loads(data[0])["id"]
    assert rid in engine.cancelled  # the engine request was not left running


def test_closed_engine_is_503(served):
    server, _ = served
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "closed", "prompt": "hi"})
    assert _is_openai_error(r, 503)["type"] == "server_error"


def test_stream_disconnect_cancels_engine_request(served):
    server, engine = served
    body = {"model": "scripted", "messages": [{"role": "user", "content": "slow"}], "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=10) as r:
        lines = r.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        rid = first["id"]
        assert first["choices"][0]["delta"]["role"] == "assistant"
        next(line for line in lines if line.startswith("data: "))
    deadline = time.monotonic() + 5
    while rid not in engine.cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rid in engine.cancelled


def test_non_streaming_disconnect_cancels_engine_request(served):
    server, engine = served
    body = {"model": "scripted", "prompt": "slow"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        slow = [r.request_id for r in engine.seen if r.prompt == "slow"]
        if slow and slow[-1] in engine.cancelled:
            break
        time.sleep(0.02)
    assert slow and slow[-1] in engine.cancelled


def test_parameter_mapping(served, client):
    _, engine = served
    client.chat.completions.create(
        model="scripted", messages=[{"role": "developer", "content": "be brief"},
                                    {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        max_completion_tokens=3, max_tokens=9, temperature=0.7, top_p=0.9, seed=5, stop="END",
        extra_body={"top_k": 4, "repetition_penalty": 1.1, "frequency_penalty": 0, "user": "u"})
    req = engine.seen[-1]
    assert req.request_id.startswith("chatcmpl-")
    assert [(m.role, m.content) for m in req.messages] == [("system", "be brief"), ("user", "hi")]
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop, s.top_k, s.repetition_penalty) == \
        (3, 0.7, 0.9, 5, ("END",), 4, 1.1)
    out = client.completions.create(model="scripted", prompt=["a b c"], max_tokens=2, stop=["x", "y"])
    assert engine.seen[-1].request_id.startswith("cmpl-") and out.id == engine.seen[-1].request_id
    assert engine.seen[-1].prompt == "a b c" and engine.seen[-1].sampling.stop == ("x", "y")
    assert out.choices[0].text == " w0 w1" and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (3, 2, 5)


@pytest.mark.parametrize("body,param", [
    ({"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "seed": 1.5}, "seed"),
    ({"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
    ({"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "stop": [""]}, "stop"),
    ({"model": "scripted", "messages": [{"role": "robot", "content": "hi"}]}, "role"),
    ({"model": "scripted", "messages": [{"role": "tool", "content": "hi"}]}, "tool_call_id"),
    ({"model": "scripted", "messages": []}, "messages"),
    ({"model": "scripted"}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ({"model": "scripted", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "n": 3}, "n"),
])
def test_invalid_chat_bodies_are_400(served, body, param):
    server, _ = served
    err = _is_openai_error(httpx.post(f"{server.url}/v1/chat/completions", json=body), 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param or param in err["message"], err


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("url,extra,param,code", [
    ("chat", {"functions": [TOOL["function"]]}, "functions", "unsupported_value"),  # the old form of tools
    ("chat", {"function_call": "auto"}, "function_call", "unsupported_value"),
    ("chat", {"frequency_penalty": 0.5}, "frequency_penalty", "unsupported_value"),
    ("chat", {"logit_bias": {"5": 10}}, "logit_bias", "unsupported_value"),
    ("chat", {"reasoning_effort": "high"}, "reasoning_effort", "unsupported_value"),
    ("chat", {"temprature": 0.1}, "temprature", "unsupported_parameter"),  # a typo is not ignored either
    ("chat", {"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, "messages[0].name",
     "unsupported_parameter"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].image_url", "unsupported_parameter"),
    ("chat", {"stream": True, "stream_options": {"include_usage": True, "every": 2}}, "stream_options.every",
     "unsupported_parameter"),
    ("completions", {"echo": True}, "echo", "unsupported_value"),
    ("completions", {"best_of": 2}, "best_of", "unsupported_value"),
])
def test_a_field_the_engines_would_ignore_is_400_naming_it(served, url, extra, param, code):
    server, engine = served
    body = {"model": "scripted", **({"messages": HI} if url == "chat" else {"prompt": "hi"}), **extra}
    seen = len(engine.seen)
    err = _is_openai_error(httpx.post(f"{server.url}/v1/{'chat/completions' if url == 'chat' else url}",
                                      json=body), 400)
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code)
    assert param in err["message"] and "\n" not in err["message"]
    assert len(engine.seen) == seen  # refused before it reached the engine


def test_fields_at_the_value_that_asks_for_nothing_are_taken(served, client):
    _, engine = served
    out = client.chat.completions.create(
        model="scripted", messages=HI, max_tokens=2, tools=[], tool_choice="none", logprobs=False,
        response_format={"type": "text"}, frequency_penalty=0, presence_penalty=0.0, user="u",
        metadata={"k": "v"}, store=False, parallel_tool_calls=False)
    assert out.choices[0].finish_reason == "length" and engine.seen[-1].sampling.max_tokens == 2


def test_the_openai_client_sees_which_field_was_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="scripted", messages=HI, logit_bias={"5": 1}, function_call="auto")
    assert e.value.status_code == 400 and e.value.body["param"] == "function_call"  # first in name order


@pytest.mark.parametrize("content,ctype", [
    (b"{not json", "application/json"), (b"[1, 2]", "application/json"),
    (b"", "application/json"), (b"prompt=hi", "text/plain"),
])
def test_bad_bodies_are_400(served, content, ctype):
    server, _ = served
    r = httpx.post(f"{server.url}/v1/completions", content=content, headers={"content-type": ctype})
    assert _is_openai_error(r, 400)["type"] == "invalid_request_error"


def test_unknown_paths_and_methods(served):
    server, _ = served
    assert _is_openai_error(httpx.get(f"{server.url}/v1/nothing"), 404)["code"] == "unknown_url"
    r = httpx.get(f"{server.url}/v1/chat/completions")
    assert _is_openai_error(r, 405)["code"] == "method_not_allowed"
    assert "POST" in r.headers.get("allow", "")
    assert _is_openai_error(httpx.get(f"{server.url}/v1/models/nope"), 404)["code"] == "model_not_found"
    assert httpx.get(f"{server.url}/v1/models/scripted").json()["id"] == "scripted"


def test_prompt_list_must_hold_one_string(served):
    server, _ = served
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "scripted", "prompt": ["a", "b"]})
    assert _is_openai_error(r, 400)["param"] == "prompt"


def test_server_port_zero_and_restart():
    server = ApiServer(create_app(ScriptedEngine())).start()
    try:
        assert server.port > 0
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "scripted"
    finally:
        server.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/v1/models", timeout=2)
