"""Fixtures for engine.models tests: copies of the demo models, clean HF env."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.models.demo import ensure_demo


@pytest.fixture
def copy_demo(tmp_path):
    """copy_demo(demo_id, name=None) -> a private copy of a built demo folder."""

    def _copy(demo_id: str = "demo", name: str | None = None) -> Path:
        dst = tmp_path / (name or f"{demo_id}-copy")
        shutil.copytree(ensure_demo(demo_id), dst)
        return dst

    return _copy


@pytest.fixture
def listing():
    """listing(root) -> everything under root with size and mtime, to prove nothing was written."""

    def _listing(root: Path):
        root = Path(root)
        if not root.exists():
            return None
        if root.is_file():
            st = root.stat()
            return [(root.name, st.st_size, st.st_mtime_ns)]
        return sorted((str(p.relative_to(root)), p.stat().st_size if p.is_file() else -1,
                       p.stat().st_mtime_ns) for p in root.rglob("*"))

    return _listing


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """An empty Hugging Face home, offline; returns the hub cache folder."""
    home = tmp_path / "hf-home"
    home.mkdir()
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home / "hub"


@pytest.fixture
def fake_hub_model():
    """fake_hub_model(cache, repo_id, src) lays src out like a real HF cache entry."""

    def _make(cache: Path, repo_id: str, src: Path, commit: str = "0123456789abcdef") -> Path:
        repo = cache / ("models--" + repo_id.replace("/", "--"))
        snap = repo / "snapshots" / commit
        (repo / "blobs").mkdir(parents=True)
        snap.mkdir(parents=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
        for i, f in enumerate(sorted(src.iterdir())):
            blob = repo / "blobs" / f"blob{i:04d}"
            shutil.copy2(f, blob)
            (snap / f.name).symlink_to(blob)
        return snap

    return _make


@pytest.fixture
def shard():
    """shard(folder) rewrites model.safetensors as two shards plus an index, like big checkpoints."""

    def _shard(folder: Path) -> Path:
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / "model.safetensors")
        names = sorted(tensors)
        half = len(names) // 2
        weight_map = {}
        for i, part in enumerate((names[:half], names[half:]), start=1):
            fname = f"model-{i:05d}-of-00002.safetensors"
            save_file({n: tensors[n] for n in part}, folder / fname, metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        (folder / "model.safetensors").unlink()
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}))
        return folder

    return _shard
