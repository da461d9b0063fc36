"""`flotilla bench NAME [--quick] [--json FILE]`: runs a scenario of engine/bench."""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import platform
import sys
import time
from pathlib import Path
from types import ModuleType

import engine.bench
from engine import __version__


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
        if hasattr(module, "add_arguments"):
            module.add_arguments(bp)
        bp.set_defaults(func=lambda args, m=module: cmd_bench(m, args))


def cmd_bench(module: ModuleType, args: argparse.Namespace) -> int:
    def report(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    started = time.time()
    figures = module.run(args, report)
    result = {
        "scenario": module.NAME,
        "quick": bool(args.quick),
        "flotilla_version": __version__,
        "machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()},
        "started_unix": round(started, 1),
        "wall_s": round(time.time() - started, 2),
        **figures,
    }
    text = json.dumps(result, indent=2, sort_keys=False)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)
    return 0
