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
    Row("local engine, `demo`, 60-digit JSON array vs a free answer of the same length",
        "{%s:engine.ms_per_token_ratio.median|f3}× the time per token "
        "({%s:engine.extra_ms_per_token.median|f3} ms more per token)" % (G, G),
        HOW + "; interleaved rounds, median over rounds and runs"),
))

FILE = REPO_ROOT / "docs" / "api.md"
TABLES = (GRAMMAR,)
