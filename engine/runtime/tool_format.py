"""How a model writes tool calls, and how we read them back out of its text.

Chat templates teach models one of a few call formats; we support the three the
popular families use:

    hermes   Qwen 2.5/3, Hermes, ChatML models:  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    llama3   Llama 3.1+:                          {"name": ..., "parameters": {...}}
    mistral  Mistral / Mixtral:                   [TOOL_CALLS][{"name": ..., "arguments": {...}}]

The format is read off the chat template's text (detect). A forced call
(tool_choice "required" or a named tool) is written in that format by a grammar
(engine/runtime/constraint.py): the prompt ends with the format's opening text and the
grammar allows exactly `{"name": "<tool>", "<args key>": <arguments>}` (a list of one
for mistral), so the arguments always parse. With tool_choice "auto" the model writes
freely and parse_calls finds whatever calls it made.

Pure: text in, text and ToolCall values out; no tokenizer, no llguidance.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from engine.protocol.structured import ToolCall, ToolSpec, is_tool_name

# JSON written by the grammar: one space after ':' and ',' and nowhere else, so the
# text is predictable enough to stream arguments as they come (ForcedCallReader).
KEY_SEPARATOR, ITEM_SEPARATOR = ": ", ", "


@dataclass(frozen=True)
class ToolFormat:
    name: str  # "hermes" | "llama3" | "mistral"
    call_open: str  # text before a call's JSON (the prompt ends with it for a forced call)
    call_close: str  # text after it ("" when the JSON itself ends the call)
    args_key: str  # "arguments" | "parameters"
    listed: bool  # mistral: the calls are a JSON list

    def head(self, tool: str) -> str:
        """A forced call's text up to its arguments."""
        return ("[" if self.listed else "") + "{" + json.dumps("name") + KEY_SEPARATOR + json.dumps(tool) \
            + ITEM_SEPARATOR + json.dumps(self.args_key) + KEY_SEPARATOR

    @property
    def tail(self) -> str:
        """A forced call's text after its arguments."""
        return "}]" if self.listed else "}"


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "arguments", listed=False)
LLAMA3 = ToolFormat("llama3", "", "", "parameters", listed=False)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", "arguments", listed=True)
FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL)}


def detect(chat_template: str | None) -> ToolFormat:
    """The call format a chat template teaches; Hermes when it shows none (the
    ChatML fallback template, base models)."""
    t = chat_template or ""
    if "[TOOL_CALLS]" in t:
        return MISTRAL
    if "<tool_call>" in t:
        return HERMES
    if "<|python_tag|>" in t or "ipython" in t:
        return LLAMA3
    return HERMES


def of(tokenizer: object) -> ToolFormat:
    """The call format of a tokenizer's chat template."""
    return detect(getattr(tokenizer, "chat_template", None))


def template_renders_tools(chat_template: str | None) -> bool:
    """The template itself shows the tools to the model (it reads the `tools` variable)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template or "") is not None


def openai_tools(tools: tuple[ToolSpec, ...]) -> list[dict]:
    """The tools as chat templates expect them (OpenAI's form, parameters parsed)."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": json.loads(t.parameters)}} for t in tools]


def tools_preamble(fmt: ToolFormat, tools: tuple[ToolSpec, ...]) -> str:
    """A system text offering the tools, for a template that does not render them."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in openai_tools(tools))
    example = fmt.call_open + ("[" if fmt.listed else "") + '{"name": <function-name>, "' + fmt.args_key \
        + '": <args-json-object>}' + ("]" if fmt.listed else "") + fmt.call_close
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"The functions you can call:\n<tools>\n{listing}\n</tools>\n\n"
            f"To call a function, answer with:\n{example}")


def call_text(fmt: ToolFormat, call: ToolCall) -> str:
    """An earlier call written back into the conversation in the model's format."""
    return fmt.call_open + fmt.head(call.name) + (call.arguments or "{}") + fmt.tail + fmt.call_close


def tool_result_text(content: str) -> str:
    """A tool's result, for a template that has no tool role."""
    return f"<tool_response>\n{content}\n</tool_response>"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# -- reading calls back ----------------------------------------------------------------
def _call(obj: object, fmt: ToolFormat, tools: dict[str, ToolSpec]) -> ToolCall | None:
    """A ToolCall from one parsed JSON object, or None when it is not a call of a known tool."""
    if not isinstance(obj, dict) or not is_tool_name(obj.get("name")) or obj["name"] not in tools:
        return None
    args = obj.get(fmt.args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def parse_calls(fmt: ToolFormat, text: str, tools: tuple[ToolSpec, ...]) -> tuple[str, tuple[ToolCall, ...]]:
    """(content, calls) from a freely written answer (tool_choice "auto"). Text that
    only looks like a call (unknown tool, broken JSON) stays in the content."""
    known = {t.name: t for t in tools}
    calls: list[ToolCall] = []
    if fmt is HERMES:
        content = text
        for m in list(re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S)):
            try:
                call = _call(json.loads(m.group(1)), fmt, known)
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
                content = content.replace(m.group(0), "", 1)
        return (content.strip() if calls else content), tuple(calls)
    body = text.strip()
    if fmt is MISTRAL:
        if not body.startswith("[TOOL_CALLS]"):
            return text, ()
        body = body[len("[TOOL_CALLS]"):]
    elif body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):]
    try:
        obj = json.loads(body)
    except ValueError:
        return text, ()
    objs = obj if isinstance(obj, list) else [obj]
    found = [_call(o, fmt, known) for o in objs]
    if not found or any(c is None for c in found):
        return text, ()
    return "", tuple(c for c in found if c is not None)


