"""`flotilla bench scale`'s pieces on checkpoints of a few MB: the streaming checkpoint builder,
the layer-by-layer transformers reference, the caps and the judgement, and the JSON a run writes
(the whole scenario end to end runs in tests/e2e/test_pipeline_under_cgroup.py)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.bench import _checkpoint as ck
from engine.bench import scale
from engine.bench._capped_fleet import CapRule, planned_process_bytes

REPO = Path(__file__).resolve().parents[3]
TINY = dict(hidden_size=64, intermediate_size=160, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=3000,
            max_file_bytes=300_000)


def tiny(tied: bool = False, **kw) -> ck.CheckpointSpec:
    base = ck.LLAMA_3_2_1B if tied else ck.LLAMA_3_1_8B
    return base.scaled(name=f"tiny-{'tied' if tied else 'untied'}", **{**TINY, **kw})


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_published_shapes_have_the_published_sizes():
    assert round(ck.LLAMA_3_1_8B.params / 1e9, 2) == 8.03  # meta-llama/Llama-3.1-8B
    assert round(ck.LLAMA_3_2_1B.params / 1e9, 2) == 1.24  # meta-llama/Llama-3.2-1B (tied)
    assert ck.LLAMA_3_1_8B.nbytes == 2 * ck.LLAMA_3_1_8B.params
    assert len(ck.file_layout(ck.LLAMA_3_1_8B)) >= 3 and len(ck.file_layout(ck.LLAMA_3_2_1B)) >= 2


@pytest.mark.parametrize("tied", [False, True])
def test_checkpoint_is_sharded_safetensors_that_transformers_loads(tmp_path, tied):
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    spec = tiny(tied)
    path = ck.ensure_checkpoint(spec, tmp_path)
    files = sorted(path.glob("*.safetensors"))
    assert len(files) >= 3 and ck.is_built(path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {n for n, _ in spec.tensors()}
    for name, fname in index["weight_map"].items():
        with safe_open(str(path / fname), "pt") as f:
            assert name in f.keys()
    assert ("lm_head.weight" in index["weight_map"]) is not tied
    cfg = AutoConfig.from_pretrained(path)
    assert (cfg.model_type, cfg.vocab_size, cfg.num_key_value_heads, cfg.tie_word_embeddings) == \
        ("llama", 3000, 2, tied)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) <= cfg.vocab_size and tok.eos_token_id == cfg.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.bfloat16
    w = model.model.layers[0].mlp.up_proj.weight.detach().float()
    assert abs(float(w.std()) - spec.init_std) < 0.1 * spec.init_std
    assert torch.all(model.model.norm.weight == 1)
    logits = model.float()(torch.arange(3, 40)[None]).logits
    assert torch.isfinite(logits).all()


def test_the_same_spec_builds_the_same_bytes_and_another_seed_does_not(tmp_path):
    a = ck.ensure_checkpoint(tiny(), tmp_path / "a")
    b = ck.ensure_checkpoint(tiny(), tmp_path / "b")
    c = ck.ensure_checkpoint(tiny(seed=1), tmp_path / "c")
    names = sorted(p.name for p in a.glob("*.safetensors"))
    assert [_sha(a / n) for n in names] == [_sha(b / n) for n in names]
    assert [_sha(a / n) for n in names] != [_sha(c / n) for n in sorted(p.name for p in c.glob("*.safetensors"))]
    assert ck.ensure_checkpoint(tiny(), tmp_path / "a") == a  # built once: found again, not rebuilt


def test_too_little_disk_is_refused_before_writing(tmp_path, monkeypatch):
    class Usage:
        free = 1000

    monkeypatch.setattr(ck.shutil, "disk_usage", lambda _p: Usage())
    with pytest.raises(ck.CheckpointError) as e:
        ck.ensure_checkpoint(tiny(), tmp_path)
    assert e.value.code == "disk_full" and "GB free" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_a_build_that_dies_leaves_no_checkpoint_and_its_leftovers_are_cleaned(tmp_path, monkeypatch):
    real = ck._write_tensor
    calls = []

    def dying(f, spec, name, shape):
        calls.append(name)
        if len(calls) == 6:
            raise OSError("disk gone")
        real(f, spec, name, shape)

    monkeypatch.setattr(ck, "_write_tensor", dying)
    with pytest.raises(OSError):
        ck.ensure_checkpoint(tiny(), tmp_path)
    assert not ck.checkpoint_path(tiny(), tmp_path).exists()
    assert list(tmp_path.iterdir()) == []
    # A killed builder (no `finally`) leaves its temporary folder; the next build removes it.
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = tmp_path / f".{ck.checkpoint_path(tiny(), tmp_path).name}.tmp-{dead.pid}"
    orphan.mkdir()
    (orphan / "model-00001-of-00003.safetensors").write_bytes(b"half")
    monkeypatch.setattr(ck, "_write_tensor", real)
    path = ck.ensure_checkpoint(tiny(), tmp_path)
    assert ck.is_built(path) and not orphan.exists()


@pytest.mark.parametrize("tied", [False, True])
def test_layer_by_layer_reference_equals_transformers(tmp_path, tied):
    import torch
    from transformers import AutoModelForCausalLM

    from engine.bench._reference import teacher_forced_argmax

    path = ck.ensure_checkpoint(tiny(tied, init_std=0.1), tmp_path)
    ids = [int(i) for i in torch.randint(3, 1500, (48,), generator=torch.Generator().manual_seed(0))]
    got = teacher_forced_argmax(path, ids)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
    assert got["argmax"] == want
    assert got["finite"] and got["positions"] == 48 and got["distinct_argmax"] > 8


def test_shape_overrides_and_their_errors():
    spec = scale.spec_for(True, "hidden=1024,layers=8,vocab=32000,tied=0,file_mb=100")
    assert (spec.hidden_size, spec.num_layers, spec.vocab_size, spec.tie_word_embeddings, spec.max_file_bytes) == \
        (1024, 8, 32000, False, 100_000_000)
    assert spec.intermediate_size == ck.LLAMA_3_2_1B.intermediate_size and spec.name != ck.LLAMA_3_2_1B.name
    assert scale.spec_for(False) is ck.LLAMA_3_1_8B and scale.spec_for(True) is ck.LLAMA_3_2_1B
    with pytest.raises(SystemExit):
        scale.spec_for(False, "width=3")


def test_caps_are_below_the_model_unless_the_plan_asks_for_more():
    rule = CapRule(fraction=0.75, whole_model_bytes=4_000)
    assert rule.cap(None) == 3_000 and rule.below_model(3_000)
    assert rule.cap(3_500) == 3_500 and rule.below_model(3_500)  # the plan's need wins
    assert rule.cap(5_000) == 5_000 and not rule.below_model(5_000)  # then it is no proof any more
    assert CapRule(0.75, 4_000, at_least_plan=False).cap(5_000) == 3_000
    based = CapRule(0.75, 4_000, base_bytes=1_000)  # small models: the interpreter's own memory on top
    assert based.cap(None) == 4_000 and based.below_model(4_000)

    class Stage:
        total_bytes, os_reserve_bytes = 10_000, 2_500

    assert planned_process_bytes(Stage()) == 7_500  # the OS reserve stays with the peer's OS


def test_agreement_and_cached_shard_cleanup(tmp_path):
    assert scale.agreement([1, 2, 3, 4], [1, 2, 0, 4]) == {"positions": 4, "matches": 3, "top1_agreement": 0.75}
    for name, fp, prec in [("a", "F", "int4"), ("b", "F", "int8"), ("c", "G", "int4")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "shard.json").write_text(json.dumps({"model_fingerprint": fp, "precision": prec}))
    assert scale.drop_cached_shards(tmp_path, "F", "int4") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "c"]


def _passing(ckpt: int = 1000) -> dict:
    worker = {"stage": 0, "oom_kills": 0, "cap_bytes": 300, "cap_below_model": True, "planned_process_bytes": 200}
    run = {"tokens": [64], "errors": []}
    return {
        "checkpoint": {"bytes": ckpt}, "ranges": [[0, 2], [2, 4]],
        "reference": {"finite": True, "distinct_argmax": 200, "positions": 256},
        "precisions": {"int4": {
            "error": None, "export": {"cap_bytes": 600, "cap_base_bytes": 0,
                       "stages": [{"ok": True, "range": [0, 2]}, {"ok": True, "range": [2, 4]}]},
            "model_bytes": 400, "teacher_forced": {"stages": [{"ok": True}, {"ok": True}], "top1_agreement": 0.9},
            "fleet": {"error": None, "workers": [worker, {**worker, "stage": 1}],
                      "runs": {"1": run, "2": {"tokens": [64, 64], "errors": []}}}}},
    }


def test_judgement_names_what_failed_with_numbers():
    assert scale.judge(_passing(), ["int4"], 64, [1, 2]) == []
    r = _passing()
    r["precisions"]["int4"]["export"]["stages"][1] = {"ok": False, "range": [2, 4],
                                                      "error": "export-int4-2: killed by the OOM killer (cap 0.60 GB)"}
    fails = scale.judge(r, ["int4"], 64, [1, 2])
    assert len(fails) == 1 and "layers 2-4" in fails[0] and "OOM" in fails[0] and "0.60 GB" in fails[0]
    r = _passing()
    p = r["precisions"]["int4"]
    p["fleet"]["workers"][1].update(oom_kills=1, cap_below_model=False, cap_bytes=5 * 10**8)
    p["fleet"]["runs"]["2"] = {"tokens": [64, 12], "errors": ["stage 1 exited"]}
    p["teacher_forced"]["top1_agreement"] = None
    fails = scale.judge(r, ["int4"], 64, [1, 2])
    assert any("stage 1" in f and "OOM" in f for f in fails)
    assert any("not below the whole model" in f for f in fails)
    assert any("2 stream(s)" in f and "12" in f for f in fails)
    assert any("agreement" in f for f in fails)
    r = _passing()
    r["precisions"]["int4"]["export"]["cap_bytes"] = 1000  # == the checkpoint: not a proof
    r["reference"]["distinct_argmax"] = 1
    fails = scale.judge(r, ["int4"], 64, [1, 2])
    assert any("not below the checkpoint" in f for f in fails) and any("degenerate" in f for f in fails)
    assert scale.judge(_passing(), ["int4", "int8"], 64, [1, 2])  # a precision with no result fails


def test_a_run_writes_the_json_and_fails_with_the_numbers_when_processes_are_oom_killed(tmp_path):
    """End to end through the CLI on a 1 MB model: its caps (0.6 x 1 MB) are far below any
    Python process, so the exporter is OOM-killed and the run must say so, exit 1, and still
    write every figure it has (provenance included)."""
    out = tmp_path / "scale.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "FLOTILLA_CACHE": str(tmp_path / "cache"),
           "TMPDIR": str(tmp_path)}  # its log folder goes here, not into /tmp for good
    res = subprocess.run([sys.executable, "-m", "engine.cli.main", "bench", "scale", "--precisions", "int8",
                          "--shape", "hidden=64,intermediate=160,layers=4,heads=4,kv_heads=2,vocab=3000,file_mb=0.3",
                          "--positions", "32", "--tokens", "8", "--json", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["scenario"] == "scale" and d["passed"] is False
    assert {"commit", "cpu", "load_before", "load_after"} <= set(d["provenance"])
    assert d["checkpoint"]["bytes"] > 0 and len(d["checkpoint"]["files"]) >= 2
    assert d["reference"]["positions"] == 32 and "argmax" not in d["reference"]
    assert d["ranges"] == [[0, 2], [2, 4]] and d["caps"]["export_fraction"] == 0.6
    ex = d["precisions"]["int8"]["export"]
    assert ex["cap_bytes"] < d["checkpoint"]["bytes"]
    st = ex["stages"][0]
    assert st["ok"] is False and st["oom_kills"] >= 1 and st["returncode"] == -9
    for key in ("cgroup_max_usage_bytes", "vm_hwm_bytes", "rss_anon_peak_bytes", "seconds", "failcnt"):
        assert key in st
    assert any("OOM" in f and "layers 0-2" in f for f in d["failures"])
    assert "FAILED:" in res.stderr
    logs = Path(d["logs"])  # kept for whoever reads why it failed
    assert logs.parent == tmp_path and (logs / "export-int8-0.log").is_file()


def test_a_precision_without_disk_for_its_shards_is_refused_before_exporting(tmp_path, monkeypatch):
    path = ck.ensure_checkpoint(tiny(), tmp_path)

    class Usage:
        free = 10

    monkeypatch.setattr(scale.shutil, "disk_usage", lambda _p: Usage())
    res = scale.measure_precision(path, "int8", scale.Caps(0.6, 0.75), ckpt_bytes=ck.checkpoint_bytes(path),
                                  ranges=[(0, 2), (2, 4)], layers=4, ids=[1, 2, 3], reference=[1, 2, 3],
                                  context_length=64, streams=(1,), tokens=4, exact=False, work=tmp_path,
                                  report=lambda _line: None)
    assert res["error"].startswith("disk_full:") and "GB free" in res["error"]
    assert res["export"]["stages"] == []  # nothing was started
    result = {**_passing(), "precisions": {"int8": res}}
    assert scale.judge(result, ["int8"], 64, [1]) == [f"int8: {res['error']}"]


def test_a_padded_preset_detokenizes_every_id_and_encodes_like_the_demo_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from engine.models.demo import _tokenizer

    spec = ck.PRESETS["random-llama-tiny"]
    path = ck.ensure_checkpoint(spec, tmp_path)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == spec.vocab_size  # openvino_genai detokenizes whatever id the model emits
    last = spec.vocab_size - 1
    assert tok.decode([last]) == f"<r{last}>"
    text = "The weather in city number 7, tomorrow."
    assert tok(text)["input_ids"] == _tokenizer("demo")(text)["input_ids"]  # encoding unchanged
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    assert ck.bench_model("random-llama-tiny") != "random-llama-tiny"  # a preset resolves to a folder
    assert ck.bench_model("demo") == "demo"  # anything else is passed on


def test_fields_added_later_keep_older_checkpoints_in_their_folders():
    # the folder the committed `bench scale` runs built (docs/bench/scale): a user's cache stays valid
    assert ck.checkpoint_path(ck.LLAMA_3_1_8B).name == "llama-3.1-8b-shape-db38167c4572a81e"
    assert ck.PRESETS["random-llama-0.9b"].digest() != ck.PRESETS["random-llama-tiny"].digest()
