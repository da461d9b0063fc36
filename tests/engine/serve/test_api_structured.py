"""Tools and structured output through the official `openai` client against a live
server over the real LocalEngine (the `demo` model on OpenVINO): whatever the
weights say, a forced call's arguments and a json_schema answer parse and validate,
streamed deltas put together give the same answer, and an agent framework from
PyPI runs a tool loop to its end."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Literal

import jsonschema
import openai
import pytest
from pydantic import Field
from schema_helpers import bounded_schemas


SCHEMAS = bounded_schemas(20, seed=11)
ASK = [{"role": "user", "content": "What is the weather in Oslo? Answer in JSON."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome", "Lima"]},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                           "parameters": CLOCK}}]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": CLOCK}


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_json_schema_answers_always_validate(demo_client):
    """20 generated schemas, greedy and sampled: every answer is complete, parses and validates."""
    for i, schema in enumerate(SCHEMAS):
        kw = {"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "seed": i}
        out = demo_client.chat.completions.create(model="demo", messages=ASK, response_format=_schema_format(schema),
                                             max_tokens=300, **kw)
        choice = out.choices[0]
        assert choice.finish_reason == "stop", (i, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_answers_are_an_object_or_say_they_were_cut(demo_client):
    out = demo_client.chat.completions.create(model="demo", messages=ASK, response_format={"type": "json_object"},
                                         max_tokens=40, temperature=0)
    choice = out.choices[0]
    assert choice.message.content.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # the model wrote on past 40 tokens: an unfinished object, said honestly
        assert choice.finish_reason == "length" and out.usage.completion_tokens == 40


def test_an_unbounded_string_cut_by_max_tokens_says_length(demo_client):
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"],
              "additionalProperties": False}
    out = demo_client.chat.completions.create(model="demo", messages=ASK, response_format=_schema_format(schema),
                                         max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.content.startswith('{"story": "')


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_call_comes_back_as_tool_calls_with_valid_arguments(demo_client, tool_choice):
    for seed in range(4):
        out = demo_client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                             max_tokens=100, temperature=1.0, seed=seed)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        if isinstance(tool_choice, dict):
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"


def test_streamed_call_deltas_put_together_give_the_same_call(demo_client):
    kw = dict(model="demo", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=100, temperature=0)
    whole = demo_client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    name, args, ids, reasons, chunks = None, "", set(), [], 0
    for chunk in demo_client.chat.completions.create(stream=True, **kw):
        choice = chunk.choices[0]
        reasons.append(choice.finish_reason)
        for d in choice.delta.tool_calls or ():
            chunks += 1
            assert d.index == 0
            ids |= {d.id} if d.id else set()
            name = d.function.name or name
            args += d.function.arguments or ""
    assert (name, args) == (whole.function.name, whole.function.arguments)
    assert len(ids) == 1 and chunks > 2  # the arguments came in pieces, as they were written
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}


def test_a_forced_call_cut_by_max_tokens_says_length(demo_client):
    """Cut before its name is complete: no call; cut in its arguments: the call with what was written."""
    named = 0
    for n in (3, 14, 18):
        out = demo_client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, max_tokens=n, temperature=0,
                                             tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = out.choices[0]
        assert choice.finish_reason == "length" and out.usage.completion_tokens == n
        assert not choice.message.content  # the call's text is never shown as prose
        for call in choice.message.tool_calls or ():
            named += 1
            assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
            with pytest.raises(json.JSONDecodeError):  # unfinished, as written
                json.loads(call.function.arguments)
    assert named >= 1


def test_a_conversation_with_earlier_calls_and_results_is_taken(demo_client, demo_server):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees."}]
    out = demo_client.chat.completions.create(model="demo", messages=history, tools=TOOLS, max_tokens=4, temperature=0)
    shorter = demo_client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, max_tokens=4, temperature=0)
    assert out.usage.prompt_tokens > shorter.usage.prompt_tokens + 20  # the call and its result were read
    assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": _schema_format({"type": "object", "properties": {"d": {"type": "string",
                                                                               "format": "no-such"}}})},
     "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, None),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, None),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
])
def test_a_structure_the_server_cannot_hold_is_a_400(demo_client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        demo_client.chat.completions.create(model="demo", messages=ASK, max_tokens=4, **body)
    assert e.value.status_code == 400
    if param is not None:
        assert e.value.body["param"] == param


def test_an_agent_framework_runs_a_tool_loop_to_its_end(demo_server):
    """openai-agents (PyPI) over the Chat Completions API: the first turn must call the
    tool (tool_choice required), the tool runs with arguments that validate, its result
    goes back as a tool message, the next turn (tool_choice reset to auto) answers."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # no trace upload to the internet
    calls: list[dict] = []

    @function_tool
    def get_weather(city: Literal["Oslo", "Rome"], days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """Weather for a city over some days."""  # bounded arguments: the grammar alone makes them end
        calls.append({"city": city, "days": days})
        return f"Sunny in {city} for {days} days."

    model = OpenAIChatCompletionsModel(
        model="demo", openai_client=openai.AsyncOpenAI(base_url=f"{demo_server.url}/v1", api_key="x", max_retries=0))
    agent = Agent(name="forecaster", instructions="Use the tool, then answer.", tools=[get_weather], model=model,
                  model_settings=ModelSettings(tool_choice="required", max_tokens=48, temperature=0))
    result = asyncio.run(Runner.run(agent, "Weather in Oslo for two days?", max_turns=6))
    assert len(calls) >= 1 and all(c["city"] in ("Oslo", "Rome") and 1 <= c["days"] <= 7 for c in calls)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, str)
