"""The same grammar holds on every engine: MoE offloading, sparse FFN, the pipeline
(its coordinator masks the logits row the last stage sends back) and the local engine
on a Qwen3 demo. A JSON-schema answer and a forced tool call parse and validate, and
end when the grammar does, on each."""

from __future__ import annotations

import json

import jsonschema
import pytest
from engine_helpers import chat, collect
from schema_helpers import bounded_schemas

from engine.protocol import GenerateRequest, SamplingParams, ToolSpec
from engine.runtime import tool_format

SCHEMAS = bounded_schemas(3, seed=5)
ASK = chat(("user", "Give me the record as JSON."))

ENGINES = [  # (kind, model, options.extra)
    ("moe", "demo-moe", {}),
    ("sparse", "demo", {"mode": "exact", "sparsity": 0.0}),
    ("pipeline", "demo", {"stages": 2}),
    ("local", "demo-qwen3", {}),
]


@pytest.fixture(scope="module", params=ENGINES, ids=[e[0] for e in ENGINES])
def engine(request, demo_dir):
    from engine.local.factory import EngineOptions, open_engine

    kind, model, extra = request.param
    demo_dir(model)
    budget = 50_000_000 if kind in ("moe", "sparse") else None
    eng = open_engine(model, kind, EngineOptions(precision="f32", cache_budget_bytes=budget, extra=extra))
    try:
        yield eng
    finally:
        eng.close()


def test_json_schema_answers_validate_on_every_engine(engine):
    for i, schema in enumerate(SCHEMAS):
        req = GenerateRequest(f"{engine.info.engine}-js{i}", messages=ASK, json_schema=json.dumps(schema),
                              sampling=SamplingParams(max_tokens=200, temperature=1.0, seed=i))
        _, text, final = collect(engine.stream(engine.submit(req), timeout=120))
        assert final.finish_reason == "stop", (text, final.error)
        jsonschema.validate(json.loads(text), schema)


def test_a_forced_tool_call_is_well_formed_on_every_engine(engine):
    tools = (ToolSpec("lookup", "", json.dumps(SCHEMAS[0])), ToolSpec("store", "", json.dumps(SCHEMAS[1])))
    fmt = tool_format.FORMATS[engine.info.tool_format]
    req = GenerateRequest(f"{engine.info.engine}-tc", messages=ASK, tools=tools, tool_choice="required",
                          forced_tool="store", sampling=SamplingParams(max_tokens=200))
    _, text, final = collect(engine.stream(engine.submit(req), timeout=120))
    assert final.finish_reason == "stop" and text.startswith(fmt.head("store")) and text.endswith(fmt.tail)
    jsonschema.validate(json.loads(text[len(fmt.head("store")):-len(fmt.tail)]), SCHEMAS[1])
