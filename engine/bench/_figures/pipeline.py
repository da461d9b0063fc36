"""docs/pipeline.md's figure tables (see engine/bench/_figures/__init__.py for the rules)."""

from __future__ import annotations

from engine.bench._report import REPO_ROOT, Row, Table

SHARDS = "`flotilla bench shards --quick`"
PIPE = "`flotilla bench pipeline --quick`"
OPS = "runtime_ops_first_shard"

PIPELINE_SHARDS = Table("pipeline-shards", ("what", "figure", "how"), (
    Row("benchmark model (random weights)",
        "{shards-quick:model.params_m|f1} M parameters, {shards-quick:model.f32_weights_mb|f0} MB f32, "
        "{shards-quick:model.layers|int} layers, hidden {shards-quick:model.hidden|int}", SHARDS),
    Row("decode step, whole model (one shard, fused KV)", "{shards-quick:whole_ms|f2} ms",
        SHARDS + ", after a 256-token prefill"),
    Row("decode step, 2 shards (fused KV)", "{shards-quick:split_ms|f2} ms", SHARDS),
    Row("decode step, 2 shards exported without `beam_idx` (unfused)",
        "{shards-quick:split_without_fix_ms|f2} ms", SHARDS),
    Row("split / whole (goal ≤ 1.05)", "{shards-quick:split_over_whole|f3}", SHARDS),
    Row("split without the fix / whole", "{shards-quick:split_over_whole_without_fix|f3}", SHARDS),
    Row("one fused SDPA node per layer in every fused shard", "{shards-quick:fused_sdpa_all_shards}", SHARDS),
))

_OPS = (("ScaledDotProductAttention (reading `MemoryInput` directly)", "ScaledDotProductAttention"),
        ("MemoryInput (ReadValue)", "MemoryInput"), ("MemoryOutput (Assign)", "MemoryOutput"),
        ("Concatenation", "Concatenation"), ("Gather", "Gather"),
        ("MatMul (attention scores / values, decomposed)", "MatMul"), ("Softmax", "Softmax"),
        ("FullyConnected (projections, MLP)", "FullyConnected"))

PIPELINE_SHARD_OPS = Table("pipeline-shard-ops", ("runtime op", "with beam_idx (fused) / without", "how"), tuple(
    Row(what, f"{{shards-quick:{OPS}.fused.{op}|int}} / {{shards-quick:{OPS}.without_fix.{op}|int}}",
        SHARDS + ", `" + OPS + "`")
    for what, op in _OPS))


MOE = "`flotilla bench shards --quick --arch qwen3_moe --layers 4`"
MOE_A3B = ("`flotilla bench shards --quick --arch qwen3_moe --hidden 2048 --layers 2 --experts 16 --top-k 8 "
           "--heads 32 --kv-heads 4`")
DENSE_2048 = "`flotilla bench shards --quick --hidden 2048 --layers 4 --inter 8192 --heads 32 --kv-heads 8`"
DENSE_4096 = "`flotilla bench shards --quick --hidden 4096 --layers 2 --inter 14336 --heads 32 --kv-heads 8`"

PIPELINE_MOE = Table("pipeline-moe", ("what", "figure", "how"), (
    Row("benchmark model (random weights)",
        "Qwen3-MoE, {shards-moe:model.layers|int} layers, hidden {shards-moe:model.hidden|int}, "
        "{shards-moe:model.experts|int} experts of width {shards-moe:model.intermediate|int} (top-"
        "{shards-moe:model.experts_per_token|int}), {shards-moe:model.f32_weights_mb|f0} MB f32", MOE),
    Row("decode step, whole model / 2 shards (f32 shards, fused KV)",
        "{shards-moe:whole_ms|f2} ms / {shards-moe:split_ms|f2} ms", MOE + ", after a 256-token prefill"),
    Row("split / whole (goal ≤ 1.05)", "{shards-moe:split_over_whole|f3}", MOE),
))


def _memory_row(src: str, what: str, prec: str, name: str, i: int, how: str) -> Row:
    r = f"{src}:memory.by_precision.{prec}.{name}.{i}"
    return Row(f"{what}, {prec}",
               f"{{{r}.shard_bytes|mib}} | {{{r}.planned.process_bytes|mib}} | {{{r}.planned.expert_bytes|mib}} | "
               f"{{{r}.measured.anon_peak_bytes|mib}} | {{{r}.plan_vs_anon|spct}}", how)


