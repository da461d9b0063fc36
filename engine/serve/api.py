"""OpenAI-compatible HTTP API over any Flotilla Engine (FastAPI + uvicorn + SSE).

Endpoints: GET /v1/models, GET /v1/models/{model}, POST /v1/chat/completions,
POST /v1/completions. `stream: true` answers with Server-Sent Events
(`data: {chunk}` lines, then `data: [DONE]`); otherwise with one JSON body.

Request fields used: model, messages / prompt, max_tokens, max_completion_tokens
(wins over max_tokens), temperature (0..2), top_p, seed, stop (a string or a
list), n (must be 1), stream, stream_options.include_usage, logprobs and
top_logprobs (chat; an integer logprobs on /v1/completions: each answer token's
logprob under the model's raw distribution and the likeliest alternatives; such a
request does not speculate: engine/serve/logprobs.py), and the extensions
top_k, repetition_penalty and speculative ({"mode": "draft"|"lookup"|"off",
"k": 1..16, "adaptive": bool}, or just the mode as a string; absent = the
engine's default; docs/speculative.md). Without max_tokens the engine's default
(SamplingParams.max_tokens) applies. Message roles: system, user, assistant (with
its tool_calls), tool (with tool_call_id); "developer" is read as "system"; content
is a string or a list of text parts. Chat also takes tools, tool_choice,
parallel_tool_calls and response_format: a JSON answer or a required call is held to
a grammar, calls come back as tool_calls (engine/serve/tool_calls.py, docs/api.md).
Any other field is a 400 naming it (code "unsupported_parameter"), unless it holds
the value that asks for nothing (functions [], frequency/presence_penalty 0, ...) or
is bookkeeping that leaves the answer alone (user, metadata): engine/serve/fields.py.

Every error is OpenAI's JSON `{"error": {"message", "type", "param", "code"}}`:
400 malformed JSON / invalid values, 401 missing or wrong API key (when one is
configured; a server bound beyond loopback always has one unless the user chose
--no-auth: engine/serve/auth.py), 404 unknown model or URL, 405 wrong method, 429 the engine's queue
is full (with Retry-After: engine/core/backpressure.py), 503 engine refused
(closed, broken), 500 anything else (no traceback in the body).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import EventSourceResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.protocol.errors import ProtocolError
from engine.protocol.messages import (
    CLIENT_ERROR_CODES,
    MAX_TOP_LOGPROBS,
    ChatMessage,
    GenerateRequest,
    SamplingParams,
    SpeculativeParams,
    TokenEvent,
    TokenLogprob,
)
from engine.runtime import tool_format
from engine.runtime.constraint import check_grammar, grammar_for
from engine.core.refusal import engine_refusal
from engine.serve import fields
from engine.serve.tool_calls import (
    ChatShaper,
    NamedToolChoice,
    ResponseFormatIn,
    ToolCallIn,
    ToolChoiceIn,
    ToolIn,
    message_calls,
    structure,
)
from engine.core.backpressure import retry_after_header
from engine.serve.logprobs import ChatLogprobs, CompletionLogprobs, chat_logprobs, completion_logprobs
from engine.core.interface import Engine, EngineError, EngineOverloaded

log = logging.getLogger(__name__)

API_TITLE = "Flotilla OpenAI-compatible API"
API_VERSION = "1.0"


# -- errors -----------------------------------------------------------------------
class ApiError(Exception):
    """An error answered as OpenAI's error JSON with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = dict(headers or {})  # e.g. Retry-After on a 429


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _error_response(e: ApiError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status,
                        headers=dict(headers or {}))


# -- request schemas (what the OpenAI clients send) -----------------------------------
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


class _Sampling(_Lenient):
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


class ChatCompletionRequest(_Sampling):
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


class CompletionRequest(_Sampling):
    """POST /v1/completions"""

    prompt: str | list[str] = Field(description="raw text, no chat template (a list must hold one string)")
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS,
                                 description="each answer token's logprob and this many likeliest alternatives")


# -- response schemas (for the OpenAPI document; handlers build plain dicts) ----------
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


_ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"model": ErrorResponse, "description": d}
    for s, d in [(400, "Invalid request"), (401, "Missing or wrong API key"),
                 (404, "Unknown model"), (500, "Engine failure"), (503, "Engine unavailable")]
}
_ERRORS[429] = {"model": ErrorResponse, "description": "The engine's queue is full: retry after Retry-After s",
                "headers": {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}}


