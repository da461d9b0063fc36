"""What an engine's final TokenEvent reads as in OpenAI's answers, whole or streamed:
usage, finish_reason, whether it refused the request itself (a 400) and OpenAI's
code for that; and the compact JSON the SSE chunks are written in.
"""

from __future__ import annotations

import json
from typing import Any

from engine.protocol.messages import CLIENT_ERROR_CODES, TokenEvent


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def openai_usage(final: TokenEvent | None) -> dict[str, Any]:
    p = final.usage.prompt_tokens if final and final.usage else 0
    c = final.usage.completion_tokens if final and final.usage else 0
    cached = final.usage.cached_tokens if final and final.usage else 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


def refused_prompt(final: TokenEvent) -> bool:
    """An error about the request itself (a client error, 400), by the event's code: the
    prompt does not fit the context or is empty, its grammar does not compile, ... (every
    engine refuses those at admission, before any token). Never by the error's words."""
    no_tokens = final.usage is None or final.usage.completion_tokens == 0
    return no_tokens and final.error_code in CLIENT_ERROR_CODES


def openai_code(final: TokenEvent) -> str | None:
    """OpenAI's error code for a refused request (context_length_exceeded is the one it names)."""
    return "context_length_exceeded" if final.error_code == "context_length_exceeded" else None


def openai_finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"  # "cancelled" ends like a stop
