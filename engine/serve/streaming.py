"""A streamed answer (`stream: true`): the Server-Sent Events of OpenAI's
chat.completion.chunk or text_completion chunks, then `data: [DONE]`; an error
after the headers are sent is reported in-band.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from engine.core.interface import Engine
from engine.protocol.messages import TokenEvent, TokenLogprob
from engine.serve.answer_fields import dumps, openai_code, openai_finish, openai_usage, refused_prompt
from engine.serve.engine_calls import cancel
from engine.serve.errors import error_body
from engine.serve.logprobs import chat_logprobs, completion_logprobs
from engine.serve.tool_calls import ChatShaper

log = logging.getLogger(__name__)


async def sse_events(engine: Engine, rid: str, head: dict[str, Any], shaper: ChatShaper | None,
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
        return {"data": dumps({**head, "choices": [choice], **extra})}

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
                                      code=openai_code(ev)) if refused_prompt(ev)
                           else error_body(f"The engine failed: {ev.error or 'unknown error'}",
                                           "server_error", code="engine_error"))
                    yield {"data": dumps(err)}
                else:
                    last = pieces(ev.text, ev.logprobs)
                    finish = openai_finish(ev.finish_reason)
                    if shaper is not None:
                        tail, finish = shaper.finish(ev.finish_reason or "stop")
                        last += [(d, ()) for d in tail]
                    for d, lps in last[:-1]:
                        yield chunk(d, None, lps)
                    d, lps = last[-1] if last else (None, ())
                    yield chunk(d, finish, lps)
                    if include_usage:
                        yield {"data": dumps({**head, "choices": [], "usage": openai_usage(ev)})}
    except Exception as e:  # headers are sent: report in-band, as for an engine error
        log.exception("unexpected error while streaming %s", rid, exc_info=e)
        yield {"data": dumps(error_body("The server had an error while streaming the answer.",
                                        "server_error", code="internal_error"))}
    finally:
        if final is None:
            cancel(engine, rid)
    yield {"data": "[DONE]"}
