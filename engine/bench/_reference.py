"""The transformers reference of a big checkpoint, computed one decoder layer at a time.

Teacher forcing: for token ids x[0..n), the argmax of the logits at every position t is the
model's greedy guess of x[t+1] given x[..t]. `teacher_forced_argmax` computes it with
transformers' own modules (embedding, rotary embedding, causal mask, decoder layers, final
norm, head) without ever holding the whole model: the model is built on the meta device,
and each part is materialised from the safetensors files just before it runs and dropped
right after. Only the n hidden states ([1, n, hidden] f32) are kept between layers, so an
8B checkpoint needs about one layer (0.9 GB in f32) plus the head.

Compute is f32 on the checkpoint's bf16 weights (upcast exactly): the most precise answer
the checkpoint has, against which every shard precision is compared.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable

REFERENCE_VERSION = 1  # bumped when the computation changes (cached answers are then redone)


class _Weights:
    """Tensor name -> its file, from model.safetensors.index.json or the single file."""

    def __init__(self, model_path: Path) -> None:
        from safetensors import safe_open

        self.path = Path(model_path)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            self.where = dict(json.loads(index.read_text())["weight_map"])
        else:
            single = self.path / "model.safetensors"
            with safe_open(str(single), "pt") as f:
                self.where = {k: single.name for k in f.keys()}
        self._open: dict[str, Any] = {}
        self._safe_open = safe_open

    def get(self, name: str):
        fname = self.where[name]
        if fname not in self._open:
            self._open[fname] = self._safe_open(str(self.path / fname), "pt")
        return self._open[fname].get_tensor(name)

    def has(self, name: str) -> bool:
        return name in self.where


def _materialise(module, prefix: str, weights: _Weights, dtype) -> None:
    """Give a meta-device module its real tensors (named prefix + local name) in dtype."""
    import torch

    module.to_empty(device="cpu")
    state = {}
    for local, _ in list(module.named_parameters()) + list(module.named_buffers()):
        name = prefix + local
        if weights.has(name):
            state[local] = weights.get(name).to(dtype)
    missing = [k for k, _ in module.named_parameters() if k not in state]
    if missing:
        raise KeyError(f"checkpoint has no {prefix}{missing[0]}")
    with torch.no_grad():
        module.load_state_dict(state, strict=False, assign=True)


def _release(module) -> None:
    module.to("meta")


def teacher_forced_argmax(model_path: Path, ids: list[int], *,
                          report: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Greedy next token at every position of ids (list of len(ids)), and health checks."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.masking_utils import create_causal_mask

    say = report or (lambda _line: None)
    t0 = time.monotonic()
    dtype = torch.float32
    config = AutoConfig.from_pretrained(str(model_path))
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    weights = _Weights(model_path)
    base = model.model
    with torch.no_grad():
        x = torch.tensor([ids], dtype=torch.long)  # [1, n]
        pos = torch.arange(x.shape[1])[None]  # [1, n]
        _materialise(base.embed_tokens, "model.embed_tokens.", weights, dtype)
        h = base.embed_tokens(x)  # [1, n, hidden]
        _release(base.embed_tokens)
        # Rotary tables are computed (non-persistent buffers), not loaded: build them for real.
        rotary = type(base.rotary_emb)(config=config)
        cos_sin = rotary(h, pos)
        mask = create_causal_mask(config=config, inputs_embeds=h, attention_mask=torch.ones_like(x),
                                  past_key_values=None, position_ids=pos)
        for i, layer in enumerate(base.layers):
            _materialise(layer, f"model.layers.{i}.", weights, dtype)
            h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
            if isinstance(h, tuple):  # older decoder layers return (hidden, ...)
                h = h[0]
            _release(layer)
            if (i + 1) % max(1, len(base.layers) // 4) == 0:
                say(f"  reference: layer {i + 1}/{len(base.layers)} ({time.monotonic() - t0:.0f} s)")
        _materialise(base.norm, "model.norm.", weights, dtype)
        h = base.norm(h)
        head = "lm_head.weight" if weights.has("lm_head.weight") else "model.embed_tokens.weight"
        w = weights.get(head).to(dtype)  # [vocab, hidden]
        logits = h[0] @ w.T  # [n, vocab]
        del w
    argmax = logits.argmax(-1).tolist()
    top2 = logits.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1])  # how decided each greedy choice is
    return {"argmax": [int(t) for t in argmax], "positions": len(ids),
            "finite": bool(torch.isfinite(logits).all()), "distinct_argmax": len(set(argmax)),
            "logit_std": round(float(logits.std()), 4), "median_top1_margin": round(float(margin.median()), 4),
            "seconds": round(time.monotonic() - t0, 1),
            "method": "transformers modules, one decoder layer at a time, f32 compute on the bf16 weights"}


def cached_teacher_forced(model_path: Path, ids: list[int], cache: Path, *,
                          report: Callable[[str], None] | None = None) -> dict[str, Any]:
    """teacher_forced_argmax, computed once per (checkpoint, ids, transformers) and kept in cache."""
    import transformers

    key = hashlib.sha256(json.dumps([REFERENCE_VERSION, Path(model_path).name, ids,
                                     transformers.__version__]).encode()).hexdigest()[:16]
    path = Path(cache) / f"{Path(model_path).name}.reference-{key}.json"
    if path.exists():
        out = json.loads(path.read_text())
        out["cached"] = True
        return out
    out = teacher_forced_argmax(model_path, ids, report=report)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(path)
    out["cached"] = False
    return out
