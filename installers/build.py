"""Build Flotilla's bundle (every OS) and its Linux package, from a clean copy.

    python -m installers.build                 # Linux: bundle + .deb into dist/
    python -m installers.build --bundle-only   # Windows/macOS CI: bundle (+ .app) only
    make dist                                  # the same as the first line, in .venv

Steps:
 1. Clean checkout: the files git tracks (plus new, not ignored ones) of
    pyproject.toml, README.md, engine/, app/, assets/ and installers/ are
    copied to a fresh folder, so caches, build leftovers and stray files of the
    working tree never reach the bundle.
 2. Cache key: SHA-256 of those files plus the build environment (Python,
    platform, every installed distribution's version, PyInstaller). A build
    with the same key is reused (`make dist` then the slow test, or several
    CI jobs of one run, build once); --rebuild ignores it.
 3. PyInstaller with installers/flotilla.spec (one folder), then a check that
    the files the app needs at run time are there (bundle_rules.REQUIRED_FILES_LINUX).
 4. Linux: the .deb (installers/linux/deb.py). macOS: the agent moved into its
    own helper bundle inside Flotilla.app (installers/macapp.py).

Cache: $FLOTILLA_DIST_CACHE, else build/dist-cache in the checkout; the two
newest builds are kept. Prints a JSON summary (paths, sizes, seconds).

`--low-priority --install-tools --no-copy` is how the test suite starts this
build in the background at its beginning (tests/conftest.py): at the lowest CPU
and I/O priority it uses the time the other tests leave idle, and the installers
tests then wait for its cache entry (the cache lock) instead of building anew.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from installers import bundle_rules
from installers import project as P

SOURCES = ["pyproject.toml", "README.md", "engine", "app", "assets", "installers"]
SKIP = ["*/__pycache__/*", "*.pyc", "*.pyo"]
KEEP_BUILDS = 2


def source_files(repo: Path = P.REPO) -> list[str]:
    """Relative paths of the files a clean checkout has (git's view when the
    tree is a git work tree, else every file under SOURCES)."""
    files: list[str] = []
    try:
        out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard", "--", *SOURCES], capture_output=True, check=True)
        files = [f for f in out.stdout.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        for top in SOURCES:
            base = repo / top
            files += [p.relative_to(repo).as_posix() for p in ([base] if base.is_file() else base.rglob("*"))
                      if p.is_file()]  # as_posix: the same list on Windows as git gives
    files = [f for f in files if (repo / f).is_file() and not any(fnmatch.fnmatch(f, s) for s in SKIP)]
    return sorted(set(files))


def environment_fingerprint() -> dict:
    """What the bundle is built from besides the sources. The distributions are those
    installed in this interpreter's environment (its site-packages), not whatever the
    calling process has on sys.path: the test suite's process has test folders and the
    checkout on it, and the key it computed then differed from the key of the build the
    suite had started in the background -- the same build, done twice (4 minutes)."""
    import sysconfig

    site = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
    dists = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions(path=site)
                   if d.metadata["Name"])
    return {"python": sys.version, "platform": sys.platform, "machine": platform.machine(),
            "dists": dists}


def cache_key(repo: Path, files: list[str]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.encode() + b"\0")
        h.update(hashlib.sha256((repo / f).read_bytes()).digest())
    h.update(json.dumps(environment_fingerprint(), sort_keys=True).encode())
    return h.hexdigest()[:20]


def clean_copy(repo: Path, files: list[str], dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    for f in files:
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / f, target)


def default_cache_root(repo: Path = P.REPO) -> Path:
    return Path(os.environ.get("FLOTILLA_DIST_CACHE") or repo / "build" / "dist-cache")


@contextlib.contextmanager
def _locked(root: Path):
    root.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: CI runs one build at a time anyway
        yield
        return
    with open(root / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _prune(root: Path, keep: Path) -> None:
    """Keep the newest KEEP_BUILDS builds; drop unfinished ones (we hold the lock)."""
    for stale in (p for p in root.iterdir() if p.is_dir() and p != keep and not (p / "build.json").exists()):
        shutil.rmtree(stale, ignore_errors=True)
    builds = sorted((p for p in root.iterdir() if p.is_dir() and (p / "build.json").exists()),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    for old in [b for b in builds if b != keep][KEEP_BUILDS - 1:]:
        shutil.rmtree(old, ignore_errors=True)


def dir_bytes(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*") if not p.is_dir())


def check_bundle(bundle: Path) -> list[str]:
    """Required files missing from a Linux bundle's _internal (empty = fine)."""
    internal = bundle / "_internal"
    have = [p.relative_to(internal).as_posix() for p in internal.rglob("*")]
    return [pat for pat in bundle_rules.REQUIRED_FILES_LINUX if not fnmatch.filter(have, pat)]


