"""`flotilla bench serve`: several users on one PC, through the HTTP API.

Every engine (--engines; default the local engine -- every request in one forward
pass over a paged KV cache --, the one-request-per-turn loop it replaced (`loop`), the
batched engine -- openvino_genai's continuous batching -- and openvino_genai's
LLMPipeline answering one request at a time, on the same IR at the same precision) is
opened at once in this process, each served with the OpenAI-compatible API on its own
loopback port, and warmed up with a burst of 4-token answers at every concurrency (a
batching engine meets new input shapes at each, and the CPU plugin builds kernels for
a shape on first use). The requests come from a client process of its own
(engine/bench/_serve_client.py has why). Then, round by round, for each concurrency c
(--concurrency, default 1,4,8,16) the engines get bursts of c streaming chat requests
at once, greedy, exactly --tokens new tokens (ignore_eos), one burst at a time: the
first engine (the one the others are compared with; the local engine by default) before
and after each of the others, whose order reverses from one concurrency to the next:
local, loop, local, batched, local, llm-pipeline, local. Each other engine answers the
prompts of the first engine's burst just before it (one engine never sees another's
cache); each of an engine's bursts in a round has prompts of its own (none is in its
prompt cache). In odd rounds the places swap: each other engine runs before and after
the first, which answers the prompts of that engine's burst just before it (loop, local,
loop, batched, local, batched, ...). A shared VM's speed drifts by more than the gaps
between engines from one minute to the next, so each ratio compares two engines' bursts
seconds apart: an engine's burst over the mean of the first engine's two around it, or
the mean of its own two over the first engine's between them. The swap is there because
a place in the order need not be neutral (the engine between the other's bursts always
runs right after the other, which may leave the machine in another state than its own
burst does): swapping every other round gives each engine of a pair each place in half
the rounds. Per concurrency:

- aggregate_tok_s: completion tokens of all c answers / wall time from sending the
  first to the last answer's end (the first engine's: the median of its bursts);
- ttft_s p50 / p95 over the c requests (request sent -> first content chunk);
- over_first_engine: aggregate_tok_s over the first engine's, from the bursts around
  (above), the median over rounds;
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

Figures are medians over rounds (--rounds); ratios are taken per round, as above, and each
row also gives their min and max over the rounds and the share of rounds in which the engine
was ahead of the first (`rounds_ahead_of_first_engine`). Random weights: the text
is gibberish of a fixed length, which is all a scheduler sees.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from engine.bench import _serve_client as serve_client
from engine.bench._pipeline_child import Child

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
    p.add_argument("--engines", default=",".join(ENGINES),
                   help="engines, comma-separated: local, loop, batched, llm-pipeline (default all four; the "
                        "first is the one the others are compared with)")
    p.add_argument("--concurrency", default=None, help="concurrent requests per step (default 1,4,8,16; quick 1,4)")
    p.add_argument("--tokens", type=int, default=None, help="new tokens per answer (default 32; quick 8)")
    p.add_argument("--rounds", type=int, default=None, help="rounds over every engine (default 3; quick 1)")


def _prompts(c: int, r: int, slot: int) -> list[str]:
    """A burst's c prompts: round r, slot (which of the first engine's bursts at this
    concurrency and round) -- so none of them is in an engine's prompt cache yet."""
    return [f"Request {r}-{slot}-{c}-{i}: tell me about the weather in city number {i * 7 + c}." for i in range(c)]


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


def _turns(engines: list[str], r: int, li: int) -> list[str]:
    """Engines in an order that reverses from one concurrency (and round) to the next."""
    return engines if (r + li) % 2 == 0 else engines[::-1]


