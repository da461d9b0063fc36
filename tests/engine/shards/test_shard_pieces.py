"""Shard pieces (engine/shards/pieces.py) against transformers, per architecture.

Every architecture the pipeline supports has a demo-size checkpoint here,
stored in bf16 like real ones (test_pipeline_architectures.py exports the same
ones). The pieces, composed in torch over a prompt in two chunks with the K/V
carried between them and a hidden (mask 0) slot in the middle, must give
transformers' own logits for the same chunks and mask; one piece of each kind
traced by OpenVINO's 16-bit path must compute what torch computes in f32 on
the same (bf16-rounded) weights.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ov = pytest.importorskip("openvino")

from engine.models.demo import DemoRecipe, ensure_recipe  # noqa: E402
from engine.shards.model import (  # noqa: E402
    EmbedPiece,
    HeadPiece,
    LayerPiece,
    ShardModule,
    UnsupportedArchitecture,
    check_supported,
    geometry,
    supported_model_types,
)

_COMMON = dict(initializer_range=0.1, max_position_embeddings=4096, tie_word_embeddings=False,
               hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


def _recipe(name: str, config_class: str, seed: int, description: str, **config) -> DemoRecipe:
    return DemoRecipe(f"arch-{name}", config_class, dict(_COMMON, **config), seed=seed,
                      description=description, dtype="bf16")


# Demo-size models of every supported architecture, each with the feature that
# sets it apart made to matter at this size (short windows, small caps, rope
# scaling that reaches the positions a test visits).
ARCHS: dict[str, DemoRecipe] = {r.demo_id[len("arch-"):]: r for r in [
    _recipe("llama3", "LlamaConfig", 11, "Llama 3.x: llama3 rope scaling, tied embeddings (3.2)",
            intermediate_size=176, rms_norm_eps=1e-5, tie_word_embeddings=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    _recipe("mistral", "MistralConfig", 12, "Mistral: sliding window on every layer",
            intermediate_size=176, head_dim=16, sliding_window=8),
    _recipe("qwen2.5", "Qwen2Config", 13, "Qwen2.5: q/k/v bias, tied embeddings",
            intermediate_size=176, tie_word_embeddings=True),
    _recipe("qwen3", "Qwen3Config", 14, "Qwen3: per-head q/k norm, head_dim > hidden / heads",
            intermediate_size=176, head_dim=32),
    _recipe("qwen3-moe", "Qwen3MoeConfig", 15, "Qwen3-MoE: 8 experts top-2, renormalised, one dense layer",
            intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, mlp_only_layers=[0], head_dim=16),
    _recipe("gemma2", "Gemma2Config", 16, "Gemma 2: local/global layers, attention and logit softcapping",
            intermediate_size=128, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
            attn_logit_softcapping=2.0, final_logit_softcapping=5.0, tie_word_embeddings=True),
    _recipe("gemma3", "Gemma3TextConfig", 17, "Gemma 3 text: local/global rope bases, linear-scaled global rope",
            intermediate_size=128, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
            tie_word_embeddings=True),
    _recipe("phi3", "Phi3Config", 18, "Phi-3/4-mini: fused qkv and gate_up, partial longrope",
            intermediate_size=128, tie_word_embeddings=True, original_max_position_embeddings=32,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                             "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5],
                             "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
                             "original_max_position_embeddings": 32}),
    _recipe("mixtral", "MixtralConfig", 19, "Mixtral: 4 experts top-2",
            intermediate_size=96, num_local_experts=4, num_experts_per_tok=2),
    _recipe("olmoe", "OlmoeConfig", 20, "OLMoE: 8 experts top-2, q/k norm over the projection, clipped qkv",
            intermediate_size=64, num_experts=8, num_experts_per_tok=2, clip_qkv=2.0),
]}

SEQ = 40  # tokens of the test prompt: past the 8-slot windows and Phi-3's 32-position switch
CHUNKS = ((0, 22), (22, SEQ))
HIDDEN_SLOT = 27  # physical slot masked to 0 in the second chunk (a rolled-back draft token)


def arch_path(name: str):
    return ensure_recipe(ARCHS[name])


_MODELS: dict[tuple[str, str], object] = {}


def hf_model(name: str, dtype: str = "f32"):
    """The checkpoint in transformers: f32 upcasts the stored bf16 weights (eager
    attention: transformers' SDPA path drops Gemma 2's attention softcapping)."""
    key = (name, dtype)
    if key not in _MODELS:
        from transformers import AutoModelForCausalLM

        torch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
        _MODELS[key] = AutoModelForCausalLM.from_pretrained(
            str(arch_path(name)), dtype=torch_dtype, attn_implementation="eager").eval()
    return _MODELS[key]


def prompt_inputs(vocab: int):
    """ids [1, SEQ], attention mask [1, SEQ] with the hidden slot, logical positions [1, SEQ]."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, vocab, (1, SEQ), generator=g)
    mask = torch.ones(1, SEQ, dtype=torch.long)
    mask[0, HIDDEN_SLOT] = 0
    # The hidden slot takes the position the next token then takes again (rollback).
    logical = [i if i <= HIDDEN_SLOT else i - 1 for i in range(SEQ)]
    return ids, mask, torch.tensor([logical])


