"""The grammar held over an answer (engine/runtime/constraint.py), driven by random
logits on the demo tokenizer: whatever the model would say, the tokens picked spell
an answer that parses and validates, and the answer ends when the grammar does."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from schema_helpers import bounded_schemas

from engine.protocol import ChatMessage, GenerateRequest, ToolSpec
from engine.runtime import chat, tool_format
from engine.runtime.constraint import Constraint, GrammarError, check_grammar, for_request, grammar_for
from engine.runtime.tool_format import HERMES, MISTRAL

SCHEMAS = bounded_schemas(20, seed=7)
ASK = (ChatMessage("user", "Answer."),)


@pytest.fixture(scope="module")
def tokenizer(demo_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_dir("demo"))


def _drive(constraint: Constraint, width: int, seed: int, limit: int = 400) -> list[int]:
    """Pick greedily from random logits [width] under the grammar until it is complete."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while not constraint.complete:
        assert len(out) < limit, "the grammar did not end"
        logits = rng.standard_normal(width).astype(np.float32) * 4
        token = int(np.argmax(constraint.masked(logits)))
        constraint.advance(token)
        out.append(token)
    return out


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_any_logits_give_an_answer_that_validates(tokenizer, i):
    req = GenerateRequest("r", messages=ASK, json_schema=json.dumps(SCHEMAS[i]))
    for seed in range(3):
        c = for_request(req, tokenizer, frozenset({tokenizer.eos_token_id}), HERMES)
        text = tokenizer.decode(_drive(c, len(tokenizer), seed), skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMAS[i])
        assert "\n" not in text and "  " not in text  # no free whitespace to run on


def test_padding_columns_of_the_head_are_never_picked(tokenizer):
    req = GenerateRequest("r", messages=ASK, json_schema=json.dumps(SCHEMAS[0]))
    c = for_request(req, tokenizer, frozenset({tokenizer.eos_token_id}), HERMES)
    logits = np.zeros(len(tokenizer) + 64, dtype=np.float32)
    logits[len(tokenizer):] = 1e9  # a head wider than the vocabulary, its padding loud
    masked = c.masked(logits)
    assert np.all(np.isneginf(masked[len(tokenizer):])) and logits[-1] == 1e9  # a copy: the row is untouched


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL])
@pytest.mark.parametrize("forced", [None, "b"])
def test_a_forced_call_is_one_of_the_tools_with_valid_arguments(tokenizer, fmt, forced):
    tools = (ToolSpec("a", "", json.dumps(SCHEMAS[1])), ToolSpec("b", "", json.dumps(SCHEMAS[2])))
    req = GenerateRequest("r", messages=ASK, tools=tools, tool_choice="required", forced_tool=forced)
    names = set()
    for seed in range(6):
        c = for_request(req, tokenizer, frozenset({tokenizer.eos_token_id}), fmt)
        text = tokenizer.decode(_drive(c, len(tokenizer), seed), skip_special_tokens=True)
        name = next(t.name for t in tools if text.startswith(fmt.head(t.name)))
        assert text.endswith(fmt.tail)
        args = json.loads(text[len(fmt.head(name)):-len(fmt.tail)])
        jsonschema.validate(args, json.loads(tools[0 if name == "a" else 1].parameters))
        names.add(name)
    assert names == ({"b"} if forced else names) and (forced or names <= {"a", "b"})


def test_free_answers_have_no_grammar(tokenizer):
    for req in (GenerateRequest("r", messages=ASK),
                GenerateRequest("r", messages=ASK, tools=(ToolSpec("a"),)),  # auto: the model chooses
                GenerateRequest("r", messages=ASK, tools=(ToolSpec("a"),), tool_choice="none")):
        assert grammar_for(req, HERMES) is None


@pytest.mark.parametrize("schema", [{"type": "string", "format": "not-a-format"},
                                    {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}])
def test_a_schema_the_compiler_refuses_is_one_grammar_error(schema):
    req = GenerateRequest("r", messages=ASK, json_schema=json.dumps({"type": "object", "properties": {"x": schema}}))
    with pytest.raises(GrammarError) as e:
        check_grammar(grammar_for(req, HERMES))
    assert "\n" not in str(e.value)


# -- the prompt side: tools in, the call's opening at the end -----------------------------
def test_a_forced_call_prompt_ends_with_the_call_opening(tokenizer):
    tools = (ToolSpec("get_weather", "the weather", json.dumps(SCHEMAS[1])),)
    free = chat.request_ids(tokenizer, GenerateRequest("r", messages=ASK, tools=tools))
    forced = chat.request_ids(tokenizer, GenerateRequest("r", messages=ASK, tools=tools, tool_choice="required"))
    opening = tokenizer("<tool_call>\n", add_special_tokens=False)["input_ids"]
    assert forced == free + opening
    text = tokenizer.decode(free)
    assert "get_weather" in text and "the weather" in text and "<tool_call>" in text  # offered in the system turn
    plain = chat.request_ids(tokenizer, GenerateRequest("r", messages=ASK, tools=tools, tool_choice="none"))
    assert "get_weather" not in tokenizer.decode(plain)


NATIVE = ("{% if tools %}TOOLS={{ tools | map(attribute='function') | map(attribute='name') | join(',') }};{% endif %}"
          "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
          "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
          "{% endfor %}[assistant]")


def test_a_template_that_renders_tools_gets_them_and_the_history_in_openai_shape(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", NATIVE)
    history = (ChatMessage("user", "Weather?"),
               ChatMessage("assistant", "", tool_calls=(tool_format.ToolCall("c1", "get_weather", '{"city": "Oslo"}'),)),
               ChatMessage("tool", "sunny", tool_call_id="c1"))
    ids = chat.request_ids(tokenizer, GenerateRequest("r", messages=history, tools=(ToolSpec("get_weather"),)))
    assert tokenizer.decode(ids) == ('TOOLS=get_weather;[user]Weather?[assistant]CALL get_weather {"city": "Oslo"}'
                                     "[tool]sunny[assistant]")


def test_a_template_without_tools_gets_the_history_as_text(tokenizer):
    history = (ChatMessage("user", "Weather?"),
               ChatMessage("assistant", "", tool_calls=(tool_format.ToolCall("c1", "get_weather", '{"city": "Oslo"}'),)),
               ChatMessage("tool", "sunny", tool_call_id="c1"))
    text = tokenizer.decode(chat.request_ids(tokenizer, GenerateRequest("r", messages=history)))
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            "</tool_call><|im_end|>") in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
