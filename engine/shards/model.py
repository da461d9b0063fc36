"""The traced forward of a pipeline shard: pieces, their composition, shard geometry.

A shard of layers [start, end) is Embed? + LayerPiece x (end - start) + Head?
(pieces.py); the exporter traces and stitches the pieces one by one,
`ShardModule` composes them in torch (tests, benches, references). What can be
sharded at all is decided from the config by `check_supported`
(engine/planner/architectures.py); MoE experts run on the tokens routed to them (moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.planner.architectures import (  # noqa: F401 - the public API of shard sharding lives here
    ARCHITECTURES,
    UnsupportedArchitecture,
    check_supported,
    layer_window,
    supported_model_types,
)
from engine.shards.pieces import EmbedPiece, HeadPiece, LayerPiece, piece_modules  # noqa: F401

@dataclass(frozen=True)
class ShardGeometry:
    """Shapes every stage of one model agrees on."""

    hidden_size: int  # width of hidden_states between stages
    vocab_size: int  # logits width of the last stage
    num_kv_heads: int  # K/V heads per layer (state dim 1)
    head_dim: int  # state dim 3
    num_layers: int  # decoder layers in the whole model


def geometry(config) -> ShardGeometry:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ShardGeometry(
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        num_layers=config.num_hidden_layers,
    )


class ShardModule(nn.Module):
    """Layers [start, end) of `hf_model`, plus embedding / head at the ends, as one module.

    forward(x, attention_mask, position_ids, *past) with
      x              int64 [1, n] token ids (first stage) or f32 [1, n, H]
      attention_mask int64 [1, past + n]  1 = visible, 0 = hidden
      position_ids   int64 [1, n]
      past           per layer: key, value f32 [1, kv_heads, past, head_dim]
    returns (out, *present) where out is hidden [1, n, H] or logits
    [1, n, V] (+ next_token int64 [1, n] on the last stage) and present holds
    per layer key, value [1, kv_heads, past + n, head_dim].
    """

    def __init__(self, hf_model, start: int, end: int, *, with_next_token: bool = True):
        super().__init__()
        config = hf_model.config
        check_supported(config)
        total = config.num_hidden_layers
        if not 0 <= start < end <= total:
            raise ValueError(f"layer range [{start}, {end}) is not inside [0, {total})")
        self.geo = geometry(config)
        self.first = start == 0
        self.last = end == total
        self.with_next_token = with_next_token
        self.embed = EmbedPiece(hf_model) if self.first else None
        self.layers = nn.ModuleList(LayerPiece(hf_model, i) for i in range(start, end))
        self.head = HeadPiece(hf_model) if self.last else None

    def forward(self, x, attention_mask, position_ids, *past):
        hidden = self.embed(x) if self.first else x
        present = []
        for i, layer in enumerate(self.layers):
            hidden, k, v = layer(hidden, attention_mask, position_ids, past[2 * i], past[2 * i + 1])
            present += [k, v]
        if not self.last:
            return (hidden, *present)
        logits = self.head(hidden)  # [1, n, V]
        if self.with_next_token:
            return (logits, torch.argmax(logits, dim=-1), *present)
        return (logits, *present)
