"""The README's figure tables (see engine/bench/_figures/__init__.py for the rules)."""

from __future__ import annotations

from engine.bench._report import REPO_ROOT, Row, Table

Q = "`flotilla bench {} --quick`"

README_MEASURED = Table("readme-measured", ("what", "figure", "how"), (
    Row("demo models built (all five, empty cache)", "{local-quick:build_demos_s|f1} s", Q.format("local")),
    Row("local engine, decode (greedy, after a warm-up answer)",
        "{local-quick:engine.demo.decode_tok_s|int} tok/s (`demo`), "
        "{local-quick:engine.demo-qwen3.decode_tok_s|int} (`demo-qwen3`), "
        "{local-quick:engine.demo-moe.decode_tok_s|int} (`demo-moe`)", Q.format("local")),
    Row("local engine, time to first token (warm engine)",
        "{local-quick:engine.demo.ttft_ms|f1} ms (`demo`)", Q.format("local")),
    Row("prompt caching: a chat's second turn after a long history (0.9 B random Llama, local engine)",
        "history {prompt-cache:history|int} tokens ({prompt-cache:rounds.0.history_tokens|int} in turn 1's "
        "prompt), {prompt-cache:turn2_cached_tokens|int} of them not prefilled again; time to first token "
        "{prompt-cache:turn1_ttft_s|f1} s → {prompt-cache:turn2_ttft_s|f1} s ({prompt-cache:turn2_over_turn1|x}), "
        "without the cache {prompt-cache:turn2_uncached_ttft_s|f1} s; same answer as without the cache: "
        "{prompt-cache:goal.identical}", "`flotilla bench prompt-cache`"),
    Row("several users on one PC: 8 concurrent chat requests through the API (0.9 B random Llama)",
        "local engine (every request in one forward pass) {serve:figures.local.levels.2.aggregate_tok_s|f1} tok/s "
        "in all; its earlier one-token-per-turn loop {serve:figures.loop.levels.2.aggregate_tok_s|f1} tok/s "
        "({serve:figures.loop.levels.2.over_first_engine|x}); openvino_genai's continuous batching "
        "{serve:figures.batched.levels.2.aggregate_tok_s|f1} tok/s ({serve:figures.batched.levels.2.over_first_engine|x}), "
        "same answers {serve:figures.batched.levels.2.same_as_first_engine|pct}; TTFT p50 "
        "{serve:figures.local.levels.2.ttft_p50_s|f2} s vs {serve:figures.loop.levels.2.ttft_p50_s|f2} s vs "
        "{serve:figures.batched.levels.2.ttft_p50_s|f2} s; openvino_genai's LLMPipeline (one request at a time) "
        "{serve:figures.llm-pipeline.levels.2.aggregate_tok_s|f1} tok/s",
        "`flotilla bench serve`"),
    Row("prompt caching on the MoE engine (Qwen3-30B-A3B's shapes, 4 layers, experts read from disk) and the "
        "sparse engine (0.9 B random Llama), the same history",
        "time to first token, turn 1 → turn 2: MoE {prompt-cache-moe:turn1_ttft_s|f1} s → "
        "{prompt-cache-moe:turn2_ttft_s|f2} s ({prompt-cache-moe:turn2_over_turn1|x}), sparse "
        "{prompt-cache-sparse:turn1_ttft_s|f1} s → {prompt-cache-sparse:turn2_ttft_s|f2} s "
        "({prompt-cache-sparse:turn2_over_turn1|x})",
        "`flotilla bench prompt-cache --engine moe` / `--engine sparse`"),
    Row("prompt caching across a 2-stage pipeline (the same model and history)",
        "{prompt-cache-pipeline:turn2_cached_tokens|int} tokens not prefilled again; time to first token "
        "{prompt-cache-pipeline:turn1_ttft_s|f1} s → {prompt-cache-pipeline:turn2_ttft_s|f1} s "
        "({prompt-cache-pipeline:turn2_over_turn1|x}); same answer as without the cache: "
        "{prompt-cache-pipeline-f32:goal.identical} in exact f32, "
        "{prompt-cache-pipeline:identical_rounds|int} of {prompt-cache-pipeline:round_count|int} rounds at the "
        "default precision (a bf16 prefill rounds differently per chunk split, and the take-over re-quantizes "
        "the u8 KV cache: docs/api.md), {prompt-cache-pipeline-exact:identical_rounds|int} of "
        "{prompt-cache-pipeline-exact:round_count|int} with `--exact-prompt-cache`",
        "`flotilla bench prompt-cache --engine pipeline` (`--precision f32`, `--exact-cache`)"),
    Row("local engine vs `openvino_genai.LLMPipeline`, same IR (0.9 B random Llama), interleaved rounds "
        "in one process; ours / genai",
        "decode {local:side_by_side.ours_vs_genai.decode_tok_s|x} "
        "({local:side_by_side.interleaved.ours_over_genai.decode_tok_s.min|f2}–"
        "{local:side_by_side.interleaved.ours_over_genai.decode_tok_s.max|f2} per round), warm first token "
        "{local:side_by_side.ours_vs_genai.ttft_warm|x}, CPU per token "
        "{local:side_by_side.ours_vs_genai.cpu_ms_per_token|x}, peak anonymous memory "
        "{local:side_by_side.ours_vs_genai.peak_anon|x} (fresh processes); "
        "{local:side_by_side.interleaved.rounds|int} rounds per run", "`flotilla bench local`"),
    Row("`flotilla chat -p` launch → first streamed byte",
        "cold (export + compile) {local-quick:launch_first_byte_s.cold|f1} s, "
        "warm {local-quick:launch_first_byte_s.warm|f1} s", Q.format("local")),
    Row("split model vs whole (fused stateful KV), per-token time",
        "`split_over_whole` {shards-quick:split_over_whole|f2}; fused SDPA in every shard: "
        "{shards-quick:fused_sdpa_all_shards}", Q.format("shards") + " (93 M Llama, f32 shards)"),
    Row("pipeline, 2 stages × 2 streams, aggregate tok/s",
        "{pipeline-quick:aggregate_tok_s.pipeline_2stages.2|f1} vs monolithic 1 stream "
        "{pipeline-quick:aggregate_tok_s.monolithic.1|f1} → {pipeline-quick:speedup_2streams|x}; "
        "vs two whole-model replicas (data parallel, 2 streams) "
        "{pipeline-quick:aggregate_tok_s.data_parallel.2|f1} → {pipeline-quick:pipeline_over_data_parallel|x}",
        Q.format("pipeline") + " (93 M Llama, loopback, 1 core per stage)"),
    Row("CurveZMQ on the data plane: 1 − tok/s(CURVE) / tok/s(plaintext), paired runs, 2 streams",
        "{pipeline-quick:curve_overhead|pct} (negative: the CURVE ring was the faster one); "
        "one decode hop's round trip {pipeline-quick:curve_hop_us.added_per_round_trip|f0} µs longer with CURVE "
        "(2000 round trips)", Q.format("pipeline")),
    Row("speculative decoding: mask rollback vs physical trim",
        "{spec-quick:mask_rollback_ms.1024|f2} ms vs {spec-quick:trim_rollback_ms.1024|f1} ms at context 1024 "
        "({spec-quick:trim_rollback_ms.4096|f1} ms at 4096; a decode step is "
        "{spec-quick:decode_step_ms.1024|f1} ms)", Q.format("spec")),
    Row("speculative decoding, 2 stages, K = 4, **synthetic** pair at 70 % acceptance",
        "{spec-quick:speedup_at_70pct|x}, output identical to greedy: {spec-quick:identical_to_greedy}",
        Q.format("spec") + " (damped target, noisy copy of its layer 0 as draft)"),
    Row("speculative decoding, real pair `demo-draft` → `demo` (trained demos)",
        "acceptance {spec-quick:real_pair.acceptance|pct}, {spec-quick:real_pair.speedup|x}", Q.format("spec")),
    Row("MoE offloading, Qwen3-30B-A3B layer shapes in bf16, every engine under a memory cap of half the "
        "checkpoint, 16 requests",
        "Bevy {moe-quick:speedup_vs_on_demand|x} over on-demand, {moe-quick:speedup_vs_prefetch|x} over prefetch "
        "(I/O: {moe-quick:io.effective}; matmuls in {moe-quick:compute}; tokens equal to on-demand's answers: "
        "Bevy {moe-quick:results.bevy.16.same_tokens_as_on_demand|pct}, prefetch "
        "{moe-quick:results.prefetch.16.same_tokens_as_on_demand|pct})", Q.format("moe")),
    Row("sparse FFN, Llama-3.1-8B layer shapes (12 layers, bf16), every engine under a memory cap of half the "
        "checkpoint, the neurons to read picked by the engine's low-rank predictor (random weights: any threshold "
        "above 0 changes the output, docs/sparse.md)",
        "{sparse-quick:equal_quality.speedup_vs_mmap|x} of mmap's speed at equal quality (threshold "
        "{sparse-quick:equal_quality.sparsity}, the dense output), {sparse-quick:speedup_vs_mmap|x} at sparsity 0.8 "
        "(top-1 agreement {sparse-quick:top1_agreement_at_sparsity|f2}); {sparse-quick:speedup_vs_on_demand|x} vs "
        "on-demand (I/O: {sparse-quick:io.effective})", Q.format("sparse")),
    Row("chaos: 3 stages, 16 streams, a stage killed every few s",
        "{chaos-quick:completed|int} of {chaos-quick:submitted|int} completed, "
        "{chaos-quick:duplicated_tokens|int} duplicated, {chaos-quick:lost_tokens|int} lost tokens; "
        "max recovery {chaos-quick:max_recovery_s|f1} s",
        Q.format("chaos")),
    Row("bigger than its processes: Llama-3.1-8B shapes, 2 stages at int4, every process in a cgroup capped "
        "below what it holds",
        "bf16 checkpoint {scale:checkpoint.bytes|mib}; exporter peak anonymous {scale:precisions.int4.export.stages.0.rss_anon_peak_bytes|mib} / "
        "{scale:precisions.int4.export.stages.1.rss_anon_peak_bytes|mib} under "
        "{scale:precisions.int4.export.cap_bytes|mib}; workers "
        "{scale:precisions.int4.fleet.workers.0.rss_anon_peak_bytes|mib} / "
        "{scale:precisions.int4.fleet.workers.1.rss_anon_peak_bytes|mib} anonymous with 2 streams filling a 1024-token "
        "context, each agent + worker in a cgroup capped below the whole int4 model "
        "({scale:precisions.int4.shard_bytes.0|mib} + {scale:precisions.int4.shard_bytes.1|mib} of shard files); "
        "{scale:precisions.int4.fleet.runs.1.tok_s|f1} tok/s (2 cores shared by both stages)",
        "`flotilla bench scale --precisions int4` (random weights; int8 / fp16, the 1B-shape runs "
        "and the agreement with transformers in docs/pipeline.md)"),
))

FILE = REPO_ROOT / "README.md"
TABLES = (README_MEASURED,)
