"""`flotilla bench prompt-cache`: what an engine's prompt cache saves a chat.

A conversation with a long history (--history tokens, default 2 000, text from the
demo corpus, a different one each round) on a model of real size (--model, default
the 0.90 B random Llama of `bench local`, bf16 checkpoint, the engine's default
precision), on the local engine, (--engine pipeline) 2 local stage processes,
(--engine moe) the MoE engine on Qwen3-30B-A3B's shapes (random weights, bf16, 4
layers: the checkpoint of `bench moe --quick`; its experts stream from disk with
O_DIRECT, in an expert cache of --cache-budget-mb), or (--engine sparse) the sparse
engine on the 0.9 B Llama (its default predicted mode and threshold): turn 1 asks a
question; turn 2 adds turn 1's answer and a new question.
Per round:

- turn 1's time to first token (everything prefilled);
- turn 2 with the cache: its TTFT and cached_tokens (what was not prefilled again);
- turn 2 without it (the same engine with its prompt cache set to 0):
  its TTFT, and whether its answer's token ids equal the cached answer's (greedy).

`goal` is the issue's bar: cached_tokens >= 1 900 of a 2 000-token history and turn 2's
TTFT <= 0.3x turn 1's, with identical answers. Random weights: the answers are
gibberish of a fixed length (--answer tokens, ignore_eos), which is all a KV cache sees.

--precision f32 runs exact math and an f32 KV cache (what the equivalence tests use);
the default is the device's choice: on a CPU bf16 compute where it has it. There a
prefill's logits depend on how the prompt is split into chunks (OpenVINO's kernels round
differently per chunk shape), and a cached turn is a different split: turn 1's prompt,
the answer's one-token steps, then the new part; and the pipeline's take-over compacts
the stages' u8 KV state, which re-quantizes it (docs/api.md). So on the pipeline each
round also asks turn 2 uncached with prefill chunks of half the size
(`other_split_identical`: is even the uncached answer unique?); so do the MoE and
sparse engines' rounds (16-bit weights and KV, and the sparse engine's predicted neurons).
--exact-cache turns on
the pipeline's exact prompt cache (PipelineConfig.prompt_cache_exact: whole prefill
chunks only, a 16-bit KV cache on the stages). Each round records
where the cached answer first parts from the uncached one (`first_difference`, None when
identical) and the share of equal tokens, so a difference is measured, not hidden.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any, Callable

ENGINES = ("local", "pipeline", "moe", "sparse")
MOE_SHAPE = "qwen3-30b-a3b"  # --engine moe's default model: this published shape, 4 layers
MOE_BUDGET_MB = 1000  # of the 4 layers' 4.8 GB of experts

NAME = "prompt-cache"
HELP = ("prompt caching on the local engine, a 2-stage pipeline, the MoE or the sparse engine: a 2 000-token "
        "chat's second turn, TTFT with and without the cache")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="random-llama-0.9b",
                   help="a random-Llama preset (random-llama-0.9b, random-llama-tiny), a demo id or a model folder")
    p.add_argument("--history", type=int, default=None, help="history tokens before turn 1's question "
                                                             "(default 2000; quick 600)")
    p.add_argument("--answer", type=int, default=16, help="tokens per answer (default 16)")
    p.add_argument("--rounds", type=int, default=None, help="conversations (default 3; quick 1)")
    p.add_argument("--engine", choices=ENGINES, default="local",
                   help="the local engine, a pipeline of 2 local stage processes, the MoE engine (on "
                        "Qwen3-30B-A3B's shapes unless --model names a folder) or the sparse engine "
                        "(default local)")
    p.add_argument("--cache-budget-mb", type=int, default=MOE_BUDGET_MB,
                   help=f"moe: the expert cache (default {MOE_BUDGET_MB} MB, a fifth of the 4 layers' experts)")
    p.add_argument("--precision", choices=("default", "f32"), default="default",
                   help="the device's default (CPU: bf16 compute where it has it, u8 KV cache) or exact f32 "
                        "math and KV (default: default)")
    p.add_argument("--exact-cache", action="store_true",
                   help="pipeline: the exact prompt cache (whole prefill chunks, 16-bit KV on the stages)")


def _model(args: argparse.Namespace, report: Callable[[str], None]) -> str:
    """The model folder: --engine moe's published shape unless --model names something else."""
    from engine.bench._checkpoint import bench_model, ensure_checkpoint
    from engine.bench._moe_models import real_spec

    if args.engine == "moe" and args.model == "random-llama-0.9b":  # the parser's default is a dense model
        return str(ensure_checkpoint(real_spec(MOE_SHAPE, None), report=report))
    return bench_model(args.model, report)


def _corpus_ids(tokenizer: Any) -> list[int]:
    from engine.models.demo_corpus import build_corpus

    return tokenizer("\n".join(build_corpus().texts(held_out=False)), add_special_tokens=False)["input_ids"]


