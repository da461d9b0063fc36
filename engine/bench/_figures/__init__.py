"""The figure tables of the README and docs/, as placeholders into benchmark JSONs.

One module per Markdown file, each with FILE (the path) and TABLES (Table
objects whose markers sit in that file). In a row's figure,
`{source:path|format}` names a field of the JSONs in docs/bench/<source>/
(median over the runs, min–max beside it); formats: f0..f3, int, x (ratio),
pct (fraction as %), ms (seconds as ms), mib (bytes as MiB), g. Only measured
fields belong in a measured table: a modelled figure goes in its own table,
labelled as modelled.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from engine.bench._report import Table


def files() -> dict[Path, tuple[Table, ...]]:
    """Which tables live in which Markdown file."""
    out: dict[Path, tuple[Table, ...]] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        out[module.FILE] = out.get(module.FILE, ()) + tuple(module.TABLES)
    return out
