"""docs/sparse.md's figure tables (see engine/bench/_figures/__init__.py for the rules).

The variant table has more than three columns: a row's figure
then holds several cells separated by " | ", and the header names every
column (the first is the row's `what`, the last its `how`).

Not here: the replayed-trace scenario (`scenario_replayed_trace.runs`), whose
keys are the Jaccard values ("0.5", "0.85"): a dotted placeholder path cannot
name a key that holds a dot.
"""

from __future__ import annotations

from engine.bench._report import REPO_ROOT, Row, Table

S = "sparse-quick"
Q = "`flotilla bench sparse --quick`"


def _f(path: str, fmt: str = "g") -> str:
    return "{" + f"{S}:{path}|{fmt}" + "}"


SPARSE_SETUP = Table("sparse-setup", ("what", "figure", "how"), (
    Row("benchmark checkpoint (random weights, Llama-3.1-8B's shapes: vocab 128256, GQA 32/8)",
        f"{_f('model.layers', 'int')} layers, hidden {_f('model.hidden', 'int')}, FFN {_f('model.neurons', 'int')}, "
        f"{{{S}:model.dtype}} safetensors shards, {_f('model.checkpoint_bytes', 'mib')}", Q),
    Row("memory cap of every engine run (ours, on-demand, mmap), from its first byte",
        f"{_f('cap_bytes', 'mib')}: the checkpoint is {_f('checkpoint_over_cap', 'x')} the cap", Q),
    Row("FFN bytes; attention + head, resident (the input embedding stays a view of the file)",
        f"{_f('model.ffn_bytes', 'mib')}; {_f('model.non_ffn_resident_bytes', 'mib')}", Q),
    Row("ours in the cap (predicted mode): predictors; neuron cache the engine chose (its minimum)",
        f"{_f('fixed_ffn_side_bytes', 'mib')}; {_f('cache_budget_bytes', 'mib')} "
        f"({_f('min_cache_budget_bytes', 'mib')}), KV reserved for {_f('context_length', 'int')} tokens", Q),
    Row("peak memory-group usage (page cache included), ours; mmap",
        f"{_f('ours_cgroup.max_usage_bytes', 'mib')}; {_f('mmap_cgroup.max_usage_bytes', 'mib')} "
        f"(OOM kills: {_f('ours_cgroup.oom_kills', 'int')})", Q),
    Row("predicted-mode bundle (gate row + up row + down column)", f"{_f('bundle_bytes_on_disk', 'int')} bytes", Q),
    Row("reads of ours and on-demand (`io`)", f"requested {{{S}:io.requested}}, in effect {{{S}:io.effective}}", Q),
    Row("disk probe, O_DIRECT random reads of one bundle",
        f"{_f('disk.bundle_read_mb_s_depth_1', 'f0')} MB/s at depth 1, "
        f"{_f('disk.bundle_read_mb_s_best_depth', 'f0')} MB/s at the best depth", Q),
    Row("disk probe, other sizes",
        f"{_f('disk.random.3.size', 'int')} bytes at depth {_f('disk.random.3.depth', 'int')}: "
        f"{_f('disk.random.3.mb_s', 'f0')} MB/s; sequential {_f('disk.sequential_mb_s', 'f0')} MB/s; "
        f"coalescing gap chosen: {_f('disk.best_gap_bundles', 'int')} bundles", Q),
))

SPARSE_QUALITY = Table(
    "sparse-quality",
    ("`--sparsities`", "SwiGLU sparsity | top-1 agreement with dense | perplexity change | ours, tok/s | "
     "ours over mmap", "key in `thresholds`"),  # type: ignore[arg-type]
    tuple(Row(("lowest", "middle", "highest")[i],
              f"{{{S}:thresholds.{i}.sparsity}} | {_f(f'thresholds.{i}.top1_agreement', 'f2')} | "
              f"{_f(f'thresholds.{i}.ppl_change_pct', 'f1')} % | {_f(f'thresholds.{i}.tok_s', 'f2')} | "
              f"{_f(f'thresholds.{i}.speedup_vs_mmap', 'x')}", f"`{i}`") for i in range(3)))

SPARSE_RESULTS = Table(
    "sparse-results",
    ("variant", "tok/s", "bytes read / token", "I/O wait share of the token", "key in `tok_s` etc."),  # type: ignore[arg-type]
    (
        Row("ours (predicted delta reads + confident prefetch)",
            f"{_f('tok_s.ours', 'f2')} | {_f('bytes_read_per_token.ours', 'mib')} "
            f"({_f('reads_per_token_ours', 'int')} reads) | {_f('io_share_of_latency.ours', 'f2')}", "`ours`"),
        Row("on-demand (no prefetch, same cap)",
            f"{_f('tok_s.on_demand', 'f2')} | {_f('bytes_read_per_token.on_demand', 'mib')} | "
            f"{_f('io_share_of_latency.on_demand', 'f2')}", "`on_demand`"),
        Row("dense through mmap, cgroup cap",
            f"{_f('tok_s.mmap', 'f2')} | {_f('bytes_read_per_token.mmap', 'mib')} "
            f"(at {_f('mmap_read_mb_s', 'f0')} MB/s) | –", "`mmap`"),
        Row("all-resident sparse (no cap, nothing read)", f"{_f('tok_s.all_resident_sparse', 'f2')} | – | –",
            "`all_resident_sparse`"),
        Row("all-resident dense (no cap, nothing read)", f"{_f('tok_s.all_resident_dense', 'f2')} | – | –",
            "`all_resident_dense`"),
    ))

