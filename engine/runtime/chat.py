"""Prompt ids for a request: the tokenizer's chat template for chat turns,
plain tokenizing for raw prompts.

A model without a chat template gets FALLBACK_TEMPLATE (ChatML:
`<|im_start|>role\\ncontent<|im_end|>\\n` per turn, then
`<|im_start|>assistant\\n`) unless the caller asks for a strict error.
Base models were not trained on any template, so their chat answers are only
as good as the model's guess; raw prompts are the better path for them.

Tools offered by a request go through the template when it renders them (it reads
`tools`); otherwise a system turn lists them and asks for calls in the format the
template shows (engine/runtime/tool_format.py). Earlier calls and tool results are
written the same way.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Iterable

from engine.protocol.messages import ChatMessage, GenerateRequest
from engine.protocol.structured import ToolSpec
from engine.runtime import tool_format

log = logging.getLogger(__name__)

FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The model has no chat template (and the fallback was not allowed)."""


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def request_ids(tokenizer: Any, request: GenerateRequest) -> list[int]:
    """The prompt ids of a request: its chat (with its tools) or its raw prompt. A forced
    tool call's prompt ends with the model's call opening (e.g. "<tool_call>\n"), so the
    grammar only has to hold the call itself."""
    if request.messages is None:
        return prompt_ids(tokenizer, request.prompt or "")
    ids = chat_ids(tokenizer, request.messages, tools=request.tools if request.tool_choice != "none" else ())
    if request.tool_choice == "required" and request.tools:
        opening = tool_format.of(tokenizer).call_open
        if opening:
            ids += _flat(tokenizer(opening, add_special_tokens=False)["input_ids"])
    return ids


def _turns(messages: Iterable[ChatMessage], native: bool, fmt: tool_format.ToolFormat) -> list[dict]:
    """Messages as a chat template reads them. A template that knows tools gets OpenAI's
    shapes (tool_calls, the tool role); one that does not gets them written as text in
    the model's call format (and tool results as a user turn)."""
    turns: list[dict] = []
    for m in messages:
        if native:
            turn: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.tool_calls:
                turn["tool_calls"] = [{"id": c.id, "type": "function",
                                       "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                                      for c in m.tool_calls]
            if m.tool_call_id is not None:
                turn["tool_call_id"] = m.tool_call_id
        elif m.role == "tool":
            turn = {"role": "user", "content": tool_format.tool_result_text(m.content)}
        else:
            calls = "\n".join(tool_format.call_text(fmt, c) for c in m.tool_calls)
            turn = {"role": m.role, "content": "\n".join(x for x in (m.content, calls) if x)}
        turns.append(turn)
    return turns


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)  # templates write them with tojson
    except ValueError:
        return text


def chat_ids(tokenizer: Any, messages: Iterable[ChatMessage], fallback: bool = True,
             tools: tuple[ToolSpec, ...] = ()) -> list[int]:
    """Token ids of the templated conversation, ending with the assistant's
    generation prompt (add_generation_prompt=True)."""
    own = getattr(tokenizer, "chat_template", None) if has_chat_template(tokenizer) else None
    fmt = tool_format.detect(own)
    native = tool_format.template_renders_tools(own)
    turns = _turns(messages, native, fmt)
    extra: dict[str, Any] = {}
    if tools and native:
        extra["tools"] = tool_format.openai_tools(tools)
    elif tools:  # offer them in the system turn, in the words and format the model would see
        preamble = tool_format.tools_preamble(fmt, tools)
        if turns and turns[0]["role"] == "system":
            turns[0] = {**turns[0], "content": turns[0]["content"] + "\n\n" + preamble}
        else:
            turns.insert(0, {"role": "system", "content": preamble})
    template = None
    if not has_chat_template(tokenizer):
        if not fallback:
            raise ChatTemplateError(
                "this model has no chat template; send a raw prompt instead, "
                "or allow the ChatML fallback template")
        log.warning("model has no chat template; using the ChatML fallback")
        template = FALLBACK_TEMPLATE
    out = tokenizer.apply_chat_template(turns, chat_template=template, add_generation_prompt=True,
                                        tokenize=True, return_dict=True, **extra)
    return _flat(out["input_ids"])


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Raw prompt: plain tokenizing with the tokenizer's special tokens (BOS...)."""
    return _flat(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def _flat(ids: Any) -> list[int]:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(t) for t in ids]
