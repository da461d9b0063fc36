"""Pipeline shards: exact chains, fused stateful SDPA, mask-based rollback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ov = pytest.importorskip("openvino")

from engine.models.demo import cache_root, ensure_demo  # noqa: E402
from engine.shards.export import (  # noqa: E402
    ShardInfo,
    _load_hf,
    ensure_shard,
    export_shard,
    shard_cache_key,
)
from engine.models.fingerprint import model_fingerprint  # noqa: E402
from engine.pipeline.runner import even_split  # noqa: E402
from engine.shards.runtime import ShardRunner  # noqa: E402

STEPS = 32
PROMPT = "The quick brown fox jumps over the lazy dog while the"


class Loaded:
    def __init__(self, demo_id: str):
        self.path = ensure_demo(demo_id)
        self.model = _load_hf(self.path)
        from transformers import AutoTokenizer

        self.prompt = AutoTokenizer.from_pretrained(str(self.path))(PROMPT)["input_ids"]
        self.total = self.model.config.num_hidden_layers
        self.runners: dict[tuple, ShardRunner] = {}

    def runner(self, start: int, end: int, *, fuse: bool = True) -> ShardRunner:
        key = (start, end, fuse)
        if key not in self.runners:
            info = ensure_shard(self.path, start, end, num_layers_total=self.total, fuse_beam_idx=fuse)
            self.runners[key] = ShardRunner(info, exact=True, cache_dir=cache_root() / "ov-blobs")
        return self.runners[key]

    def hf_greedy(self, steps: int = STEPS) -> list[int]:
        from transformers import DynamicCache

        ids = torch.tensor([self.prompt])
        cache, out = DynamicCache(config=self.model.config), []
        with torch.no_grad():
            for _ in range(steps):
                res = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
                nxt = int(res.logits[0, -1].argmax())
                out.append(nxt)
                ids = torch.tensor([[nxt]])
        return out


@pytest.fixture(scope="module")
def demo():
    return Loaded("demo")


@pytest.fixture(scope="module")
def demo_moe():
    return Loaded("demo-moe")


def chain_step(streams, tokens: list[int], mask: np.ndarray, positions: np.ndarray) -> dict:
    """Run one chunk through every stage; returns the last stage's outputs."""
    x: np.ndarray = np.array([tokens], np.int64)
    out: dict = {}
    for i, stream in enumerate(streams):
        feed = {"attention_mask": mask, "position_ids": positions[None]}
        feed["input_ids" if i == 0 else "hidden_states"] = x
        out = stream.run(feed)
        x = out.get("hidden_states_out")
    return out


def chain_greedy(streams, prompt: list[int], steps: int = STEPS) -> list[int]:
    tokens, length, out_tokens = list(prompt), 0, []
    for _ in range(steps):
        n = len(tokens)
        mask = np.ones((1, length + n), np.int64)
        out = chain_step(streams, tokens, mask, np.arange(length, length + n))
        nxt = int(out["next_token"][0, -1])
        assert nxt == int(out["logits"][0, -1].argmax())
        out_tokens.append(nxt)
        length += n
        tokens = [nxt]
    return out_tokens


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_chain_matches_transformers_greedy(demo, stages):
    ranges = even_split(demo.total, stages)
    streams = [demo.runner(s, e).new_stream() for s, e in ranges]
    assert chain_greedy(streams, demo.prompt) == demo.hf_greedy()


def test_moe_two_stage_chain_matches_transformers_greedy(demo_moe):
    streams = [demo_moe.runner(s, e).new_stream() for s, e in even_split(demo_moe.total, 2)]
    assert chain_greedy(streams, demo_moe.prompt) == demo_moe.hf_greedy()


def test_every_shard_has_fused_sdpa_with_kv_cache(demo, demo_moe):
    shards = [(demo, r) for n in (1, 2, 3, 4) for r in even_split(demo.total, n)]
    shards += [(demo_moe, r) for r in even_split(demo_moe.total, 2)]
    for loaded, (s, e) in shards:
        runner = loaded.runner(s, e)
        # One fused SDPA-with-KV-cache node per decoder layer of the shard.
        assert len(runner.fused_sdpa_nodes()) == e - s, (loaded.path.name, s, e)


def test_without_beam_idx_there_is_no_fusion(demo):
    runner = demo.runner(0, 4, fuse=False)
    assert "beam_idx" not in runner.input_names
    assert runner.fused_sdpa_nodes() == []


