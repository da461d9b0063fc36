"""`flotilla pipeline --weights`: every precision of the plan, the plan shown before
anything is exported, and a plan that does not fit refused in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cli_helpers import run_cli, snapshot

CHOICES = ["auto", "f32", "bf16", "fp16", "int8", "int4"]


@pytest.fixture()
def isolated_cache(tmp_path: Path, demo_folder: Path) -> dict[str, str]:
    """A cache holding only the demo model, so we can prove nothing else gets written."""
    cache = tmp_path / "cache"
    shutil.copytree(demo_folder, cache / demo_folder.relative_to(demo_folder.parents[1]))
    return {"FLOTILLA_CACHE": str(cache), "HF_HOME": str(tmp_path / "hf"), "FLOTILLA_CONFIG": str(tmp_path / "cfg")}


def test_weights_offers_every_precision_and_refuses_others():
    from engine.planner.weights import WEIGHT_CHOICES

    assert list(WEIGHT_CHOICES) == CHOICES  # the CLI's own copy of the labels
    helped = run_cli("pipeline", "--help")
    assert helped.returncode == 0 and "{auto,f32,bf16,fp16,int8,int4}" in helped.stdout
    bad = run_cli("pipeline", "--model", "demo", "--weights", "q3", "--plan-only")
    assert bad.returncode == 2 and "invalid choice: 'q3'" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("weights, shown", [
    ("auto", "weights f32 (auto: the most precise that fits)"),  # the demo checkpoint is f32
    ("bf16", "weights bf16,"),
    ("int4", "weights int4,"),
])
def test_plan_only_prints_the_plan_at_that_precision_and_exports_nothing(weights, shown, isolated_cache):
    cache = Path(isolated_cache["FLOTILLA_CACHE"])
    before = snapshot(cache)
    proc = run_cli("pipeline", "--model", "demo", "--stages", "3", "--weights", weights, "--context", "1024",
                   "--max-streams", "2", "--plan-only", env_extra=isolated_cache)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("plan: 3 stage(s), ") and shown in lines[0], lines[0]
    assert "context 1024 tokens x 2 stream(s)" in lines[0]
    assert [ln.split(",")[1].strip() for ln in lines[1:]] == ["layers 0–3", "layers 3–6", "layers 6–8"]
    assert snapshot(cache) == before, "--plan-only wrote to the cache"


def test_a_plan_that_does_not_fit_is_refused_before_any_export(isolated_cache):
    cache = Path(isolated_cache["FLOTILLA_CACHE"])
    before = snapshot(cache)
    # 100k streams of KV fit on no PC, whatever the weights.
    proc = run_cli("pipeline", "--model", "demo", "--max-streams", "100000", "-p", "hi",
                   env_extra=isolated_cache)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and errors[0].startswith("flotilla: error: the plan cannot run on this PC"), errors
    assert "even with int4 weights" in errors[0] and "stage 0:" in errors[0] and "KV" in errors[0]
    assert snapshot(cache) == before, "a shard was exported for a plan that does not fit"


def test_the_plan_is_shown_before_the_shards_are_made():
    # A real launch (shards, stage processes, wiring); the chat on stdin ends at once.
    proc = run_cli("pipeline", "--model", "demo", "--weights", "f32", timeout=300, input="/exit\n")
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr.splitlines()
    head = next(i for i, ln in enumerate(err) if ln.startswith("plan: 2 stage(s), weights f32"))
    shard = next(i for i, ln in enumerate(err) if "shard 0 (layers 0–4, f32)" in ln)
    assert head < shard, proc.stderr


def test_a_checkpoint_missing_one_safetensors_file_is_one_line(tmp_path):
    """A sharded checkpoint whose index names a file that is not there: one clear line,
    non-zero exit, nothing exported."""
    import json

    from safetensors.torch import load_file, save_file

    from engine.models.demo import ensure_demo

    model = tmp_path / "broken"
    shutil.copytree(ensure_demo("demo"), model)
    tensors = load_file(str(model / "model.safetensors"))
    (model / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, chunk in parts.items():
        save_file({n: tensors[n] for n in chunk}, str(model / fname))
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, chunk in parts.items() for n in chunk}}))
    (model / "model-00002-of-00002.safetensors").unlink()
    env = {"FLOTILLA_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "hf"),
           "FLOTILLA_CONFIG": str(tmp_path / "cfg")}
    proc = run_cli("pipeline", "--model", str(model), "-p", "hi", env_extra=env)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and "model-00002-of-00002.safetensors" in errors[0], errors
    assert not (tmp_path / "cache" / "shards").exists() or not any((tmp_path / "cache" / "shards").iterdir())


def test_an_unsupported_architecture_is_refused_at_plan_time_in_one_line(tmp_path):
    """A causal LM of a family the shards do not cover (Falcon): one line naming the
    type and what is supported, before any weight is read."""
    import json

    import torch
    from safetensors.torch import save_file

    model = tmp_path / "falcon"
    model.mkdir()
    save_file({"lm_head.weight": torch.zeros(100, 64)}, str(model / "model.safetensors"))
    from engine.models.demo import ensure_demo

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_demo("demo") / name, model / name)
    (model / "config.json").write_text(json.dumps({
        "model_type": "falcon", "architectures": ["FalconForCausalLM"], "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}))
    env = {"FLOTILLA_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "hf"),
           "FLOTILLA_CONFIG": str(tmp_path / "cfg")}
    proc = run_cli("pipeline", "--model", str(model), "--plan-only", env_extra=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and "'falcon' cannot be split into pipeline shards" in errors[0], errors
    assert "llama" in errors[0]  # names what is supported
