"""The request bodies of the OpenAI-compatible API (what the OpenAI clients send):
pydantic models, strict on types, lenient on extra fields (engine/serve/fields.py
decides which of those are refused).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.protocol.messages import MAX_TOP_LOGPROBS
from engine.serve.tool_calls import ResponseFormatIn, ToolCallIn, ToolChoiceIn, ToolIn


class _Lenient(BaseModel):
    # extra="allow": undeclared fields are kept in model_extra, where fields.py decides
    # which of them are refused (most) or harmless at their value (module doc);
    # strict: a wrong JSON type ("0.5" for a number, 1.0 for an integer) is a 400.
    model_config = ConfigDict(extra="allow", strict=True)


class ContentPart(_Lenient):
    type: str = Field(description='only "text" parts are supported')
    text: str | None = None


class ChatMessageIn(_Lenient):
    role: str = Field(description='"system", "user", "assistant", "tool" ("developer" = "system")')
    content: str | list[ContentPart] | None = Field(default=None, description="text or text parts")
    tool_calls: list[ToolCallIn] | None = Field(default=None, description="assistant: the calls it made")
    tool_call_id: str | None = Field(default=None, description="tool: the call this result answers")


class SpeculativeIn(BaseModel):
    """extension: speculative decoding of this request (docs/speculative.md)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    mode: Literal["off", "draft", "lookup"] = Field(description="draft model, prompt lookup, or off")
    k: int | None = Field(default=None, description="drafted tokens per step (1..16; start value when adaptive)")
    adaptive: bool = Field(default=True, description="adapt k to the running acceptance rate")


class StreamOptions(_Lenient):
    include_usage: bool = Field(default=False, description="send a last chunk with usage")


class RequestBody(_Lenient):
    # the fields both endpoints take (chat and text completions)
    model: str = Field(description="a model id from GET /v1/models")
    max_tokens: int | None = Field(default=None, description="new tokens at most")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float | None = Field(default=None, description="nucleus mass kept, (0, 1]")
    n: int | None = Field(default=None, description="choices per request; only 1 is supported")
    seed: int | None = Field(default=None, description="fixes the sampling RNG")
    stop: str | list[str] | None = Field(default=None, description="stop strings")
    stream: bool = Field(default=False, description="answer with Server-Sent Events")
    stream_options: StreamOptions | None = None
    top_k: int | None = Field(default=None, description="extension: keep the k likeliest tokens (0 = off)")
    repetition_penalty: float | None = Field(default=None, description="extension: >1 discourages repeats")
    ignore_eos: bool | None = Field(default=None, description="extension: go on past end-of-sequence tokens "
                                                              "until max_tokens or a stop string")
    speculative: SpeculativeIn | Literal["off", "draft", "lookup"] | None = Field(
        default=None, description="extension: speculative decoding, e.g. {\"mode\": \"lookup\", \"k\": 4}")


class ChatCompletionRequest(RequestBody):
    """POST /v1/chat/completions"""

    messages: list[ChatMessageIn] = Field(min_length=1, description="the conversation so far")
    max_completion_tokens: int | None = Field(default=None,
                                              description="new tokens at most (wins over max_tokens)")
    logprobs: bool | None = Field(default=None, description="each answer token's logprob (the model's raw "
                                                            "distribution, before temperature and top-k/p)")
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS,
                                     description="with logprobs: the likeliest tokens at each position")
    tools: list[ToolIn] | None = Field(default=None, description="functions the model may call")
    tool_choice: ToolChoiceIn | None = Field(
        default=None, description='"auto" (default with tools), "none", "required" or a named function; '
                                  "required and named calls are forced by a grammar")
    parallel_tool_calls: bool | None = Field(
        default=None, description="accepted; a forced call is one call, an auto answer may hold several")
    response_format: ResponseFormatIn | None = Field(
        default=None, description='{"type": "text" | "json_object" | "json_schema"}: JSON answers are held '
                                  "to the schema by a grammar")


class CompletionRequest(RequestBody):
    """POST /v1/completions"""

    prompt: str | list[str] = Field(description="raw text, no chat template (a list must hold one string)")
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS,
                                 description="each answer token's logprob and this many likeliest alternatives")