def _generation_responses(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    ok = {"model": model, "description": "JSON, or Server-Sent Events when stream is true",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}}
    return {200: ok, **_ERRORS}


# -- mapping requests onto the engine protocol ----------------------------------------
def _logprobs(body: _Sampling) -> int | None:
    """How many alternatives per token the body asks for with logprobs, or None (no logprobs)."""
    if isinstance(body, CompletionRequest):
        return body.logprobs
    assert isinstance(body, ChatCompletionRequest)
    if not body.logprobs:
        if body.top_logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return None
    return body.top_logprobs or 0


def _sampling(body: _Sampling, max_tokens: int | None) -> SamplingParams:
    if body.n is not None and body.n != 1:
        raise ApiError(400, "n must be 1: this server returns one choice per request", param="n")
    stop = body.stop
    kw: dict[str, Any] = {
        "max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "top_k": body.top_k, "repetition_penalty": body.repetition_penalty, "seed": body.seed,
        "stop": None if stop is None else ((stop,) if isinstance(stop, str) else tuple(stop)),
        "ignore_eos": body.ignore_eos, "logprobs": _logprobs(body),
    }
    return SamplingParams(**{k: v for k, v in kw.items() if v is not None})


def _speculative(body: _Sampling) -> SpeculativeParams | None:
    spec = body.speculative
    if spec is None:
        return None
    if isinstance(spec, str):
        return SpeculativeParams(mode=spec)
    return SpeculativeParams(mode=spec.mode, k=spec.k, adaptive=spec.adaptive)


def _chat_message(m: ChatMessageIn) -> ChatMessage:
    role = "system" if m.role == "developer" else m.role
    if role not in ("system", "user", "assistant", "tool"):
        raise ApiError(400, f"messages: role must be system, user, assistant, tool or developer, not {role!r:.40}",
                       param="messages")
    if m.content is None:
        content = ""
    elif isinstance(m.content, str):
        content = m.content
    else:
        if any(p.type != "text" or p.text is None for p in m.content):
            raise ApiError(400, "only text content parts are supported", param="messages")
        content = "".join(p.text or "" for p in m.content)
    return ChatMessage(role=role, content=content, tool_calls=message_calls(m.tool_calls),
                       tool_call_id=m.tool_call_id)


def _refuse_unsupported(body: _Sampling) -> None:
    """A 400 naming the first field the engines would have to ignore (engine/serve/fields.py)."""
    chat = isinstance(body, ChatCompletionRequest)
    checks = [(body, fields.CHAT_NEUTRAL if chat else fields.COMPLETION_NEUTRAL, "")]
    if body.stream_options is not None:
        checks.append((body.stream_options, fields.STREAM_OPTIONS_NEUTRAL, "stream_options."))
    for i, m in enumerate(body.messages if chat else ()):
        checks.append((m, fields.MESSAGE_NEUTRAL, f"messages[{i}]."))
        parts = m.content if isinstance(m.content, list) else ()
        checks += [(part, {}, f"messages[{i}].content[{j}].") for j, part in enumerate(parts)]
    for model, neutral, prefix in checks:
        found = fields.refusal(model.model_extra, neutral, prefix)
        if found is not None:
            raise ApiError(400, found.message, param=found.param, code=found.code)


