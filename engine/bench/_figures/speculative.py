"""docs/speculative.md's figure tables (see engine/bench/_figures/__init__.py for the rules).

Everything here comes from `flotilla bench spec --quick` (docs/bench/spec-quick/).
The rollback table and the synthetic rows of the throughput table use the
synthetic pair (`pair.synthetic`: true, acceptance set by construction); the
real pair (`real_pair`) and prompt lookup on a real target (`real_lookup`) sit
beside them.
"""

from __future__ import annotations

from engine.bench._report import REPO_ROOT, Row, Table

S = "spec-quick"
HOW = "`flotilla bench spec --quick`"
CONTEXTS = ("256", "1024", "4096")


def _per_context(template: str) -> str:
    """One figure per rollback context: '256: …; 1024: …; 4096: …'."""
    return "; ".join(f"{c}: " + template.replace("CTX", c) for c in CONTEXTS)


ROLLBACK = Table("spec-rollback", ("what (context 256 / 1024 / 4096 tokens)", "measured", "how"), (
    Row("decode step (1 token)", _per_context("{%s:rollback.CTX.decode_step_ms|f1} ms" % S),
        HOW + ", whole synthetic target as one shard, 1 thread"),
    Row("mask rollback (hide 4 rejected drafts, build the next mask and positions)",
        _per_context("{%s:rollback.CTX.mask_rollback_ms|f3} ms = {%s:rollback.CTX.mask_over_decode_pct|f2} %% "
                     "of a step" % (S, S)), HOW),
    Row("mask rollback under 1 % of a decode step at every context (goal)",
        "{%s:mask_rollback_under_1pct}" % S, HOW),
    Row("physical trim of the same 4 positions (query_state → slice → set_state)",
        _per_context("{%s:rollback.CTX.trim_rollback_ms|f1} ms = {%s:rollback.CTX.trim_over_decode_pct|f0} %% "
                     "of a step" % (S, S)), HOW),
    Row("physical trim per MiB of KV state (what a compaction copy costs)",
        _per_context("{%s:rollback.CTX.trim_ms_per_mib|f2} ms/MiB of {%s:rollback.CTX.kv_mib|f1} MiB" % (S, S)),
        HOW),
    Row("decode step with 4 hidden positions", _per_context("{%s:rollback.CTX.decode_step_with_hidden_ms|f1} ms" % S),
        HOW),
    Row("verify step (pending + 4 drafts = 5 tokens)", _per_context("{%s:rollback.CTX.verify_step_ms_k4|f1} ms" % S),
        HOW),
))


def _draft(level: str, i: int) -> Row:
    return Row(f"**synthetic** pair, draft calibrated to ≈{level} %",
               "{%s:throughput.tok_s.draft%s|f1} tok/s = {%s:throughput.speedup.draft%s|x}; acceptance "
               "{%s:throughput.measured.draft%s.acceptance|pct} online (teacher-forced "
               "{%s:drafts.%d.teacher_forced_acceptance|pct}), {%s:throughput.measured.draft%s.tokens_per_step|f2} "
               "tokens per verify step" % (S, level, S, level, S, level, S, i, S, level),
               HOW)


THROUGHPUT = Table("spec-throughput", ("what (2 stages, 1 stream, K = 4 fixed, greedy, 48 tokens)", "measured",
                                       "how"), (
    Row("synthetic target, no speculation", "{%s:throughput.tok_s.off|f1} tok/s" % S,
        HOW + " (2 worker processes, f32, 1 thread each)"),
    _draft("50", 0),
    _draft("70", 1),
    _draft("90", 2),
    Row("**synthetic** pair ≈70 %, 2 interleaved streams (aggregate)",
        "{%s:throughput.two_streams_tok_s.off|f1} → {%s:throughput.two_streams_tok_s.draft70|f1} tok/s = "
        "{%s:throughput.two_streams_tok_s.speedup|x}" % (S, S, S), HOW),
    Row("**synthetic** pair ≈70 %, adaptive K (one answer per run)",
        "{%s:throughput.adaptive_k_tok_s_at_70pct|f1} tok/s" % S, HOW),
    Row("prompt lookup on the synthetic target (story prompt)",
        "{%s:throughput.tok_s.lookup|f1} tok/s = {%s:throughput.speedup.lookup|x}; acceptance "
        "{%s:throughput.measured.lookup.acceptance|pct}" % (S, S, S), HOW),
    Row("**real** pair `demo-draft` → `demo` (trained demos, nothing tuned for agreement)",
        "{%s:real_pair.tok_s.off|f1} → {%s:real_pair.tok_s.draft|f1} tok/s = {%s:real_pair.speedup|x}; "
        "acceptance {%s:real_pair.acceptance|pct} ({%s:real_pair.accepted_of_drafted|pct} of drafted tokens "
        "kept), {%s:real_pair.tokens_per_step|f2} tokens per verify step" % (S, S, S, S, S, S), HOW),
    Row("**real** target `demo`, prompt lookup, repetitive code-like prompt",
        "{%s:real_lookup.tok_s.off|f1} → {%s:real_lookup.tok_s.lookup|f1} tok/s = {%s:real_lookup.speedup|x}; "
        "acceptance {%s:real_lookup.acceptance|pct} ({%s:real_lookup.accepted_of_drafted|pct} of drafted "
        "tokens kept), {%s:real_lookup.tokens_per_step|f2} tokens per verify step" % (S, S, S, S, S, S), HOW),
    Row("every speculative answer equals plain greedy (synthetic, real pair, lookup)",
        "{%s:identical_to_greedy}" % S, HOW),
))

# openvino_genai's own speculative LLMPipeline on the same synthetic pair (the JSON's
# `openvino_genai`; only while every run has `supported: true`, else drop the table).
ANCHOR = Table("spec-anchor", ("what (synthetic target + ≈70 % draft, K = 4, greedy, 48 tokens)", "measured", "how"), (
    Row("openvino_genai `LLMPipeline` with `draft_model` (whole model in one process, f32, "
        "`num_assistant_tokens` = 4)",
        "{%s:openvino_genai.tok_s_plain|f1} → {%s:openvino_genai.tok_s_speculative|f1} tok/s = "
        "{%s:openvino_genai.speedup|x}; same text as without the draft: {%s:openvino_genai.identical_text}"
        % (S, S, S, S), HOW + " (optimum-intel IR + openvino_tokenizers, the plugin's default threads)"),
))

# Not a measurement: a bound computed from measured parts, so in its own table.
MODEL = Table("spec-model", ("what", "modelled from measured parts", "model"), (
    Row("ceiling of the ≈70 % speedup, even with a free draft (context 256, the closest measured "
        "to the benchmark's short answers)",
        "{%s:throughput.measured.draft70.tokens_per_step|f2} tokens per verify step ÷ "
        "({%s:rollback.256.verify_step_ms_k4|f1} ms verify step / {%s:rollback.256.decode_step_ms|f1} ms "
        "decode step)" % (S, S, S),
        "speedup ≤ tokens per verify step / (verify step / decode step); the K draft steps on the "
        "coordinator only lower it"),
))

FILE = REPO_ROOT / "docs" / "speculative.md"
TABLES = (ROLLBACK, THROUGHPUT, ANCHOR, MODEL)
