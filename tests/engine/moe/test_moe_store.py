"""Expert store: conversion of both checkpoint layouts, alignment, checksums,
atomic writes, and a corrupted blob caught (never a wrong answer)."""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest
import torch

from engine.moe.convert import convert
from engine.moe.engine import MoEConfig, MoEEngine
from engine.moe.store import ALIGN, BLOB_FILE, INDEX_FILE, REST_FILE, ChecksumError, ExpertStore
from engine.platform import read_checks
from engine.platform.pread import aligned_buffer
from engine.protocol.messages import GenerateRequest, SamplingParams


def _blob(store: ExpertStore, key) -> np.ndarray:
    buf = aligned_buffer(store.index.blob_bytes)
    store.read_into(key, buf)
    return np.frombuffer(buf, dtype=np.float32, count=store.index.data_bytes // 4).copy()


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "olmoe"])
def test_layout_aligned_and_complete(moe_model, arch):
    path, store_dir = moe_model(arch)
    store = ExpertStore(store_dir)
    idx = store.index
    assert store.direct  # ext4: O_DIRECT works here
    assert idx.blob_bytes % ALIGN == 0 and idx.blob_bytes >= idx.data_bytes
    assert all(b.offset % ALIGN == 0 for b in idx.blobs.values())
    assert len(idx.blobs) == len(idx.moe_layers) * idx.num_experts
    from safetensors import safe_open

    with safe_open(str(store_dir / REST_FILE), "pt") as f:
        names = list(f.keys())
    assert not any(".experts." in n for n in names)  # experts live in blobs only
    assert any(".mlp.gate." in n for n in names)  # routers stay resident
    if arch == "qwen2_moe":
        assert any("shared_expert" in n for n in names)
    # The blob holds exactly the checkpoint's gate, up and down of that expert.
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        pre = "block_sparse_moe" if arch == "mixtral" else "mlp"
        names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        want = np.concatenate([f.get_tensor(f"model.layers.1.{pre}.experts.3.{n}.weight").numpy().ravel()
                               for n in names])
    np.testing.assert_array_equal(_blob(store, (1, 3)), want)
    store.close()


def test_stacked_layout_converts_the_same(moe_model, tmp_path):
    """A checkpoint with transformers 5 stacked experts gives the same blobs."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    path, store_dir = moe_model("mixtral")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)  # stacked [E, 2I, H]
    src = tmp_path / "stacked"
    src.mkdir()
    save_file(state, str(src / "model.safetensors"))
    shutil.copy(path / "config.json", src / "config.json")
    out = convert(src, tmp_path / "store")
    a, b = ExpertStore(store_dir), ExpertStore(out)
    assert a.keys == b.keys
    for key in a.keys[:: max(1, len(a.keys) // 6)]:
        np.testing.assert_array_equal(_blob(a, key), _blob(b, key))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # temp folder renamed away


def _corrupt_copy(store_dir, tmp_path, key):
    bad = tmp_path / "bad-store"
    shutil.copytree(store_dir, bad)
    index = json.loads((bad / INDEX_FILE).read_text())
    offset = index["blobs"][f"{key[0]}.{key[1]}"]["offset"]
    with open(bad / BLOB_FILE, "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0x01]))  # one flipped bit
    return bad


def test_corrupted_blob_is_caught_on_read(moe_model, tmp_path):
    _path, store_dir = moe_model("mixtral")
    bad = _corrupt_copy(store_dir, tmp_path, (0, 2))
    store = ExpertStore(bad)
    with pytest.raises(ChecksumError, match="expert 2 of layer 0 is corrupted"):
        store.read_into((0, 2), aligned_buffer(store.index.blob_bytes))
    store.read_into((0, 3), aligned_buffer(store.index.blob_bytes))  # the others are fine


def test_a_blob_damaged_after_its_first_check_is_caught_on_the_next_read(moe_model, tmp_path, monkeypatch):
    # by default a blob is checked on its first read only -- and again once its file changed
    monkeypatch.setattr(read_checks, "SETTLE_S", 0.0)  # the copied store counts as settled at once
    _path, store_dir = moe_model("mixtral")
    good = tmp_path / "store"
    shutil.copytree(store_dir, good)
    store = ExpertStore(good)
    buf = aligned_buffer(store.index.blob_bytes)
    for _ in range(2):
        store.read_into((0, 2), buf)
    assert (store.reads, store.checksums) == (2, 1)  # the re-read was not checked: the file had not changed
    time.sleep(0.05)  # past the file time stamps' granularity
    offset = store.index.blobs[(0, 2)].offset
    with open(good / BLOB_FILE, "r+b") as f:  # one bit flipped in place, while the store is open
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(ChecksumError, match="expert 2 of layer 0 is corrupted"):
        store.read_into((0, 2), buf)
    store.close()


@pytest.mark.parametrize("scheduler", ["bevy", "on_demand", "prefetch", "resident"])
def test_corrupted_blob_ends_requests_with_an_error(moe_model, tmp_path, scheduler):
    """Every expert of layer 0 corrupted: any request needs one, so each must
    end with a clear error and no tokens -- never an answer from bad weights."""
    _path, store_dir = moe_model("mixtral")
    bad = tmp_path / "bad-all"
    shutil.copytree(store_dir, bad)
    index = ExpertStore(bad).index
    with open(bad / BLOB_FILE, "r+b") as f:
        for e in range(index.num_experts):
            f.seek(index.blobs[(0, e)].offset + 8)
            f.write(b"\xff\xff\xff\xff")
    cfg = MoEConfig(scheduler=scheduler, cache_budget_bytes=4 * index.blob_bytes)
    if scheduler == "resident":  # preloading reads (and checks) every blob at open
        with pytest.raises(ChecksumError, match="corrupted"):
            MoEEngine(bad, "bad", cfg)
        return
    with MoEEngine(bad, "bad", cfg) as eng:
        finals = []
        for i in range(3):
            events = eng.generate(GenerateRequest(f"r{i}", prompt="Once upon a time",
                                                  sampling=SamplingParams(max_tokens=4)))
            assert not any(e.token_ids for e in events)
            finals.append(events[-1])
    for final in finals:
        assert final.finish_reason == "error"
        assert "corrupted" in final.error and "checksum" in final.error
