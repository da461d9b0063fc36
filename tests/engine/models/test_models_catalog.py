"""Catalog: demos, HF cache scan, registered folders persisted in models.json."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.models import ModelError, add_model_folder, list_local_models, remove_model_folder
from engine.models.catalog import config_dir
from engine.models.demo import demo_ids, demo_path, ensure_demo


@pytest.fixture
def cfg(tmp_path, monkeypatch, hf_home):
    """A private FLOTILLA_CONFIG (not created yet) and an empty, missing HF cache."""
    d = tmp_path / "config"
    monkeypatch.setenv("FLOTILLA_CONFIG", str(d))
    return d


def _by_id(entries):
    return {e.model_id: e for e in entries}


def test_config_dir_honours_env(cfg):
    assert config_dir() == cfg


def test_lists_demos_without_a_hub_cache(cfg):
    for d in demo_ids():
        ensure_demo(d)
    entries = list_local_models()
    assert [e.model_id for e in entries] == demo_ids()  # no cache, no folders: just demos
    for e in entries:
        assert e.kind == "demo" and e.built and e.path == demo_path(e.model_id)
        assert e.size_bytes > 0 and e.architecture.endswith("ForCausalLM") and e.description
    assert not cfg.exists()  # listing writes nothing


def test_unbuilt_demo_is_listed_as_not_built(cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("FLOTILLA_CACHE", str(tmp_path / "empty-cache"))
    entries = _by_id(list_local_models())
    assert entries["demo"].built is False and entries["demo"].size_bytes == 0
    assert entries["demo-moe"].architecture == "Qwen2MoeForCausalLM"
    assert not (tmp_path / "empty-cache").exists()


def test_add_list_and_persist(cfg, copy_demo):
    folder = copy_demo("demo-qwen3", name="my-qwen")
    entry = add_model_folder(folder)
    assert (entry.model_id, entry.kind, entry.path, entry.architecture) == (
        "my-qwen", "hf", folder, "Qwen3ForCausalLM")
    assert entry.size_bytes == sum(f.stat().st_size for f in folder.iterdir())

    data = json.loads((cfg / "models.json").read_text())
    assert data["folders"] == [str(folder)]
    assert [p.name for p in cfg.iterdir()] == ["models.json"]  # no temp file left behind

    add_model_folder(str(folder))  # twice: still once
    assert json.loads((cfg / "models.json").read_text())["folders"] == [str(folder)]

    listed = _by_id(list_local_models())["my-qwen"]  # a fresh read of the file
    assert (listed.kind, listed.path, listed.error) == ("hf", folder, None)

    assert remove_model_folder(folder) is True
    assert "my-qwen" not in _by_id(list_local_models())
    assert remove_model_folder(folder) is False


def test_add_invalid_folder_persists_nothing(cfg, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="is an empty folder"):
        add_model_folder(tmp_path / "empty")
    assert not cfg.exists()


def test_add_never_takes_a_path_for_a_demo_id(cfg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match="does not exist"):
        add_model_folder("demo")


def test_moved_folder_is_listed_with_its_error(cfg, copy_demo):
    folder = copy_demo(name="moving")
    add_model_folder(folder)
    shutil.rmtree(folder)
    entry = _by_id(list_local_models())["moving"]
    assert entry.error and "does not exist" in entry.error


def test_damaged_models_json_is_tolerated(cfg, copy_demo):
    cfg.mkdir()
    (cfg / "models.json").write_text("{not json")
    assert [e.kind for e in list_local_models()] == ["demo"] * len(demo_ids())
    add_model_folder(copy_demo())  # rewrites it whole
    assert len(json.loads((cfg / "models.json").read_text())["folders"]) == 1


def test_hub_cache_models_are_listed(cfg, hf_home, fake_hub_model, tmp_path):
    snap = fake_hub_model(hf_home, "acme/tiny-llama", ensure_demo("demo"))
    # A config-only probe is not a usable model and is not offered.
    probe = tmp_path / "probe"
    probe.mkdir()
    shutil.copy(ensure_demo("demo") / "config.json", probe)
    fake_hub_model(hf_home, "acme/config-only", probe)
    hub = [e for e in list_local_models() if e.kind == "hub"]
    assert [e.model_id for e in hub] == ["acme/tiny-llama"]
    assert hub[0].path == snap and hub[0].architecture == "LlamaForCausalLM"
    assert hub[0].size_bytes == sum(f.stat().st_size for f in snap.iterdir())
