"""Reading tool calls back out of a model's text, in the three call formats, whole and
streamed in arbitrary pieces (engine/runtime/tool_format.py, engine/serve/tool_calls.py)."""

from __future__ import annotations

import json
import random

import pytest

from engine.protocol.structured import ToolCall, ToolSpec
from engine.runtime import tool_format
from engine.runtime.tool_format import HERMES, LLAMA3, MISTRAL, AutoCallReader, ForcedCallReader, parse_calls
from engine.serve.tool_calls import ChatShaper

TOOLS = (ToolSpec("get_weather", "", '{"type": "object"}'), ToolSpec("search", "", '{"type": "object"}'))


def _pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 5)
        out.append(text[i:i + n])
        i += n
    return out


@pytest.mark.parametrize("template,name", [
    ("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}", "hermes"),
    ("{%- if tools %}<tools>{{ tools | tojson }}</tools> <tool_call>{% endif %}", "hermes"),
    ("{{- '<|python_tag|>' }}{% if m.role == 'ipython' %}", "llama3"),
    ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", "mistral"),
    (None, "hermes"),
])
def test_the_format_is_read_off_the_template(template, name):
    assert tool_format.detect(template).name == name


@pytest.mark.parametrize("fmt,text", [
    (HERMES, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    (LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'),
])
def test_a_call_in_each_format_is_read(fmt, text):
    content, calls = parse_calls(fmt, text, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert content == ("Let me look." if fmt is HERMES else "")


def test_several_hermes_calls_and_their_ids():
    text = ('<tool_call>\n{"name": "search", "arguments": {"q": "a"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>')
    content, calls = parse_calls(HERMES, text, TOOLS)
    assert content == "" and [c.name for c in calls] == ["search", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "Rome"}  # arguments written as a JSON string
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("fmt,text", [
    (HERMES, '<tool_call>\n{"name": "unknown_tool", "arguments": {}}\n</tool_call>'),
    (HERMES, '<tool_call>\n{"name": "search", "arguments": {broken\n</tool_call>'),
    (LLAMA3, '{"city": "Oslo"}'),
    (LLAMA3, "Plain words."),
    (MISTRAL, '[{"name": "search", "arguments": {}}]'),  # no [TOOL_CALLS] marker
])
def test_text_that_only_looks_like_a_call_stays_content(fmt, text):
    assert parse_calls(fmt, text, TOOLS) == (text, ())


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL])
@pytest.mark.parametrize("seed", range(5))
def test_a_forced_call_streams_to_the_same_arguments(fmt, seed):
    args = '{"city": "Paris", "days": [1, 2], "note": "a}b"}'
    text = fmt.head("get_weather") + args + fmt.tail
    reader = ForcedCallReader(fmt, TOOLS)
    names, got = [], ""
    for piece in _pieces(text, seed):
        name, new = reader.feed(piece)
        names += [name] if name else []
        got += new
    got += reader.finish(complete=True)
    assert names == ["get_weather"] and got == args == reader.arguments


def test_a_forced_call_cut_short_keeps_what_was_written():
    reader = ForcedCallReader(HERMES, TOOLS)
    name, sent = reader.feed(HERMES.head("search") + '{"q": "unfinish')
    rest = reader.finish(complete=False)  # max_tokens: the tail was never written; nothing is dropped
    assert name == "search" and sent + rest == '{"q": "unfinish' == reader.arguments


@pytest.mark.parametrize("fmt,text,content", [
    (HERMES, 'Sure.\n<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>', "Sure.\n"),
    (HERMES, "No call here, just < and <tool and text.", "No call here, just < and <tool and text."),
    (LLAMA3, '{"name": "search", "parameters": {"q": "x"}}', ""),
    (LLAMA3, "Just words {not a call}", "Just words {not a call}"),
    (MISTRAL, '[TOOL_CALLS][{"name": "search", "arguments": {"q": "x"}}]', ""),
])
@pytest.mark.parametrize("seed", range(4))
def test_an_auto_answer_streams_its_content_and_then_its_calls(fmt, text, content, seed):
    reader = AutoCallReader(fmt, TOOLS)
    streamed = "".join(reader.feed(p) for p in _pieces(text, seed))
    rest, calls = reader.finish()
    assert (streamed + rest).strip() == content.strip()
    assert [c.name for c in calls] == (["search"] if "search" in text else [])


@pytest.mark.parametrize("choice", ["required", "auto"])
@pytest.mark.parametrize("seed", range(3))
def test_the_chat_shaper_streams_what_it_answers_whole(choice, seed):
    args = '{"q": "x"}'
    text = (HERMES.head("search") + args + HERMES.tail if choice == "required"
            else "<tool_call>\n" + HERMES.head("search") + args + HERMES.tail + "\n</tool_call>")
    whole = ChatShaper(TOOLS, choice, HERMES)
    whole.feed(text)
    _, reason = whole.finish("stop")
    streamed, deltas = ChatShaper(TOOLS, choice, HERMES), []
    for p in _pieces(text, seed):
        deltas += streamed.feed(p)
    tail, reason2 = streamed.finish("stop")
    deltas += tail
    assert reason == reason2 == "tool_calls"
    call = whole.message()["tool_calls"][0]
    assert whole.message()["content"] is None and call["function"] == {"name": "search", "arguments": args}
    # the deltas, put together as a client does, give the same call
    parts = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert parts[0]["id"] == streamed.calls[0]["id"] and parts[0]["function"]["name"] == "search"
    assert "".join(p["function"].get("arguments", "") for p in parts) == args


def test_earlier_calls_are_written_back_in_the_models_format():
    call = ToolCall("c1", "search", '{"q": "x"}')
    assert tool_format.call_text(HERMES, call) == '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'
    assert tool_format.call_text(MISTRAL, call) == '[TOOL_CALLS][{"name": "search", "arguments": {"q": "x"}}]'
    assert tool_format.call_text(LLAMA3, call) == '{"name": "search", "parameters": {"q": "x"}}'
