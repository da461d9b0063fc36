"""docs/api.md's figure table: what a grammar costs per token (see engine/bench/_figures/__init__.py
for the rules). Everything comes from `flotilla bench grammar` (docs/bench/grammar/), random logits
(synthetic), the large vocabulary a BPE trained on the stdlib source."""

from __future__ import annotations

from engine.bench._report import REPO_ROOT, Row, Table

G = "grammar"
HOW = "`flotilla bench grammar` (random logits; in one process, one after the other)"
SCHEMA_WORDS = {"tool_arguments": "tool arguments (3 bounded fields)",
                "nested_record": "nested record (object, array, strings)",
                "any_object": "`json_object` (any object)"}


def _mask_row(vocab: str, words: str, schema: str) -> Row:
    def lib(name: str) -> str:
        cell = f"cells.{vocab}.{schema}.{name}"
        return (f"{name} {{{G}:{cell}.mask_ms.median|f3}} ms (p95 {{{G}:{cell}.mask_ms.p95|f3}}), "
                f"compile {{{G}:{cell}.compile_ms|f1}} ms")
    return Row(f"{words}, {SCHEMA_WORDS[schema]}", lib("llguidance") + "; " + lib("xgrammar"), HOW)


_DEMO = "demo vocabulary"
_BIG = "stdlib BPE (synthetic)"

GRAMMAR = Table("api-grammar", ("mask per token (compute + apply) and compile per request", "measured", "how"), (
    Row("the two vocabularies", "demo {%s:cells.demo.tool_arguments.llguidance.vocab_size|int} tokens; stdlib BPE "
        "{%s:setup.stdlib_bpe_vocab|int} tokens (Llama 3: 128 256)" % (G, G), HOW),
    *(_mask_row("demo", _DEMO, s) for s in SCHEMA_WORDS),
    *(_mask_row("stdlib_bpe", _BIG, s) for s in SCHEMA_WORDS),
    Row("first request on a vocabulary (the tokenizer view is built once per tokenizer)",
        "llguidance {%s:cells.stdlib_bpe.tool_arguments.llguidance.first_request_ms|f0} ms, xgrammar "
        "{%s:cells.stdlib_bpe.tool_arguments.xgrammar.first_request_ms|f0} ms on the stdlib BPE" % (G, G), HOW),
    Row("one-request-per-turn engine (`--engine loop`, the local engine when this was measured), `demo`, "
        "60-digit JSON array vs a free answer of the same length",
        "{%s:engine.ms_per_token_ratio.median|f3}× the time per token "
        "({%s:engine.extra_ms_per_token.median|f3} ms more per token)" % (G, G),
        HOW + "; interleaved rounds, median over rounds and runs"),
))

P = "prompt-cache"
PHOW = "`flotilla bench prompt-cache` (0.9 B random Llama, bf16, default precision; answers of 16 tokens)"

PP = "prompt-cache-pipeline"
PPHOW = ("`flotilla bench prompt-cache --engine pipeline` (the same model and history, "
         "2 local stage processes, default precision: on CPU bf16 compute where it has it, u8 KV cache)")
PPF = "prompt-cache-pipeline-f32"
PPFHOW = "`flotilla bench prompt-cache --engine pipeline --precision f32` (the same, exact f32 math and KV)"

PPX = "prompt-cache-pipeline-exact"
PPXHOW = ("`flotilla bench prompt-cache --engine pipeline --exact-cache` (the same, default compute precision, "
          "whole prefill chunks reused, f16 KV cache on the stages)")

PM = "prompt-cache-moe"
PMHOW = ("`flotilla bench prompt-cache --engine moe` (the MoE engine on Qwen3-30B-A3B's shapes, 4 layers, random "
         "weights, bf16; experts read with O_DIRECT into a 1 GB expert cache; the same history; answers of 16 tokens)")
PS = "prompt-cache-sparse"
PSHOW = ("`flotilla bench prompt-cache --engine sparse` (the sparse engine on the 0.9 B random Llama, its default "
         "predicted neurons at sparsity 0.8; the same history; answers of 16 tokens)")


def _engine_rows(src: str, how: str, words: str) -> tuple[Row, ...]:
    """The MoE or sparse engine's rows: what was taken over, the times, and whether the answer is unique."""
    return (
        Row(f"{words}: turn 2's `cached_tokens`; time to first token, turn 1 / turn 2 cached / turn 2 uncached",
            "{%s:turn2_cached_tokens|int}; {%s:turn1_ttft_s|f2} s / {%s:turn2_ttft_s|f2} s / "
            "{%s:turn2_uncached_ttft_s|f2} s" % (src, src, src, src), how),
        Row(f"{words}: turn 2 cached over turn 1 (goal ≤ 0.3×); over turn 2 uncached",
            "{%s:turn2_over_turn1|x}; {%s:cached_over_uncached|x}" % (src, src), how),
        Row(f"{words}: rounds (of 3 a run) whose cached answer is the uncached one; the control: rounds whose "
            "uncached answer stays the same with prefill chunks of half the size",
            "{%s:identical_rounds|int}; {%s:other_split_identical_rounds|int}" % (src, src), how),
    )


