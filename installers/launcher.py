"""The first Python code that runs in a frozen Flotilla bundle.

Every executable of the bundle (`flotilla`, `flotilla-agent`, and on Windows
and macOS the windowed `FlotillaApp`) is the same frozen script; it looks up
what to run by its own file name in a table the PyInstaller spec writes from
pyproject.toml (installers/flotilla.spec). Besides that it makes the bundle
behave like a Python install where Flotilla relies on one:

- `sys.executable -m MODULE ...` and `sys.executable -c CODE ...`: the agent
  starts shard workers as `{python} -m engine.shards.worker ...`, the local
  pipeline and the benchmarks do the same. In a bundle sys.executable is this
  executable, so those two Python flags are emulated here (with runpy), and
  the workers run from the same bundle with no Python installed.
- windowed executables on Windows have no stdout/stderr (None): they get
  os.devnull, so a print() cannot crash the agent or the app.
- multiprocessing.freeze_support(), which frozen programs need on Windows and
  macOS for "spawn" children.
"""

from __future__ import annotations

import importlib
import os
import re
import runpy
import sys
from collections.abc import Mapping, Sequence

# Interpreter flags that take no value and change nothing we care about here.
_IGNORED_FLAGS = {"-u", "-B", "-E", "-s", "-S", "-I", "-O", "-OO", "-q", "-b", "-bb", "-d", "-v"}
# Flags followed by a value (skipped with it).
_VALUED_FLAGS = {"-X", "-W"}


def entry_for(executable: str, entries: Mapping[str, tuple[str, Sequence[str]]]) -> tuple[str, Sequence[str]]:
    """(module:function, argv prefix) for this executable, by file name
    (case-insensitive, without .exe); the first entry is the default."""
    stem = re.split(r"[\\/]", executable)[-1].lower()
    stem = stem[:-4] if stem.endswith(".exe") else stem
    table = {k.lower(): v for k, v in entries.items()}
    return table.get(stem, next(iter(entries.values())))


def python_mode(argv: Sequence[str]) -> tuple[str, str, list[str]] | None:
    """("-m", module, args) or ("-c", code, args) when argv asks for the
    Python interpreter; None for a normal command line."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in _IGNORED_FLAGS:
            i += 1
        elif arg in _VALUED_FLAGS:
            i += 2
        elif arg in ("-m", "-c") and i + 1 < len(argv):
            return arg, argv[i + 1], list(argv[i + 2:])
        else:
            return None  # a Flotilla command line (or a script path: not supported)
    return None


def _fix_stdio() -> None:
    for name in ("stdin", "stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "r" if name == "stdin" else "w", encoding="utf-8"))


def _run_python(mode: str, what: str, args: list[str]) -> int:
    if "-u" in sys.argv[1:]:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.reconfigure(line_buffering=True, write_through=True)
            except (AttributeError, ValueError):
                pass
    if mode == "-m":
        sys.argv = [what, *args]  # run_module replaces argv[0] with the module's path
        runpy.run_module(what, run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *args]
        exec(compile(what, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    return 0


def launch(entries: Mapping[str, tuple[str, Sequence[str]]]) -> None:
    """Run the entry point that belongs to this executable, and exit with its code."""
    import multiprocessing

    multiprocessing.freeze_support()
    _fix_stdio()
    argv = sys.argv[1:]
    py = python_mode(argv)
    if py is not None:
        sys.exit(_run_python(*py))
    target, prefix = entry_for(sys.executable, entries)
    module, _, func = target.partition(":")
    main = importlib.import_module(module)
    for attr in func.split("."):
        main = getattr(main, attr)
    sys.exit(main([*prefix, *argv]))
