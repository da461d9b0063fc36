"""resolve_model: demo ids, folders, OpenVINO IR, hub cache, and every bad input."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest

from engine.models import ModelError, ResolvedModel, resolve_model
from engine.models.demo import demo_ids, ensure_demo


@pytest.mark.parametrize("demo_id", demo_ids())
def test_resolves_each_demo(demo_id):
    r = resolve_model(demo_id)
    assert isinstance(r, ResolvedModel)
    assert (r.spec, r.model_id, r.kind) == (demo_id, demo_id, "demo")
    assert r.path == ensure_demo(demo_id) and (r.path / "config.json").is_file()
    assert r.architecture.endswith("ForCausalLM")
    assert len(r.fingerprint) == 20
    assert resolve_model(demo_id).fingerprint == r.fingerprint  # stable


def test_local_hf_folder(copy_demo, listing):
    folder = copy_demo("demo-qwen3", name="my-qwen")
    before = listing(folder)
    r = resolve_model(str(folder))
    assert (r.kind, r.model_id, r.path, r.architecture) == ("hf", "my-qwen", folder, "Qwen3ForCausalLM")
    assert r.weights_format == "safetensors"
    assert listing(folder) == before


def test_fingerprint_follows_the_weights_not_the_file_times(copy_demo):
    """A model is the same on every machine (shards are compared by it): copying or touching
    its files keeps its fingerprint; changing a tensor deep inside a weight file (a fine-tune
    saved over it) does not."""
    import json
    import struct

    folder = copy_demo()
    fp = resolve_model(str(folder)).fingerprint
    w = folder / "model.safetensors"
    os.utime(w, ns=(w.stat().st_atime_ns, w.stat().st_mtime_ns + 10**9))
    assert resolve_model(str(folder)).fingerprint == fp
    raw = bytearray(w.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    # a tensor that starts past the first MiB and ends before the last one
    begin = min(v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"
                and 8 + n + v["data_offsets"][0] > 1 << 20 and 8 + n + v["data_offsets"][1] < len(raw) - (1 << 20))
    raw[8 + n + begin] ^= 0xFF
    w.write_bytes(bytes(raw))
    assert resolve_model(str(folder)).fingerprint != fp


def test_openvino_ir_folder(copy_demo, listing):
    folder = copy_demo(name="demo-ov")
    (folder / "model.safetensors").unlink()  # optimum-intel writes no safetensors
    (folder / "openvino_model.xml").write_text("<net name='dummy'/>")  # never parsed here
    (folder / "openvino_model.bin").write_bytes(b"\0" * 4096)
    before = listing(folder)
    r = resolve_model(str(folder))
    assert (r.kind, r.weights_format, r.architecture) == ("openvino", "openvino", "LlamaForCausalLM")
    assert listing(folder) == before


def test_sharded_safetensors(copy_demo, listing, shard):
    folder = shard(copy_demo())
    before = listing(folder)
    assert resolve_model(str(folder)).kind == "hf"
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelError, match=r"missing 1 of 2 weight shards \(first: model-00002-of-00002"):
        resolve_model(str(folder))
    assert len(listing(folder)) == len(before) - 1


# --------------------------------------------------------------------------- bad inputs

def _missing(tmp_path, copy_demo):
    return tmp_path / "nope", r"model not found: .*nope does not exist"


def _file(tmp_path, copy_demo):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"12345678")
    return f, r"model\.safetensors is a file, not a model folder"


def _empty(tmp_path, copy_demo):
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty", r"empty is an empty folder; copy the model files"


def _no_config(tmp_path, copy_demo):
    folder = copy_demo()
    (folder / "config.json").unlink()
    return folder, r"is not a Hugging Face model folder: no config\.json"


def _bad_json(tmp_path, copy_demo):
    folder = copy_demo()
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    return folder, r"config\.json is not valid JSON \(.* at line 1\); re-download or re-copy"


def _vision(tmp_path, copy_demo):
    folder = copy_demo()
    (folder / "config.json").write_text(json.dumps(
        {"architectures": ["ViTForImageClassification"], "model_type": "vit", "hidden_size": 32}))
    return folder, r"holds ViTForImageClassification \(model_type vit\), not a causal language model"


def _no_weights(tmp_path, copy_demo):
    folder = copy_demo()
    (folder / "model.safetensors").unlink()
    return folder, r"has no weights \(model\.safetensors, pytorch_model\.bin or openvino_model\.xml/\.bin\)"


def _truncated(tmp_path, copy_demo):
    folder = copy_demo()
    w = folder / "model.safetensors"
    size = w.stat().st_size
    with open(w, "r+b") as fh:
        fh.truncate(size - 1000)
    return folder, rf"model\.safetensors is truncated \({size - 1000} of {size} bytes\)"


def _garbage_header(tmp_path, copy_demo):
    folder = copy_demo()
    w = folder / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[8:20] = b"\xff" * 12  # header JSON destroyed, length intact
    w.write_bytes(bytes(data))
    return folder, r"model\.safetensors is corrupted \(its safetensors header is not valid JSON\)"


def _huge_header(tmp_path, copy_demo):
    folder = copy_demo()
    w = folder / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[:8] = struct.pack("<Q", 2**40)
    w.write_bytes(bytes(data))
    return folder, r"model\.safetensors is truncated or corrupted \(header length"


def _no_tokenizer(tmp_path, copy_demo):
    folder = copy_demo()
    (folder / "tokenizer.json").unlink()
    return folder, r"has no tokenizer .*copy the tokenizer files"


def _ov_without_bin(tmp_path, copy_demo):
    folder = copy_demo()
    (folder / "openvino_model.xml").write_text("<net/>")
    return folder, r"has openvino_model\.xml but no openvino_model\.bin"


BAD = [_missing, _file, _empty, _no_config, _bad_json, _vision, _no_weights, _truncated,
       _garbage_header, _huge_header, _no_tokenizer, _ov_without_bin]


@pytest.mark.parametrize("make", BAD, ids=[f.__name__.strip("_") for f in BAD])
def test_bad_input_is_one_clear_line_and_writes_nothing(make, tmp_path, copy_demo, listing):
    path, pattern = make(tmp_path, copy_demo)
    before = listing(tmp_path)
    with pytest.raises(ModelError, match=pattern) as info:
        resolve_model(str(path))
    msg = str(info.value)
    assert "\n" not in msg
    assert path.name in msg  # the message names the path
    assert listing(tmp_path) == before


def test_bert_folder_is_not_a_causal_lm(tmp_path, copy_demo, listing):
    import torch
    from transformers import BertConfig, BertModel

    folder = tmp_path / "bert"
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32)
    torch.manual_seed(0)
    BertModel(cfg).save_pretrained(folder)
    shutil.copy(ensure_demo("demo") / "tokenizer.json", folder)
    before = listing(tmp_path)
    with pytest.raises(ModelError, match=r"bert holds BertModel \(model_type bert\), not a causal language model"):
        resolve_model(str(folder))
    assert listing(tmp_path) == before


def test_empty_spec():
    with pytest.raises(ModelError, match="no model given"):
        resolve_model("  ")


# --------------------------------------------------------------------------- hub ids

def test_hub_id_offline_is_clear(hf_home, listing):
    before = listing(hf_home.parent)
    with pytest.raises(ModelError) as info:
        resolve_model("Qwen/Qwen3-0.6B")
    msg = str(info.value)
    assert msg.startswith("cannot download Qwen/Qwen3-0.6B: offline mode")
    assert "not in the local Hugging Face cache" in msg and "pass its path" in msg
    assert "\n" not in msg
    assert listing(hf_home.parent) == before


def test_hub_id_without_network(hf_home, monkeypatch):
    import httpx
    from huggingface_hub import HfApi

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")

    def no_net(*_a, **_k):
        raise httpx.ConnectError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(HfApi, "model_info", no_net)
    with pytest.raises(ModelError, match=r"^cannot download Qwen/Qwen3-0\.6B: no network \(the model is not "
                                         r"in the local Hugging Face cache\); copy the folder here and pass its path$"):
        resolve_model("Qwen/Qwen3-0.6B")


def test_hub_id_download_disabled(hf_home, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(ModelError, match=r"cannot download acme/tiny: downloads are disabled"):
        resolve_model("acme/tiny", allow_download=False)


def test_hub_id_from_cache(hf_home, fake_hub_model):
    snap = fake_hub_model(hf_home, "acme/tiny-llama", ensure_demo("demo"))
    r = resolve_model("acme/tiny-llama")  # offline: must come from the cache
    assert (r.kind, r.model_id, r.path) == ("hub", "acme/tiny-llama", snap)
    assert r.architecture == "LlamaForCausalLM"


def test_local_folder_wins_over_hub_id(copy_demo, tmp_path, monkeypatch, hf_home):
    (tmp_path / "acme").mkdir()
    shutil.move(str(copy_demo()), tmp_path / "acme" / "tiny")
    monkeypatch.chdir(tmp_path)
    r = resolve_model("acme/tiny")
    assert (r.kind, r.model_id) == ("hf", "tiny")


def test_download_progress_reaches_the_callback(capsys):
    from engine.models.ref import _progress_bar

    seen = []
    bar = _progress_bar("acme/tiny", lambda msg, frac: seen.append((msg, frac)))(
        total=0, unit="B", unit_scale=True, desc="Downloading")
    bar.total += 1000  # snapshot_download grows the total as file sizes become known
    bar.update(500)
    bar.update(500)
    bar.close()
    assert seen[0] == ("downloading acme/tiny", pytest.approx(0.495))
    assert seen[-1][1] == pytest.approx(0.99)  # 1.0 is reported once the snapshot is complete
    assert capsys.readouterr().err == ""  # no tqdm bar printed over the CLI's own progress
