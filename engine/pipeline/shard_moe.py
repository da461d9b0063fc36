"""A traceable stand-in for transformers 5's stacked-experts modules.

transformers 5 keeps a MoE layer's experts as two stacked tensors
(`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) and runs them in a Python
loop over the experts that were hit (one_hot / nonzero / index_add_), which
depends on tensor values and does not convert to OpenVINO. `DenseExperts`
takes the experts module's place inside the MoE block — same call, same
result — so the block's own routing (softmax / top-k / renormalisation, Qwen's
shared expert and its gate) stays transformers' code:

  forward(hidden [T, H], top_k_index int64 [T, k], top_k_weights [T, k]) -> [T, H]

It runs every expert for every token, each weighted by a [T, E] matrix holding
the token's top-k routing weights and zeros elsewhere: two plain matmuls over
all experts at once. Exact, because the down projection is linear (weighting
before it equals weighting after it) and a zero weight removes an expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def is_stacked_experts(module) -> bool:
    """A transformers 5 experts module this file can run (gated, untransposed, no bias)."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
            and gate_up.dim() == 3 and down.dim() == 3
            and getattr(module, "has_gate", True) and not getattr(module, "has_bias", False)
            and not getattr(module, "is_transposed", False))


class DenseExperts(nn.Module):
    """All experts of one MoE layer, weighted densely (see the module docstring)."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        if not is_stacked_experts(experts):
            raise ValueError(f"{type(experts).__name__} is not a stacked gated experts module")
        # The experts module itself (not its tensors): the exporter loads its
        # weights after the piece is built, replacing the Parameter objects.
        self.experts = experts

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        experts = self.experts
        num_e, two_i, h = experts.gate_up_proj.shape
        inter = two_i // 2
        # [T, k] routing -> [T, E]: weight of expert e for token t, 0 when not chosen
        expert_ids = torch.arange(num_e, device=top_k_index.device)
        chosen = (top_k_index[:, :, None] == expert_ids).to(hidden.dtype)  # [T, k, E]
        weights = (chosen * top_k_weights.to(hidden.dtype)[:, :, None]).sum(dim=1)  # [T, E]
        # gate_up_proj [E, 2I, H] -> [E*2I, H]
        gate_up = F.linear(hidden, experts.gate_up_proj.reshape(num_e * two_i, h))  # [T, E*2I]
        gate, up = gate_up.view(-1, num_e, two_i).chunk(2, dim=-1)  # [T, E, I] each
        act = experts.act_fn(gate) * up * weights[:, :, None]  # [T, E, I]
        # down_proj [E, H, I] -> [H, E, I] -> [H, E*I]
        down = experts.down_proj.permute(1, 0, 2).reshape(h, num_e * inter)
        return F.linear(act.reshape(-1, num_e * inter), down)  # [T, H]
