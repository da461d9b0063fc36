"""SparseExperts (engine/shards/moe.py) against transformers' experts modules.

The layer is converted by OpenVINO once (traced on 3 tokens) and run with other
token counts and routings, including experts no token chose (their matmuls
have zero rows) and an expert every token chose; the result must be what
transformers' own experts loop computes in f32. The 16-bit trace keeps every
expert's projections as 16-bit 2-D constants, and NNCF compresses all of them.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ov = pytest.importorskip("openvino")

from test_shard_pieces import TRACED_LAYER, hf_model  # noqa: E402

from engine.shards.moe import SparseExperts  # noqa: E402
from engine.shards.model import LayerPiece, geometry  # noqa: E402

E, K, H = 8, 2, 48  # experts, top-k, hidden size


def _experts(family: str) -> torch.nn.Module:
    """A transformers experts module with random weights, run by its eager loop."""
    import transformers

    torch.manual_seed(7)
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as cls

        config = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=24, num_experts=E,
                                             num_experts_per_tok=K)
    else:
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as cls

        config = transformers.MixtralConfig(hidden_size=H, intermediate_size=40, num_local_experts=E,
                                            num_experts_per_tok=K)
    config._experts_implementation = "eager"  # transformers' own one_hot / where / index_add_ loop
    experts = cls(config).eval()
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return experts


def _routing(tokens: int, allowed: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k_index int64 [T, K] (distinct experts per token, from `allowed`), weights [T, K]."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(allowed)
    index = torch.stack([pool[torch.randperm(len(allowed), generator=g)[:K]] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, K, generator=g), dim=-1)
    return index, weights


class _Call(torch.nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, hidden, top_k_index, top_k_weights):
        return self.experts(hidden, top_k_index, top_k_weights)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_sparse_experts_converted_by_openvino_compute_transformers_experts(family):
    experts = _experts(family)
    example = (torch.randn(3, H), *_routing(3, list(range(E)), seed=1))
    spec = [(ov.PartialShape([-1, H]), ov.Type.f32), (ov.PartialShape([-1, K]), ov.Type.i64),
            (ov.PartialShape([-1, K]), ov.Type.f32)]
    with torch.no_grad():
        ov_model = ov.convert_model(_Call(SparseExperts(experts)), example_input=example, input=spec)
    compiled = ov.Core().compile_model(ov_model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    g = torch.Generator().manual_seed(2)
    cases = [
        (1, [0, 1, 2, 3, 4, 5, 6, 7]),  # decode: 6 experts idle
        (6, [0, 2, 3, 5, 6]),  # a batch with experts 1, 4, 7 idle
        (5, [3, 6]),  # every token chooses experts 3 and 6
        (9, list(range(E))),
    ]
    for seed, (tokens, allowed) in enumerate(cases, start=10):
        hidden = torch.randn(tokens, H, generator=g)
        index, weights = _routing(tokens, allowed, seed)
        with torch.no_grad():
            want = experts(hidden, index, weights)
        got = compiled([hidden.numpy(), index.numpy(), weights.numpy()])[0]
        assert got.shape == (tokens, H)
        np.testing.assert_allclose(got, want.numpy(), atol=1e-5, rtol=1e-5, err_msg=f"{tokens} tokens, {allowed}")


def test_sparse_experts_follow_weights_loaded_after_they_were_built():
    """The exporter's loader replaces the stacked Parameters: the per-expert views follow."""
    experts = _experts("qwen3_moe")
    sparse = SparseExperts(experts)
    hidden = torch.randn(4, H)
    index, weights = _routing(4, list(range(E)), seed=3)
    experts._parameters["gate_up_proj"] = torch.nn.Parameter(torch.randn_like(experts.gate_up_proj))
    experts._parameters["down_proj"] = torch.nn.Parameter(torch.randn_like(experts.down_proj))
    with torch.no_grad():
        torch.testing.assert_close(sparse(hidden, index, weights), experts(hidden, index, weights))


def _moe_layer_16bit():
    """Layer 1 (an MoE layer) of the Qwen3-MoE demo traced by OpenVINO's 16-bit path."""
    from openvino.frontend.pytorch.patch_model import __make_16bit_traceable

    model = hf_model("qwen3-moe", "bf16")
    geo = geometry(model.config)
    piece = LayerPiece(model, TRACED_LAYER["qwen3-moe"])
    kv = ov.PartialShape([-1, geo.num_kv_heads, -1, geo.head_dim])
    spec = [(ov.PartialShape([-1, -1, geo.hidden_size]), ov.Type.f32), (ov.PartialShape([-1, -1]), ov.Type.i64),
            (ov.PartialShape([-1, -1]), ov.Type.i64), (kv, ov.Type.f32), (kv, ov.Type.f32)]
    example = (torch.randn(1, 3, geo.hidden_size), torch.ones(1, 5, dtype=torch.long), torch.arange(2, 5)[None],
               torch.randn(1, geo.num_kv_heads, 2, geo.head_dim), torch.randn(1, geo.num_kv_heads, 2, geo.head_dim))
    __make_16bit_traceable(piece)
    with torch.no_grad():
        return ov.convert_model(piece, example_input=example, input=spec), model.config.num_experts


def _matrices(ov_model, types) -> int:
    """2-D constants of element type in `types` that are weight matrices (not [rows, 1] scales)."""
    return sum(1 for op in ov_model.get_ops() if op.get_type_name() == "Constant"
               and op.get_output_element_type(0) in types and len(op.get_output_shape(0)) == 2
               and min(op.get_output_shape(0)) > 1)


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_every_expert_weight_is_compressed(precision):
    from engine.shards.compress import compress_piece

    ov_model, num_experts = _moe_layer_16bit()
    sixteen = (ov.Type.bf16, ov.Type.f16)
    # q, k, v, o + per expert gate_up and down, each a 16-bit matrix (no f32 copy of the stacked experts)
    assert _matrices(ov_model, sixteen) == 4 + 2 * num_experts
    assert not any(op.get_type_name() == "Constant" and len(op.get_output_partial_shape(0)) == 3
                   and op.get_output_partial_shape(0)[0].get_length() == num_experts for op in ov_model.get_ops())
    compressed = compress_piece(ov_model, precision, "layers")
    assert _matrices(compressed, sixteen) == 0
    low = (ov.Type.u8, ov.Type.i8) if precision == "int8" else (ov.Type.u4, ov.Type.i4)
    weights = sum(1 for op in compressed.get_ops() if op.get_type_name() == "Constant"
                  and op.get_output_element_type(0) in low and op.get_output_partial_shape(0).rank.get_length() >= 2)
    assert weights >= 4 + 2 * num_experts