def hf_chunked_logits(model, ids, mask, pos) -> torch.Tensor:
    from transformers import DynamicCache

    cache, out = DynamicCache(config=model.config), []
    with torch.no_grad():
        for lo, hi in CHUNKS:
            res = model(input_ids=ids[:, lo:hi], attention_mask=mask[:, :hi], position_ids=pos[:, lo:hi],
                        past_key_values=cache, use_cache=True)
            out.append(res.logits)
    return torch.cat(out, dim=1)


def pieces_chunked_logits(model, ids, mask, pos) -> torch.Tensor:
    config = model.config
    geo = geometry(config)
    embed, head = EmbedPiece(model), HeadPiece(model)
    layers = [LayerPiece(model, i) for i in range(config.num_hidden_layers)]
    empty = torch.zeros(1, geo.num_kv_heads, 0, geo.head_dim)
    past = [(empty, empty)] * len(layers)
    out = []
    with torch.no_grad():
        for lo, hi in CHUNKS:
            hidden = embed(ids[:, lo:hi])
            for i, layer in enumerate(layers):
                hidden, k, v = layer(hidden, mask[:, :hi], pos[:, lo:hi], *past[i])
                past[i] = (k, v)
            out.append(head(hidden))
    return torch.cat(out, dim=1)


def visible_rows(logits: torch.Tensor) -> torch.Tensor:
    keep = [i for i in range(logits.shape[1]) if i != HIDDEN_SLOT]
    return logits[:, keep]


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_pieces_match_transformers_over_chunks_with_a_hidden_slot(name):
    model = hf_model(name)
    ids, mask, pos = prompt_inputs(model.config.vocab_size)
    want = hf_chunked_logits(model, ids, mask, pos)
    got = pieces_chunked_logits(model, ids, mask, pos)
    torch.testing.assert_close(visible_rows(got), visible_rows(want), atol=1e-4, rtol=1e-4)


def test_gemma2_softcapping_matters_at_this_size():
    """Control: without attention softcapping (transformers' SDPA path) the logits move,
    so the Gemma 2 case above does check the capped attention."""
    from transformers import AutoModelForCausalLM

    sdpa = AutoModelForCausalLM.from_pretrained(str(arch_path("gemma2")), dtype=torch.float32,
                                                attn_implementation="sdpa").eval()
    ids, mask, pos = prompt_inputs(sdpa.config.vocab_size)
    capped = pieces_chunked_logits(hf_model("gemma2"), ids, mask, pos)
    uncapped = hf_chunked_logits(sdpa, ids, mask, pos)
    assert (visible_rows(capped) - visible_rows(uncapped)).abs().max() > 1e-2