def _build(request_id: str, body: _Sampling) -> GenerateRequest:
    """Turn an API body into a GenerateRequest; ProtocolError becomes a 400."""
    try:
        if isinstance(body, ChatCompletionRequest):
            mt = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            shape, wrong = structure(body.tools, body.tool_choice, body.response_format)
            if wrong is not None:
                raise ApiError(400, f"'{wrong}' does not name a tool of this request or is incomplete",
                               param=wrong)
            req = GenerateRequest(request_id=request_id, sampling=_sampling(body, mt),
                                  messages=tuple(_chat_message(m) for m in body.messages),
                                  speculative=_speculative(body), **shape)
            _check_grammar(req)
            return req
        assert isinstance(body, CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ApiError(400, "prompt must be a string or a list of exactly one string",
                               param="prompt")
            prompt = prompt[0]
        return GenerateRequest(request_id=request_id, prompt=prompt,
                               sampling=_sampling(body, body.max_tokens), speculative=_speculative(body))
    except ProtocolError as e:
        reason = str(e)
        first = reason.split(" ", 1)[0]
        raise ApiError(400, reason, param=first if first in type(body).model_fields else None) from None


def _check_grammar(req: GenerateRequest) -> None:
    """A schema the grammar compiler refuses is a 400 naming the field, before the engine sees it."""
    try:
        grammar = grammar_for(req, tool_format.HERMES)  # the schemas' validity does not depend on the format
        if grammar is not None:
            check_grammar(grammar)
    except ValueError as e:  # GrammarError, or llguidance refusing the schema text
        param = "response_format" if req.json_schema is not None else "tools"
        raise ApiError(400, f"{param}: the schema cannot be enforced: {e}", param=param,
                       code="invalid_schema") from None


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _usage(final: TokenEvent | None) -> dict[str, Any]:
    p = final.usage.prompt_tokens if final and final.usage else 0
    c = final.usage.completion_tokens if final and final.usage else 0
    cached = final.usage.cached_tokens if final and final.usage else 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _refused_prompt(final: TokenEvent) -> bool:
    """An error about the request itself (a client error, 400), by the event's code: the
    prompt does not fit the context or is empty, its grammar does not compile, ... (every
    engine refuses those at admission, before any token). Never by the error's words."""
    no_tokens = final.usage is None or final.usage.completion_tokens == 0
    return no_tokens and final.error_code in CLIENT_ERROR_CODES


def _openai_code(final: TokenEvent) -> str | None:
    """OpenAI's error code for a refused request (context_length_exceeded is the one it names)."""
    return "context_length_exceeded" if final.error_code == "context_length_exceeded" else None


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"  # "cancelled" ends like a stop


# -- the app ----------------------------------------------------------------------------
class _ApiKeyMiddleware:
    """Pure ASGI: checks `Authorization: Bearer <key>` on /v1 before the body is read."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            auth = Headers(scope=scope).get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if not auth:
                err = ApiError(401, "You didn't provide an API key: send 'Authorization: Bearer <key>'.",
                               code="invalid_api_key")
            elif scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.key):
                err = ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
            else:
                err = None
            if err is not None:
                await _error_response(err, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, e: ApiError) -> JSONResponse:
        return _error_response(e, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, e: RequestValidationError) -> JSONResponse:
        errors = list(e.errors())
        bad_json = [err for err in errors if err.get("type") == "json_invalid"]
        if bad_json:
            why = (bad_json[0].get("ctx") or {}).get("error", "")
            return _error_response(ApiError(400, f"We could not parse the JSON body of your request ({why})."))
        parts: list[str] = []
        param = None
        for err in errors:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            if param is None and loc:
                param = loc[0]
            text = f"{'.'.join(loc)}: {err.get('msg', 'invalid')}" if loc else err.get("msg", "invalid")
            if text not in parts:
                parts.append(text)
        message = "; ".join(parts[:4]) or "invalid request body"
        return _error_response(ApiError(400, message, param=param))

    async def _http(req: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 404:
            err = ApiError(404, f"Unknown request URL: {req.method} {req.url.path}.", code="unknown_url")
        elif e.status_code == 405:
            err = ApiError(405, f"Method {req.method} is not allowed for {req.url.path}.",
                           code="method_not_allowed")
        else:
            err = ApiError(e.status_code, str(e.detail), "server_error" if e.status_code >= 500
                           else "invalid_request_error")
        return _error_response(err, e.headers)

    app.add_exception_handler(StarletteHTTPException, _http)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http)  # type: ignore[arg-type]

    @app.exception_handler(Exception)
    async def _unexpected(_req: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error in the API", exc_info=e)
        return _error_response(ApiError(500, "The server had an error while processing your request.",
                                        "server_error", code="internal_error"))


def create_app(engines: Mapping[str, Engine] | Engine, api_key: str | None = None) -> FastAPI:
    """An OpenAI-compatible app over one engine or several, keyed by model id."""
    table: dict[str, Engine] = (
        {engines.info.model_id: engines} if isinstance(engines, Engine) else dict(engines)
    )
    if not table:
        raise ValueError("create_app needs at least one engine")
    created = int(time.time())
    app = FastAPI(
        title=API_TITLE, version=API_VERSION,
        description="Chat and text completions from Flotilla engines (local, pipeline, MoE "
                    "offloading, sparse), wire-compatible with the OpenAI API.",
        openapi_tags=[{"name": "models", "description": "Which models this server answers with"},
                      {"name": "generation", "description": "Chat and text completions"}],
    )
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)
    _install_error_handlers(app)
    app.state.engines = table

    def engine_for(model: str) -> Engine:
        engine = table.get(model)
        if engine is None:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return engine

    def card(model_id: str, engine: Engine) -> dict[str, Any]:
        info = engine.info
        return {"id": model_id, "object": "model", "created": created, "owned_by": "flotilla",
                "engine": info.engine, "device": info.device, "context_length": info.context_length}

    @app.get("/v1/models", tags=["models"], summary="List models", response_model=ModelList,
             responses={401: _ERRORS[401]})
    async def list_models() -> Any:
        return {"object": "list", "data": [card(k, e) for k, e in table.items()]}

    @app.get("/v1/models/{model}", tags=["models"], summary="Retrieve a model", response_model=ModelCard,
             responses={401: _ERRORS[401], 404: _ERRORS[404]})
    async def get_model(model: str) -> Any:
        return card(model, engine_for(model))

    @app.post("/v1/chat/completions", tags=["generation"], summary="Create a chat completion",
              responses=_generation_responses(ChatCompletion))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await _generate(body, request, engine_for(body.model), chat=True)

    @app.post("/v1/completions", tags=["generation"], summary="Create a text completion",
              responses=_generation_responses(Completion))
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await _generate(body, request, engine_for(body.model), chat=False)

    return app


# -- one generation ---------------------------------------------------------------------
def _submit(engine: Engine, req: GenerateRequest) -> None:
    try:
        engine.submit(req)
    except EngineOverloaded as e:
        raise ApiError(429, f"The engine is busy: {e}", "rate_limit_error", code="engine_overloaded",
                       headers={"Retry-After": retry_after_header(e.retry_after_s)}) from None
    except EngineError as e:
        raise ApiError(503, f"The engine cannot take this request: {e}", "server_error",
                       code="engine_unavailable") from None
    except ProtocolError as e:
        raise ApiError(400, str(e)) from None


def _cancel(engine: Engine, request_id: str) -> None:
    try:
        engine.cancel(request_id)
    except Exception:  # already finished or forgotten: nothing left to stop
        pass


async def _generate(body: _Sampling, request: Request, engine: Engine, chat: bool) -> Any:
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    _refuse_unsupported(body)
    req = _build(rid, body)
    refused = engine_refusal(req, engine.info.unsupported, chat)
    if refused is not None:
        raise ApiError(400, f"'{refused.param}' is not supported by this model's engine "
                            f"({engine.info.engine}); serve it with --engine local for that",
                       param=refused.param, code=refused.code)
    _submit(engine, req)
    head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": body.model}
    shaper = ChatShaper(req.tools, req.tool_choice, tool_format.FORMATS[engine.info.tool_format]) if chat else None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventSourceResponse(_sse(engine, rid, head, shaper, include_usage), ping=15)
    text, final, lps = await _collect(engine, rid, request)
    if final is not None and final.finish_reason == "error" and _refused_prompt(final):
        raise ApiError(400, final.error or "the prompt was refused", param="messages" if chat else "prompt",
                       code=_openai_code(final))
    if final is not None and final.finish_reason == "error":
        raise ApiError(500, f"The engine failed: {final.error or 'unknown error'}", "server_error",
                       code="engine_error")
    finish = _finish(final.finish_reason if final else None)
    if shaper is not None:
        shaper.feed(text)
        _, finish = shaper.finish(final.finish_reason if final else "stop")
        choice = {"index": 0, "message": shaper.message(),
                  "logprobs": chat_logprobs(lps) if req.sampling.logprobs is not None else None,
                  "finish_reason": finish}
        head = {**head, "object": "chat.completion"}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish,
                  "logprobs": completion_logprobs(lps) if req.sampling.logprobs is not None else None}
    return JSONResponse({**head, "choices": [choice], "usage": _usage(final)})


async def _collect(engine: Engine, rid: str,
                   request: Request) -> tuple[str, TokenEvent | None, list[TokenLogprob]]:
    """Gather a whole answer; a client that hangs up cancels the engine request."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        _cancel(engine, rid)

    watcher = asyncio.create_task(watch())
    parts: list[str] = []
    lps: list[TokenLogprob] = []
    final: TokenEvent | None = None
    try:
        async with contextlib.aclosing(engine.async_stream(rid)) as events:
            async for ev in events:
                parts.append(ev.text)
                lps.extend(ev.logprobs)
                if ev.final:
                    final = ev
    finally:
        watcher.cancel()
        if final is None:
            _cancel(engine, rid)
    return "".join(parts), final, lps


async def _sse(engine: Engine, rid: str, head: dict[str, Any], shaper: ChatShaper | None,
               include_usage: bool) -> AsyncIterator[dict[str, str]]:
    """SSE events of one streamed answer (a chat when shaper is set). A disconnect
    cancels this generator (sse-starlette), which cancels the engine request in `finally`."""
    extra = {"usage": None} if include_usage else {}
    sent = 0  # characters streamed so far (completions' text_offset)

    def chunk(delta: dict[str, Any] | str | None, finish: str | None,
              lps: tuple[TokenLogprob, ...] = ()) -> dict[str, str]:
        nonlocal sent
        if shaper is not None:
            choice: dict[str, Any] = {"index": 0, "delta": delta or {}, "finish_reason": finish,
                                      "logprobs": chat_logprobs(lps) if lps else None}
        else:
            text = delta if isinstance(delta, str) else ""
            choice = {"index": 0, "text": text, "finish_reason": finish,
                      "logprobs": completion_logprobs(lps, sent) if lps else None}
            sent += len(text)
        return {"data": _dumps({**head, "choices": [choice], **extra})}

    def pieces(text: str, lps: tuple[TokenLogprob, ...]) -> list[tuple[Any, tuple[TokenLogprob, ...]]]:
        """The deltas of one event's text, the event's logprobs on the first of them."""
        deltas: list[Any] = shaper.feed(text) if shaper is not None else ([text] if text else [])
        if lps and not deltas:
            deltas = [{} if shaper is not None else ""]
        return [(d, lps if i == 0 else ()) for i, d in enumerate(deltas)]

    final: TokenEvent | None = None
    try:
        if shaper is not None:
            yield chunk({"role": "assistant", "content": ""}, None)
        async with contextlib.aclosing(engine.async_stream(rid)) as events:
            async for ev in events:
                if not ev.final:
                    for d, lps in pieces(ev.text, ev.logprobs):
                        yield chunk(d, None, lps)
                    continue
                final = ev
                if ev.finish_reason == "error":
                    for d, _ in pieces(ev.text, ()):
                        yield chunk(d, None)
                    err = (error_body(ev.error or "the request was refused", "invalid_request_error",
                                      code=_openai_code(ev)) if _refused_prompt(ev)
                           else error_body(f"The engine failed: {ev.error or 'unknown error'}",
                                           "server_error", code="engine_error"))
                    yield {"data": _dumps(err)}
                else:
                    last = pieces(ev.text, ev.logprobs)
                    finish = _finish(ev.finish_reason)
                    if shaper is not None:
                        tail, finish = shaper.finish(ev.finish_reason or "stop")
                        last += [(d, ()) for d in tail]
                    for d, lps in last[:-1]:
                        yield chunk(d, None, lps)
                    d, lps = last[-1] if last else (None, ())
                    yield chunk(d, finish, lps)
                    if include_usage:
                        yield {"data": _dumps({**head, "choices": [], "usage": _usage(ev)})}
    except Exception as e:  # headers are sent: report in-band, as for an engine error
        log.exception("unexpected error while streaming %s", rid, exc_info=e)
        yield {"data": _dumps(error_body("The server had an error while streaming the answer.",
                                         "server_error", code="internal_error"))}
    finally:
        if final is None:
            _cancel(engine, rid)
    yield {"data": "[DONE]"}


# -- serving ----------------------------------------------------------------------------
def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve in the foreground until Ctrl-C (binds 127.0.0.1 unless told otherwise)."""
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


class ApiServer:
    """uvicorn in a background thread: start() returns once it listens; port 0
    picks a free port (read it from .port afterwards); stop() shuts it down."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        self.app, self.host, self.port = app, host, port
        self.access = None  # engine.serve.auth.Access of whoever decided the key (client.start_api_server)
        self._config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                      timeout_graceful_shutdown=2, lifespan="off")
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ApiServer":
        if self._thread is not None:
            raise RuntimeError("the server is already started")
        # Bind here, in the caller's thread: a port in use is an OSError the caller
        # sees at once (one line), not an exception dying in the server thread, and
        # port 0 is resolved before start() returns.
        sock = _listen_socket(self.host, self.port)
        self.port = sock.getsockname()[1]
        server = uvicorn.Server(self._config)
        self._server = server
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="flotilla-api",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not self._thread.is_alive():
                self._thread = None
                sock.close()
                raise OSError(f"the API server could not start on {self.host}:{self.port}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the API server did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        server.should_exit = True
        thread.join(timeout)
        if thread.is_alive():
            server.force_exit = True
            thread.join(timeout)
        self._thread = None

    def __enter__(self) -> "ApiServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _listen_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for uvicorn; OSError ("address already in use") if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if os.name == "posix":  # as asyncio does: quick restarts; on Windows it would allow port theft
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock
