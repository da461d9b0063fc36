"""One POST /v1/chat/completions or /v1/completions: from the validated body to the
engine's answer, as one JSON body or as Server-Sent Events (engine/serve/streaming.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from engine.core.interface import Engine
from engine.core.refusal import engine_refusal
from engine.runtime import tool_format
from engine.serve.answer_fields import openai_code, openai_finish, openai_usage, refused_prompt
from engine.serve.engine_calls import collect, submit
from engine.serve.errors import ApiError
from engine.serve.logprobs import chat_logprobs, completion_logprobs
from engine.serve.request_mapping import build_request, refuse_unsupported
from engine.serve.request_models import RequestBody
from engine.serve.streaming import sse_events
from engine.serve.tool_calls import ChatShaper


async def generate(body: RequestBody, request: Request, engine: Engine, chat: bool) -> Any:
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    refuse_unsupported(body)
    req = build_request(rid, body)
    refused = engine_refusal(req, engine.info.unsupported, chat)
    if refused is not None:
        raise ApiError(400, f"'{refused.param}' is not supported by this model's engine "
                            f"({engine.info.engine}); serve it with --engine local for that",
                       param=refused.param, code=refused.code)
    submit(engine, req)
    head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": body.model}
    shaper = ChatShaper(req.tools, req.tool_choice, tool_format.FORMATS[engine.info.tool_format]) if chat else None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventSourceResponse(sse_events(engine, rid, head, shaper, include_usage), ping=15)
    text, final, lps = await collect(engine, rid, request)
    if final is not None and final.finish_reason == "error" and refused_prompt(final):
        raise ApiError(400, final.error or "the prompt was refused", param="messages" if chat else "prompt",
                       code=openai_code(final))
    if final is not None and final.finish_reason == "error":
        raise ApiError(500, f"The engine failed: {final.error or 'unknown error'}", "server_error",
                       code="engine_error")
    finish = openai_finish(final.finish_reason if final else None)
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
    return JSONResponse({**head, "choices": [choice], "usage": openai_usage(final)})