def test_masked_junk_positions_are_invisible(demo):
    prompt = demo.prompt
    stages = [demo.runner(s, e) for s, e in even_split(demo.total, 2)]
    p = len(prompt)

    # Reference: prompt alone, then one continuation token.
    ref = [r.new_stream() for r in stages]
    chain_step(ref, prompt, np.ones((1, p), np.int64), np.arange(p))
    cont = 17
    ref_out = chain_step(ref, [cont], np.ones((1, p + 1), np.int64), np.array([p]))

    # Rollback: prompt + 3 junk tokens stay in the KV state but are masked to 0;
    # the continuation takes the logical position p.
    test = [r.new_stream() for r in stages]
    junk = [5, 6, 7]
    chain_step(test, prompt + junk, np.ones((1, p + 3), np.int64), np.arange(p + 3))
    mask = np.ones((1, p + 4), np.int64)
    mask[0, p:p + 3] = 0
    out = chain_step(test, [cont], mask, np.array([p]))
    np.testing.assert_allclose(out["logits"], ref_out["logits"], atol=1e-4, rtol=1e-4)

    # Control: the same junk left visible does change the logits.
    seen = [r.new_stream() for r in stages]
    chain_step(seen, prompt + junk, np.ones((1, p + 3), np.int64), np.arange(p + 3))
    out = chain_step(seen, [cont], np.ones((1, p + 4), np.int64), np.array([p]))
    assert np.abs(out["logits"] - ref_out["logits"]).max() > 1e-2


def test_cache_key_and_manifest(demo, tmp_path, monkeypatch):
    fp = model_fingerprint(demo.path)
    assert fp == model_fingerprint(demo.path)
    keys = {shard_cache_key(fp, 0, 4, "f32", "v1"), shard_cache_key(fp, 0, 4, "fp16", "v1"),
            shard_cache_key(fp, 4, 8, "f32", "v1"), shard_cache_key(fp, 0, 4, "f32", "v2")}
    assert len(keys) == 4
    info = ensure_shard(demo.path, 6, 8, num_layers_total=demo.total, cache=tmp_path)
    assert Path(info.path).parent == tmp_path
    assert [p.name for p in tmp_path.iterdir()] == [Path(info.path).name]  # no temp leftovers
    manifest = json.loads((Path(info.path) / "shard.json").read_text())
    assert manifest["start"] == 6 and manifest["end"] == 8 and manifest["hidden_size"] == 128
    assert manifest["inputs"] == ["hidden_states", "attention_mask", "position_ids", "logits_to_keep", "beam_idx"]
    assert manifest["outputs"] == ["logits", "next_token"]
    assert manifest["states"][:2] == ["past_key_values.6.keypresent.6.key",
                                      "past_key_values.6.valuepresent.6.value"]
    assert len(manifest["states"]) == 4
    assert ShardInfo.load(Path(info.path)) == info
    # A second call is a cache hit: nothing is exported again.
    import engine.shards.export as export

    def no_export(*_a, **_k):
        raise AssertionError("exported again")

    monkeypatch.setattr(export, "export_shard", no_export)
    assert ensure_shard(demo.path, 6, 8, cache=tmp_path) == info


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_16bit_shard_runs_close(demo, tmp_path, precision):
    """16-bit weights (f32 activations): half the bytes, close to the f32 shard. bf16
    caught a real bug: the converted constants share the torch tensors' memory, and a
    piece saved after its weights were released ran NaN."""
    info = export_shard(demo.path, 0, 2, tmp_path / precision, num_layers_total=demo.total,
                        precision=precision)
    f32 = demo.runner(0, 2)
    assert os.path.getsize(tmp_path / precision / "shard.bin") < 0.6 * os.path.getsize(f32.info.xml.with_suffix(".bin"))
    p = len(demo.prompt)
    feed = (demo.prompt, np.ones((1, p), np.int64), np.arange(p))
    runner = ShardRunner(info)
    assert len(runner.fused_sdpa_nodes()) == 2
    got = chain_step([runner.new_stream()], *feed)["hidden_states_out"]
    want = chain_step([f32.new_stream()], *feed)["hidden_states_out"]
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