WHOLE = (("whole", 0, "whole"),)
_MEMORY_CASES = (
    ("shards-quick", "Llama, hidden 1024, 8 layers", WHOLE, SHARDS),
    ("shards-h2048", "Llama, hidden 2048 (Llama-3.2-1B's widths), 4 layers", WHOLE, DENSE_2048),
    ("shards-h4096", "Llama, hidden 4096 (Llama-3.1-8B's widths), 2 layers", WHOLE, DENSE_4096),
    ("shards-moe", "Qwen3-MoE, hidden 1024, 4 layers of 32 experts of width 768",
     WHOLE + (("split", 0, "stage 0 of 2"), ("split", 1, "stage 1 of 2")), MOE),
    ("shards-moe-a3b", "Qwen3-MoE at Qwen3-30B-A3B's expert shape (hidden 2048, width 768), 2 layers of 16 experts",
     WHOLE, MOE_A3B),
)

PIPELINE_SHARD_MEMORY = Table(
    "pipeline-shard-memory",
    ("shard", "shard file | planned process | of which expert copy | measured anonymous peak | plan vs measured",
     "how"),
    tuple(_memory_row(src, f"{what}: {label}", prec, n, i, how)
          for src, what, parts, how in _MEMORY_CASES for prec in ("fp16", "int8") for n, i, label in parts))


def _streams(case: str) -> str:
    return " / ".join(f"{{pipeline-quick:aggregate_tok_s.{case}.{n}|f1}}" for n in (1, 2, 4))


PIPELINE_TOK_S = Table("pipeline-tok-s", ("aggregate tok/s", "1 / 2 / 4 streams", "how"), (
    Row("monolithic: whole model, 1 process on 1 core, no messaging", _streams("monolithic"), PIPE),
    Row("monolithic_engine: whole model as 1 stage worker behind the coordinator", _streams("monolithic_engine"),
        PIPE),
    Row("pipeline_2stages: 2 stage workers, 1 core each, coordinator", _streams("pipeline_2stages"), PIPE),
    Row("data_parallel: 2 whole-model replicas, 1 core each", _streams("data_parallel"), PIPE),
))

PIPELINE_RATIOS = Table("pipeline-ratios", ("what", "figure", "how"), (
    Row("`speedup_2streams`: pipeline, 2 streams / monolithic, 1 stream (goal 1.85; the paper's 1.80×)",
        "{pipeline-quick:speedup_2streams|x}", PIPE),
    Row("same with 4 streams", "{pipeline-quick:speedup_by_streams.4|x}", PIPE),
    Row("`pipeline_over_data_parallel`: pipeline / data_parallel at the same stream count (equal CPU budget)",
        "{pipeline-quick:pipeline_over_data_parallel|x} at 2 streams, "
        "{pipeline-quick:pipeline_over_data_parallel_by_streams.4|x} at 4", PIPE),
    Row("interleaving gain on loopback: pipeline, N streams / 1 stream",
        "{pipeline-quick:interleaving_gain_loopback.2|x} at 2 streams, "
        "{pipeline-quick:interleaving_gain_loopback.4|x} at 4", PIPE),
    Row("compute per step reported by the workers, mean over the run: stage 0 / stage 1",
        "{pipeline-quick:stage_compute_ms_mean.0|f1} / {pipeline-quick:stage_compute_ms_mean.1|f1} ms", PIPE),
    Row("the same for the whole model as one worker", "{pipeline-quick:monolithic_engine_compute_ms_mean|f1} ms",
        PIPE),
    Row("where the coordinators ran (`pinning.coordinator_mode`)", "{pipeline-quick:pinning.coordinator_mode}",
        PIPE + " on this machine's cores"),
    Row("`curve_overhead`: CURVE vs plaintext ring, 2 streams (goal < 3 %; details in fleet.md)",
        "{pipeline-quick:curve_overhead|pct}", PIPE),
))

FILE = REPO_ROOT / "docs" / "pipeline.md"
TABLES = (PIPELINE_SHARDS, PIPELINE_SHARD_OPS, PIPELINE_MOE, PIPELINE_SHARD_MEMORY, PIPELINE_TOK_S,
          PIPELINE_RATIOS)
