"""The users of `flotilla bench serve`: a process of its own that sends bursts of
streaming chat requests to an API server and reports what it saw.

Why a process: a user's client never runs inside the server's process. Inside the
bench's process, the client's HTTP and JSON work for 16 streams would hold the GIL
the engines' own Python needs between forward passes (the local engine's scheduler
thread, LLMPipeline's streamer callback), but not the GIL of openvino_genai's
continuous batching, which computes in a child process: a bias for one engine.

It is a benchmark helper process (engine/bench/_pipeline_child.py): each command is a
burst, {"url", "model", "prompts", "tokens", "schema"}, answered with its figures.

    client = start()                                    # in the bench
    row = client.ask(job(url, model, prompts, tokens))
    client.close()
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from engine import aio
from engine.bench._pipeline_child import Child, answer_commands


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


async def _one(client: Any, url: str, model: str, prompt: str, tokens: int,
               schema: dict[str, Any] | None) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "digits", "schema": schema, "strict": True}}
    t0 = time.perf_counter()
    first, text, usage = None, [], None
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"the API answered {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices", ()):
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    end = time.perf_counter()
    return {"ttft_s": (first or end) - t0, "end": end, "text": "".join(text),
            "tokens": int((usage or {}).get("completion_tokens", 0))}


async def burst(url: str, model: str, prompts: list[str], tokens: int,
                schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every prompt at once, each its own streaming request; wall time from sending the
    first to the last answer's end."""
    import httpx

    async with httpx.AsyncClient(timeout=1800) as client:
        t0 = time.perf_counter()
        got = await asyncio.gather(*(_one(client, url, model, p, tokens, schema) for p in prompts))
    wall = max(g["end"] for g in got) - t0
    ttfts = [g["ttft_s"] for g in got]
    total = sum(g["tokens"] for g in got)
    return {"concurrency": len(prompts), "wall_s": round(wall, 3), "tokens": total,
            "aggregate_tok_s": round(total / wall, 3),
            "ttft_p50_s": round(percentile(ttfts, 0.5), 3), "ttft_p95_s": round(percentile(ttfts, 0.95), 3),
            "texts": [g["text"] for g in got]}


def job(url: str, model: str, prompts: list[str], tokens: int, schema: dict[str, Any] | None = None) -> dict:
    """The command for one burst (the client's answer: burst()'s figures)."""
    return {"url": url, "model": model, "prompts": prompts, "tokens": tokens, "schema": schema}


def start() -> Child:
    """The client process (a Child running main() below)."""
    return Child([], None, None, module=__name__)


def _answer(cmd: dict) -> dict:
    if cmd.get("cmd") == "quit":
        return {"ok": True}
    return aio.run(burst(cmd["url"], cmd["model"], cmd["prompts"], cmd["tokens"], cmd.get("schema")))


def main() -> None:
    answer_commands(_answer)
