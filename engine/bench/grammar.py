"""`flotilla bench grammar`: what holding an answer to a grammar costs per token.

- the grammar libraries side by side, in this process, on the same schemas and the
  same random logits: llguidance (Flotilla's, through engine/runtime/constraint.py, the
  very path the engines take: mask a copy of the row, then advance) and xgrammar when
  it is installed (it is not a dependency: it needs torch and triton at run time).
  Per schema: time to compile the grammar for a request, and per token the time to
  compute and apply the mask (median and p95 over --tokens picks);
- on two vocabularies: the demo tokenizer (2 048 tokens) and a byte-level BPE trained
  here on this Python's standard library to --vocab tokens (synthetic, deterministic;
  it reaches ~123 k, near Llama 3's 128 256: the size where a mask costs the most);
- in the engine: the local engine's decode time per token with a JSON schema against
  a free answer of the same length (ignore_eos), interleaved (--rounds), on the demo
  model: the overhead a user sees.

The logits are random (numpy, seeded): the mask's cost depends on the grammar's state
and the vocabulary, not on what a model would say.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

NAME = "grammar"
HELP = ("constrained decoding: per-token mask cost of llguidance (and xgrammar when installed) on a small "
        "and a ~128 k vocabulary, and the local engine's decode with and without a JSON schema")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Oslo", "Rome", "Lima", "Quito"]},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
RECORD = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
    "name": {"type": "string", "maxLength": 24},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "admin": {"type": "boolean"}},
              "required": ["name", "admin"], "additionalProperties": False}},
    "required": ["id", "name", "tags", "owner"], "additionalProperties": False}
DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 60, "maxItems": 60}
SCHEMAS = {"tool_arguments": WEATHER, "nested_record": RECORD, "any_object": {"type": "object"}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=None, help="masked picks per schema and library (default 400; "
                                                            "quick 100)")
    p.add_argument("--vocab", type=int, default=131072, help="target size of the large BPE (default 131072)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved engine rounds (default 3; quick 1)")


def _stdlib_tokenizer(vocab: int) -> Any:
    from engine.models.train_demos import train_tokenizer

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    return train_tokenizer([p.read_text(errors="replace") for p in files], vocab=vocab)


def _stats(ms: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(ms), 4), "p95": round(float(np.percentile(ms, 95)), 4),
            "min": round(min(ms), 4), "max": round(max(ms), 4), "n": len(ms)}


def _drive(start: Callable[[], Any], mask: Callable[[Any, np.ndarray], np.ndarray],
           advance: Callable[[Any, int], bool], width: int, tokens: int, seed: int) -> tuple[list[float], int]:
    """Masked greedy picks from random logits; a completed answer starts over.
    Returns (ms per mask, answers completed)."""
    rng = np.random.default_rng(seed)
    state, ms, done = start(), [], 0
    for _ in range(tokens):
        logits = rng.standard_normal(width).astype(np.float32) * 4
        t = time.perf_counter()
        row = mask(state, logits)
        ms.append((time.perf_counter() - t) * 1000.0)
        if advance(state, int(np.argmax(row))):
            state, done = start(), done + 1
    return ms, done


def _llguidance(tok: Any, schema: dict, tokens: int) -> dict[str, Any]:
    from engine.protocol import ChatMessage, GenerateRequest
    from engine.runtime import constraint, tool_format

    eos = frozenset({tok.eos_token_id})
    req = GenerateRequest("b", messages=(ChatMessage("user", "x"),), json_schema=json.dumps(schema))
    t = time.perf_counter()
    constraint.Constraint(constraint.grammar_for(req, tool_format.HERMES), tok, eos)  # tokenizer view built once
    first_ms = (time.perf_counter() - t) * 1000.0
    t = time.perf_counter()
    constraint.for_request(req, tok, eos, tool_format.HERMES)
    compile_ms = (time.perf_counter() - t) * 1000.0

    def advance(c: Any, token: int) -> bool:
        c.advance(token)
        return c.complete

    ms, done = _drive(lambda: constraint.for_request(req, tok, eos, tool_format.HERMES),
                      lambda c, row: c.masked(row), advance, len(tok), tokens, seed=1)
    return {"first_request_ms": round(first_ms, 2), "compile_ms": round(compile_ms, 2),
            "mask_ms": _stats(ms), "answers_completed": done}


def _xgrammar(tok: Any, schema: dict, tokens: int, cache: dict) -> dict[str, Any]:
    import torch
    import xgrammar as xgr

    t = time.perf_counter()
    if id(tok) not in cache:
        cache[id(tok)] = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)),
                                             cache_enabled=False)
    compiler = cache[id(tok)]
    text = json.dumps(schema)
    compiled = compiler.compile_json_schema(text, any_whitespace=False)
    first_ms = (time.perf_counter() - t) * 1000.0
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(text, any_whitespace=False)
    compile_ms = (time.perf_counter() - t) * 1000.0
    bits = xgr.allocate_token_bitmask(1, len(tok))

    def mask(m: Any, row: np.ndarray) -> np.ndarray:
        m.fill_next_token_bitmask(bits)
        out = torch.from_numpy(row.copy())[None]  # a copy, as our path takes one
        xgr.apply_token_bitmask_inplace(out, bits)
        return out[0].numpy()

    def advance(m: Any, token: int) -> bool:
        m.accept_token(token)
        return m.is_terminated()

    ms, done = _drive(lambda: xgr.GrammarMatcher(compiled), mask, advance, len(tok), tokens, seed=1)
    return {"first_request_ms": round(first_ms, 2), "compile_ms": round(compile_ms, 2),
            "mask_ms": _stats(ms), "answers_completed": done}


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in ("llguidance", "xgrammar"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _engine_overhead(rounds: int, report: Callable[[str], None]) -> dict[str, Any]:
    from engine.protocol import ChatMessage, GenerateRequest, SamplingParams
    from engine.local.factory import EngineOptions, open_engine
    from engine.platform.memory import settled_heap

    eng = open_engine("demo", "local", EngineOptions())
    ask = (ChatMessage("user", "Write sixty digits."),)

    def run(rid: str, **kw: Any) -> tuple[float, int]:
        req = GenerateRequest(rid, messages=ask, **kw)
        events = list(eng.stream(eng.submit(req), timeout=300))
        final = events[-1]
        return final.timings.decode_tok_s, final.usage.completion_tokens

    with settled_heap():  # as `flotilla serve` runs once its engine is open
        try:
            run("warm", sampling=SamplingParams(max_tokens=16))
            rows = []
            for r in range(rounds):
                tok_s_c, n = run(f"c{r}", json_schema=json.dumps(DIGITS), sampling=SamplingParams(max_tokens=400))
                tok_s_f, n_f = run(f"f{r}", sampling=SamplingParams(max_tokens=n, ignore_eos=True))
                rows.append({"tokens": n, "constrained_ms_per_token": round(1000.0 / tok_s_c, 3),
                             "free_ms_per_token": round(1000.0 / tok_s_f, 3), "free_tokens": n_f})
                report(f"engine round {r + 1}: {rows[-1]}")
        finally:
            eng.close()
    ratio = [x["constrained_ms_per_token"] / x["free_ms_per_token"] for x in rows]
    extra = [x["constrained_ms_per_token"] - x["free_ms_per_token"] for x in rows]
    return {"model": "demo (2 048-token vocabulary)", "schema": "60 digits (array of 60 integers 0..9)",
            "rounds": rows, "ms_per_token_ratio": {"median": round(statistics.median(ratio), 3),
                                                   "min": round(min(ratio), 3), "max": round(max(ratio), 3)},
            "extra_ms_per_token": {"median": round(statistics.median(extra), 3),
                                   "min": round(min(extra), 3), "max": round(max(extra), 3)}}


def run(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from engine.models.demo import ensure_demo

    tokens = args.tokens or (100 if args.quick else 400)
    rounds = args.rounds or (1 if args.quick else 3)
    versions = _versions()
    report("training the large BPE on the standard library (~20 s)")
    t = time.perf_counter()
    big = _stdlib_tokenizer(args.vocab)
    train_s = time.perf_counter() - t
    vocabs = {"demo": AutoTokenizer.from_pretrained(ensure_demo("demo")), "stdlib_bpe": big}
    libs: dict[str, Any] = {"llguidance": lambda tok, s: _llguidance(tok, s, tokens)}
    if versions["xgrammar"]:
        xg_cache: dict = {}
        libs["xgrammar"] = lambda tok, s: _xgrammar(tok, s, tokens, xg_cache)
    cells: dict[str, dict[str, dict[str, Any]]] = {}  # vocab -> schema -> library -> figures
    for vname, tok in vocabs.items():
        for sname, schema in SCHEMAS.items():
            for lname, measure in libs.items():
                cell = {"vocab_size": len(tok), **measure(tok, schema)}
                cells.setdefault(vname, {}).setdefault(sname, {})[lname] = cell
                report(f"{vname} ({len(tok)}) {sname} {lname}: mask {cell['mask_ms']['median']} ms "
                       f"(p95 {cell['mask_ms']['p95']}), compile {cell['compile_ms']} ms")
    engine = _engine_overhead(rounds, report)
    mask = {lib: [cells[v][s][lib]["mask_ms"]["median"] for v in cells for s in cells[v]] for lib in libs}
    return {
        "mask_ms_worst_median": {lib: max(v) for lib, v in mask.items()},
        "setup": {"synthetic": "random logits; the large vocabulary is a BPE trained here on the stdlib source",
                  "libraries": versions, "stdlib_bpe_vocab": len(big),
                  "stdlib_bpe_train_s": round(train_s, 1), "tokens_per_cell": tokens,
                  "json_style": "no free whitespace; ', ' and ': ' separators (both libraries)"},
        "cells": cells,
        "engine": engine,
    }