def strip_bundle(bundle: Path) -> int:
    """strip --strip-unneeded the vetted libraries (bundle_rules.STRIP_LINUX); bytes saved."""
    internal = bundle / "_internal"
    saved = 0
    for pat in bundle_rules.STRIP_LINUX:
        for path in internal.glob(pat):
            if path.is_symlink() or not path.is_file():
                continue
            before = path.stat().st_size
            subprocess.run(["strip", "--strip-unneeded", str(path)], check=True, capture_output=True)
            saved += before - path.stat().st_size
    return saved


def run_pyinstaller(src: Path, entry: Path, log: Path) -> Path:
    work, dist = entry / "work", entry / "bundle"
    env = dict(os.environ)
    if sys.platform in ("win32", "darwin"):  # .ico / .icns for the executables and the .app
        from installers.icons import make_all
        make_all(entry / "icons")
        env["FLOTILLA_ICON_DIR"] = str(entry / "icons")
    # No --clean: PyInstaller's own cache (stripped copies of the big libraries) is reused.
    cmd = [sys.executable, "-m", "PyInstaller", "--noconfirm", "--log-level", "WARN",
           "--distpath", str(dist), "--workpath", str(work), str(src / "installers" / "flotilla.spec")]
    with log.open("w") as fh:
        res = subprocess.run(cmd, cwd=src, stdout=fh, stderr=subprocess.STDOUT, env=env)
    if res.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"PyInstaller failed (log: {log}):\n{tail}")
    return dist / "flotilla"


def build(repo: Path = P.REPO, cache_root: Path | None = None, package: bool = True,
          rebuild: bool = False, compression: str = "zstd", out_dir: Path | None = None) -> dict:
    """Build (or reuse) the bundle and, on Linux, the .deb. Returns the summary."""
    try:
        import PyInstaller  # noqa: F401
    except ImportError:
        raise SystemExit("installers: PyInstaller is missing; `pip install -e '.[dist]'` "
                         "(or `make dist`, which does it)") from None
    cache_root = cache_root or default_cache_root(repo)
    t0 = time.monotonic()
    files = source_files(repo)
    key = cache_key(repo, files)
    entry = cache_root / key
    summary_file = entry / "build.json"
    with _locked(cache_root):
        cached = json.loads(summary_file.read_text()) if summary_file.exists() and not rebuild else None
        wants_deb = package and sys.platform.startswith("linux")
        if cached and (not wants_deb or "deb" in cached):
            summary = cached
            summary["cached"] = True
        else:
            if entry.exists():
                shutil.rmtree(entry)
            entry.mkdir(parents=True)
            src = entry / "src"
            clean_copy(repo, files, src)
            t1 = time.monotonic()
            bundle = run_pyinstaller(src, entry, entry / "pyinstaller.log")
            summary = {"key": key, "version": P.load(src / "pyproject.toml").version,
                       "bundle": str(bundle), "icons": str(entry / "icons"),
                       "pyinstaller_s": round(time.monotonic() - t1, 1)}
            if sys.platform == "darwin":
                from installers import macapp

                app = bundle.parent / f"{P.APP_NAME}.app"
                summary["app"] = str(app)
                summary["agent_app"] = str(macapp.make_helper(app, P.load(src / "pyproject.toml")))
                problems = macapp.check_layout(app)
                if problems:
                    raise RuntimeError(f"{app}: {problems}")
            if sys.platform.startswith("linux"):
                if shutil.which("strip"):
                    summary["stripped_bytes"] = strip_bundle(bundle)
                missing = check_bundle(bundle)
                if missing:
                    raise RuntimeError(f"the bundle lacks required files: {missing}")
                summary["bundle_bytes"] = dir_bytes(bundle)
                if package:
                    from installers.icons import make_all
                    from installers.linux.deb import build_deb

                    t2 = time.monotonic()
                    icons = make_all(entry / "icons")
                    res = build_deb(bundle, entry / "pkg", icons, P.load(src / "pyproject.toml"),
                                    compression=compression, workdir=entry)
                    summary.update(deb=str(res["deb"]), deb_bytes=res["deb_bytes"],
                                   depends=res["depends"], compression=compression,
                                   deb_s=round(time.monotonic() - t2, 1))
            shutil.rmtree(entry / "work", ignore_errors=True)  # GBs of intermediate files
            summary["build_s"] = round(time.monotonic() - t0, 1)
            summary_file.write_text(json.dumps(summary, indent=2))
            summary["cached"] = False
        _prune(cache_root, entry)
    if out_dir and summary.get("deb"):
        out_dir.mkdir(parents=True, exist_ok=True)
        target = out_dir / Path(summary["deb"]).name
        shutil.copy2(summary["deb"], target)
        summary["deb_copy"] = str(target)
    summary["total_s"] = round(time.monotonic() - t0, 1)
    return summary