PROMPT_CACHE = Table("api-prompt-cache", ("a chat's second turn after a long history", "measured", "how"), (
    Row("history (turn 1's prompt) / turn 2's prompt", "{%s:rounds.0.history_tokens|int} / "
        "{%s:rounds.0.turn2_prompt_tokens|int} tokens (first round)" % (P, P), PHOW),
    Row("turn 2's prompt tokens taken from the cache (`cached_tokens`)", "{%s:turn2_cached_tokens|int}" % P, PHOW),
    Row("time to first token: turn 1 / turn 2 cached / turn 2 uncached",
        "{%s:turn1_ttft_s|f2} s / {%s:turn2_ttft_s|f2} s / {%s:turn2_uncached_ttft_s|f2} s" % (P, P, P), PHOW),
    Row("turn 2 cached over turn 1 (goal ≤ 0.3×); over turn 2 uncached",
        "{%s:turn2_over_turn1|x}; {%s:cached_over_uncached|x}" % (P, P), PHOW),
    Row("cached and uncached answers identical (greedy)", "{%s:goal.identical}" % P, PHOW),
    Row("what the cache costs: KV its kept blocks held after turn 2 (first round) / the KV pool they live "
        "in (the bound: every running request at the full context, at most 2 GiB)",
        "{%s:rounds.0.kept_bytes_after_turn2|mib} / {%s:memory.kv_pool_bytes|mib}" % (P, P), PHOW),
    Row("2-stage pipeline: turn 2's `cached_tokens`", "{%s:turn2_cached_tokens|int}" % PP, PPHOW),
    Row("2-stage pipeline: time to first token, turn 1 / turn 2 cached / turn 2 uncached",
        "{%s:turn1_ttft_s|f2} s / {%s:turn2_ttft_s|f2} s / {%s:turn2_uncached_ttft_s|f2} s" % (PP, PP, PP), PPHOW),
    Row("2-stage pipeline: turn 2 cached over turn 1 (goal ≤ 0.3×); over turn 2 uncached",
        "{%s:turn2_over_turn1|x}; {%s:cached_over_uncached|x}" % (PP, PP), PPHOW),
    Row("2-stage pipeline, exact f32: cached and uncached answers identical (greedy)",
        "{%s:goal.identical} ({%s:identical_rounds|int} of {%s:round_count|int} rounds); turn 2 cached over turn 1 "
        "{%s:turn2_over_turn1|x}" % (PPF, PPF, PPF, PPF), PPFHOW),
    Row("2-stage pipeline, default precision: rounds whose cached answer is the uncached one; "
        "equal tokens (16 a round)", "{%s:identical_rounds|int} of {%s:round_count|int}; {%s:same_tokens|pct}"
        % (PP, PP, PP), PPHOW),
    Row("2-stage pipeline, default precision, the control: rounds whose uncached answer stays the same "
        "with prefill chunks of half the size", "{%s:other_split_identical_rounds|int} of {%s:round_count|int}"
        % (PP, PP), PPHOW),
    Row("2-stage pipeline, exact prompt cache: rounds whose cached answer is the uncached one; turn 2's "
        "`cached_tokens`; turn 2 cached over turn 1",
        "{%s:identical_rounds|int} of {%s:round_count|int}; {%s:turn2_cached_tokens|int}; {%s:turn2_over_turn1|x}"
        % (PPX, PPX, PPX, PPX), PPXHOW),
    *_engine_rows(PM, PMHOW, "MoE engine"),
    *_engine_rows(PS, PSHOW, "sparse engine"),
))

S = "serve"
# one engine's cell of a serve set: aggregate tok/s and TTFT (its figures key, three times)
SERVE_FIG = "{%s.aggregate_tok_s|f1} tok/s in all; TTFT p50 {%s.ttft_p50_s|f2} s, p95 {%s.ttft_p95_s|f2} s"
SHOW = ("`flotilla bench serve` (0.9 B random Llama, bf16, default precision; streaming chat requests of "
        "32 greedy tokens through the API from a client process; every engine open at once; each other "
        "engine's burst between two of the local engine's, its ratio over their mean; 3 rounds per run)")


