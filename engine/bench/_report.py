"""`flotilla bench report`: the README's and docs' figure tables, regenerated from committed JSONs.

A figure may appear in a table only as a placeholder that names a field of a
benchmark JSON under docs/bench/ (see engine/bench/_figures/). The runs of a
scenario live in one folder (`docs/bench/<scenario>-quick/run-1.json`, …);
a placeholder shows the median over the runs and, when there are several,
their min–max. Rendering fails, naming the row, when a source folder is empty,
a field is missing, or a JSON lacks its provenance (commit, CPU, load).

The tables sit between markers in the Markdown files:

    <!-- bench-report:TABLE start -->
    …generated…
    <!-- bench-report:TABLE end -->

`flotilla bench report` rewrites them in place; `--check` only compares and
fails when a table is stale, which is what the test suite runs.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from engine.bench import _provenance

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO_ROOT / "docs" / "bench"
PLACEHOLDER = re.compile(r"\{([a-z0-9_\-]+):([^}|]+)(?:\|([a-z0-9_.]+))?\}")


class ReportError(Exception):
    """A figure without a valid source; the message names the table row."""


@dataclass(frozen=True)
class Row:
    what: str  # first column: what is measured
    figure: str  # a template: {source:path.to.field|format} placeholders in prose
    how: str  # the command that produced the sources


@dataclass(frozen=True)
class Table:
    name: str  # the marker name
    header: tuple[str, str, str]
    rows: tuple[Row, ...]


@dataclass
class Source:
    """The runs of one scenario (one folder of JSONs)."""

    name: str
    runs: list[dict[str, Any]]
    files: list[Path]


def load_source(name: str, bench_dir: Path | None = None) -> Source:
    folder = (bench_dir or BENCH_DIR) / name
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    if not files:
        raise ReportError(f"no JSON in {_rel(folder)}")
    runs = []
    for f in files:
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise ReportError(f"{_rel(f)} is not valid JSON: {e}") from None
        prov = data.get("provenance")
        missing = _provenance.missing_fields(prov)
        if missing:
            raise ReportError(f"{_rel(f)} has no provenance ({', '.join(missing)}): re-run it with `flotilla bench`")
        if prov["dirty"]:
            raise ReportError(f"{_rel(f)} measured uncommitted code ({', '.join(prov.get('dirty_paths') or [])}): "
                              "commit, then re-run it")
        runs.append(data)
    return Source(name, runs, files)


def field(data: Any, path: str) -> Any:
    """`a.b.2` → data["a"]["b"]["2"] (list indices too); a key holding a dot ("0.85")
    is matched whole, the longest key first."""
    parts, cur, i = path.split("."), data, 0
    while i < len(parts):
        if isinstance(cur, dict):
            for j in range(len(parts), i, -1):
                key = ".".join(parts[i:j])
                if key in cur:
                    cur, i = cur[key], j
                    break
            else:
                raise KeyError(path)
        elif isinstance(cur, list) and parts[i].isdigit() and int(parts[i]) < len(cur):
            cur, i = cur[int(parts[i])], i + 1
        else:
            raise KeyError(path)
    return cur


def _fmt_number(x: float, spec: str) -> str:
    if spec == "pct":  # a fraction shown as a percentage
        return f"{x * 100:.1f} %"
    if spec == "spct":  # a signed relative difference shown as a percentage
        return f"{x * 100:+.1f} %"
    if spec == "x":  # a ratio
        return f"{x:.2f}×"
    if spec.startswith("f") and spec[1:].isdigit():
        return f"{x:.{int(spec[1:])}f}"
    if spec == "int":
        return f"{x:.0f}"
    if spec == "ms":  # seconds shown in ms
        return f"{x * 1000:.1f} ms"
    if spec == "mib":
        return f"{x / 2**20:.0f} MiB"
    return f"{x:.3g}"


def render_value(values: list[Any], spec: str) -> str:
    """The median of the runs, with their min–max when they differ."""
    if all(isinstance(v, bool) for v in values):
        if len(set(values)) == 1:
            return "yes" if values[0] else "no"
        return f"{sum(values)} of {len(values)} runs"
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        if len(set(map(str, values))) == 1:
            return str(values[0])
        return " / ".join(map(str, values))
    fmt: Callable[[float], str] = lambda v: _fmt_number(float(v), spec)  # noqa: E731
    med = fmt(statistics.median(values))
    lo, hi = fmt(min(values)), fmt(max(values))
    if len(values) < 2 or lo == hi:
        return med
    unit = ""
    for suffix in (" %", "×", " ms", " MiB"):
        if med.endswith(suffix):
            unit = suffix
            lo, hi = lo.removesuffix(suffix), hi.removesuffix(suffix)
            med = med.removesuffix(suffix)
            break
    sep = " to " if lo.startswith("-") or hi.startswith("-") else "–"  # "-7.0–-2.0" would misread
    return f"{med}{unit} ({lo}{sep}{hi})"


def render_figure(template: str, sources: dict[str, Source]) -> tuple[str, set[str]]:
    used: set[str] = set()

    def sub(m: re.Match) -> str:
        name, path, spec = m.group(1), m.group(2), m.group(3) or "g"
        if name not in sources:
            sources[name] = load_source(name)
        src = sources[name]
        used.add(name)
        try:
            values = [field(run, path) for run in src.runs]
        except KeyError:
            raise ReportError(f"{name}: field {path!r} is missing in {_rel(src.files[0].parent)}") from None
        if any(v is None for v in values):
            raise ReportError(f"{name}: field {path!r} is null in a run (not measured)")
        return render_value(values, spec)

    return PLACEHOLDER.sub(sub, template), used


def render_table(table: Table, sources: dict[str, Source] | None = None) -> str:
    sources = {} if sources is None else sources
    # A figure column may hold several cells ("a | b"): its header names each.
    columns = sum(h.count(" | ") + 1 for h in table.header)
    lines = [f"| {' | '.join(table.header)} |", "|" + "---|" * columns]
    used_all: set[str] = set()
    for row in table.rows:
        try:
            text, used = render_figure(row.figure, sources)
        except ReportError as e:
            raise ReportError(f"table {table.name!r}, row {row.what!r}: {e}") from None
        if not used:
            raise ReportError(f"table {table.name!r}, row {row.what!r}: a figure with no source")
        used_all |= used
        lines.append(f"| {row.what} | {text} | {row.how} |")
    lines.append("")
    lines.append(footnote(sorted(used_all), sources))
    return "\n".join(lines)


def footnote(names: list[str], sources: dict[str, Source]) -> str:
    """One line per source: where the JSONs are, the commit, CPU and load they ran at."""
    parts = []
    for name in names:
        src = sources[name]
        commits = sorted({(r["provenance"]["commit"] or "?")[:10] for r in src.runs})
        cpu = src.runs[0]["provenance"]["cpu"]
        # 1-min load average before and after each run: a run shares the machine with whatever
        # ran meanwhile, and "after" shows it where "before" was quiet.
        loads = [r["provenance"][k][0] for r in src.runs for k in ("load_before", "load_after")
                 if r["provenance"].get(k)]
        flags = ",".join(cpu.get("flags") or []) or "none"
        parts.append(f"`{_rel(src.files[0].parent)}/` ({len(src.runs)} run{'s' if len(src.runs) != 1 else ''}, commit {'/'.join(commits)}, "
                     f"{cpu['model']}, {cpu['cores']} cores, flags {flags}, "
                     f"load {min(loads):.2f}–{max(loads):.2f})")
    return ("Figures: median of the runs (min–max). Sources: " + "; ".join(parts) + ". "
            "Regenerate with `flotilla bench report`.")


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- bench-report:{name} start -->", f"<!-- bench-report:{name} end -->"


def apply(text: str, table: Table, rendered: str) -> str:
    start, end = _markers(table.name)
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ReportError(f"markers for table {table.name!r} not found")
    return text[: i + len(start)] + "\n" + rendered + "\n" + text[j:]


def run_report(files: dict[Path, tuple[Table, ...]], check: bool) -> list[str]:
    """Rewrite (or with check, compare) every table; returns the stale files."""
    sources: dict[str, Source] = {}
    stale = []
    for path, tables in files.items():
        text = path.read_text()
        new = text
        for table in tables:
            new = apply(new, table, render_table(table, sources))
        if new != text:
            stale.append(_rel(path))
            if not check:
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text(new)
                tmp.replace(path)
    return stale


def _rel(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(p)
