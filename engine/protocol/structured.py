"""What a request says about the shape of its answer: the tools the model may call,
whether (and which) it must call, and a JSON schema the answer must match.

The engine turns these into a prompt (the tools rendered by the model's chat template)
and a grammar that masks every token which would leave the shape
(engine/runtime/constraint.py), so a forced tool call's arguments and a json_schema
answer always parse and validate, whatever the weights.
"""

from __future__ import annotations

import json
import re
from typing import ClassVar, Literal, get_args

from engine.protocol._checks import is_text as _is_text
from engine.protocol._checks import require as _require
from engine.protocol.base import Message

ToolChoice = Literal["auto", "none", "required"]  # a forced call names its tool in forced_tool
TOOL_CHOICES: tuple[str, ...] = get_args(ToolChoice)
MAX_TOOLS = 128
MAX_SCHEMA_CHARS = 100_000  # one JSON schema, as text
MAX_TOOL_CALLS = 64  # tool calls in one assistant message
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


def _is_json_object(text: str) -> bool:
    if not _is_text(text, MAX_SCHEMA_CHARS, allow_empty=False):
        return False
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):  # RecursionError: a schema nested thousands deep
        return False


def is_tool_name(v: object) -> bool:
    return isinstance(v, str) and TOOL_NAME.match(v) is not None


class ToolSpec(Message):
    """A function the model may call (OpenAI's tools[i].function)."""

    KIND: ClassVar[str] = "tool_spec"
    name: str
    description: str = ""
    parameters: str = '{"type": "object"}'  # the arguments' JSON schema, as JSON text

    def __post_init__(self) -> None:
        _require(is_tool_name(self.name), "a tool name is 1..64 letters, digits, '_' or '-'")
        _require(_is_text(self.description, MAX_SCHEMA_CHARS), "a tool description is too long")
        _require(_is_json_object(self.parameters), f"tool {self.name}: parameters must be a JSON object")


class ToolCall(Message):
    """A call the model made (or made earlier, echoed back in the conversation)."""

    KIND: ClassVar[str] = "tool_call"
    id: str  # the caller's handle, answered by a "tool" message's tool_call_id
    name: str
    arguments: str  # JSON text, as the model wrote it

    def __post_init__(self) -> None:
        _require(_is_text(self.id, 128, allow_empty=False), "a tool call id is 1..128 characters")
        _require(is_tool_name(self.name), "a tool name is 1..64 letters, digits, '_' or '-'")
        _require(_is_text(self.arguments, MAX_SCHEMA_CHARS), "tool call arguments are too long")


def check_structure(tools: tuple[ToolSpec, ...], tool_choice: str, forced_tool: str | None,
                    json_schema: str | None) -> None:
    """The rules between a request's structure fields (GenerateRequest calls this)."""
    _require(len(tools) <= MAX_TOOLS, f"tools must be at most {MAX_TOOLS} ToolSpec values")
    names = [t.name for t in tools]
    _require(len(set(names)) == len(names), "two tools have the same name")
    _require(tool_choice in TOOL_CHOICES, f"tool_choice must be one of {TOOL_CHOICES}")
    _require(forced_tool is None or forced_tool in names, "the forced tool is not among the tools")
    _require(forced_tool is None or tool_choice == "required", "a forced tool goes with tool_choice 'required'")
    _require(tool_choice != "required" or tools, "tool_choice 'required' needs at least one tool")
    _require(json_schema is None or _is_json_object(json_schema), "json_schema must be a JSON object")
    # both would constrain the same answer: a call's arguments or a JSON document
    _require(json_schema is None or tool_choice != "required",
             "a required tool call and a JSON answer format do not go together")
