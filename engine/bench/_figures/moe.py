"""docs/moe.md's figure tables (see engine/bench/_figures/__init__.py for the rules).

The per-scheduler and overlap-bound tables have more than three columns: a
row's figure then holds several cells separated by " | ", and the header
names every column (the first is the row's `what`, the last its `how`).
"""

from __future__ import annotations

from engine.bench._report import REPO_ROOT, Row, Table

S = "moe-quick"
Q = "`flotilla bench moe --quick`"
SCHEDULERS = ("bevy", "on_demand", "prefetch", "resident")
CONCURRENCY = ("1", "4", "16")


def _f(path: str, fmt: str) -> str:
    return "{" + f"{S}:{path}|{fmt}" + "}"


MOE_HEADLINE = Table("moe-headline", ("what", "figure", "how"), (
    Row("Bevy over on_demand (tok/s ratio)",
        f"{_f('speedup_vs_on_demand', 'x')} at {_f('concurrency_for_speedups', 'int')} requests "
        f"(goal {_f('goals.speedup_vs_on_demand', 'x')}; I/O: {{{S}:io.effective}})", Q),
    Row("Bevy over prefetch (tok/s ratio)",
        f"{_f('speedup_vs_prefetch', 'x')} at {_f('concurrency_for_speedups', 'int')} requests "
        f"(goal {_f('goals.speedup_vs_prefetch', 'x')}; I/O: {{{S}:io.effective}})", Q),
    Row("reads (`io`)", "requested {moe-quick:io.requested}, in effect {moe-quick:io.effective}", Q),
    Row("benchmark model (random weights)",
        f"{_f('model.layers', 'int')} layers × {_f('model.experts_per_layer', 'int')} experts, "
        f"top-{_f('model.top_k', 'int')}, {_f('model.expert_mb', 'f2')} MB per expert, "
        f"{_f('model.all_experts_mb', 'f0')} MB of experts", Q),
    Row("expert cache", f"{_f('cache_budget_mb', 'f0')} MB = {_f('cache_fraction', 'pct')} of the experts", Q),
    Row("disk, the engine's reader (4 threads, median of a run's repeats)", f"{_f('disk_mb_s', 'f0')} MB/s", Q),
    Row("wall time of one quick run", f"{_f('wall_s', 'f0')} s", Q),
))


def _result_row(sched: str, conc: str) -> Row:
    p = f"results.{sched}.{conc}."
    cells = (_f(p + "tok_s", "f1"), _f(p + "tpot_s", "f3"), _f(p + "hit_rate", "f2"),
             _f(p + "mb_per_token", "f1"), _f(p + "mean_batch", "f1"), _f(p + "io_busy_frac", "pct"),
             _f(p + "compute_frac", "pct"), _f(p + "disk_mb_s_busy", "f0"))
    return Row(f"{sched}, {conc}", " | ".join(cells), f"`results.{sched}.{conc}`")


MOE_RESULTS = Table(
    "moe-results",
    ("scheduler, requests", "tok/s (aggregate)", "TPOT per request (s)", "hit rate", "MB read / token",
     "attention batch (rows)", "disk busy", "compute thread busy", "disk MB/s while busy",
     "JSON field"),  # type: ignore[arg-type]
    tuple(_result_row(s, c) for s in SCHEDULERS for c in CONCURRENCY))


def _bound_row(conc: str) -> Row:
    p = f"overlap_bound.{conc}."
    cells = (_f(p + "compute_s_per_token", "ms"), _f(p + "io_s_per_token", "ms"), _f(p + "bound_s_per_token", "ms"),
             _f(p + "serial_s_per_token", "ms"), _f(p + "bevy_vs_bound", "pct"), _f(p + "on_demand_vs_bound", "pct"),
             _f(p + "prefetch_vs_bound", "pct"),
             _f(p + "max_speedup_vs_on_demand", "x") + f" (I/O: {{{S}:io.effective}})")
    return Row(conc, " | ".join(cells), f"`overlap_bound.{conc}`")


# Modelled: a formula over measured parts (engine/bench/moe.py, `overlap_bound`).
MOE_BOUND = Table(
    "moe-bound",
    ("requests", "compute / token (resident run)", "I/O / token (bevy's bytes ÷ disk)",
     "bound = max(compute, I/O)", "on_demand serial (compute + its I/O)", "bevy reaches", "on_demand reaches",
     "prefetch reaches", "most any scheduler can gain over on_demand", "JSON field"),  # type: ignore[arg-type]
    tuple(_bound_row(c) for c in CONCURRENCY))

FILE = REPO_ROOT / "docs" / "moe.md"
TABLES = (MOE_RESULTS, MOE_HEADLINE, MOE_BOUND)
