"""The text the trained demo models learn from: a deterministic corpus recipe.

Text every machine has and that we may use: the running interpreter's own
standard library (its top-level modules' source and docstrings, plus
pydoc_data/topics.py, the language reference as English prose; PSF licence)
and this project's own prose (README.md, docs/*.md, assets/demo/corpus.txt).

The project's prose is read from a frozen snapshot (assets/demo/corpus-docs.json.gz,
written by `flotilla models train-demos --freeze-docs`), not from the live docs:
the docs change with every commit, and a rebuild of the shipped weights must read
the bytes they were trained on. The stdlib differs between Python versions, so the
recipe records the Python version and every file's sha256; `corpus.digest` names
the whole corpus, and the trained weights' recipe JSON says which corpus they came
from (train-demos compares the two and says what differs, rather than refusing to
train on another Python).

The file list is fixed by rule and sorted, so two runs read the same bytes in the
same order.

The held-out split is by a hash of the file's *name*, not its content, so the
same modules are held out on every Python version.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent.parent
# The project's prose as it was when the shipped weights were trained: {name: text}.
FROZEN_DOCS = PROJECT_ROOT / "assets" / "demo" / "corpus-docs.json.gz"

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
    origin: str  # where it was read: a path on this machine, or the frozen snapshot's file
    sha256: str  # of its bytes, as read
    size: int  # bytes
    held_out: bool  # in the perplexity split, never trained on
    data: bytes = field(default=b"", repr=False, compare=False)  # the bytes themselves


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
        return [text for _name, text in self.named_texts(held_out)]

    def named_texts(self, held_out: bool) -> list[tuple[str, str]]:
        """(name, text) of the split's files, in file order."""
        return [(f.name, f.data.decode("utf-8", errors="replace")) for f in self.split(held_out)]

    def manifest(self) -> dict:
        """What the recipe JSON records: enough to tell which corpus weights came from."""
        return {"python": self.python, "digest": self.digest,
                "heldout_rule": f"sha256(name)[:8] % {HELDOUT_MODULUS} == 0",
                "files": {f.name: f.sha256[:16] for f in self.files},
                "train_bytes": sum(f.size for f in self.split(False)),
                "heldout_bytes": sum(f.size for f in self.split(True))}


def name_bucket(name: str, buckets: int) -> int:
    """A stable bucket of a name (sha256, any Python): the held-out split, the chat phrasings."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % buckets


def is_held_out(name: str) -> bool:
    return name_bucket(name, HELDOUT_MODULUS) == 0


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def live_docs(project: Path | None = None) -> list[tuple[str, Path]]:
    """(name, path) of the project's prose files as they are in this checkout."""
    project = project or PROJECT_ROOT
    docs = [project / "README.md", project / "assets" / "demo" / "corpus.txt", *(project / "docs").glob("*.md")]
    return sorted((f"project/{p.relative_to(project).as_posix()}", p) for p in docs if p.is_file())


def freeze_docs(project: Path | None = None, out: Path | None = None) -> dict[str, str]:
    """Write the project's prose as it is now into the frozen snapshot (atomically);
    returns {name: text}. Fixed gzip header (no name, mtime 0): same docs, same bytes."""
    out = out or FROZEN_DOCS
    docs = {name: path.read_bytes().decode("utf-8") for name, path in live_docs(project)}
    blob = json.dumps(docs, sort_keys=True, ensure_ascii=False, indent=0).encode()
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        gz.write(blob)
    tmp.replace(out)
    return docs


def frozen_docs(path: Path | None = None) -> dict[str, str]:
    """{name: text} of the frozen snapshot; empty when the checkout has none."""
    path = path or FROZEN_DOCS
    if not path.is_file():
        return {}
    return json.loads(gzip.decompress(path.read_bytes()))


def corpus_sources(stdlib: Path | None = None) -> list[tuple[str, Path]]:
    """(name, path) of the corpus's stdlib files, sorted by name."""
    stdlib = stdlib or stdlib_dir()
    out: list[tuple[str, Path]] = []
    for p in stdlib.glob("*.py"):
        if p.name in _STDLIB_EXCLUDE or p.name.startswith(_STDLIB_EXCLUDE_PREFIXES) or not p.is_file():
            continue
        out.append((f"stdlib/{p.name}", p))
    for rel in _STDLIB_EXTRA:
        if (stdlib / rel).is_file():
            out.append((f"stdlib/{rel}", stdlib / rel))
    return sorted(out)


def build_corpus(stdlib: Path | None = None, docs: Path | None = None,
                 max_train_bytes: int | None = None) -> Corpus:
    """The corpus on this machine: the stdlib as installed, the project's prose from
    the frozen snapshot `docs` (default FROZEN_DOCS; the live docs when there is none).
    max_train_bytes keeps only the first training files (in name order) up to that
    many bytes: small runs for tests."""
    entries: list[tuple[str, str, bytes]] = [(n, str(p), p.read_bytes()) for n, p in corpus_sources(stdlib)]
    frozen = frozen_docs(docs)
    if frozen:
        origin = str(docs or FROZEN_DOCS)
        entries += [(n, origin, text.encode()) for n, text in frozen.items()]
    else:
        entries += [(n, str(p), p.read_bytes()) for n, p in live_docs()]
    files: list[CorpusFile] = []
    train_bytes = 0
    for name, origin, data in sorted(entries):
        held = is_held_out(name)
        if not held and max_train_bytes is not None:
            if train_bytes >= max_train_bytes:
                continue
            train_bytes += len(data)
        files.append(CorpusFile(name, origin, hashlib.sha256(data).hexdigest(), len(data), held, data))
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
