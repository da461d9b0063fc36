"""Quality against dense: top-1 agreement and perplexity on held-out text.

Teacher-forced: the dense model -- by default every weight a view of the
mmap'd checkpoint in its own dtype, computed with the engine's kernels (16-bit
weights: mixed_linear), never a dense copy in RAM -- runs the held-out text once
as is, and once with each FFN restricted the way the sparse engine computes
it (exact mode: |act(g)| > tau; predicted mode: that AND the own predictor).
The engine computes exactly these neurons with exactly these weights, so the
figures are the engine's (a test checks engine == this simulation).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from engine.sparse.calibrate import SEQ, Calibration, activation, text_ids
from engine.sparse.weights import ffn_layout, mixed_linear


def _restricted_forward(mlp, act_fn, tau: float, predictor, mode: str):
    def forward(x):
        g = mixed_linear(x, mlp.gate_proj.weight)
        a = act_fn(g)
        keep = a.abs() > tau if tau > 0 else torch.ones_like(a, dtype=torch.bool)
        if mode == "predicted" and predictor is not None:
            keep = keep & predictor.predict(x.reshape(-1, x.shape[-1])).reshape(a.shape)
        return mixed_linear(a * keep * mixed_linear(x, mlp.up_proj.weight), mlp.down_proj.weight)
    return forward


def held_out_logits(model, seqs: list[list[int]]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([model(input_ids=torch.tensor([s])).logits[0, :-1] for s in seqs])  # [T, V]


def evaluate(model_dir: Path, calibs: dict[str, Calibration], modes=("exact", "predicted"),
             text: Path | None = None, model=None, tokenizer=None) -> list[dict]:
    """Rows {sparsity, mode, top1_agreement, ppl_dense, ppl_sparse, ppl_change}."""
    from transformers import AutoTokenizer

    layout = ffn_layout(model_dir)
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir)
    if model is None:
        from engine.sparse.layerwise import mapped_dense

        model = mapped_dense(model_dir)
    _, held = text_ids(tokenizer, text)
    seqs = [held[i:i + SEQ] for i in range(0, len(held), SEQ) if len(held[i:i + SEQ]) > 2]
    labels = torch.cat([torch.tensor(s[1:]) for s in seqs])
    dense = held_out_logits(model, seqs)
    ppl_dense = math.exp(float(torch.nn.functional.cross_entropy(dense, labels)))
    act_fn = activation(layout.act)
    mlps = [model.get_submodule(f"{layout.prefix}.{l}.mlp") for l in range(layout.num_layers)]
    rows = []
    for name, calib in calibs.items():
        for mode in modes:
            try:
                for l, mlp in enumerate(mlps):
                    mlp.forward = _restricted_forward(mlp, act_fn, calib.thresholds[l], calib.own[l], mode)
                sparse = held_out_logits(model, seqs)
            finally:
                for mlp in mlps:
                    del mlp.forward  # back to the class's forward
            ppl = math.exp(float(torch.nn.functional.cross_entropy(sparse, labels)))
            rows.append({"sparsity": name, "mode": mode,
                         "top1_agreement": round(float((sparse.argmax(-1) == dense.argmax(-1)).float().mean()), 4),
                         "ppl_dense": round(ppl_dense, 3), "ppl_sparse": round(ppl, 3),
                         "ppl_change_pct": round(100 * (ppl / ppl_dense - 1), 2)})
    return rows
