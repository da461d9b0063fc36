"""`flotilla bench serve`: several users on one PC, through the HTTP API.

Every engine (--engines; default the local engine -- every request in one forward
pass over a paged KV cache --, the one-request-per-turn loop it replaced (`loop`), the
batched engine -- openvino_genai's continuous batching -- and openvino_genai's
LLMPipeline answering one request at a time, on the same IR at the same precision) is
opened at once in this process, each served with the OpenAI-compatible API on its own
loopback port, and warmed up with a burst of 4-token answers at every concurrency (a
batching engine meets new input shapes at each, and the CPU plugin builds kernels for
a shape on first use). Then, round by round, for each concurrency c (--concurrency,
default 1,4,8,16) every engine in turn gets c streaming chat requests at once, each a
different prompt (no engine can re-use another's prefix), greedy, exactly --tokens
new tokens (ignore_eos). The engines take turns burst by burst, in an order that
alternates from one burst to the next, so a machine whose speed drifts over minutes
(a shared VM's does) weighs on every engine alike. Per concurrency:

- aggregate_tok_s: completion tokens of all c answers / wall time from sending the
  first to the last answer's end;
- ttft_s p50 / p95 over the c requests (request sent -> first content chunk);
- same_as_first_engine: the share of answers whose text equals the first engine's
  answer to the same prompt (greedy; bf16 math on two kernels can part late in an answer).

Then, on every engine that enforces response_format, the same bursts again with a JSON
schema (an array of 0..9 digits far longer than --tokens, so every answer still runs
exactly --tokens tokens and ends on the length limit) and prompts of their own (a free
burst's prompt is in the engine's prompt cache by then; these carry another round
number): constrained_over_free is its aggregate tok/s over the free bursts' (per round,
same engine, prompts of about the same length, answers of the same length),
constrained_extra_ms_per_token the extra wall time per token of one answer --
the constrained-decoding overhead a user of the API sees, mask and grammar included.

Figures are medians over rounds (--rounds); ratios (each engine over the first) are
taken per round, between bursts run one right after the other. Random weights: the text
is gibberish of a fixed length, which is all a scheduler sees.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from engine import aio

NAME = "serve"
HELP = ("several users on one PC through the HTTP API: aggregate tok/s and TTFT p50/p95 at 1, 4, 8 and 16 "
        "concurrent requests, the local engine vs its earlier one-request-per-turn loop vs openvino_genai's "
        "continuous batching and LLMPipeline, "
        "and the constrained-decoding (JSON schema) overhead per token")

LLM_PIPELINE = "llm-pipeline"  # openvino_genai's LLMPipeline, one request at a time (engine/bench/_llm_pipeline.py)
ENGINES = ("local", "loop", "batched", LLM_PIPELINE)
CONSTRAINED_ROUND = 1000  # the JSON-schema bursts' prompts: "Request 1000-..." (never a free burst's)
DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
          "minItems": 4096, "maxItems": 4096}  # never complete within --tokens: every answer ends on length


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a random-Llama preset (random-llama-0.9b, random-llama-tiny), a demo id or a model "
                        "folder (default random-llama-0.9b; quick demo)")
    p.add_argument("--engines", default=",".join(ENGINES), help="engines, comma-separated: local, loop, batched, llm-pipeline (default all four)")
    p.add_argument("--concurrency", default=None, help="concurrent requests per step (default 1,4,8,16; quick 1,4)")
    p.add_argument("--tokens", type=int, default=None, help="new tokens per answer (default 32; quick 8)")
    p.add_argument("--rounds", type=int, default=None, help="rounds over every engine (default 3; quick 1)")


def _prompt(c: int, i: int, r: int) -> str:
    return f"Request {r}-{c}-{i}: tell me about the weather in city number {i * 7 + c}."


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


async def _one(client: Any, url: str, model: str, prompt: str, tokens: int,
               schema: dict[str, Any] | None) -> dict[str, Any]:
    import json

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
    return {"ttft_s": (first or end) - t0, "end": end, "start": t0, "text": "".join(text),
            "tokens": int((usage or {}).get("completion_tokens", 0))}


async def _burst(url: str, model: str, c: int, r: int, tokens: int,
                 schema: dict[str, Any] | None = None) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(timeout=1800) as client:
        t0 = time.perf_counter()
        got = await asyncio.gather(*(_one(client, url, model, _prompt(c, i, r), tokens, schema) for i in range(c)))
    wall = max(g["end"] for g in got) - t0
    ttfts = [g["ttft_s"] for g in got]
    return {"concurrency": c, "wall_s": round(wall, 3), "tokens": sum(g["tokens"] for g in got),
            "aggregate_tok_s": round(sum(g["tokens"] for g in got) / wall, 3),
            "ttft_p50_s": round(_percentile(ttfts, 0.5), 3), "ttft_p95_s": round(_percentile(ttfts, 0.95), 3),
            "texts": [g["text"] for g in got]}


def _open(kind: str, path: str, levels: list[int]) -> tuple[Any, float]:
    from engine.local.factory import EngineOptions, open_engine

    t = time.perf_counter()
    options = EngineOptions(extra={"max_concurrent": max(levels)})
    if kind == LLM_PIPELINE:  # a baseline, not an engine kind users pick
        from engine.bench._llm_pipeline import open_llm_pipeline

        engine = open_llm_pipeline(path, options, None)
    else:
        engine = open_engine(path, kind, options)
        if hasattr(engine, "max_concurrent"):
            engine.max_concurrent = max(levels)
    return engine, time.perf_counter() - t


def _order(engines: list[str], r: int, li: int, constrained: bool) -> list[str]:
    """The engines' turn order for one burst: reversed every other burst, so no engine
    always goes first (module doc)."""
    return engines if (r + li + constrained) % 2 == 0 else engines[::-1]


def _round(served: dict[str, tuple[str, Any]], engines: list[str], levels: list[int], tokens: int, r: int,
           report: Callable[[str], None]) -> dict[str, Any]:
    """One round: every concurrency, every engine in turn; then the JSON-schema bursts
    on the engines that enforce response_format."""
    out: dict[str, Any] = {"orders": [], **{kind: {"levels": []} for kind in engines}}
    for li, c in enumerate(levels):
        order = _order(engines, r, li, False)
        out["orders"].append(order)
        for kind in order:
            url, engine = served[kind]
            row = aio.run(_burst(url, engine.info.model_id, c, r, tokens))
            out[kind]["levels"].append(row)
            report(f"  {kind} c={c}: {row['aggregate_tok_s']:.2f} tok/s, TTFT p50 {row['ttft_p50_s']:.2f} s "
                   f"p95 {row['ttft_p95_s']:.2f} s")
    schema_engines = [k for k in engines if "response_format" not in served[k][1].info.unsupported]
    for li, c in enumerate(levels):
        for kind in _order(schema_engines, r, li, True):
            url, engine = served[kind]
            # prompts of their own: the free bursts' prompts are in the engines' prompt caches
            row = aio.run(_burst(url, engine.info.model_id, c, CONSTRAINED_ROUND + r, tokens, DIGITS))
            if not all(t.startswith("[") and set(t) <= set("[0123456789, \n") for t in row["texts"]):
                raise RuntimeError(f"the {kind} engine's answers did not hold to the JSON schema")
            out[kind].setdefault("constrained_levels", []).append(row)
            report(f"  {kind} c={c} with a JSON schema: {row['aggregate_tok_s']:.2f} tok/s")
    return out


def _serve_all(path: str, engines: list[str], levels: list[int], tokens: int, rounds: int,
               report: Callable[[str], None]) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Open and serve every engine at once, warm each up, then run the rounds."""
    from engine.serve.api import ApiServer, create_app

    served: dict[str, tuple[str, Any]] = {}
    load_s: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        for kind in engines:
            report(f"opening the {kind} engine on {Path(path).name}")
            engine, load_s[kind] = _open(kind, path, levels)
            stack.callback(engine.close)
            server = stack.enter_context(ApiServer(create_app(engine)))
            served[kind] = (server.url + "/v1/chat/completions", engine)
            # warm-up: first inference, and the shapes of every concurrency (module doc)
            for c in levels:
                aio.run(_burst(served[kind][0], engine.info.model_id, c, -1, 4))
        per_round = []
        for r in range(rounds):
            report(f"round {r + 1}/{rounds}")
            per_round.append(_round(served, engines, levels, tokens, r, report))
    return per_round, load_s