def test_last_stage_computes_only_the_logits_asked_for(demo):
    """logits_to_keep = c: logits and next_token of the last c positions only (0: all), equal
    to the same rows of a whole-prompt call (decode and prefill read 1 row; a
    speculative verify reads K + 1)."""
    p = len(demo.prompt)
    mask, pos = np.ones((1, p), np.int64), np.arange(p)
    whole = chain_step([demo.runner(0, 8).new_stream()], demo.prompt, mask, pos)
    assert whole["logits"].shape[1] == p  # no count given: every position
    for c in (1, 4, 0, p + 5):
        stream = demo.runner(0, 8).new_stream()
        out = stream.run({"input_ids": np.array([demo.prompt], np.int64), "attention_mask": mask,
                          "position_ids": pos[None], "logits_to_keep": np.array([c], np.int64)})
        rows = min(c, p) or p
        assert out["logits"].shape == (1, rows, whole["logits"].shape[2])
        np.testing.assert_allclose(out["logits"][0], whole["logits"][0, -rows:], atol=1e-5)
        assert out["next_token"][0].tolist() == whole["next_token"][0, -rows:].tolist()


def test_pieces_follow_the_byte_budget():
    """A shard is traced in pieces of at most PIECE_BYTES (>= 1 part each, the
    embedding and head counted like layers); int4 traces the embedding and the
    head alone, and so does int8 (they are quantised per row by compress_rows_int8)."""
    from engine.shards.export_pieces import Piece, plan_pieces

    class Ckpt:  # 6 layers of 100 bytes, embedding 60, head 300 (bf16 elements)
        shapes = {**{f"model.layers.{i}.w": (50,) for i in range(6)},
                  "model.embed_tokens.weight": (30,), "lm_head.weight": (150,)}
        dtypes = {n: "BF16" for n in shapes}

    assert plan_pieces(Ckpt, 0, 6, 6, "fp16", budget=260) == [
        Piece(True, 0, 2, False), Piece(False, 2, 4, False), Piece(False, 4, 6, False), Piece(False, 6, 6, True)]
    assert plan_pieces(Ckpt, 2, 5, 6, "int8", budget=1000) == [Piece(False, 2, 5, False)]
    assert plan_pieces(Ckpt, 4, 6, 6, "int8", budget=1000) == [Piece(False, 4, 6, False), Piece(False, 6, 6, True)]
    assert plan_pieces(Ckpt, 0, 6, 6, "int4", budget=50) == (
        [Piece(True, 0, 0, False)] + [Piece(False, i, i + 1, False) for i in range(6)] + [Piece(False, 6, 6, True)])
    assert plan_pieces(Ckpt, 0, 6, 6, "f32", budget=10_000) == [Piece(True, 0, 6, True)]


def test_bad_requests_are_rejected(demo, tmp_path):
    with pytest.raises(ValueError):
        export_shard(demo.path, 4, 2, tmp_path)
    with pytest.raises(ValueError):
        export_shard(demo.path, 0, 4, tmp_path, num_layers_total=12)
    with pytest.raises(ValueError):
        export_shard(demo.path, 0, 4, tmp_path, precision="f8")


ARCHS = {
    "LlamaConfig": {},
    "MistralConfig": {},
    "Qwen2Config": {},
    "Qwen3Config": {"head_dim": 8},
    "Qwen2MoeConfig": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                       "shared_expert_intermediate_size": 24, "norm_topk_prob": True,
                       "mlp_only_layers": [1]},
    "MixtralConfig": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "OlmoeConfig": {"num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 3.0},
}


@pytest.mark.parametrize("config_class", sorted(ARCHS))
def test_traced_forward_matches_transformers(config_class):
    """The shard forward (torch, before conversion) equals HF on every family."""
    import transformers

    from engine.shards.model import ShardModule

    config = getattr(transformers, config_class)(
        vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
        tie_word_embeddings=False, **ARCHS[config_class])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        stages = [ShardModule(model, s, e).eval() for s, e in ((0, 1), (1, 3))]
        geo = stages[0].geo
        empty = torch.zeros(1, geo.num_kv_heads, 0, geo.head_dim)
        mask, pos = torch.ones(1, 7, dtype=torch.long), torch.arange(7)[None]
        # Prefill 5 tokens, then 2 more on top of the returned KV.
        past: list[list[torch.Tensor]] = [[empty] * 2, [empty] * 4]
        got = []
        for lo, hi in ((0, 5), (5, 7)):
            x = ids[:, lo:hi]
            for i, stage in enumerate(stages):
                out = stage(x, mask[:, :hi], pos[:, lo:hi], *past[i])
                past[i] = list(out[-2 * len(stage.layers):])
                x = out[0]
            got.append(x)
    torch.testing.assert_close(torch.cat(got, dim=1), want, atol=1e-4, rtol=1e-4)