def test_hidden_slot_is_invisible_to_later_tokens():
    """The mask-0 slot changes nothing for the tokens after it (when no window
    counts it): same logits as the prompt without that token at all."""
    model = hf_model("qwen3")
    ids, mask, pos = prompt_inputs(model.config.vocab_size)
    got = pieces_chunked_logits(model, ids, mask, pos)
    keep = [i for i in range(SEQ) if i != HIDDEN_SLOT]
    with torch.no_grad():
        plain = model(input_ids=ids[:, keep]).logits  # positions 0..SEQ-2, no hidden slot
    torch.testing.assert_close(got[:, keep], plain, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        seen = model(input_ids=ids, position_ids=pos).logits  # control: the same token left visible
    assert (seen[:, HIDDEN_SLOT + 1:] - got[:, HIDDEN_SLOT + 1:]).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["llama3", "gemma2", "qwen3-moe", "phi3"])
def test_shard_module_composition_equals_transformers(name):
    model = hf_model(name)
    total = model.config.num_hidden_layers
    ids, _, _ = prompt_inputs(model.config.vocab_size)
    stages = [ShardModule(model, 0, 1), ShardModule(model, 1, total)]
    geo = stages[0].geo
    empty = torch.zeros(1, geo.num_kv_heads, 0, geo.head_dim)
    past = [[empty] * 2, [empty] * 2 * (total - 1)]
    mask, pos = torch.ones(1, SEQ, dtype=torch.long), torch.arange(SEQ)[None]
    got = []
    with torch.no_grad():
        want = hf_chunked_logits(model, ids, mask, pos)
        for lo, hi in CHUNKS:
            x = ids[:, lo:hi]
            for i, stage in enumerate(stages):
                out = stage(x, mask[:, :hi], pos[:, lo:hi], *past[i])
                past[i] = list(out[-2 * len(stage.layers):])
                x = out[0]
            assert torch.equal(out[1], out[0].argmax(dim=-1))  # next_token
            got.append(x)
    torch.testing.assert_close(torch.cat(got, dim=1), want, atol=1e-4, rtol=1e-4)


# -- OpenVINO 16-bit tracing ---------------------------------------------------

# The layer traced per architecture: the first, but Qwen3-MoE's first layer is dense.
TRACED_LAYER = {"qwen3-moe": 1}


def _convert_16bit(piece, example, spec):
    from openvino.frontend.pytorch.patch_model import __make_16bit_traceable

    __make_16bit_traceable(piece)
    with torch.no_grad():
        return ov.convert_model(piece, example_input=example, input=spec)