def _order(engines: list[str], r: int, li: int) -> list[tuple[str, int]]:
    """One concurrency's free bursts, as (engine, prompt slot). Even rounds: the first
    engine (the one the others are compared with) before and after each other engine,
    which answers the prompts of the first engine's burst just before it. Odd rounds: each
    other engine before and after the first, which answers the prompts of that engine's
    burst just before it. So neither engine of a pair always has the place between the
    other's bursts (module doc)."""
    base, others = engines[0], _turns(engines[1:], r, li)
    if r % 2 == 1:
        return [turn for slot, kind in enumerate(others)
                for turn in ((kind, 2 * slot), (base, 2 * slot), (kind, 2 * slot + 1))]
    order = [(base, 0)]
    for slot, kind in enumerate(others):
        order += [(kind, slot), (base, slot + 1)]
    return order


def _same(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The share of two bursts' answers (to the same prompts) whose texts are equal."""
    return sum(x == y for x, y in zip(a["texts"], b["texts"])) / len(a["texts"])


def _compared(bursts: list[tuple[str, dict[str, Any]]], base: str, odd: bool) -> list[tuple[str, dict[str, Any]]]:
    """Each other engine's cell at one concurrency, its ratio over the first engine taken
    from the bursts around it (even rounds: the first engine's two around its burst; odd
    rounds: its own two around the first engine's), in the order they ran."""
    cells = []
    if odd:
        for i in range(1, len(bursts), 3):
            (kind, first), (_base, middle), (_kind, second) = bursts[i - 1:i + 2]
            cell = _base_cell([first, second])
            cell["over_first_engine"] = round(cell["aggregate_tok_s"] / middle["aggregate_tok_s"], 4)
            cell["same_as_first_engine"] = _same(middle, first)
            cells.append((kind, cell))
        return cells
    for i, (kind, row) in enumerate(bursts):
        if kind != base:
            before, after = bursts[i - 1][1], bursts[i + 1][1]
            row["over_first_engine"] = round(
                row["aggregate_tok_s"] / statistics.mean((before["aggregate_tok_s"], after["aggregate_tok_s"])), 4)
            row["same_as_first_engine"] = _same(row, before)
            cells.append((kind, row))
    return cells


def _base_cell(bursts: list[dict[str, Any]]) -> dict[str, Any]:
    """An engine's bursts at one concurrency in one round as one cell: the median of its
    bursts (the first engine's; in odd rounds, each other engine's two)."""
    def med(key: str) -> float:
        return statistics.median(b[key] for b in bursts)

    return {"concurrency": bursts[0]["concurrency"], "tokens": bursts[0]["tokens"], "wall_s": med("wall_s"),
            "aggregate_tok_s": med("aggregate_tok_s"), "ttft_p50_s": med("ttft_p50_s"),
            "ttft_p95_s": med("ttft_p95_s"), "over_first_engine": 1.0, "same_as_first_engine": 1.0,
            "bursts": bursts}


def _round(served: dict[str, tuple[str, Any]], client: Child, engines: list[str], levels: list[int],
           tokens: int, r: int, report: Callable[[str], None]) -> dict[str, Any]:
    """One round: every concurrency, the engines' bursts in _order; then the JSON-schema
    bursts on the engines that enforce response_format."""
    base = engines[0]
    out: dict[str, Any] = {"orders": [], **{kind: {"levels": []} for kind in engines}}
    for li, c in enumerate(levels):
        order = _order(engines, r, li)
        out["orders"].append([kind for kind, _slot in order])
        bursts = []
        for kind, slot in order:
            url, engine = served[kind]
            row = client.ask(serve_client.job(url, engine.info.model_id, _prompts(c, r, slot), tokens))
            bursts.append((kind, row))
            report(f"  {kind} c={c}: {row['aggregate_tok_s']:.2f} tok/s, TTFT p50 {row['ttft_p50_s']:.2f} s "
                   f"p95 {row['ttft_p95_s']:.2f} s")
        for kind, cell in _compared(bursts, base, odd=r % 2 == 1):
            out[kind]["levels"].append(cell)
        out[base]["levels"].append(_base_cell([row for kind, row in bursts if kind == base]))
    schema_engines = [k for k in engines if "response_format" not in served[k][1].info.unsupported]
    for li, c in enumerate(levels):
        for kind in _turns(schema_engines, r, li):
            url, engine = served[kind]
            # prompts of their own: the free bursts' prompts are in the engines' prompt caches
            row = client.ask(serve_client.job(url, engine.info.model_id, _prompts(c, CONSTRAINED_ROUND + r, 0),
                                              tokens, DIGITS))
            if not all(t.startswith("[") and set(t) <= set("[0123456789, \n") for t in row["texts"]):
                raise RuntimeError(f"the {kind} engine's answers did not hold to the JSON schema")
            out[kind].setdefault("constrained_levels", []).append(row)
            report(f"  {kind} c={c} with a JSON schema: {row['aggregate_tok_s']:.2f} tok/s")
    return out


def _serve_all(path: str, engines: list[str], levels: list[int], tokens: int, rounds: int,
               report: Callable[[str], None]) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Open and serve every engine at once, warm each up, then run the rounds."""
    from engine.platform.memory import settled_heap
    from engine.serve.api import ApiServer, create_app

    served: dict[str, tuple[str, Any]] = {}
    load_s: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        client = serve_client.start()
        stack.callback(client.close)
        for kind in engines:
            report(f"opening the {kind} engine on {Path(path).name}")
            engine, load_s[kind] = _open(kind, path, levels)
            stack.callback(engine.close)
            server = stack.enter_context(ApiServer(create_app(engine)))
            served[kind] = (server.url + "/v1/chat/completions", engine)
            # warm-up: first inference, and the shapes of every concurrency (module doc)
            for c in levels:
                client.ask(serve_client.job(served[kind][0], engine.info.model_id, _prompts(c, -1, 0), 4))
        per_round = []
        with settled_heap():  # as `flotilla serve` runs once its engine is open
            for r in range(rounds):
                report(f"round {r + 1}/{rounds}")
                per_round.append(_round(served, client, engines, levels, tokens, r, report))
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
    figures: dict[str, Any] = {}
    for kind in engines:
        rows = []
        for li, c in enumerate(levels):
            cells = [rd[kind]["levels"][li] for rd in per_round]
            ratios = [x["over_first_engine"] for x in cells]
            rows.append({"concurrency": c, **{key: statistics.median(x[key] for x in cells) for key in (
                "aggregate_tok_s", "ttft_p50_s", "ttft_p95_s", "over_first_engine", "same_as_first_engine")},
                # the rounds' spread: a gap between engines is told from the VM's drift only where
                # most rounds agree on its sign
                "over_first_engine_min": min(ratios), "over_first_engine_max": max(ratios),
                "rounds_ahead_of_first_engine": round(sum(x > 1.0 for x in ratios) / len(ratios), 3)})
        figures[kind] = {"levels": rows, "load_s": round(load_s[kind], 2)}
        if "constrained_levels" in per_round[0][kind]:
            figures[kind]["constrained"] = [_constrained(per_round, kind, li, c) for li, c in enumerate(levels)]
    # the fastest by the side-by-side ratios, not by tok/s measured minutes apart
    best = {c: max(engines, key=lambda k: figures[k]["levels"][i]["over_first_engine"]) for i, c in enumerate(levels)}
    for rd in per_round:  # the texts were compared above; the JSON keeps their lengths only
        for kind in engines:
            for cell in rd[kind]["levels"] + rd[kind].get("constrained_levels", []):
                for burst in cell.get("bursts", [cell]):
                    burst["text_chars"] = [len(t) for t in burst.pop("texts")]
    return {"model": Path(path).name, "engines": engines, "concurrency": levels, "tokens": tokens,
            "rounds": rounds, "figures": figures, "fastest": {str(c): k for c, k in best.items()},
            "per_round": per_round}