def _constrained(per_round: list[dict[str, Any]], kind: str, li: int, c: int) -> dict[str, Any]:
    """One engine's JSON-schema bursts at one concurrency against its free ones, per round."""
    pairs = [(rd[kind]["constrained_levels"][li], rd[kind]["levels"][li]) for rd in per_round]
    return {"concurrency": c,
            "aggregate_tok_s": statistics.median(j["aggregate_tok_s"] for j, _ in pairs),
            "ttft_p50_s": statistics.median(j["ttft_p50_s"] for j, _ in pairs),
            "constrained_over_free": round(statistics.median(j["aggregate_tok_s"] / f["aggregate_tok_s"]
                                                             for j, f in pairs), 3),
            "constrained_extra_ms_per_token": round(statistics.median(
                1000.0 * (j["wall_s"] - f["wall_s"]) / (f["tokens"] / c) for j, f in pairs), 2)}


def run(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    from engine.bench._checkpoint import bench_model

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    levels = [int(x) for x in (args.concurrency or ("1,4" if args.quick else "1,4,8,16")).split(",")]
    tokens = args.tokens or (8 if args.quick else 32)
    rounds = args.rounds or (1 if args.quick else 3)
    path = bench_model(args.model or ("demo" if args.quick else "random-llama-0.9b"), report)
    per_round, load_s = _serve_all(path, engines, levels, tokens, rounds, report)
    base = engines[0]
    figures: dict[str, Any] = {}
    for kind in engines:
        rows = []
        for li, c in enumerate(levels):
            cells = [rd[kind]["levels"][li] for rd in per_round]
            same = [sum(a == b for a, b in zip(cell["texts"], rd[base]["levels"][li]["texts"])) / c
                    for cell, rd in zip(cells, per_round)]
            rows.append({
                "concurrency": c,
                "aggregate_tok_s": statistics.median(x["aggregate_tok_s"] for x in cells),
                "ttft_p50_s": statistics.median(x["ttft_p50_s"] for x in cells),
                "ttft_p95_s": statistics.median(x["ttft_p95_s"] for x in cells),
                "over_first_engine": statistics.median(
                    x["aggregate_tok_s"] / rd[base]["levels"][li]["aggregate_tok_s"] for x, rd in zip(cells, per_round)),
                "same_as_first_engine": statistics.median(same),
            })
        figures[kind] = {"levels": rows, "load_s": round(load_s[kind], 2)}
        if "constrained_levels" in per_round[0][kind]:
            figures[kind]["constrained"] = [_constrained(per_round, kind, li, c) for li, c in enumerate(levels)]
    best = {c: max(engines, key=lambda k: figures[k]["levels"][i]["aggregate_tok_s"]) for i, c in enumerate(levels)}
    for rd in per_round:  # the texts were compared above; the JSON keeps their lengths only
        for kind in engines:
            for cell in rd[kind]["levels"] + rd[kind].get("constrained_levels", []):
                cell["text_chars"] = [len(t) for t in cell.pop("texts")]
    return {"model": Path(path).name, "engines": engines, "concurrency": levels, "tokens": tokens,
            "rounds": rounds, "figures": figures, "fastest": {str(c): k for c, k in best.items()},
            "per_round": per_round}
