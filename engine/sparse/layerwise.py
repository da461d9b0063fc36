"""FFN inputs of a dense model, one decoder layer at a time, from memory-mapped weights.

Calibration and `sparse profile` need every FFN layer's input on some text. Running the
whole model with hooks keeps all layers' inputs at once (32 layers x tokens x 4096 x 4
bytes for an 8B model), and loading it dense in f32 holds twice the checkpoint. Here the
model is the meta-device skeleton with every weight a view of the mmap'd checkpoint (in
its own dtype; the OS pages a layer in while it runs and may drop it after), and the
sequences advance one decoder layer at a time: only the current hidden states, and the
FFN inputs of the layer being yielded, are in RAM.

    model = mapped_dense(model_dir)
    for l, inputs in layer_inputs(model, [calib_seqs, held_seqs]):   # inputs[g]: [T_g, h]
        ...
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch


def mapped_dense(model_dir: Path):
    """The dense model, every weight a view of the mmap'd checkpoint (nothing copied)."""
    from engine.sparse.weights import load_dense_mmap

    return load_dense_mmap(Path(model_dir), resident=False, copy_rest=False)


@torch.inference_mode()
def layer_inputs(model, groups: list[list[list[int]]]) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """(layer, [FFN inputs of group g: [T_g, h] f32]) for every decoder layer in order;
    each group is a list of independent token sequences (causal attention within each)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    rope = base.rotary_emb
    hidden = [[base.embed_tokens(torch.tensor([s], dtype=torch.long)).float() for s in seqs]
              for seqs in groups]  # [1, n, h] per sequence
    for l, layer in enumerate(base.layers):
        captured: list[torch.Tensor] = []
        hook = layer.mlp.register_forward_pre_hook(
            lambda _m, args: captured.append(args[0].reshape(-1, args[0].shape[-1]).float().clone()))
        try:
            inputs = []
            for g, seqs in enumerate(hidden):
                start = len(captured)
                for i, x in enumerate(seqs):
                    pos = torch.arange(x.shape[1])[None]  # [1, n]
                    seqs[i] = layer(x, attention_mask=None, position_ids=pos,
                                    position_embeddings=rope(x, pos))  # mask None + n > 1: causal (SDPA)
                inputs.append(torch.cat(captured[start:]) if len(captured) > start
                              else torch.empty(0, base.config.hidden_size))
        finally:
            hook.remove()
        yield l, inputs


def gate_weight(model, layout, layer: int) -> torch.Tensor:
    """Layer `layer`'s gate projection [N, h] widened to f32 (one layer's transient)."""
    return model.get_submodule(f"{layout.prefix}.{layer}.mlp.gate_proj").weight.detach().float()
