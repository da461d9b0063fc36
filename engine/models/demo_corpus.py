"""The text the trained demo models learn from: a deterministic corpus recipe.

Text every machine has and that we may use: the running interpreter's own
standard library (its top-level modules' source and docstrings, plus
pydoc_data/topics.py, the language reference as English prose; PSF licence)
and this project's own prose (README.md, docs/*.md, assets/demo/corpus.txt).

The file list is fixed by rule and sorted, so two runs on one machine read the
same bytes in the same order. The stdlib differs between Python versions (and
the docs between commits), so the recipe records the Python version and every
file's sha256; `corpus.digest` names the whole corpus, and the trained weights'
recipe JSON says which corpus they came from (train-demos compares the two and
says what differs, rather than refusing to train on another Python).

The held-out split is by a hash of the file's *name*, not its content, so the
same modules are held out on every Python version.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent.parent

# Held out when int(sha256(name)[:8], 16) % HELDOUT_MODULUS == 0 (about 1 file in 16).
HELDOUT_MODULUS = 16

# Top-level stdlib modules left out, and why.
_STDLIB_EXCLUDE_PREFIXES = (
    "_sysconfigdata",  # this machine's build flags and paths, not Python text
)
_STDLIB_EXCLUDE = {
    "this.py",  # the Zen of Python rot13-encoded: letters, but not English
    "__hello__.py",  # a frozen-module smoke test
}
# Beyond the top level: the language reference as prose strings.
_STDLIB_EXTRA = ("pydoc_data/topics.py",)


@dataclass(frozen=True)
class CorpusFile:
    """One file of the corpus."""

    name: str  # stable label: "stdlib/argparse.py", "project/docs/moe.md"
    path: Path  # where it was read on this machine
    sha256: str  # of its bytes, as read
    size: int  # bytes
    held_out: bool  # in the perplexity split, never trained on


@dataclass(frozen=True)
class Corpus:
    """The whole recipe's outcome on this machine."""

    python: str  # interpreter version whose stdlib was read, e.g. "3.11.7"
    files: tuple[CorpusFile, ...]  # sorted by name
    digest: str  # sha256[:16] over (name, sha256) of every file: the corpus's identity

    def split(self, held_out: bool) -> list[CorpusFile]:
        return [f for f in self.files if f.held_out == held_out]

    def texts(self, held_out: bool) -> list[str]:
        """The split's texts, in file order (undecodable bytes replaced, deterministically)."""
        return [f.path.read_bytes().decode("utf-8", errors="replace") for f in self.split(held_out)]

    def manifest(self) -> dict:
        """What the recipe JSON records: enough to tell which corpus weights came from."""
        return {"python": self.python, "digest": self.digest,
                "heldout_rule": f"sha256(name)[:8] % {HELDOUT_MODULUS} == 0",
                "files": {f.name: f.sha256[:16] for f in self.files},
                "train_bytes": sum(f.size for f in self.split(False)),
                "heldout_bytes": sum(f.size for f in self.split(True))}


def is_held_out(name: str) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % HELDOUT_MODULUS == 0


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_sources(stdlib: Path | None = None, project: Path | None = None) -> list[tuple[str, Path]]:
    """(name, path) of every corpus file, sorted by name."""
    stdlib = stdlib or stdlib_dir()
    project = project or PROJECT_ROOT
    out: list[tuple[str, Path]] = []
    for p in stdlib.glob("*.py"):
        if p.name in _STDLIB_EXCLUDE or p.name.startswith(_STDLIB_EXCLUDE_PREFIXES) or not p.is_file():
            continue
        out.append((f"stdlib/{p.name}", p))
    for rel in _STDLIB_EXTRA:
        if (stdlib / rel).is_file():
            out.append((f"stdlib/{rel}", stdlib / rel))
    docs = [project / "README.md", project / "assets" / "demo" / "corpus.txt", *(project / "docs").glob("*.md")]
    for p in docs:
        if p.is_file():
            out.append((f"project/{p.relative_to(project).as_posix()}", p))
    return sorted(out)


def build_corpus(stdlib: Path | None = None, project: Path | None = None,
                 max_train_bytes: int | None = None) -> Corpus:
    """The corpus on this machine. max_train_bytes keeps only the first training
    files (in name order) up to that many bytes: small runs for tests."""
    files: list[CorpusFile] = []
    train_bytes = 0
    for name, path in corpus_sources(stdlib, project):
        data = path.read_bytes()
        held = is_held_out(name)
        if not held and max_train_bytes is not None:
            if train_bytes >= max_train_bytes:
                continue
            train_bytes += len(data)
        files.append(CorpusFile(name, path, hashlib.sha256(data).hexdigest(), len(data), held))
    blob = json.dumps([(f.name, f.sha256) for f in files])
    digest = hashlib.sha256(blob.encode()).hexdigest()[:16]
    return Corpus(python=platform.python_version(), files=tuple(files), digest=digest)


def compare_manifests(shipped: dict, current: dict) -> list[str]:
    """Human lines saying how two corpus manifests differ (empty: same corpus)."""
    if shipped.get("digest") == current.get("digest"):
        return []
    lines = []
    if shipped.get("python") != current.get("python"):
        lines.append(f"Python {shipped.get('python')} -> {current.get('python')}")
    a, b = shipped.get("files", {}), current.get("files", {})
    changed = sorted(n for n in a.keys() & b.keys() if a[n] != b[n])
    gone, new = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    for label, names in (("changed", changed), ("missing here", gone), ("new here", new)):
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            lines.append(f"{len(names)} file(s) {label}: {shown}")
    return lines
