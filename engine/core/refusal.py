"""A request field its engine cannot honour, named so the API answers 400 with it.

Every engine says which fields it cannot honour in EngineInfo.unsupported; engine_refusal
finds the first one a GenerateRequest asks for. Pure; the HTTP layer (engine/serve/fields.py)
adds the OpenAI fields no engine implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

UNSUPPORTED = "unsupported_parameter"  # the field is not implemented at all
UNSUPPORTED_VALUE = "unsupported_value"  # the field is known; only its neutral value is implemented


@dataclass(frozen=True)
class Refusal:
    param: str  # the field's path, e.g. "tools" or "messages[2].name"
    code: str  # UNSUPPORTED or UNSUPPORTED_VALUE

    @property
    def message(self) -> str:
        if self.code == UNSUPPORTED_VALUE:
            return f"'{self.param}' is not supported with this value by Flotilla's API (leave it out)"
        return f"'{self.param}' is not a parameter Flotilla's API supports (leave it out)"


def engine_refusal(request: Any, unsupported: frozenset[str], chat: bool = True) -> Refusal | None:
    """The first field a request uses that its engine cannot honour (EngineInfo.unsupported
    names them as chat fields), or None. `request` is an engine GenerateRequest."""
    asked = []
    if request.sampling.logprobs:
        asked.append("top_logprobs")
    if request.sampling.logprobs is not None:
        asked.append("logprobs")
    if request.json_schema is not None:
        asked.append("response_format")
    elif request.constrained:
        asked.append("tool_choice")
    if request.speculative is not None and request.speculative.mode != "off":
        asked.append("speculative")
    for name in asked:
        if name in unsupported:
            shown = name if chat or name != "top_logprobs" else "logprobs"
            return Refusal(shown, UNSUPPORTED_VALUE)
    return None
