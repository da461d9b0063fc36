"""Calibration reads the checkpoint as it is: the mmap-backed model run one decoder layer at a
time gives the FFN inputs transformers' own forward gives (f32), holds no weight copy, and the
sparse engine keeps 16-bit embeddings and head in their dtype, the input embedding (untied) as
a view of the file, not a copy in RAM."""

from __future__ import annotations

import torch

from engine.sparse.layerwise import layer_inputs, mapped_dense
from engine.sparse.weights import ffn_layout

SEQS = [[5, 17, 99, 3, 250, 41, 7, 8, 13], [400, 2, 61, 77, 5]]


def test_layer_by_layer_inputs_equal_transformers_hooks():
    from transformers import AutoModelForCausalLM

    from engine.models.demo import ensure_demo

    path = ensure_demo("demo")
    layout = ffn_layout(path)
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want: list[list[torch.Tensor]] = [[] for _ in range(layout.num_layers)]
    hooks = [ref_model.model.layers[i].mlp.register_forward_pre_hook(
        lambda _m, a, i=i: want[i].append(a[0][0].clone())) for i in range(layout.num_layers)]
    with torch.inference_mode():
        for s in SEQS:
            ref_model(input_ids=torch.tensor([s]))
    for h in hooks:
        h.remove()
    got = dict(layer_inputs(mapped_dense(path), [SEQS[:1], SEQS[1:]]))
    assert sorted(got) == list(range(layout.num_layers))
    for l in range(layout.num_layers):
        torch.testing.assert_close(got[l][0], want[l][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(got[l][1], want[l][1], atol=1e-5, rtol=0)


def test_mapped_model_copies_no_weight(wide_model_bf16):
    from engine.sparse.weights import MappedWeights

    model = mapped_dense(wide_model_bf16)
    maps = MappedWeights(wide_model_bf16)
    big = [p for n, p in model.named_parameters() if p.dim() == 2]
    assert big and all(p.dtype == torch.bfloat16 for p in big)  # no widening, no copy
    # every 2-D weight is a view of the file: writing is refused by the read-only mmap
    assert all(not p.is_meta for p in model.parameters())
    assert len(maps.names()) >= len(big)


def test_engine_keeps_16_bit_embeddings_and_head(wide_model_bf16):
    from engine.sparse.engine import SparseConfig, SparseEngine

    with SparseEngine(wide_model_bf16, "t", SparseConfig(sparsity=0.5)) as eng:
        model = eng.backend.model
        assert model.get_input_embeddings().weight.dtype == torch.bfloat16
        assert model.lm_head.weight.dtype == torch.bfloat16
        ids = torch.tensor([[1, 2, 3]])
        assert model.get_input_embeddings()(ids).dtype == torch.float32
        assert not any(p.is_meta for n, p in model.named_parameters() if ".mlp." not in n)
        emb, head = model.get_input_embeddings().weight, model.lm_head.weight
        assert emb.data_ptr() != head.data_ptr()  # the fixture is untied
        # the untied table is not a copy: its bytes lie in a mapping of the checkpoint file,
        # and what the engine reports as resident leaves it out
        assert _mapped_file(emb.data_ptr()).endswith(".safetensors")
        assert not _mapped_file(head.data_ptr()).endswith(".safetensors")
        resident = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if ".mlp." not in n and n != "model.embed_tokens.weight")
        assert eng.backend.resident_bytes == resident


def _mapped_file(address: int) -> str:
    """The file behind the mapping that holds `address` ("" for anonymous memory)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                return parts[5] if len(parts) > 5 else ""
    raise AssertionError(f"address {address:#x} is not mapped")
