"""The models this machine can run without asking: demos, HF cache, user folders.

Listing is read-only and tolerant: a missing Hugging Face cache, a moved user
folder or a damaged models.json never makes the list fail; a registered
folder that no longer resolves is still listed, with `error` saying why, so
the model picker can show it greyed out instead of silently dropping it.

User folders persist in `models.json` in the settings folder (engine/paths.py:
$FLOTILLA_CONFIG, else the OS's), written atomically so a crash never leaves half a file.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.models import demo
from engine.models.config_file import read_config
from engine.models.errors import ModelError
from engine.models.ref import architecture_of, hf_cache_dir, resolve_model

MODELS_FILE = "models.json"
_FILE_VERSION = 1


@dataclass(frozen=True)
class LocalModelEntry:
    """One model the picker can offer."""

    model_id: str  # what to pass to resolve_model for demos/hub; display name for folders
    kind: str  # "demo" | "hub" | "hf" | "openvino"
    path: Path  # the model folder (for unbuilt demos: where it will be built)
    size_bytes: int  # bytes on disk (0 for an unbuilt demo)
    architecture: str | None  # e.g. "LlamaForCausalLM"; None when unknown
    built: bool  # demos: already in the cache; other kinds: always True
    description: str = ""  # one line for lists (demo recipe text)
    error: str | None = None  # why a registered folder cannot be used now, else None


def config_dir() -> Path:
    """The settings folder models.json lives in (engine/paths.py: $FLOTILLA_CONFIG, else the
    OS's; an earlier version's models.json is moved there). Not created: listing writes nothing,
    the first add_model_folder creates it."""
    from engine.paths import folders

    return folders().settings


def list_local_models() -> list[LocalModelEntry]:
    """Demo models, hub models in the HF cache, then registered folders."""
    return _demo_entries() + _hub_entries() + _folder_entries()


def add_model_folder(path: str | Path) -> LocalModelEntry:
    """Validate a model folder and remember it; returns its catalog entry."""
    folder = Path(path).expanduser().absolute()
    # An absolute path is never taken for a demo id or a hub id.
    resolved = resolve_model(str(folder), allow_download=False)
    folders = _read_folders()
    if str(resolved.path) not in folders:
        folders.append(str(resolved.path))
        _write_folders(folders)
    return LocalModelEntry(model_id=resolved.model_id, kind=resolved.kind, path=resolved.path,
                           size_bytes=_folder_size(resolved.path),
                           architecture=resolved.architecture, built=True)


def remove_model_folder(path: str | Path) -> bool:
    """Forget a registered folder (the files are left alone); True if it was known."""
    target = str(Path(path).expanduser().absolute())
    folders = _read_folders()
    kept = [f for f in folders if f != target and str(Path(f).resolve()) != str(Path(target).resolve())]
    if len(kept) == len(folders):
        return False
    _write_folders(kept)
    return True


# --------------------------------------------------------------------------- sources

def _demo_entries() -> list[LocalModelEntry]:
    out = []
    for demo_id in demo.demo_ids():
        path = demo.demo_path(demo_id)
        built = (path / "config.json").is_file() and (path / "model.safetensors").is_file()
        recipe = demo.RECIPES[demo_id]
        arch = _arch(path) if built else recipe.config_class.replace("Config", "ForCausalLM")
        out.append(LocalModelEntry(model_id=demo_id, kind="demo", path=path,
                                   size_bytes=_folder_size(path) if built else 0,
                                   architecture=arch, built=built, description=recipe.description))
    return out


def _hub_entries() -> list[LocalModelEntry]:
    try:
        from huggingface_hub import scan_cache_dir

        info = scan_cache_dir(hf_cache_dir())
    except Exception:  # no cache yet (CacheNotFound), unreadable, or no huggingface_hub
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        # Prefer the revision `main` points at; else the newest one.
        revs = sorted(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified))
        snap = Path(revs[-1].snapshot_path)
        # Only folders that could run: a config probe alone is not a model.
        if not (snap / "config.json").is_file() or not _has_weights(snap):
            continue
        out.append(LocalModelEntry(model_id=repo.repo_id, kind="hub", path=snap,
                                   size_bytes=int(revs[-1].size_on_disk),
                                   architecture=_arch(snap), built=True))
    return out


def _folder_entries() -> list[LocalModelEntry]:
    out = []
    for f in _read_folders():
        path = Path(f)
        try:
            r = resolve_model(str(path), allow_download=False)
        except ModelError as e:
            out.append(LocalModelEntry(model_id=path.name, kind="hf", path=path, size_bytes=0,
                                       architecture=None, built=True, error=str(e)))
            continue
        out.append(LocalModelEntry(model_id=r.model_id, kind=r.kind, path=r.path,
                                   size_bytes=_folder_size(r.path), architecture=r.architecture,
                                   built=True))
    return out


# --------------------------------------------------------------------------- helpers

def _arch(path: Path) -> str | None:
    try:
        return architecture_of(read_config(path))
    except ModelError:
        return None


def _has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin")) \
        or (path / "openvino_model.xml").is_file()


def _folder_size(path: Path) -> int:
    total = 0
    try:
        for p in path.iterdir():
            if p.is_file():  # follows HF cache symlinks to the blobs
                total += p.stat().st_size
    except OSError:
        pass
    return total


def _models_file() -> Path:
    return config_dir() / MODELS_FILE


def _read_folders() -> list[str]:
    try:
        data = json.loads(_models_file().read_text(encoding="utf-8"))
        folders = data.get("folders", []) if isinstance(data, dict) else []
        return [str(f) for f in folders if isinstance(f, str)]
    except (OSError, ValueError):
        # Missing or damaged: start empty; the next add rewrites it whole.
        return []


def _write_folders(folders: list[str]) -> None:
    target = _models_file()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".models-", suffix=".json", dir=target.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"version": _FILE_VERSION, "folders": folders}, fh, indent=2)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        raise ModelError(f"cannot save {target}: {e.strerror or e}; check that folder's permissions") from None