def _history(tokenizer: Any, ids: list[int], tokens: int, round_: int) -> list[tuple[str, str]]:
    """Alternating user/assistant turns of corpus text (ids), about `tokens` long in all."""
    start = (round_ * 7919 * 13) % max(1, len(ids) - tokens - 1)
    turns, at, i = [], start, 0
    per = max(50, tokens // 8)
    while at < start + tokens:
        turns.append(("user" if i % 2 == 0 else "assistant", tokenizer.decode(ids[at:at + per])))
        at, i = at + per, i + 1
    if turns[-1][0] == "user":
        turns.append(("assistant", "I see."))
    return turns


def _ask(engine: Any, rid: str, turns: list[tuple[str, str]], n: int) -> tuple[list[int], Any]:
    from engine.protocol import ChatMessage, GenerateRequest, SamplingParams

    req = GenerateRequest(rid, messages=tuple(ChatMessage(r, c) for r, c in turns),
                          sampling=SamplingParams(max_tokens=n, ignore_eos=True))
    events = list(engine.stream(engine.submit(req), timeout=900))
    final = events[-1]
    if final.finish_reason == "error":
        raise RuntimeError(f"the engine failed: {final.error}")
    return [t for e in events for t in e.token_ids], final


def _ask_split(engine: Any, rid: str, turns: list[tuple[str, str]], n: int) -> list[int]:
    """The answer with prefill chunks of half the engine's size (nothing cached): the
    pipeline's and the MoE engine's config.prefill_chunk, the sparse engine's prefill_chunk."""
    import dataclasses

    config = getattr(engine, "config", None)  # read at each admission; a bench-only swap, put back at once
    if config is not None:
        engine.config = dataclasses.replace(config, prefill_chunk=max(1, config.prefill_chunk // 2))
    else:
        chunk = engine.prefill_chunk
        engine.prefill_chunk = max(1, chunk // 2)
    try:
        return _ask(engine, rid, turns, n)[0]
    finally:
        if config is not None:
            engine.config = config
        else:
            engine.prefill_chunk = chunk


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two answers' token ids differ (or one ends); None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def kv_cache_precision(precision: str) -> str:
    """The KV cache element type the CPU plugin uses at this precision (what the stages and the
    local engine compile with: f32 in exact mode, else the plugin's default)."""
    if precision == "f32":
        return "f32"
    import openvino as ov

    return ov.Core().get_property("CPU", "KV_CACHE_PRECISION").to_string()  # e.g. "u8"


def _torch_kv_precision(engine: Any) -> str:
    """The KV element type of the engines that keep it in torch tensors (f16, f32 in exact
    mode): the MoE engine's pool, the sparse engine's transformers cache."""
    memory = getattr(engine, "memory", None)
    return memory["kv_precision"] if memory is not None else engine.stats()["kv_precision"]


def _io(engine: Any) -> dict[str, Any] | None:
    """The "io" record of an engine that reads weights from a store while it runs (moe, sparse)."""
    from engine.bench._io_figures import io_figures

    store = getattr(engine, "store", None)
    if store is None and hasattr(engine, "runtime"):
        store = engine.runtime.store
    if store is None:
        return None
    info = store.io_info()
    return io_figures(info["requested"] != "buffered", [info])


def _kept_bytes(engine: Any) -> int | None:
    """KV bytes of the paged engine's kept blocks (held by no running request); None elsewhere."""
    pool = getattr(engine, "pool", None)
    return None if pool is None else (pool.available - pool.free_blocks) * engine.model.block_bytes


def _memory(engine: Any) -> dict[str, Any]:
    """What the cache may cost: the paged engine's KV pool (the bound kept blocks live in);
    this process's anonymous memory and its peak resident set."""
    from engine.bench._local_memory import proc_status

    out: dict[str, Any] = {}
    stats = engine.stats() if getattr(engine.info, "engine", None) in ("moe", "sparse") else {}
    for key in ("kv_reserve_bytes", "cache_budget_bytes", "direct_io", "bytes_read"):  # moe, sparse
        if key in stats:
            out[key] = stats[key]
    pool = getattr(engine, "pool", None)
    if pool is not None:  # cached_tokens come in whole blocks there
        out.update(kv_pool_bytes=pool.blocks * engine.model.block_bytes, kv_block_bytes=engine.model.block_bytes,
                   grain_tokens=pool.block_size)
    status = proc_status()
    out.update(rss_anon_bytes=status.get("RssAnon"), peak_rss_bytes=status.get("VmHWM"))
    return out


def run(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    from engine.local.factory import EngineOptions, open_engine
    from engine.pipeline.prompt_cache import EXACT_CACHE_KV
    from engine.platform.memory import settled_heap

    history = args.history or (600 if args.quick else 2000)
    rounds = args.rounds or (1 if args.quick else 3)
    precision = getattr(args, "precision", "default")
    exact_cache = bool(getattr(args, "exact_cache", False))
    if exact_cache and args.engine != "pipeline":  # refused before the model is built
        raise SystemExit("--exact-cache is a pipeline setting (the local engine's cache is exact already)")
    path = _model(args, report)
    report(f"opening {Path(path).name} on the {args.engine} engine (export and compile on first use)")
    if args.engine in ("moe", "sparse"):  # one conversation at a time: its KV is what is kept
        budget = args.cache_budget_mb * 10**6 if args.engine == "moe" else None
        engine = open_engine(path, args.engine, EngineOptions(precision=precision, cache_budget_bytes=budget,
                                                              extra={"max_concurrent": 1} if args.engine == "moe"
                                                              else {}))
        pool = 1
        torch_kv = _torch_kv_precision(engine)
    elif args.engine == "pipeline":
        engine = open_engine(path, "pipeline", EngineOptions(precision=precision, extra={
            "stages": 2, "max_concurrent": 2, "prompt_cache_exact": exact_cache}))
        pool = engine.parked.capacity
    else:  # the paged engine's cache is bounded by its KV pool: any count > 0 turns it back on
        engine = open_engine(path, "local", EngineOptions(precision=precision))
        pool = engine.backend.pool_size if hasattr(engine, "backend") else 1
    with settled_heap():  # as `flotilla chat` and `serve` run once their engine is open
        rows = []
        try:
            _ask(engine, "warm", [("user", "Hello")], 4)
            corpus = _corpus_ids(engine.tokenizer)
            for r in range(rounds):
                turns = _history(engine.tokenizer, corpus, history, r)
                q1 = turns + [("user", "What did we talk about?")]
                ids1, end1 = _ask(engine, f"r{r}t1", q1, args.answer)
                q2 = q1 + [("assistant", engine.tokenizer.decode(ids1, skip_special_tokens=True)),
                           ("user", "And what else?")]
                ids2, end2 = _ask(engine, f"r{r}t2", q2, args.answer)
                kept = _kept_bytes(engine)  # what the cache holds once turn 2 ended
                engine.set_prompt_cache(0)  # no cache: turn 2 again from nothing
                ids3, end3 = _ask(engine, f"r{r}t2-nocache", q2, args.answer)
                other = None
                if args.engine != "local":  # the control: uncached again, other chunk boundaries
                    other = _ask_split(engine, f"r{r}t2-split", q2, args.answer)
                engine.set_prompt_cache(pool)
                row = {"history_tokens": end1.usage.prompt_tokens, "turn2_prompt_tokens": end2.usage.prompt_tokens,
                       "turn2_cached_tokens": end2.usage.cached_tokens,
                       "uncached_cached_tokens": end3.usage.cached_tokens,
                       "turn1_ttft_s": round(end1.timings.ttft_s, 4), "turn2_ttft_s": round(end2.timings.ttft_s, 4),
                       "turn2_uncached_ttft_s": round(end3.timings.ttft_s, 4),
                       "identical": ids2 == ids3, "first_difference": first_difference(ids2, ids3),
                       "same_tokens": round(sum(a == b for a, b in zip(ids2, ids3)) / max(1, len(ids3)), 4),
                       "kept_bytes_after_turn2": kept,
                       "other_split_identical": None if other is None else other == ids3}
                row["turn2_over_turn1"] = round(row["turn2_ttft_s"] / row["turn1_ttft_s"], 4)
                row["cached_over_uncached"] = round(row["turn2_ttft_s"] / row["turn2_uncached_ttft_s"], 4)
                rows.append(row)
                report(f"round {r + 1}: {row}")
            memory = _memory(engine)
            io = _io(engine)
        finally:
            engine.close()

    def med(key: str) -> float:
        return statistics.median(x[key] for x in rows)

    goal = {"cached_at_least_1900_of_2000": all(x["turn2_cached_tokens"] >= 0.95 * history for x in rows),
            "ttft_at_most_0.3x": med("turn2_over_turn1") <= 0.3,
            "identical": all(x["identical"] for x in rows)}
    return {"engine": args.engine, "model": Path(path).name, "history": history, "answer_tokens": args.answer,
            "precision": precision, "pool_size": pool,
            "kv_cache_precision": (torch_kv if args.engine in ("moe", "sparse")
                                   else EXACT_CACHE_KV if exact_cache and precision != "f32"
                                   else kv_cache_precision(precision)),
            **({"io": io} if io is not None else {}),
            "rounds": rows, "turn2_over_turn1": med("turn2_over_turn1"),
            "cached_over_uncached": med("cached_over_uncached"), "turn1_ttft_s": med("turn1_ttft_s"),
            "turn2_ttft_s": med("turn2_ttft_s"), "turn2_uncached_ttft_s": med("turn2_uncached_ttft_s"),
            "turn2_cached_tokens": med("turn2_cached_tokens"),
            "identical_rounds": sum(x["identical"] for x in rows), "round_count": len(rows),
            "same_tokens": med("same_tokens"), "exact_cache": exact_cache,
            "other_split_identical_rounds": (None if args.engine == "local"
                                             else sum(bool(x["other_split_identical"]) for x in rows)),
            "goal": goal, "memory": memory,
            "passed": all(goal.values())}
