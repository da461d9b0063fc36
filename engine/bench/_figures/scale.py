"""`flotilla bench scale`'s figure tables for docs/pipeline.md (rules: engine/bench/_figures/__init__.py).

Sources: docs/bench/scale-quick/ (`flotilla bench scale --quick --runs 3 --out-dir
docs/bench/scale-quick`, 1B shapes, all three precisions per run) and the 8B-shape runs, one
folder per precision because a full run of all three takes about an hour here:
docs/bench/scale/ (`--precisions int4 --runs 3`), docs/bench/scale-int8/ and
docs/bench/scale-fp16/ (`--precisions int8` / `fp16`; their folder says how many runs).
A table without a source fails `flotilla bench report --check`.
"""

from __future__ import annotations

from engine.bench._report import REPO_ROOT, Row, Table

FULL, QUICK = "scale", "scale-quick"
PRECISIONS = ("int4", "int8", "fp16")
# The folder each precision's figures come from: one folder per run kind.
SOURCES = {QUICK: {p: QUICK for p in PRECISIONS}, FULL: {"int4": FULL, "int8": "scale-int8", "fp16": "scale-fp16"}}
# The runs that measured the planner with the context filled (bench scale's fill run), by precision.
PLAN_SOURCES: dict[str, dict[str, str]] = {FULL: {"int4": FULL, "int8": "scale-int8", "fp16": "scale-fp16"}}
HOW = {FULL: "`flotilla bench scale`", QUICK: "`flotilla bench scale --quick`", "scale-int8": "`flotilla bench scale`",
       "scale-fp16": "`flotilla bench scale`"}


def _f(src: str, path: str, fmt: str) -> str:
    return "{" + f"{src}:{path}|{fmt}" + "}"


def _pair(src: str, p: str, field: str, fmt: str = "mib") -> str:
    """stage 0 / stage 1 of a per-stage list."""
    return f"{_f(src, p + '.0.' + field, fmt)} / {_f(src, p + '.1.' + field, fmt)}"


def _memory_row(kind: str, prec: str) -> Row:
    src, p = SOURCES[kind][prec], f"precisions.{prec}."
    cells = (
        _pair(src, p + "export.stages", "shard_bytes"),
        f"{_f(src, p + 'export.cap_bytes', 'mib')} (checkpoint {_f(src, 'checkpoint.bytes', 'mib')})",
        _pair(src, p + "export.stages", "rss_anon_peak_bytes") + " (VmHWM " + _pair(src, p + "export.stages",
                                                                                   "vm_hwm_bytes") + ")",
        _pair(src, p + "export.stages", "seconds", "f0") + " s",
        f"{_pair(src, p + 'fleet.workers', 'cap_bytes')} (model {_f(src, p + 'model_bytes', 'mib')})",
        _pair(src, p + "fleet.workers", "rss_anon_peak_bytes") + " (VmHWM " + _pair(src, p + "fleet.workers",
                                                                                   "peak_rss_bytes") + ")",
        _pair(src, p + "fleet.workers", "planned_process_bytes"),
    )
    return Row(prec, " | ".join(cells), HOW[src] + f", `precisions.{prec}`")


def _speed_row(kind: str, prec: str) -> Row:
    src, p = SOURCES[kind][prec], f"precisions.{prec}."
    cells = (_f(src, p + "fleet.runs.1.tok_s", "f2"), _f(src, p + "fleet.runs.2.tok_s", "f2"),
             _f(src, p + "fleet.runs.1.ttft_s", "f2") + " s", _f(src, p + "fleet.cold_ttft_s", "f1") + " s",
             _f(src, p + "teacher_forced.top1_agreement", "pct"))
    return Row(prec, " | ".join(cells), HOW[src] + f", `precisions.{prec}`")


def memory_table(kind: str) -> Table:
    return Table(f"{kind}-memory", (
        "weights", "shard files (stage 0 / 1)", "exporter cap", "exporter peak anonymous (VmHWM, with mapped "
        "files)", "export time", "agent+worker cap", "worker peak anonymous (VmHWM)", "planned (process)",
        "JSON field"),  # type: ignore[arg-type]
        tuple(_memory_row(kind, p) for p in PRECISIONS))


def _plan_row(src: str, prec: str) -> Row:
    p = f"precisions.{prec}."
    cells = (_pair(src, p + "fleet.workers", "planned_process_bytes"),
             _pair(src, p + "fleet.workers", "rss_anon_peak_bytes"),
             _pair(src, p + "fleet.workers", "plan_vs_anon", "spct"),
             f"{_f(src, p + 'fleet.fill.streams', 'int')} × {_f(src, p + 'fleet.fill.prompt_tokens', 'int')}")
    return Row(prec, " | ".join(cells), HOW[src] + f", `precisions.{prec}.fleet`")


def plan_table(kind: str) -> Table:
    """The planner's process memory against each worker's measured anonymous peak, from the runs
    that filled the planned context (only those: a run with a short prompt never reaches the
    KV and prefill memory the plan reserves)."""
    return Table(f"{kind}-plan", (
        "weights", "planned process memory (stage 0 / 1)", "measured anonymous peak", "plan vs measured",
        "fill run: streams × prompt tokens", "JSON field"),  # type: ignore[arg-type]
        tuple(_plan_row(src, prec) for prec, src in PLAN_SOURCES[kind].items()))


def speed_table(kind: str) -> Table:
    return Table(f"{kind}-speed", (
        "weights", "tok/s, 1 stream", "tok/s, 2 streams (aggregate)", "first token (warm)",
        "first token (cold: compiles)", "teacher-forced top-1 vs the bf16 reference",
        "JSON field"),  # type: ignore[arg-type]
        tuple(_speed_row(kind, p) for p in PRECISIONS))


def checkpoint_table(src: str) -> Table:
    return Table(f"{src}-checkpoint", ("what", "figure", "how"), (
        Row("checkpoint (random weights, real layer shapes, bf16)",
            f"{_f(src, 'checkpoint.name', 'g')}: {_f(src, 'checkpoint.params_b', 'f2')} B parameters, "
            f"{_f(src, 'checkpoint.bytes', 'mib')} in safetensors files", HOW[src]),
        Row("reference (transformers, one layer at a time, f32 on the bf16 weights)",
            f"{_f(src, 'reference.distinct_argmax', 'int')} distinct greedy tokens over "
            f"{_f(src, 'reference.positions', 'int')} positions, finite: {_f(src, 'reference.finite', 'g')}", HOW[src]),
        Row("judged (every process under its cap, no OOM kill, agreement reported)",
            f"passed: {_f(src, 'passed', 'g')}", HOW[src]),
        Row("wall time of one run", f"{_f(src, 'wall_s', 'f0')} s", HOW[src]),
    ))


READY = (checkpoint_table(FULL), memory_table(FULL), plan_table(FULL), speed_table(FULL),
         checkpoint_table(QUICK), memory_table(QUICK), speed_table(QUICK))

FILE = REPO_ROOT / "docs" / "pipeline.md"
TABLES: tuple[Table, ...] = READY
