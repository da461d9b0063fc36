"""Bounded queues: submit() past max_pending raises EngineOverloaded, load()
shows running / queued, and the HTTP API answers 429 with Retry-After."""

from __future__ import annotations

import threading

import pytest

from engine.protocol.messages import GenerateRequest, SamplingParams, TokenEvent, Usage
from engine.core.backpressure import retry_after_header, retry_after_s
from engine.core.interface import Engine, EngineInfo, EngineOverloaded


class HeldEngine(Engine):
    """Accepts requests and answers only when released (2 run at once)."""

    max_concurrent = 2

    def __init__(self) -> None:
        super().__init__()
        self.started: list[str] = []

    @property
    def info(self) -> EngineInfo:
        return EngineInfo("held", "test", "CPU", 128)

    def _start(self, request: GenerateRequest) -> None:
        self.started.append(request.request_id)

    def cancel(self, request_id: str) -> None:
        self._emit(TokenEvent(request_id, finish_reason="cancelled", usage=Usage(0, 0)))

    def release(self, request_id: str) -> None:
        self._emit(TokenEvent(request_id, text="ok", finish_reason="stop", usage=Usage(1, 1)))

    def _shutdown(self) -> None:
        pass


def _req(i: int) -> GenerateRequest:
    return GenerateRequest(f"r{i}", prompt="hi", sampling=SamplingParams(max_tokens=4))


def test_submit_past_the_bound_is_refused_and_load_counts():
    eng = HeldEngine()
    eng.max_pending = 5
    for i in range(5):
        eng.submit(_req(i))
    load = eng.load()
    assert (load.running, load.queued, load.max_running, load.max_pending, load.state) == (2, 3, 2, 5, "ok")
    with pytest.raises(EngineOverloaded) as e:
        eng.submit(_req(5))
    assert e.value.retry_after_s >= 1 and "5 requests" in str(e.value)
    eng.release("r0")  # a final event frees a slot at once, even before the client reads it
    assert eng.load().queued == 2
    eng.submit(_req(6))
    assert [ev.finish_reason for ev in eng.stream("r0")] == ["stop"]
    eng.close()


def test_retry_after_follows_the_queue():
    assert retry_after_s(0, 8, 0.0) == 1.0
    assert retry_after_s(15, 8, 4.0) == 8.0  # two rounds of 4 s ahead
    assert retry_after_s(10_000, 1, 30.0) == 60.0  # capped
    assert retry_after_header(0.2) == "1" and retry_after_header(7.5) == "8"


def test_api_answers_429_with_retry_after():
    from fastapi.testclient import TestClient

    from engine.serve.api import create_app

    eng = HeldEngine()
    eng.max_pending = 1
    eng.submit(_req(0))
    client = TestClient(create_app(eng))
    r = client.post("/v1/chat/completions", json={"model": "held", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert err["code"] == "engine_overloaded" and err["type"] == "rate_limit_error"
    spec = client.get("/openapi.json").json()
    assert "429" in spec["paths"]["/v1/chat/completions"]["post"]["responses"]
    # a slot frees: the next request is served
    eng.release("r0")
    done = threading.Event()

    def answer() -> None:
        while not done.is_set():
            for rid in [r for r in eng.started if r != "r0"]:
                eng.release(rid)
                done.set()
            done.wait(0.01)

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    r = client.post("/v1/completions", json={"model": "held", "prompt": "x"})
    done.set()
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
    eng.close()
