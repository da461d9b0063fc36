"""`flotilla bench NAME [--quick] [--json FILE]`: runs a scenario of engine/bench."""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
import time
from pathlib import Path
from types import ModuleType

import engine.bench
from engine import __version__
from engine.bench import _provenance


def scenarios() -> dict[str, ModuleType]:
    found: dict[str, ModuleType] = {}
    for info in pkgutil.iter_modules(engine.bench.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"engine.bench.{info.name}")
        if hasattr(module, "NAME") and hasattr(module, "run"):
            found[module.NAME] = module
    return dict(sorted(found.items()))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark scenario (figures for docs/ and the README)")
    bsub = p.add_subparsers(dest="bench_name", metavar="SCENARIO", required=True)
    for name, module in scenarios().items():
        bp = bsub.add_parser(name, help=module.HELP, description=module.HELP)
        bp.add_argument("--quick", action="store_true", help="a short run (minutes), for CI and a first look")
        bp.add_argument("--json", metavar="FILE", type=Path, help="also write the figures as JSON to FILE")
        bp.add_argument("--runs", type=int, default=1, metavar="N",
                        help="run the scenario N times (figures are quoted as the median of runs)")
        bp.add_argument("--out-dir", metavar="DIR", type=Path,
                        help="write run-1.json … run-N.json into DIR (replacing the runs there), "
                             "e.g. docs/bench/NAME-quick for `flotilla bench report`")
        if hasattr(module, "add_arguments"):
            module.add_arguments(bp)
        bp.set_defaults(func=lambda args, m=module: cmd_bench(m, args))
    rp = bsub.add_parser("report", help="regenerate the figure tables of the README and docs/ from docs/bench/*.json",
                         description="Rewrites the tables between <!-- bench-report:NAME --> markers from the "
                                     "committed benchmark JSONs; fails when a figure has no source.")
    rp.add_argument("--check", action="store_true", help="only compare; exit 1 if a table is stale")
    rp.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from engine.bench import _figures, _report

    try:
        stale = _report.run_report(_figures.files(), check=args.check)
    except _report.ReportError as e:
        print(f"flotilla bench report: {e}", file=sys.stderr)
        return 1
    if args.check and stale:
        print(f"flotilla bench report: stale tables in {', '.join(stale)}: run `flotilla bench report`",
              file=sys.stderr)
        return 1
    print("up to date" if not stale else f"rewrote {', '.join(stale)}")
    return 0


def cmd_bench(module: ModuleType, args: argparse.Namespace) -> int:
    runs = max(1, getattr(args, "runs", 1) or 1)
    out_dir: Path | None = getattr(args, "out_dir", None)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        for old in out_dir.glob("run-*.json"):
            old.unlink()
    rc = 0
    for i in range(runs):
        if runs > 1:
            print(f"run {i + 1}/{runs}", file=sys.stderr, flush=True)
        target = out_dir / f"run-{i + 1}.json" if out_dir is not None else args.json
        rc = max(rc, run_once(module, args, target))
    return rc


def run_once(module: ModuleType, args: argparse.Namespace, json_path: Path | None) -> int:
    def report(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    started = time.time()
    provenance = _provenance.collect_before()
    if provenance.get("dirty"):
        report("note: the work tree differs from HEAD; this JSON cannot be quoted as that commit's figures")
    figures = module.run(args, report)
    result = {
        "scenario": module.NAME,
        "quick": bool(args.quick),
        "flotilla_version": __version__,
        "provenance": _provenance.finish(provenance),
        "started_unix": round(started, 1),
        "wall_s": round(time.time() - started, 2),
        # What storage reads really went through; scenarios that read weights while
        # measuring say so themselves (requested vs effective O_DIRECT).
        "io": {"effective": "none: no storage reads are measured in this scenario"},
        **figures,
    }
    text = json.dumps(result, indent=2, sort_keys=False)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = json_path.with_name(json_path.name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(json_path)  # never a half-written JSON where a report reads it
    print(text)
    if result.get("passed") is False:
        for failure in result.get("failures", []):
            report(f"FAILED: {failure}")
        return 1
    return 0