SPARSE_HEADLINE = Table("sparse-headline", ("what", "figure", "how"), (
    Row("ours over dense mmap at equal quality: the highest threshold whose top-1 agreement is >= 0.9",
        f"{_f('equal_quality.speedup_vs_mmap', 'x')} at sparsity {{{S}:equal_quality.sparsity}} "
        f"(agreement {_f('equal_quality.top1_agreement', 'f2')}; I/O: {{{S}:io.effective}})", Q),
    Row("ours over dense mmap at sparsity 0.8 (approximate output: agreement in the quality table)",
        f"{_f('speedup_vs_mmap', 'x')} (goal {_f('goal_speedup_vs_mmap', 'x')}, met: {{{S}:goal_met}}; "
        f"I/O: {{{S}:io.effective}})", Q),
    Row("ours over on-demand (tok/s ratio)",
        f"{_f('speedup_vs_on_demand', 'x')} (I/O: {{{S}:io.effective}})", Q),
    Row("same tokens from ours and on-demand", f"{{{S}:same_tokens_ours_vs_on_demand}}", Q),
    Row("neuron cache hit rate (ours, on-demand)",
        f"{_f('cache_hit_rate.ours', 'f2')}, {_f('cache_hit_rate.on_demand', 'f2')}", Q),
    Row("active neurons per token (all layers); share read on demand",
        f"{_f('active_neurons_per_token', 'int')}; {_f('on_demand_share_ours', 'pct')}", Q),
    Row("ahead prefetch precision at run time", _f("prefetch_precision_runtime", "f2"), Q),
    Row("ours, time per token",
        f"{_f('time_per_token_ms_ours.total', 'f0')} ms = {_f('time_per_token_ms_ours.io_wait', 'f0')} ms waiting "
        f"for I/O + {_f('time_per_token_ms_ours.crc_verify', 'f1')} ms checksums + "
        f"{_f('time_per_token_ms_ours.other_compute_and_python', 'f0')} ms compute and Python", Q),
    Row("all-resident sparse floor, time per token", f"{_f('time_per_token_ms_ours.all_resident_sparse_floor', 'f0')} ms",
        Q),
))

SPARSE_LOCALITY = Table("sparse-locality", ("what", "figure", "how"), (
    Row("Jaccard of consecutive tokens' active sets, calibration text",
        f"{_f('overlap_jaccard.calibration_text_mean', 'f2')} (layers {_f('overlap_jaccard.per_layer.0', 'f2')}, "
        f"{_f('overlap_jaccard.per_layer.1', 'f2')}); two independent sets of the same density: "
        f"{_f('overlap_jaccard.independent_sets_same_density', 'f2')}", Q + " (CATS, sparsity 0.8)"),
    Row("the same, of the sets ours read while decoding (predicted mode: the predictor's sets, which overshoot)",
        _f("overlap_jaccard.decode_runtime_mean", "f2"), Q),
    Row("low-rank predictors, recall / precision",
        f"own {_f('predictor.own_recall', 'f2')} / {_f('predictor.own_precision', 'f2')}, "
        f"ahead {_f('predictor.ahead_recall', 'f2')} / {_f('predictor.ahead_precision', 'f2')}", Q),
    Row("previous token's set as predictor, recall", _f("predictor.temporal_recall", "f2"), Q),
))


# Modelled: formulas over measured parts (engine/bench/sparse.py, `bound`).
SPARSE_BOUND = Table("sparse-bound", ("what", "modelled figure", "model"), (
    Row("ours' I/O lower bound per token",
        f"{_f('bound.ours_io_lower_bound_ms', 'f0')} ms (at {_f('bound.disk_mb_s_used', 'f0')} MB/s; the probe "
        f"gave {_f('bound.disk_mb_s_probe', 'f0')} MB/s for one bundle, our coalesced reads reached "
        f"{_f('bound.disk_mb_s_achieved', 'f0')} MB/s)",
        "ours' bytes per token ÷ the better of the probe's best random-read rate for a bundle and the rate "
        "our reads reached"),
    Row("most ours can gain over mmap, I/O fully hidden",
        f"{_f('bound.max_speedup_if_io_fully_hidden', 'x')} "
        f"(mmap {_f('bound.mmap_ms_per_token', 'f0')} ms ÷ max(I/O bound, compute floor "
        f"{_f('bound.ours_compute_floor_ms', 'f0')} ms); I/O: {{{S}:io.effective}})",
        "mmap's time per token ÷ max(ours' I/O lower bound, all-resident sparse time)"),
    Row("most ours can gain over mmap, I/O not hidden",
        _f("bound.max_speedup_if_io_not_hidden", "x") + f" (I/O: {{{S}:io.effective}})",
        "mmap's time per token ÷ (ours' I/O lower bound + all-resident sparse time)"),
))

FILE = REPO_ROOT / "docs" / "sparse.md"
TABLES = (SPARSE_SETUP, SPARSE_QUALITY, SPARSE_RESULTS, SPARSE_HEADLINE, SPARSE_LOCALITY, SPARSE_BOUND)
