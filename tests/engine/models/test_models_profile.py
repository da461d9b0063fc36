"""ModelProfile numbers checked against the real tensors, not against the code."""

from __future__ import annotations

import json

import pytest

from engine.models import ExpertInfo, ModelError, ModelProfile, profile_model, resolve_model
from engine.models.demo import demo_ids


def _state_dict(folder):
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def _nbytes(t):
    return t.numel() * t.element_size()


@pytest.mark.parametrize("demo_id", demo_ids())
def test_demo_profile_matches_config_and_tensors(demo_id):
    r = resolve_model(demo_id)
    cfg = json.loads((r.path / "config.json").read_text())
    sd = _state_dict(r.path)
    p = profile_model(r)

    L = cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert (p.model_id, p.architecture, p.model_type) == (demo_id, cfg["architectures"][0], cfg["model_type"])
    assert (p.num_layers, p.hidden_size, p.intermediate_size) == (L, cfg["hidden_size"], cfg["intermediate_size"])
    assert (p.num_heads, p.num_kv_heads, p.head_dim) == (
        cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim)
    assert p.vocab_size == cfg["vocab_size"] == sd["model.embed_tokens.weight"].shape[0]
    assert p.dtype_bytes == 4 and p.max_context == cfg["max_position_embeddings"]

    per_layer = tuple(sum(_nbytes(t) for n, t in sd.items() if n.startswith(f"model.layers.{i}."))
                      for i in range(L))
    assert p.bytes_per_layer == per_layer
    assert p.embedding_bytes == _nbytes(sd["model.embed_tokens.weight"])
    assert p.head_bytes == _nbytes(sd["lm_head.weight"]) + _nbytes(sd["model.norm.weight"])
    assert p.total_bytes == sum(_nbytes(t) for t in sd.values())
    assert p.embedding_bytes + sum(p.bytes_per_layer) + p.head_bytes == p.total_bytes
    assert not p.tied_embeddings

    assert p.kv_bytes_per_token == 2 * L * cfg["num_key_value_heads"] * head_dim * 4
    assert p.kv_bytes(100) == 100 * p.kv_bytes_per_token
    assert p.kv_bytes(100, dtype_bytes=2) == 50 * p.kv_bytes_per_token
    assert p.layer_range_bytes(0, L) == sum(per_layer)
    assert (p.experts is not None) == (demo_id == "demo-moe")


def test_moe_profile_experts():
    r = resolve_model("demo-moe")
    sd = _state_dict(r.path)
    p = profile_model(r)
    e = p.experts
    assert isinstance(e, ExpertInfo)
    assert (e.num_experts, e.top_k) == (8, 2)
    assert e.moe_layers == (0, 1, 2, 3)
    for layer in e.moe_layers:
        for j in range(8):
            one = sum(_nbytes(t) for n, t in sd.items() if n.startswith(f"model.layers.{layer}.mlp.experts.{j}."))
            assert one == e.bytes_per_expert
    shared = sum(_nbytes(t) for n, t in sd.items()
                 if n.startswith("model.layers.0.mlp.shared_expert"))  # + shared_expert_gate
    assert shared == e.shared_expert_bytes > 0
    assert e.bytes_per_expert == 3 * 128 * 96 * 4  # gate, up, down of hidden 128 x moe_intermediate 96


def test_moe_stacked_expert_layout(copy_demo):
    """transformers 5 keeps experts stacked ([E, 2I, H]); such checkpoints must profile the same."""
    import torch
    from safetensors.torch import save_file

    folder = copy_demo("demo-moe")
    sd = _state_dict(folder)
    out = {n: t for n, t in sd.items() if ".mlp.experts." not in n}
    for i in range(4):
        pre = f"model.layers.{i}.mlp.experts"
        out[f"{pre}.gate_up_proj"] = torch.stack([
            torch.cat([sd[f"{pre}.{j}.gate_proj.weight"], sd[f"{pre}.{j}.up_proj.weight"]]) for j in range(8)
        ])  # [E, 2I, H]
        out[f"{pre}.down_proj"] = torch.stack([sd[f"{pre}.{j}.down_proj.weight"] for j in range(8)])  # [E, H, I]
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
    stacked = profile_model(resolve_model(str(folder)))
    per_expert = profile_model(resolve_model("demo-moe"))
    assert stacked.experts == per_expert.experts
    assert stacked.bytes_per_layer == per_expert.bytes_per_layer


def test_sharded_profile_equals_single_file(copy_demo, shard):
    sharded = profile_model(resolve_model(str(shard(copy_demo()))))
    single = profile_model(resolve_model("demo"))
    assert sharded.bytes_per_layer == single.bytes_per_layer
    assert (sharded.embedding_bytes, sharded.head_bytes, sharded.total_bytes) == (
        single.embedding_bytes, single.head_bytes, single.total_bytes)


def test_tied_embeddings_count_the_matrix_for_the_head(copy_demo):
    from safetensors.torch import save_file

    folder = copy_demo()
    sd = _state_dict(folder)
    del sd["lm_head.weight"]
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    p = profile_model(resolve_model(str(folder)))
    emb = _nbytes(sd["model.embed_tokens.weight"])
    assert p.tied_embeddings
    assert p.total_bytes == sum(_nbytes(t) for t in sd.values())  # on disk: once
    assert p.head_bytes == emb + _nbytes(sd["model.norm.weight"])  # the last stage needs it too
    assert p.embedding_bytes + sum(p.bytes_per_layer) + p.head_bytes == p.total_bytes + emb