class ForcedCallReader:
    """Streams a forced call's pieces as its text comes: the tool's name once the
    head is complete, then the arguments' text (holding back what may be the tail).
    The grammar wrote the text, so it has exactly the shape of ToolFormat.head/tail."""

    def __init__(self, fmt: ToolFormat, tools: tuple[ToolSpec, ...]) -> None:
        self.fmt = fmt
        self.heads = {fmt.head(t.name): t.name for t in tools}
        self.text = ""
        self.name: str | None = None
        self.id = new_call_id()
        self._sent = 0  # argument characters handed out so far
        self._start = 0  # where the arguments begin in self.text

    def feed(self, piece: str) -> tuple[str | None, str]:
        """(the tool's name the first time it is known, else None; new argument text)."""
        self.text += piece
        named = None
        if self.name is None:
            for head, name in self.heads.items():
                if self.text.startswith(head):
                    self.name, self._start, named = name, len(head), name
                    break
            if self.name is None:
                return None, ""
        upto = max(self._start, len(self.text) - len(self.fmt.tail))
        new = self.text[self._start + self._sent:upto]
        self._sent += len(new)
        return named, new

    def finish(self, complete: bool) -> str:
        """The rest of the arguments: without the tail when the call completed, as written
        when it was cut off (max_tokens: the arguments are then unfinished JSON)."""
        if self.name is None:
            return ""
        end = len(self.text) - len(self.fmt.tail) if complete and self.text.endswith(self.fmt.tail) \
            else len(self.text)
        rest = self.text[self._start + self._sent:end]
        self._sent += len(rest)
        return rest

    @property
    def arguments(self) -> str:
        return self.text[self._start:self._start + self._sent]


class AutoCallReader:
    """Streams a freely written answer (tool_choice "auto") as content until the text
    may be starting a call; from there on it holds the text back, and at the end
    parse_calls decides what was a call and what is content."""

    def __init__(self, fmt: ToolFormat, tools: tuple[ToolSpec, ...]) -> None:
        self.fmt, self.tools = fmt, tools
        self.text = ""
        self._sent = 0  # content characters handed out
        self._holding = False  # a call may have begun: nothing more goes out before the end

    def _openers(self) -> tuple[str, ...]:
        if self.fmt is HERMES:
            return ("<tool_call>",)
        if self.fmt is MISTRAL:
            return ("[TOOL_CALLS]",)
        return ("{", "<|python_tag|>")

    def feed(self, piece: str) -> str:
        """Content that can go out now."""
        self.text += piece
        if self._holding:
            return ""
        rest = self.text[self._sent:]
        if self.fmt is HERMES:
            at = rest.find("<tool_call>")
            if at >= 0:
                self._holding = True
                out = rest[:at]
            else:  # keep back what may be the start of "<tool_call>"
                keep = next((k for k in range(min(len(rest), 10), 0, -1) if "<tool_call>".startswith(rest[-k:])), 0)
                out = rest[:len(rest) - keep]
        else:  # llama3 / mistral: a call is the whole answer, so only its start matters
            lead = self.text.lstrip()
            if not lead:
                return ""
            if any(lead.startswith(o) or o.startswith(lead) for o in self._openers()):
                self._holding = True
                return ""
            out = rest
        self._sent += len(out)
        return out

    def finish(self) -> tuple[str, tuple[ToolCall, ...]]:
        """(content not sent yet, the calls found)."""
        if not self._holding:
            out = self.text[self._sent:]
            self._sent = len(self.text)
            return out, ()
        held = self.text[self._sent:]  # from the possible call's start on
        content, calls = parse_calls(self.fmt, held, self.tools)
        return (content if calls else held), calls