def ensure_build_tools() -> None:
    """What `make dist` does first: install the `dist` extra's build tools (PyInstaller)
    into this environment when they are missing."""
    try:
        import PyInstaller  # noqa: F401
        return
    except ImportError:
        pass
    reqs = subprocess.run([sys.executable, "-m", "installers.project", "dist-requirements"], cwd=P.REPO,
                          capture_output=True, text=True, check=True).stdout.split()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *reqs], check=True)


def lower_priority() -> None:
    """Run this process (and what it starts) at the lowest CPU and I/O priority."""
    import psutil

    me = psutil.Process()
    with contextlib.suppress(OSError, AttributeError, psutil.Error):
        me.nice(19 if hasattr(os, "nice") else psutil.IDLE_PRIORITY_CLASS)
    with contextlib.suppress(OSError, AttributeError, psutil.Error):
        me.ionice(psutil.IOPRIO_CLASS_IDLE if hasattr(psutil, "IOPRIO_CLASS_IDLE") else psutil.IOPRIO_VERYLOW)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m installers.build", description=__doc__.split("\n")[0])
    ap.add_argument("--bundle-only", action="store_true", help="no .deb (Windows/macOS CI)")
    ap.add_argument("--rebuild", action="store_true", help="ignore a cached build with the same key")
    ap.add_argument("--compression", default="zstd", choices=["zstd", "xz", "gzip", "none"],
                    help=".deb compression (xz for dpkg older than Debian 12 / Ubuntu 21.10)")
    ap.add_argument("--out", default=str(P.REPO / "dist"), help="copy the .deb here (default: dist/)")
    ap.add_argument("--cache", default=None, help="cache folder (default: $FLOTILLA_DIST_CACHE or build/dist-cache)")
    ap.add_argument("--summary", default=None, metavar="FILE", help="also write the JSON summary here (CI)")
    ap.add_argument("--no-copy", action="store_true", help="leave the .deb in the cache (no copy to --out)")
    ap.add_argument("--low-priority", action="store_true",
                    help="lowest CPU and I/O priority: a build beside other work (the test suite)")
    ap.add_argument("--install-tools", action="store_true", help="install PyInstaller first if it is missing")
    args = ap.parse_args(argv)
    if args.low_priority:
        lower_priority()
    if args.install_tools:
        ensure_build_tools()
    summary = build(cache_root=Path(args.cache) if args.cache else None, package=not args.bundle_only,
                    rebuild=args.rebuild, compression=args.compression,
                    out_dir=None if args.no_copy else Path(args.out))
    print(json.dumps(summary, indent=2))
    if args.summary:
        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary).write_text(json.dumps(summary, indent=2))
    if summary.get("deb"):
        print(f"built {summary.get('deb_copy', summary['deb'])}: {summary['deb_bytes'] / 2**20:.0f} MiB "
              f"(bundle {summary['bundle_bytes'] / 2**20:.0f} MiB installed)"
              f"{' [cached]' if summary['cached'] else ''}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
