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
    *(Row(f"{p}, whole model alone in a process: shard; planned; measured anonymous peak; plan vs measured",
          f"{{{d}.shard_bytes|mib}}; {{{d}.planned.process_bytes|mib}}; {{{d}.measured.anon_peak_bytes|mib}}; "
          f"{{{d}.plan_vs_anon|spct}}", SHARDS + " (memory runs: see the MoE section)")
      for p, d in (("fp16", "shards-quick:memory.by_precision.fp16.whole.0"),
                   ("int8", "shards-quick:memory.by_precision.int8.whole.0"))),
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


MOE = "`flotilla bench shards --quick --arch qwen3_moe`"
_MEM = "shards-moe:memory.by_precision"


def _moe_memory_row(prec: str, name: str, i: int, what: str) -> Row:
    r = f"{_MEM}.{prec}.{name}.{i}"
    return Row(f"{prec}, {what}",
               f"shard {{{r}.shard_bytes|mib}}; planned {{{r}.planned.process_bytes|mib}} "
               f"(experts {{{r}.planned.expert_bytes|mib}}, counted twice); measured "
               f"{{{r}.measured.anon_peak_bytes|mib}}; plan vs measured {{{r}.plan_vs_anon|spct}}", MOE)


PIPELINE_MOE = Table("pipeline-moe", ("what", "figure", "how"), (
    Row("benchmark model (random weights)",
        "Qwen3-MoE, {shards-moe:model.layers|int} layers, hidden {shards-moe:model.hidden|int}, "
        "{shards-moe:model.experts|int} experts of width {shards-moe:model.intermediate|int} (top-"
        "{shards-moe:model.experts_per_token|int}), {shards-moe:model.f32_weights_mb|f0} MB f32", MOE),
    Row("decode step, whole model / 2 shards (f32 shards, fused KV)",
        "{shards-moe:whole_ms|f2} ms / {shards-moe:split_ms|f2} ms", MOE + ", after a 256-token prefill"),
    Row("split / whole (goal ≤ 1.05)", "{shards-moe:split_over_whole|f3}", MOE),
    *(_moe_memory_row(p, n, i, w) for p in ("fp16", "int8")
      for n, i, w in (("whole", 0, "whole model"), ("split", 0, "stage 0 of 2"), ("split", 1, "stage 1 of 2"))),
))


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
TABLES = (PIPELINE_SHARDS, PIPELINE_SHARD_OPS, PIPELINE_MOE, PIPELINE_TOK_S, PIPELINE_RATIOS)
