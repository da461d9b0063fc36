"""Bad input on the command line: one clear line, non-zero exit, no traceback,
nothing written half-way (neither in the user's folder nor in the cache)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from cli_helpers import run_cli, snapshot


@pytest.fixture()
def isolated_cache(tmp_path: Path, demo_folder: Path) -> dict[str, str]:
    """A cache holding only the demo model, so we can prove nothing else gets written."""
    cache = tmp_path / "cache"
    dest = cache / demo_folder.relative_to(demo_folder.parents[1])
    shutil.copytree(demo_folder, dest)
    return {"FLOTILLA_CACHE": str(cache), "HF_HOME": str(tmp_path / "hf"),
            "FLOTILLA_CONFIG": str(tmp_path / "config")}


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 1, proc
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("flotilla: error:")]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle.lower() in errors[0].lower(), errors[0]


def _case_missing(tmp: Path) -> Path:
    return tmp / "no-such-model"


def _case_empty(tmp: Path) -> Path:
    p = tmp / "empty"
    p.mkdir()
    return p


def _case_not_causal(tmp: Path) -> Path:
    from transformers import BertConfig, BertModel

    p = tmp / "bert"
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32)
    BertModel(cfg).save_pretrained(p)
    return p


def _case_truncated(tmp: Path, demo_folder: Path) -> Path:
    p = tmp / "truncated"
    shutil.copytree(demo_folder, p)
    weights = p / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    return p


@pytest.mark.parametrize("case, needles", [
    ("missing", ["does not exist"]),
    ("empty", ["empty"]),
    ("not_causal", ["causal"]),
    ("truncated", ["safetensors"]),
])
def test_bad_model_path_is_one_clear_line(case, needles, tmp_path, demo_folder, isolated_cache):
    work = tmp_path / "work"
    work.mkdir()
    if case == "truncated":
        model = _case_truncated(work, demo_folder)
    else:
        model = {"missing": _case_missing, "empty": _case_empty, "not_causal": _case_not_causal}[case](work)
    before_model, before_cache = snapshot(work), snapshot(Path(isolated_cache["FLOTILLA_CACHE"]))
    proc = run_cli("chat", "--model", str(model), "-p", "hello", "--max-tokens", "4", env_extra=isolated_cache)
    assert_one_line_error(proc, *needles)
    assert str(model.name) in proc.stderr
    assert snapshot(work) == before_model, "the user's folder was modified"
    assert snapshot(Path(isolated_cache["FLOTILLA_CACHE"])) == before_cache, "something was written to the cache"


def test_bad_model_inspect_and_serve_also_fail_cleanly(tmp_path, isolated_cache):
    for args in (["models", "inspect", str(tmp_path / "nope")],
                 ["serve", "--model", str(tmp_path / "nope"), "--port", "0"]):
        proc = run_cli(*args, env_extra=isolated_cache)
        assert_one_line_error(proc, "does not exist")


def test_hub_id_offline_says_why(isolated_cache):
    proc = run_cli("models", "pull", "some-org/some-model-that-is-not-cached", env_extra=isolated_cache)
    assert_one_line_error(proc, "some-org/some-model-that-is-not-cached")


def test_invalid_sampling_is_refused_before_loading(isolated_cache):
    proc = run_cli("chat", "--model", "demo", "-p", "hi", "--top-p", "0", env_extra=isolated_cache)
    assert_one_line_error(proc, "top_p")


def test_version_and_help():
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("flotilla ")
    from engine import __version__

    assert __version__ in proc.stdout
    for cmd in ("chat", "serve", "models"):
        helped = run_cli(cmd, "--help")
        assert helped.returncode == 0 and "usage: flotilla" in helped.stdout
