"""Measured overlap of consecutive tokens' active sets (`flotilla sparse profile`).

Runs the dense model on a text and reports, per FFN layer, the sparsity and
the mean Jaccard |A_t & A_t+1| / |A_t | A_t+1| of consecutive tokens' active
sets: the temporal locality a neuron cache can live on. For comparison, two
*independent* random sets of density d overlap with Jaccard d / (2 - d).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.sparse.calibrate import SEQ, activation, active_mask, text_ids
from engine.sparse.layerwise import gate_weight, layer_inputs, mapped_dense
from engine.sparse.predictor import jaccard_consecutive
from engine.sparse.weights import ffn_layout


def overlap_profile(model_dir: Path, sparsity: float = 0.8, text: Path | None = None,
                    model=None, tokenizer=None) -> dict:
    from transformers import AutoTokenizer

    layout = ffn_layout(model_dir)
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir)
    model = model or mapped_dense(model_dir)  # one layer at a time from the mmap'd checkpoint
    calib_seqs, held = text_ids(tokenizer, text)
    seqs = calib_seqs + [held[i:i + SEQ] for i in range(0, len(held), SEQ) if len(held[i:i + SEQ]) > 8]
    act_fn = activation(layout.act)
    layers = []
    for l, per_seq in layer_inputs(model, [[s] for s in seqs]):  # consecutive = within one sequence
        wg = gate_weight(model, layout, l)
        with torch.no_grad():
            mags = torch.cat([act_fn(x @ wg.T).abs() for x in per_seq])
            if layout.relu_family or sparsity <= 0:
                tau = 0.0
            else:
                tau = float(torch.quantile(mags.flatten()[:2_000_000], sparsity))
        jac, dens = [], []
        for x in per_seq:
            a = active_mask(x @ wg.T, act_fn, tau).numpy()
            jac.append(jaccard_consecutive(a))
            dens.append(a.mean())
        d = float(np.mean(dens))
        layers.append({"layer": l, "sparsity": round(1 - d, 4), "jaccard": round(float(np.nanmean(jac)), 4),
                       "jaccard_if_independent": round(d / (2 - d), 4) if d < 1 else 1.0})
    return {"model": str(model_dir), "activation": layout.act,
            "threshold": "natural zeros (ReLU)" if layout.relu_family else f"CATS, target sparsity {sparsity}",
            "tokens": int(sum(len(s) for s in seqs)), "layers": layers,
            "jaccard_mean": round(float(np.mean([r["jaccard"] for r in layers])), 4)}
