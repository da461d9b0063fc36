"""engine.models.checkpoint: one tensor at a time, in the stored dtype, as modules name them."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from engine.models.checkpoint import Checkpoint, empty_model, read_config, release  # noqa: E402
from engine.models.errors import ModelError  # noqa: E402


def _split_into_shards(folder, per_file: int = 20):
    """Rewrite a one-file checkpoint as several bf16 safetensors files + index (as hubs ship them)."""
    from safetensors.torch import load_file, save_file

    src = folder / "model.safetensors"
    tensors = load_file(str(src))
    src.unlink()
    names = sorted(tensors)
    chunks = [names[i:i + per_file] for i in range(0, len(names), per_file)]
    weight_map = {}
    for k, chunk in enumerate(chunks):
        fname = f"model-{k + 1:05d}-of-{len(chunks):05d}.safetensors"
        save_file({n: tensors[n].to(torch.bfloat16).contiguous() for n in chunk}, str(folder / fname))
        weight_map.update({n: fname for n in chunk})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors, chunks


def test_reads_sharded_bf16_one_tensor_at_a_time(copy_demo):
    folder = copy_demo("demo")
    tensors, chunks = _split_into_shards(folder)
    assert len(chunks) > 2
    ckpt = Checkpoint(folder)
    assert ckpt.dtype() == torch.bfloat16
    name = "model.layers.3.mlp.down_proj.weight"
    got = ckpt.tensor(name)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, tensors[name].to(torch.bfloat16))


def test_layer_loads_into_a_meta_skeleton_and_back(copy_demo):
    folder = copy_demo("demo")
    tensors, _ = _split_into_shards(folder)
    ckpt = Checkpoint(folder)
    model = empty_model(read_config(folder), torch.bfloat16)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.device.type == "cpu"  # buffers are real
    layer = model.model.layers[2]
    loaded = ckpt.load_into(layer, "model.layers.2")
    assert loaded == sum(t.numel() * 2 for n, t in tensors.items() if n.startswith("model.layers.2."))
    assert torch.equal(layer.self_attn.q_proj.weight, tensors["model.layers.2.self_attn.q_proj.weight"].bfloat16())
    assert all(p.device.type == "meta" for p in model.model.layers[3].parameters())  # nothing else loaded
    release(layer)
    assert all(p.device.type == "meta" for p in layer.parameters())


def test_per_expert_checkpoint_fills_stacked_experts(copy_demo):
    folder = copy_demo("demo-moe")
    ckpt = Checkpoint(folder)
    model = empty_model(read_config(folder), torch.float32)
    experts = model.model.layers[1].mlp.experts
    ckpt.load_into(experts, "model.layers.1.mlp.experts")
    e = 5
    gate = ckpt.tensor(f"model.layers.1.mlp.experts.{e}.gate_proj.weight")
    up = ckpt.tensor(f"model.layers.1.mlp.experts.{e}.up_proj.weight")
    down = ckpt.tensor(f"model.layers.1.mlp.experts.{e}.down_proj.weight")
    assert torch.equal(experts.gate_up_proj[e], torch.cat((gate, up)))  # [2I, H]
    assert torch.equal(experts.down_proj[e], down)  # [H, I]


def test_tied_head_reads_the_embedding(copy_demo):
    from safetensors.torch import load_file, save_file

    folder = copy_demo("demo")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    ckpt = Checkpoint(folder)
    assert torch.equal(ckpt.for_param("lm_head.weight", tuple(tensors["model.embed_tokens.weight"].shape)),
                       tensors["model.embed_tokens.weight"])


def test_missing_shard_file_is_one_line(copy_demo):
    folder = copy_demo("demo")
    _, chunks = _split_into_shards(folder)
    (folder / f"model-00002-of-{len(chunks):05d}.safetensors").unlink()
    with pytest.raises(ModelError) as e:
        Checkpoint(folder)
    assert "model-00002" in str(e.value) and "\n" not in str(e.value)


def test_shape_that_disagrees_with_the_config_is_refused(copy_demo):
    folder = copy_demo("demo")
    ckpt = Checkpoint(folder)
    with pytest.raises(ModelError, match="shape"):
        ckpt.for_param("model.layers.0.mlp.down_proj.weight", (1, 2))
