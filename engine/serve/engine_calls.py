"""The engine side of one API request: submitting it (the engine's refusals as
ApiErrors: 429 with Retry-After, 503, 400), cancelling it, and gathering a whole
answer while watching for the client hanging up.
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import Request

from engine.core.backpressure import retry_after_header
from engine.core.interface import Engine, EngineError, EngineOverloaded
from engine.protocol.errors import ProtocolError
from engine.protocol.messages import GenerateRequest, TokenEvent, TokenLogprob
from engine.serve.errors import ApiError


def submit(engine: Engine, req: GenerateRequest) -> None:
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


def cancel(engine: Engine, request_id: str) -> None:
    try:
        engine.cancel(request_id)
    except Exception:  # already finished or forgotten: nothing left to stop
        pass


async def collect(engine: Engine, rid: str,
                  request: Request) -> tuple[str, TokenEvent | None, list[TokenLogprob]]:
    """Gather a whole answer; a client that hangs up cancels the engine request."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        cancel(engine, rid)

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
            cancel(engine, rid)
    return "".join(parts), final, lps