def test_openvino_ir_profile_from_config_scaled_to_bin(copy_demo):
    folder = copy_demo()
    (folder / "model.safetensors").unlink()
    (folder / "openvino_model.xml").write_text("<net/>")
    (folder / "openvino_model.bin").write_bytes(b"\0" * 1_000_000)  # like an int4-compressed IR
    p = profile_model(resolve_model(str(folder)))
    ref = profile_model(resolve_model("demo"))
    assert p.num_layers == 8 and len(p.bytes_per_layer) == 8
    assert p.total_bytes == 1_000_000
    assert abs(p.embedding_bytes + sum(p.bytes_per_layer) + p.head_bytes - 1_000_000) < 100
    # Proportions follow the real model: each layer keeps its share.
    assert p.bytes_per_layer[0] / p.total_bytes == pytest.approx(ref.bytes_per_layer[0] / ref.total_bytes, rel=1e-3)


@pytest.mark.parametrize("demo_id", ["demo", "demo-moe"])
def test_json_round_trip(demo_id):
    p = profile_model(resolve_model(demo_id))
    data = json.loads(json.dumps(p.to_dict()))
    assert isinstance(data["bytes_per_layer"], list)
    back = ModelProfile.from_dict(data)
    assert back == p
    assert hash(back) == hash(p)  # still frozen, tuples restored


def test_from_dict_rejects_malformed():
    data = profile_model(resolve_model("demo")).to_dict()
    del data["num_layers"]
    with pytest.raises(ModelError, match="malformed model profile: missing num_layers"):
        ModelProfile.from_dict(data)
    with pytest.raises(ModelError, match="malformed model profile"):
        ModelProfile.from_dict({**profile_model(resolve_model("demo")).to_dict(), "bytes_per_layer": "x"})
    with pytest.raises(ModelError, match="version 99 is not supported"):
        ModelProfile.from_dict({"version": 99})



@pytest.mark.parametrize("demo_id", ["demo", "demo-qwen3"])
def test_param_counts_match_the_tensors(demo_id):
    from engine.models.profile import ParamCounts

    r = resolve_model(demo_id)
    sd = _state_dict(r.path)
    p = profile_model(r)

    def counts(names):
        out = ParamCounts()
        for n in names:
            out = out + ParamCounts.of_shape(tuple(sd[n].shape))
        return out

    for i, c in enumerate(p.layer_params):
        names = [n for n in sd if n.startswith(f"model.layers.{i}.")]
        assert c == counts(names)
        assert c.vector == sum(sd[n].numel() for n in names if sd[n].dim() == 1)  # norms stay f32
        assert (c.matrix + c.vector) * 4 == p.bytes_per_layer[i]  # f32 checkpoint
    assert p.embedding_params == counts(["model.embed_tokens.weight"])
    assert p.head_params == counts(["lm_head.weight", "model.norm.weight"])
    assert p.layer_tail_params == counts(["model.layers.0.mlp.down_proj.weight"])
    assert p.dtype == "f32" and p.kv_elements_per_token * 4 == p.kv_bytes_per_token


def test_config_only_folder_counts_like_the_tensors(tmp_path):
    """A folder with nothing but config.json profiles from the config: the same
    parameter counts as the real tensors, bytes at the config's dtype."""
    r = resolve_model("demo")
    real = profile_model(r)
    cfg = json.loads((r.path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16", "dtype": "bfloat16"}))
    p = profile_model(tmp_path)
    assert p.layer_params == real.layer_params and p.embedding_params == real.embedding_params
    assert p.head_params == real.head_params and p.layer_tail_params == real.layer_tail_params
    assert p.dtype == "bf16" and p.dtype_bytes == 2
    assert p.total_bytes == real.total_bytes // 2  # the same parameters at 2 bytes
    assert p.model_id == tmp_path.name


def test_default_context():
    from engine.models.profile import DEFAULT_CONTEXT, default_context

    assert default_context(131072) == DEFAULT_CONTEXT == 4096
    assert default_context(2048) == 2048 and default_context(0) == DEFAULT_CONTEXT


def test_one_context_default_for_engines_and_planner(copy_demo):
    """A 128k model: the local engines (the paged default and the loop) serve, and the planner
    plans, the same default context (engine_context, the one rule), and take a context that was
    asked for."""
    import json

    from engine.models.profile import DEFAULT_CONTEXT, engine_context, trained_context
    from engine.planner.plan import DeviceProfile, PeerProfile, PlanModel, PlanRequest, auto_plan
    from engine.local.factory import open_whole_model
    from engine.scheduler.loop import LocalEngine

    model = copy_demo("demo", "long-context")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 131072}))
    assert trained_context(model) == 131072
    assert engine_context(model) == DEFAULT_CONTEXT and engine_context(model, 10_000) == 10_000
    assert engine_context(model, 200_000) == 131072
    peer = PeerProfile("p", "pc", (DeviceProfile("CPU", "CPU"),), 8 * 10**9, 16 * 10**9)
    plan = auto_plan(PlanModel.from_profile(profile_model(model)), [peer], PlanRequest())
    engine = LocalEngine(model, "long-context", backend="torch")
    asked = LocalEngine(model, "long-context", backend="torch", context_length=10_000)
    paged = open_whole_model(model, "long-context", precision="f32")  # what `--engine local` opens
    try:
        assert type(paged).__name__ == "PagedEngine"
        assert engine.info.context_length == paged.info.context_length == plan.context_length == DEFAULT_CONTEXT
        assert asked.info.context_length == 10_000
    finally:
        engine.close()
        asked.close()
        paged.close()


def test_bf16_safetensors_dtype_label(copy_demo):
    import torch
    from safetensors.torch import save_file

    folder = copy_demo()
    sd = {k: v.to(torch.bfloat16) for k, v in _state_dict(folder).items()}
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    p = profile_model(resolve_model(str(folder)))
    assert p.dtype == "bf16"  # the stored tensors win over config.json's float32
