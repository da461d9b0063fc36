"""The answers of the OpenAI-compatible API as pydantic models, for the OpenAPI
document only (the handlers build plain dicts), with the error responses every
endpoint documents.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from engine.serve.logprobs import ChatLogprobs, CompletionLogprobs
from engine.serve.tool_calls import ToolCallIn


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    engine: str = Field(description="extension: which Flotilla engine answers")
    device: str = Field(description="extension: e.g. CPU")
    context_length: int = Field(description="extension: prompt + answer tokens per request")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose KV was kept from an earlier request "
                                           "(prompt caching: only the rest was prefilled)")


class UsageOut(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallIn] | None = None  # the same shape as a client sends back


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(BaseModel):
    """Non-streaming answer; streaming sends chat.completion.chunk objects instead."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageOut


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class Completion(BaseModel):
    """Non-streaming answer; streaming sends text_completion chunks instead."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageOut


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    s: {"model": ErrorResponse, "description": d}
    for s, d in [(400, "Invalid request"), (401, "Missing or wrong API key"),
                 (404, "Unknown model"), (500, "Engine failure"), (503, "Engine unavailable")]
}
ERROR_RESPONSES[429] = {"model": ErrorResponse, "description": "The engine's queue is full: retry after Retry-After s",
                "headers": {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}}


def generation_responses(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    ok = {"model": model, "description": "JSON, or Server-Sent Events when stream is true",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}}
    return {200: ok, **ERROR_RESPONSES}
