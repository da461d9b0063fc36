"""The users of `flotilla bench serve`: a process of its own that sends bursts of
streaming chat requests to an API server and reports what it saw.

Why a process: a user's client never runs inside the server's process. Inside the
bench's process, the client's HTTP and JSON work for 16 streams would hold the GIL
the engines' own Python needs between forward passes (the local engine's scheduler
thread, LLMPipeline's streamer callback), but not the GIL of openvino_genai's
continuous batching, which computes in a child process: a bias for one engine.

Protocol, one JSON object per line: the bench writes a burst to stdin
({"url", "model", "prompts", "tokens", "schema"}) and reads its figures from stdout
(`burst()` below), or {"error": "..."}. The process ends when stdin closes.

    client = BurstClient()          # in the bench
    row = client.burst(url, model, prompts, tokens)
    client.close()
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

from engine import aio


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


class BurstClient:
    """The client process, seen from the bench."""

    def __init__(self) -> None:
        from engine.platform import process

        self._proc = process.spawn([sys.executable, "-m", "engine.bench._serve_client"], die_with_us=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def burst(self, url: str, model: str, prompts: list[str], tokens: int,
              schema: dict[str, Any] | None = None) -> dict[str, Any]:
        job = {"url": url, "model": model, "prompts": prompts, "tokens": tokens, "schema": schema}
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps(job) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the bench's client process ended (exit code {self._proc.wait()})")
        got = json.loads(line)
        if "error" in got:
            raise RuntimeError(f"the bench's client: {got['error']}")
        return got

    def close(self) -> None:
        from engine.platform import process

        if self._proc.stdin is not None:
            self._proc.stdin.close()
        process.stop(self._proc, grace=10.0, ask=lambda: None)

    def __enter__(self) -> "BurstClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> None:
    for line in sys.stdin:
        job = json.loads(line)
        try:
            out = aio.run(burst(job["url"], job["model"], job["prompts"], job["tokens"], job.get("schema")))
        except Exception as e:  # reported to the bench, which raises it there
            out = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
