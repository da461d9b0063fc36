"""Which OpenAI request fields the API takes without acting on them, and which it refuses.

A field the engines do not implement is a 400 naming it (code "unsupported_parameter"),
never silently dropped: an app that asks for tool calls, a JSON schema or logprobs and
gets prose back breaks in ways its user cannot see. The one exception is a field set to
the value that asks for nothing (functions=[], frequency_penalty 0,
...), which clients send by default, and bookkeeping that does
not change the answer (user, metadata).

Pure: a dict of extra fields in, the first refusal (or None) out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from engine.core.refusal import UNSUPPORTED, UNSUPPORTED_VALUE, Refusal



def _absent(v: Any) -> bool:
    return v is None


def _zero(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0)


def _false(v: Any) -> bool:
    return v is None or v is False


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


def _anything(_v: Any) -> bool:
    return True


def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or v in values


def _text_modalities(v: Any) -> bool:
    return v is None or v == ["text"]


# field -> "this value asks for nothing we do not do"
_COMMON: dict[str, Callable[[Any], bool]] = {
    "frequency_penalty": _zero,
    "presence_penalty": _zero,
    "logit_bias": _empty,
    "user": _anything,  # an end-user id for abuse tracking: it does not change the answer
    "metadata": _anything,  # tags for stored completions: the answer is the same
    "store": _false,
    "service_tier": _one_of("auto", "default"),
}

CHAT_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    **_COMMON,
    "functions": _empty,  # the deprecated form of tools: ask with tools instead
    "function_call": _one_of("none"),
    "modalities": _text_modalities,
    "reasoning_effort": _absent,
    "prediction": _absent,
    "audio": _absent,
    "web_search_options": _absent,
}

COMPLETION_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    **_COMMON,
    "echo": _false,
    "suffix": _one_of(""),
    "best_of": _one_of(1),
}

# assistant message fields a client echoes back from an earlier answer
MESSAGE_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "refusal": _absent,
    "function_call": _absent,
    "audio": _absent,
    "annotations": _empty,
}

STREAM_OPTIONS_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "include_obfuscation": _anything,  # padding of chunks against side channels: plain chunks are fine
}


def refusal(extra: Mapping[str, Any] | None, neutral: Mapping[str, Callable[[Any], bool]],
            prefix: str = "") -> Refusal | None:
    """The first field of `extra` (the fields the schema does not declare) we would have to ignore."""
    for name in sorted(extra or {}):
        ok = neutral.get(name)
        if ok is None:
            return Refusal(prefix + name, UNSUPPORTED)
        if not ok(extra[name]):
            return Refusal(prefix + name, UNSUPPORTED_VALUE)
    return None