def _run(ov_model, inputs) -> list[np.ndarray]:
    compiled = ov.Core().compile_model(ov_model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    res = compiled([t.numpy() for t in inputs])
    return [res[o] for o in compiled.outputs]


def _bf16_matrices(ov_model) -> int:
    """2-D bf16 constants of a converted model: the weights kept 16-bit."""
    return sum(1 for op in ov_model.get_ops() if op.get_type_name() == "Constant"
               and op.get_output_element_type(0) == ov.Type.bf16 and len(op.get_output_partial_shape(0)) == 2)


def _linears(piece) -> int:
    return sum(1 for m in piece.modules() if type(m) in (torch.nn.Linear, torch.nn.Embedding))


def _layer_inputs(geo, n: int, past: int, seed: int):
    """hidden, mask (one hidden past slot), logical positions, past K, past V."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(1, past + n, dtype=torch.long)
    mask[0, past // 2] = 0
    # Positions past Phi-3's 32-position switch, so the long factors are what runs.
    pos = torch.arange(40 + past, 40 + past + n)[None]
    kv = (1, geo.num_kv_heads, past, geo.head_dim)
    return (torch.randn(1, n, geo.hidden_size, generator=g), mask, pos,
            torch.randn(*kv, generator=g), torch.randn(*kv, generator=g))


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_layer_piece_traced_with_16bit_weights_computes_the_f32_result(name):
    """Traced on bf16 weights (3 new tokens over 2 past), run with other sizes
    (5 over 9): the IR equals torch f32 on the same bf16-rounded weights."""
    m16, m32 = hf_model(name, "bf16"), hf_model(name, "f32")
    geo = geometry(m32.config)
    i = TRACED_LAYER.get(name, 0)
    kv = ov.PartialShape([-1, geo.num_kv_heads, -1, geo.head_dim])
    spec = [(ov.PartialShape([-1, -1, geo.hidden_size]), ov.Type.f32), (ov.PartialShape([-1, -1]), ov.Type.i64),
            (ov.PartialShape([-1, -1]), ov.Type.i64), (kv, ov.Type.f32), (kv, ov.Type.f32)]
    piece = LayerPiece(m16, i)
    linears = _linears(piece)
    ov_layer = _convert_16bit(piece, _layer_inputs(geo, 3, 2, seed=1), spec)
    assert _bf16_matrices(ov_layer) == linears, "every nn.Linear weight stays a 16-bit constant"
    inputs = _layer_inputs(geo, 5, 9, seed=2)
    with torch.no_grad():
        want = LayerPiece(m32, i)(*inputs)
    got = _run(ov_layer, inputs)
    assert [g.shape for g in got] == [tuple(w.shape) for w in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["gemma2", "mistral"])  # scaled embedding, softcapped tied head | plain
def test_embed_and_head_pieces_traced_with_16bit_weights_compute_the_f32_result(name):
    m16, m32 = hf_model(name, "bf16"), hf_model(name, "f32")
    geo = geometry(m32.config)
    g = torch.Generator().manual_seed(3)
    i64 = (ov.PartialShape([-1, -1]), ov.Type.i64)
    ov_embed = _convert_16bit(EmbedPiece(m16), (torch.ones(1, 3, dtype=torch.long),), [i64])
    assert _bf16_matrices(ov_embed) == 1, "the embedding matrix stays a 16-bit constant (Gemma's too)"
    ids = torch.randint(3, geo.vocab_size, (1, 6), generator=g)
    with torch.no_grad():
        want = EmbedPiece(m32)(ids)
    np.testing.assert_allclose(_run(ov_embed, (ids,))[0], want.numpy(), atol=1e-5, rtol=1e-5)

    ov_head = _convert_16bit(HeadPiece(m16), (torch.zeros(1, 3, geo.hidden_size),),
                             [(ov.PartialShape([-1, -1, geo.hidden_size]), ov.Type.f32)])
    hidden = torch.randn(1, 6, geo.hidden_size, generator=g)
    with torch.no_grad():
        want = HeadPiece(m32)(hidden)
    np.testing.assert_allclose(_run(ov_head, (hidden,))[0], want.numpy(), atol=1e-4, rtol=1e-4)


# -- refusals ----------------------------------------------------------------


def test_supported_model_types_cover_the_architectures_above():
    supported = supported_model_types()
    assert supported == sorted(supported)
    for recipe in ARCHS.values():
        assert hf_model(recipe.demo_id[len("arch-"):]).config.model_type in supported
    assert "qwen2_moe" in supported  # demo-moe


@pytest.mark.parametrize("config_class,kwargs,model_type", [
    ("T5Config", {}, "t5"),
    ("BertConfig", {}, "bert"),
    ("Gemma3Config", {}, "gemma3"),  # vision tower + text decoder
    ("LlamaConfig", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "llama"),
    ("Gemma3TextConfig", {"use_bidirectional_attention": True}, "gemma3_text"),
])
def test_unsupported_configs_are_refused_in_one_line(config_class, kwargs, model_type):
    import transformers

    config = getattr(transformers, config_class)(**kwargs)
    with pytest.raises(UnsupportedArchitecture) as err:
        check_supported(config)
    message = str(err.value)
    assert err.value.code == "unsupported_architecture" and isinstance(err.value, ValueError)
    assert "\n" not in message and repr(model_type) in message
    assert "supported" in message


def test_supported_configs_pass():
    import transformers

    for config_class in ("LlamaConfig", "MistralConfig", "Qwen2Config", "Qwen3Config", "Qwen3MoeConfig",
                         "Qwen2MoeConfig", "MixtralConfig", "OlmoeConfig", "Gemma2Config", "Gemma3TextConfig",
                         "Phi3Config"):
        check_supported(getattr(transformers, config_class)())
