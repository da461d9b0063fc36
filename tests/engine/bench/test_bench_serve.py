"""`flotilla bench serve` at demo size: every engine answers every request through the
HTTP API, figures are consistent, and the LLMPipeline baseline refuses what it cannot do.
No speed assertions: the real figures come from running the benchmark."""

from __future__ import annotations

import argparse
import json

import pytest

from engine.bench import serve


def _args(extra: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    serve.add_arguments(p)
    return p.parse_args(["--quick", *extra])


def test_serve_bench_runs_every_engine_at_every_concurrency(demo_dir):
    demo_dir("demo")
    lines: list[str] = []
    out = serve.run(_args(["--concurrency", "1,3", "--tokens", "6", "--rounds", "2"]), lines.append)
    json.dumps(out, allow_nan=False)
    assert out["engines"] == list(serve.ENGINES) and out["concurrency"] == [1, 3]
    for rd, order in zip(out["per_round"], (list(serve.ENGINES), list(serve.ENGINES)[::-1])):
        assert rd["order"] == order  # rounds alternate the order
        for kind in serve.ENGINES:
            for cell, c in zip(rd[kind]["levels"], (1, 3)):
                assert cell["concurrency"] == c and cell["tokens"] == 6 * c  # ignore_eos: every token came
                assert all(n > 0 for n in cell["text_chars"]) and len(cell["text_chars"]) == c
                assert 0 < cell["ttft_p50_s"] <= cell["ttft_p95_s"] <= cell["wall_s"]
    for kind, fig in out["figures"].items():
        for row in fig["levels"]:
            assert 0 <= row["same_as_first_engine"] <= 1 and row["aggregate_tok_s"] > 0
            if kind == out["engines"][0]:
                assert row["over_first_engine"] == 1.0 and row["same_as_first_engine"] == 1.0
    assert set(out["fastest"]) == {"1", "3"} and set(out["fastest"].values()) <= set(serve.ENGINES)


def test_llm_pipeline_baseline_refuses_logprobs_by_name_and_cancels(demo_dir):
    import openai

    from engine.bench._llm_pipeline import LLMPipelineEngine
    from engine.protocol.messages import GenerateRequest, SamplingParams
    from engine.serve.api import ApiServer, create_app

    with LLMPipelineEngine(demo_dir("demo"), "demo") as engine:
        with ApiServer(create_app(engine)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                               logprobs=True, max_tokens=4)
            assert e.value.body["param"] == "logprobs"
            ok = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=5, extra_body={"ignore_eos": True}, temperature=0)
            assert ok.usage.completion_tokens == 5 and ok.choices[0].finish_reason == "length"
        rid = engine.submit(GenerateRequest("long", prompt="hello", sampling=SamplingParams(max_tokens=4000,
                                                                                              ignore_eos=True)))
        for ev in engine.stream(rid, timeout=60):
            if ev.token_ids:
                engine.cancel(rid)
            if ev.final:
                assert ev.finish_reason == "cancelled" and ev.usage.completion_tokens < 4000
        after = engine.generate(GenerateRequest("after", prompt="hello",
                                                sampling=SamplingParams(max_tokens=3, ignore_eos=True)))
        assert after[-1].finish_reason == "length"  # the engine goes on
