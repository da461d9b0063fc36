"""A traceable stand-in for transformers 5's stacked-experts modules that runs only the routed experts.

transformers 5 keeps a MoE layer's experts as two stacked tensors
(`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) and loops in Python over
the experts that were hit (one_hot / nonzero / histc / index_add_): the loop's
length depends on tensor values and `aten::histc` has no OpenVINO conversion.
`SparseExperts` takes the experts module's place inside the MoE block — same
call, same result — so the block's own routing (softmax / top-k /
renormalisation, Qwen's shared expert and its gate) stays transformers' code:

  forward(hidden [T, H], top_k_index int64 [T, k], top_k_weights [T, k]) -> [T, H]

The loop runs over all E experts, unrolled at trace time; expert e takes the
m_e token rows routed to it (`where(top_k_index == e)`, m_e = 0 when no token
chose it: the plugin skips an empty matmul), runs its gated MLP on those rows
only, scales them by their routing weights and adds them back (index_add).
The graph has data-dependent shapes (NonZero), which OpenVINO runs natively,
and computes T*k expert MLPs instead of T*E. Experts are accumulated in
ascending index, as transformers does.

Why this form (measured on a 2-core AVX2 EPYC, Qwen3-30B-A3B expert shapes,
2 MoE layers, issue 14's report): against the former dense form (every expert
for every token, two matmuls weighted by a [T, E] routing matrix), 4x faster
per decoded token at fp16, 2.3x at int4, 9x on a 256-token prefill (resident
memory once every expert has run is the same). The CPU plugin's
own MoE lowering (optimum-intel's tiled pattern -> GatherMatmul) also
converts and is exact, but ran slower than this loop with fp16 weights (its
weights are decompressed by separate Convert nodes on every call; decode
~1.7x, prefill ~4x slower, measured under a higher load). Cost: ~12 graph nodes per expert, so
compiling an MoE layer takes seconds (compiled blobs are cached).

Weights: each expert is two nn.Linear modules whose weights are views of the
stacked tensors, so OpenVINO's 16-bit path (`__make_16bit_traceable`) keeps
them as 16-bit 2-D constants exactly like every other projection — no f32
copy of the stacked tensors, a 16-bit IR stays 16-bit — and NNCF compresses
them as ordinary MatMul weights (per channel int8, groups for int4). The
stacked experts module is held outside the module tree (`_source`) so that
path never casts it to f32; the views follow its tensors when a loader
replaces them (`_sync`, before any call), so weights may be loaded after the
piece is built — but before `__make_16bit_traceable`, which stashes the weights
it sees.
"""

from __future__ import annotations

import torch
from torch import nn


def is_stacked_experts(module) -> bool:
    """A transformers 5 experts module this file can run (gated, untransposed, no bias)."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
            and gate_up.dim() == 3 and down.dim() == 3
            and getattr(module, "has_gate", True) and not getattr(module, "has_bias", False)
            and not getattr(module, "is_transposed", False))


def _linear_over(weight: torch.Tensor) -> nn.Linear:
    """An nn.Linear (exact class: OpenVINO's 16-bit extension matches it) whose weight is `weight`."""
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=False, device="meta")
    linear._parameters["weight"] = nn.Parameter(weight, requires_grad=False)
    return linear


class SparseExperts(nn.Module):
    """The experts of one MoE layer, each run on the tokens routed to it (see the module docstring)."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        if not is_stacked_experts(experts):
            raise ValueError(f"{type(experts).__name__} is not a stacked gated experts module")
        num_e = experts.gate_up_proj.shape[0]
        # Not a child module: its stacked Parameters must stay out of the traced tree.
        object.__setattr__(self, "_source", experts)
        self.act_fn = experts.act_fn
        meta = torch.empty(0, device="meta")
        self.gate_up = nn.ModuleList(_linear_over(meta.new_empty(experts.gate_up_proj.shape[1:]))
                                     for _ in range(num_e))  # expert e: [2I, H]
        self.down = nn.ModuleList(_linear_over(meta.new_empty(experts.down_proj.shape[1:]))
                                  for _ in range(num_e))  # expert e: [H, I]
        self._views_of: tuple[torch.Tensor, torch.Tensor] | None = None
        self._sync()

    def _sync(self) -> None:
        """Point the per-expert weights at the source's current stacked tensors (a
        loader replaces the Parameter objects; views of the old ones would be stale)."""
        gate_up, down = self._source.gate_up_proj, self._source.down_proj
        if self._views_of is not None and self._views_of[0] is gate_up and self._views_of[1] is down:
            return
        for e in range(gate_up.shape[0]):  # views share the stacked storage: no copy
            self.gate_up[e]._parameters["weight"] = nn.Parameter(gate_up.detach()[e], requires_grad=False)
            self.down[e]._parameters["weight"] = nn.Parameter(down.detach()[e], requires_grad=False)
        self._views_of = (gate_up, down)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        self._sync()
        out = torch.zeros_like(hidden)  # [T, H]
        weights = top_k_weights.to(hidden.dtype)  # [T, k]
        for e in range(len(self.gate_up)):
            token, slot = torch.where(top_k_index == e)  # [m] each: the m tokens that chose expert e
            gate, up = self.gate_up[e](hidden[token]).chunk(2, dim=-1)  # [m, H] -> [m, 2I] -> [m, I] x2
            y = self.down[e](self.act_fn(gate) * up) * weights[token, slot, None]  # [m, H]
            out = out.index_add(0, token, y)
        return out
