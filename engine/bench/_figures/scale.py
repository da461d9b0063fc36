"""`flotilla bench scale`'s figure tables for docs/pipeline.md (rules: engine/bench/_figures/__init__.py).

Sources: docs/bench/scale-quick/ (`flotilla bench scale --quick --runs 3 --out-dir
docs/bench/scale-quick`, 1B shapes) and, once committed, docs/bench/scale/ (the 8B-shape run:
then TABLES = READY, and SCALE_HEADLINE into _figures/readme.py; a table without a source
fails `flotilla bench report --check`).
"""

from __future__ import annotations

from engine.bench._report import REPO_ROOT, Row, Table

FULL, QUICK = "scale", "scale-quick"
HOW = {FULL: "`flotilla bench scale`", QUICK: "`flotilla bench scale --quick`"}
PRECISIONS = ("int4", "int8", "fp16")


def _f(src: str, path: str, fmt: str) -> str:
    return "{" + f"{src}:{path}|{fmt}" + "}"


def _pair(src: str, p: str, field: str, fmt: str = "mib") -> str:
    """stage 0 / stage 1 of a per-stage list."""
    return f"{_f(src, p + '.0.' + field, fmt)} / {_f(src, p + '.1.' + field, fmt)}"


def _memory_row(src: str, prec: str) -> Row:
    p = f"precisions.{prec}."
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


def _speed_row(src: str, prec: str) -> Row:
    p = f"precisions.{prec}."
    cells = (_f(src, p + "fleet.runs.1.tok_s", "f2"), _f(src, p + "fleet.runs.2.tok_s", "f2"),
             _f(src, p + "fleet.runs.1.ttft_s", "f2") + " s", _f(src, p + "fleet.cold_ttft_s", "f1") + " s",
             _f(src, p + "teacher_forced.top1_agreement", "pct"))
    return Row(prec, " | ".join(cells), HOW[src] + f", `precisions.{prec}`")


def memory_table(src: str) -> Table:
    return Table(f"{src}-memory", (
        "weights", "shard files (stage 0 / 1)", "exporter cap", "exporter peak anonymous (VmHWM, with mapped "
        "files)", "export time", "agent+worker cap", "worker peak anonymous (VmHWM)", "planned (process)",
        "JSON field"),  # type: ignore[arg-type]
        tuple(_memory_row(src, p) for p in PRECISIONS))


def speed_table(src: str) -> Table:
    return Table(f"{src}-speed", (
        "weights", "tok/s, 1 stream", "tok/s, 2 streams (aggregate)", "first token (warm)",
        "first token (cold: compiles)", "teacher-forced top-1 vs the bf16 reference",
        "JSON field"),  # type: ignore[arg-type]
        tuple(_speed_row(src, p) for p in PRECISIONS))


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


SCALE_HEADLINE = Table("scale-headline", ("what", "figure", "how"), (
    Row("Llama-3.1-8B shapes (16 GB bf16), 2 stages at int4: exporter peak RSS under a cap of 0.6 x the "
        "checkpoint",
        f"{_pair(FULL, 'precisions.int4.export.stages', 'vm_hwm_bytes')} "
        f"(cap {_f(FULL, 'precisions.int4.export.cap_bytes', 'mib')})", HOW[FULL]),
    Row("the same, each agent + worker under a cap below the whole int4 model: worker peak RSS / planned",
        f"{_pair(FULL, 'precisions.int4.fleet.workers', 'peak_rss_bytes')} / "
        f"{_pair(FULL, 'precisions.int4.fleet.workers', 'planned_process_bytes')}", HOW[FULL]),
    Row("int4 tok/s, 1 / 2 streams",
        f"{_f(FULL, 'precisions.int4.fleet.runs.1.tok_s', 'f2')} / {_f(FULL, 'precisions.int4.fleet.runs.2.tok_s', 'f2')}",
        HOW[FULL]),
))

READY = (checkpoint_table(FULL), memory_table(FULL), speed_table(FULL),
         checkpoint_table(QUICK), memory_table(QUICK), speed_table(QUICK))

FILE = REPO_ROOT / "docs" / "pipeline.md"
# The quick (1B-shape) runs are committed; the 8B-shape run (FULL) is not yet, so its tables stay off.
TABLES: tuple[Table, ...] = (checkpoint_table(QUICK), memory_table(QUICK), speed_table(QUICK))
