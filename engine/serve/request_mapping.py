"""Mapping an API request body onto the engine protocol: a GenerateRequest with its
SamplingParams, messages, tools and speculative settings, or a 400 (ApiError) naming
the field that cannot be honoured.
"""

from __future__ import annotations

from typing import Any

from engine.protocol.errors import ProtocolError
from engine.protocol.messages import ChatMessage, GenerateRequest, SamplingParams, SpeculativeParams
from engine.runtime import tool_format
from engine.runtime.constraint import check_grammar, grammar_for
from engine.serve import fields
from engine.serve.errors import ApiError
from engine.serve.request_models import ChatCompletionRequest, ChatMessageIn, CompletionRequest, RequestBody
from engine.serve.tool_calls import message_calls, structure


def _logprobs(body: RequestBody) -> int | None:
    """How many alternatives per token the body asks for with logprobs, or None (no logprobs)."""
    if isinstance(body, CompletionRequest):
        return body.logprobs
    assert isinstance(body, ChatCompletionRequest)
    if not body.logprobs:
        if body.top_logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return None
    return body.top_logprobs or 0


def _sampling(body: RequestBody, max_tokens: int | None) -> SamplingParams:
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


def _speculative(body: RequestBody) -> SpeculativeParams | None:
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


def refuse_unsupported(body: RequestBody) -> None:
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


def build_request(request_id: str, body: RequestBody) -> GenerateRequest:
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