def _serve_rows(i: int, c: int) -> tuple[Row, ...]:
    local = f"{S}:figures.local.levels.{i}"
    users = f"{c} concurrent request{'s' if c > 1 else ''}"

    def beside(kind: str, label: str) -> Row:
        k = f"{S}:figures.{kind}.levels.{i}"
        return Row(f"{users}: {label}", SERVE_FIG % (k, k, k) + "; {%s.over_first_engine|x} the local engine's tok/s "
                   "(its bursts just before and after); same answers as it: {%s.same_as_first_engine|pct}" % (k, k),
                   SHOW)

    held = f"{S}:figures.local.constrained.{i}"
    return (Row(f"{users}: local engine (every request in one forward pass, paged KV cache)",
                SERVE_FIG % (local, local, local), SHOW),
            Row(f"{users}: local engine, every answer held to a JSON schema (constrained decoding)",
                "{%s.aggregate_tok_s|f1} tok/s in all; {%s.constrained_over_free|x} its free answers' tok/s; "
                "{%s.constrained_extra_ms_per_token|f2} ms more per token of an answer (below the runs' noise "
                "where the range spans 0)" % (held, held, held), SHOW),
            beside("loop", "the earlier local engine (one token of each request per turn, `--engine loop`)"),
            beside("batched", "openvino_genai continuous batching (`--engine batched`)"),
            beside("llm-pipeline", "openvino_genai LLMPipeline (one request at a time)"))


SERVE = Table("api-serve", ("several users on one PC", "measured", "how"),
              tuple(r for i, c in enumerate((1, 4, 8, 16)) for r in _serve_rows(i, c)))

# One request at a time, where the local engine and LLMPipeline are closest: more rounds, two engines.
S1 = "serve-c1"
S1HOW = ("`flotilla bench serve --engines local,llm-pipeline --concurrency 1 --rounds 12` (the same model "
         "and requests as above; 12 rounds per run)")
_LOCAL1, _LLM1 = f"{S1}:figures.local.levels.0", f"{S1}:figures.llm-pipeline.levels.0"
SERVE_C1 = Table("api-serve-c1", ("one request at a time, 12 rounds a run", "measured", "how"), (
    Row("local engine", "{%s.aggregate_tok_s|f1} tok/s; TTFT p50 {%s.ttft_p50_s|f2} s" % (_LOCAL1, _LOCAL1), S1HOW),
    Row("openvino_genai LLMPipeline", "{%s.aggregate_tok_s|f1} tok/s; TTFT p50 {%s.ttft_p50_s|f2} s" % (_LLM1, _LLM1),
        S1HOW),
    Row("LLMPipeline over the local engine (tok/s; in even rounds its burst over the mean of the local engine's "
        "just before and after, in odd rounds the mean of its two over the local engine's between them): the median "
        "of a run's rounds; their lowest and highest; the share of rounds it was ahead",
        "{%s.over_first_engine|x}; {%s.over_first_engine_min|x} to {%s.over_first_engine_max|x}; "
        "{%s.rounds_ahead_of_first_engine|pct}" % (_LLM1, _LLM1, _LLM1, _LLM1), S1HOW),
))

# Several requests, where continuous batching is the engine to beat: the two alone, more rounds.
SB = "serve-batched"
SBHOW = ("`flotilla bench serve --engines local,batched --concurrency 4,8,16 --rounds 6` (the same model and "
         "requests as above; 6 rounds per run)")


def _batched_rows(i: int, c: int) -> tuple[Row, ...]:
    local, cb = f"{SB}:figures.local.levels.{i}", f"{SB}:figures.batched.levels.{i}"
    return (Row(f"{c} concurrent requests: local engine", SERVE_FIG % (local, local, local), SBHOW),
            Row(f"{c} concurrent requests: openvino_genai continuous batching", SERVE_FIG % (cb, cb, cb), SBHOW),
            Row(f"{c} concurrent requests: continuous batching over the local engine (tok/s, as in the table "
                "above): the median of a run's rounds; their lowest and highest; the share of rounds it was "
                "ahead; same answers",
                "{%s.over_first_engine|x}; {%s.over_first_engine_min|x} to {%s.over_first_engine_max|x}; "
                "{%s.rounds_ahead_of_first_engine|pct}; {%s.same_as_first_engine|pct}" % (cb, cb, cb, cb, cb), SBHOW))


SERVE_BATCHED = Table("api-serve-batched", ("several requests at once, 6 rounds a run", "measured", "how"),
                      tuple(r for i, c in enumerate((4, 8, 16)) for r in _batched_rows(i, c)))

FILE = REPO_ROOT / "docs" / "api.md"
TABLES = (GRAMMAR, PROMPT_CACHE, SERVE, SERVE_C1, SERVE_BATCHED)
