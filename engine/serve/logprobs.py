"""Token logprobs in OpenAI's two shapes: chat's `choices[].logprobs.content` list and the
legacy completions' parallel arrays. The engine gives TokenLogprob values (the raw
next-token distribution, engine/runtime/sampling.py); this only lays them out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from engine.protocol.messages import TokenLogprob


class TopLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprobOut):
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(items: Sequence[TokenLogprob]) -> dict[str, Any]:
    """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], "refusal": None}"""
    return {"content": [{**_entry(t.text, t.logprob),
                         "top_logprobs": [_entry(s, v) for s, v in zip(t.top_texts, t.top_logprobs)]}
                        for t in items], "refusal": None}


def completion_logprobs(items: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """{"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}; offset is
    where the first token's text starts (characters of text sent before these tokens)."""
    offsets = []
    for t in items:
        offsets.append(offset)
        offset += len(t.text)
    return {"tokens": [t.text for t in items], "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [dict(zip(t.top_texts, t.top_logprobs)) for t in items],
            "text_offset": offsets}
