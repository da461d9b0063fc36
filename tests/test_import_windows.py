"""Every Windows-only import path of engine/ and app/, exercised here with sys.platform faked.

A subprocess (`python -c WRAPPER`) first imports, with the real platform, every module outside
Flotilla that engine/ and app/ import, and the names they take from it (the standard library's and third-party
packages' own import-time branches are theirs to test, and several cannot import at all under a
fake, e.g. subprocess needs _winapi), then sets sys.platform = "win32", and then imports every module of engine/ and app/, does `import engine, app`, and runs
`flotilla --help` and `flotilla selftest --help`. So any module-level `if sys.platform ==
"win32"` (or engine.platform.system()) branch runs its Windows side, and a Windows API imported
at module level instead of lazily inside the Windows branch (winreg, msvcrt, _winapi,
ctypes.windll) fails here as it would break `import engine` on Linux.

What cannot be faked (stays the real OS's in the subprocess; covered on the hosted Windows
runner by .github/workflows/portable.yml, and by unit tests with the OS calls faked):
- os.name stays "posix" (pathlib builds a WindowsPath from it on every Path() call, which
  cannot be instantiated here), so os.path, pathlib and os.sep keep POSIX semantics; code
  tests the OS through engine.platform.system() (sys.platform), never os.name;
- the Windows APIs themselves: winreg, msvcrt, _winapi, ctypes.windll / WinDLL, the Job object;
- asyncio's ProactorEventLoop, signal.CTRL_BREAK_EVENT / SIGBREAK, subprocess' Windows
  creationflags: not present in this Python build;
- third-party import-time branches (pyzmq, psutil, platformdirs, Qt, OpenVINO): imported with
  the real platform first.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OURS = ("engine", "app", "installers")

WRAPPER = r'''
import importlib, json, os, pkgutil, sys, traceback
externals, repo = json.loads(sys.argv[1]), sys.argv[2]
sys.path.insert(0, repo)
for name, attrs in externals:        # with the real platform: not ours to test
    try:
        mod = importlib.import_module(name)
        for attr in attrs:               # lazy packages (transformers) load a submodule per name
            getattr(mod, attr, None)
    except BaseException:
        pass
real = sys.platform
sys.platform = "win32"
failures, imported = {}, []
import engine, app                   # python -c "import engine, app", on "Windows"
from engine.platform import system
assert system() == "windows", system()
for pkg in (engine, app):
    def onerror(name):
        failures[name] = "".join(traceback.format_exception_only(*sys.exc_info()[:2])).strip()
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".", onerror=onerror):
        try:
            importlib.import_module(info.name)
            imported.append(info.name)
        except BaseException as e:
            failures[info.name] = "".join(traceback.format_exception_only(type(e), e)).strip()
helps = {}
from engine.cli.main import main
for argv in (["--help"], ["selftest", "--help"]):
    try:
        main(argv)
        helps[" ".join(argv)] = "returned"
    except SystemExit as e:
        helps[" ".join(argv)] = e.code
still = sys.platform
sys.platform = real
print("\n@@RESULT@@" + json.dumps({"failures": failures, "imported": imported, "helps": helps,
                                    "platform_during": still}))
'''


def _imports(path: Path) -> dict[str, set[str]]:
    """Every module a file imports, anywhere in it, with the names taken from it."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                out.setdefault(a.name, set())
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.setdefault(node.module, set()).update(a.name for a in node.names if a.name != "*")
    return out


def _externals() -> list[tuple[str, list[str]]]:
    """The modules outside Flotilla that engine/ and app/ import (at module level or lazily)."""
    found: dict[str, set[str]] = {}
    for top in ("engine", "app"):
        for path in (REPO / top).rglob("*.py"):
            for mod, names in _imports(path).items():
                found.setdefault(mod, set()).update(names)
    return sorted((m, sorted(n)) for m, n in found.items() if m.split(".")[0] not in OURS)


def test_every_module_imports_and_the_cli_helps_with_the_os_faked_as_windows():
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "QT_QPA_PLATFORM": "offscreen"}
    res = subprocess.run([sys.executable, "-c", WRAPPER, json.dumps(_externals()), str(REPO)], capture_output=True,
                         text=True, encoding="utf-8", errors="replace", timeout=600, env=env, cwd=REPO)
    assert res.returncode == 0, res.stderr[-4000:]
    out, _, raw = res.stdout.rpartition("\n@@RESULT@@")
    result = json.loads(raw)
    assert result["platform_during"] == "win32"
    assert result["failures"] == {}, "\n".join(f"{k}: {v}" for k, v in result["failures"].items())
    assert result["helps"] == {"--help": 0, "selftest --help": 0}
    assert "selftest" in out and "usage: flotilla" in out
    # Every module really went through the faked import (the walk found them all):
    ours = {p.relative_to(REPO).with_suffix("").as_posix().replace("/", ".")
            for top in ("engine", "app") for p in (REPO / top).rglob("*.py") if p.name != "__init__.py"}
    assert ours <= set(result["imported"]), sorted(ours - set(result["imported"]))[:20]
