"""The API's side of tools and structured output: the request fields (tools,
tool_choice, response_format, tool messages) and the answer's shape (tool_calls,
streamed as deltas).

The engine renders the tools into the prompt and holds a forced call or a JSON schema
to a grammar (engine/runtime/chat.py, engine/runtime/constraint.py); here the text it
streams becomes OpenAI's `tool_calls`, read in the model's call format
(engine/runtime/tool_format.py): a forced call piece by piece (the name, then the
arguments as they come), a free ("auto") answer's calls once the answer is complete.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.protocol.structured import ToolCall, ToolSpec
from engine.runtime.constraint import ANY_OBJECT
from engine.runtime.tool_format import AutoCallReader, ForcedCallReader, ToolFormat


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionIn(_Strict):
    name: str = Field(description="letters, digits, '_' and '-', at most 64")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="JSON schema of the arguments")
    strict: bool | None = Field(default=None, description="accepted; the arguments always follow the schema "
                                                          "when the call is forced")


class ToolIn(_Strict):
    type: Literal["function"]
    function: FunctionIn


class _FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _FunctionName


class FunctionCallIn(_Strict):
    name: str
    arguments: str = Field(description="JSON text")


class ToolCallIn(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class JsonSchemaIn(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = Field(default=None, description="accepted; the answer always follows the schema")


class ResponseFormatIn(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaIn | None = None


ToolChoiceIn = Literal["auto", "none", "required"] | NamedToolChoice


def structure(tools: list[ToolIn] | None, tool_choice: ToolChoiceIn | None,
              response_format: ResponseFormatIn | None) -> tuple[dict[str, Any], str | None]:
    """GenerateRequest's structure fields from the body, and the first field that is
    wrong (as a (fields, param) pair: param None when all is well)."""
    specs = tuple(ToolSpec(t.function.name, t.function.description or "",
                           json.dumps(t.function.parameters or {"type": "object"}))
                  for t in tools or ())
    choice, forced = "auto", None
    if isinstance(tool_choice, NamedToolChoice):
        choice, forced = "required", tool_choice.function.name
        if forced not in {t.name for t in specs}:
            return {}, "tool_choice"
    elif tool_choice is not None:
        choice = tool_choice
    if not specs:
        choice = "none" if choice in ("auto", "none") else choice
    schema = None
    if response_format is not None and response_format.type == "json_object":
        schema = ANY_OBJECT
    elif response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None:
            return {}, "response_format.json_schema"
        schema = json.dumps(response_format.json_schema.schema_ or {})
    return {"tools": specs, "tool_choice": choice, "forced_tool": forced, "json_schema": schema}, None


def message_calls(calls: list[ToolCallIn] | None) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in calls or ())


def call_out(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class ChatShaper:
    """Turns the text of a chat answer into content and tool_calls, streamed or whole.

    feed(text) -> the deltas to send now (dicts of OpenAI's chat delta); finish(reason)
    -> the last deltas and the finish_reason ("tool_calls" when the answer is calls)."""

    def __init__(self, tools: tuple[ToolSpec, ...], tool_choice: str, fmt: ToolFormat) -> None:
        self.forced = ForcedCallReader(fmt, tools) if tool_choice == "required" and tools else None
        self.auto = AutoCallReader(fmt, tools) if tool_choice == "auto" and tools else None
        self.content: list[str] = []
        self.calls: list[dict[str, Any]] = []  # the calls as sent (id, name, arguments so far)

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if self.forced is not None:
            named, args = self.forced.feed(text)
            out = []
            if named is not None:
                self.calls.append({"id": self.forced.id, "type": "function",
                                   "function": {"name": named, "arguments": ""}})
                out.append({"tool_calls": [{"index": 0, "id": self.forced.id, "type": "function",
                                            "function": {"name": named, "arguments": ""}}]})
            if args:
                out.append(self._args(args))
            return out
        if self.auto is not None:
            text = self.auto.feed(text)
        return self._text(text)

    def finish(self, reason: str) -> tuple[list[dict[str, Any]], str]:
        """reason: the engine's finish_reason ("stop", "length", "cancelled")."""
        base = "length" if reason == "length" else "stop"
        if self.forced is not None:
            rest = self.forced.finish(complete=reason == "stop")
            out = [self._args(rest)] if rest and self.calls else []
            return out, ("tool_calls" if self.calls and base == "stop" else base)
        if self.auto is None:
            return [], base
        text, calls = self.auto.finish()
        out = self._text(text)
        for call in calls:
            self.calls.append(call_out(call))
            out.append({"tool_calls": [{"index": len(self.calls) - 1, **call_out(call)}]})
        return out, ("tool_calls" if calls else base)

    def message(self) -> dict[str, Any]:
        """The whole assistant message (non-streamed answers)."""
        content = "".join(self.content)
        msg: dict[str, Any] = {"role": "assistant", "content": content if content or not self.calls else None}
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg

    def _text(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self.content.append(text)
        return [{"content": text}]

    def _args(self, args: str) -> dict[str, Any]:
        self.calls[0]["function"]["arguments"] += args
        return {"tool_calls": [{"index": 0, "function": {"arguments": args}}]}

