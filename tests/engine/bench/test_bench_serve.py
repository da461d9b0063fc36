"""`flotilla bench serve` at demo size: every engine answers every request through the
HTTP API, figures are consistent, and the LLMPipeline baseline refuses what it cannot do.
No speed assertions: the real figures come from running the benchmark.

Both run in a child process, as a user runs the bench: the openvino_genai pipelines it
opens and closes then never share a process with the rest of the suite."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

ENGINES = ["local", "loop", "batched", "llm-pipeline"]


def test_serve_bench_runs_every_engine_at_every_concurrency(demo_dir, tmp_path):
    demo_dir("demo")
    out_file = tmp_path / "serve.json"
    proc = subprocess.run([sys.executable, "-m", "engine.cli.main", "bench", "serve", "--quick", "--concurrency", "1,3",
                           "--tokens", "6", "--rounds", "2", "--json", str(out_file)],
                          capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(out_file.read_text())
    assert out["engines"] == ENGINES and out["concurrency"] == [1, 3]
    others = ENGINES[1:]
    for r, rd in enumerate(out["per_round"]):
        # even rounds: the local engine before and after each other engine, whose order reverses
        # from one concurrency to the next; odd rounds: each other engine before and after it
        for li, order in enumerate(rd["orders"]):
            turn = others if (r + li) % 2 == 0 else others[::-1]
            around = rd["local"]["levels"][li]["bursts"]
            if r % 2 == 0:
                assert order == ["local", turn[0], "local", turn[1], "local", turn[2], "local"]
                for j in (1, 3, 5):  # each ratio is over the local bursts just before and after it
                    cell = rd[order[j]]["levels"][li]
                    mean = (around[j // 2]["aggregate_tok_s"] + around[j // 2 + 1]["aggregate_tok_s"]) / 2
                    assert abs(cell["over_first_engine"] - cell["aggregate_tok_s"] / mean) < 1e-3
                continue
            assert order == [turn[0], "local", turn[0], turn[1], "local", turn[1], turn[2], "local", turn[2]]
            assert len(around) == 3
            for j, kind in enumerate(turn):  # the mean of its two bursts over the local one between them
                cell = rd[kind]["levels"][li]
                assert len(cell["bursts"]) == 2
                mean = statistics.mean(b["aggregate_tok_s"] for b in cell["bursts"])
                assert abs(cell["aggregate_tok_s"] - mean) < 1e-9
                assert abs(cell["over_first_engine"] - mean / around[j]["aggregate_tok_s"]) < 1e-3
        for kind in ENGINES:
            for cell, c in zip(rd[kind]["levels"], (1, 3)):
                assert cell["concurrency"] == c
                for burst in cell.get("bursts", [cell]):
                    assert burst["tokens"] == 6 * c  # ignore_eos: every token came
                    assert all(n > 0 for n in burst["text_chars"]) and len(burst["text_chars"]) == c
                    assert 0 < burst["ttft_p50_s"] <= burst["ttft_p95_s"] <= burst["wall_s"]
                if kind == "local":  # one burst before and after each other engine, or between its two
                    assert len(cell["bursts"]) == (4 if r % 2 == 0 else 3)
                    assert cell["aggregate_tok_s"] == statistics.median(b["aggregate_tok_s"] for b in cell["bursts"])
                else:
                    assert cell["over_first_engine"] > 0 and 0 <= cell["same_as_first_engine"] <= 1
        # the JSON-schema bursts ran where response_format is enforced (the bench checks the
        # answers held to the schema), every answer to its length limit; nowhere else
        for kind in ("local", "loop"):
            assert [c["tokens"] for c in rd[kind]["constrained_levels"]] == [6, 18]
        assert "constrained_levels" not in rd["batched"] and "constrained_levels" not in rd["llm-pipeline"]
    assert [row["concurrency"] for row in out["figures"]["local"]["constrained"]] == [1, 3]
    assert all(row["constrained_over_free"] > 0 for row in out["figures"]["local"]["constrained"])
    for kind, fig in out["figures"].items():
        for li, row in enumerate(fig["levels"]):
            assert 0 <= row["same_as_first_engine"] <= 1 and row["aggregate_tok_s"] > 0
            # the rounds' spread of the ratio, and the share of rounds the engine was ahead
            ratios = [rd[kind]["levels"][li]["over_first_engine"] for rd in out["per_round"]]
            assert (row["over_first_engine_min"], row["over_first_engine_max"]) == (min(ratios), max(ratios))
            assert row["rounds_ahead_of_first_engine"] == sum(x > 1 for x in ratios) / len(ratios)
            if kind == out["engines"][0]:
                assert row["over_first_engine"] == 1.0 and row["same_as_first_engine"] == 1.0
    assert set(out["fastest"]) == {"1", "3"} and set(out["fastest"].values()) <= set(ENGINES)


DRIVER = """
import sys
from pathlib import Path
import openai
from engine.bench._llm_pipeline import LLMPipelineEngine
from engine.protocol.messages import GenerateRequest, SamplingParams
from engine.serve.api import ApiServer, create_app

with LLMPipelineEngine(Path(sys.argv[1]), "demo") as engine:
    with ApiServer(create_app(engine)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        try:
            client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                           logprobs=True, max_tokens=4)
            raise SystemExit("logprobs was not refused")
        except openai.BadRequestError as e:
            assert e.body["param"] == "logprobs", e.body
        ok = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, extra_body={"ignore_eos": True}, temperature=0)
        assert ok.usage.completion_tokens == 5 and ok.choices[0].finish_reason == "length", ok
    rid = engine.submit(GenerateRequest("long", prompt="hello",
                                        sampling=SamplingParams(max_tokens=4000, ignore_eos=True)))
    last = None
    for ev in engine.stream(rid, timeout=60):
        if ev.token_ids:
            engine.cancel(rid)
        last = ev
    assert last.finish_reason == "cancelled" and last.usage.completion_tokens < 4000, last
    after = engine.generate(GenerateRequest("after", prompt="hello",
                                            sampling=SamplingParams(max_tokens=3, ignore_eos=True)))
    assert after[-1].finish_reason == "length", after[-1]  # the engine goes on
print("ok")
"""


def test_llm_pipeline_baseline_refuses_logprobs_by_name_and_cancels(demo_dir):
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(demo_dir("demo"))], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (proc.stdout[-2000:], proc.stderr[-3000:])
