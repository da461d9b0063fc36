"""A traceable torch forward for a contiguous layer range of a HF causal LM.

`ShardModule` re-uses the weights of a loaded transformers model but owns its
forward, written so that OpenVINO's torch frontend sees exactly the patterns
its CPU/GPU plugins fuse:

- attention through `F.scaled_dot_product_attention` with an explicit boolean
  mask built from `attention_mask` (1 visible, 0 hidden) AND causality of the
  current chunk, so rolled-back speculative tokens can be hidden by the caller;
- past K/V as explicit inputs, concatenated on the sequence axis and returned
  as present K/V (made stateful afterwards by `export.py`);
- rotary embeddings computed in-graph from explicit `position_ids`;
- MoE blocks in a dense all-experts formulation (every expert for every token,
  weighted by a [tokens, E] matrix holding the top-k routing weights and zeros
  elsewhere), because the transformers 5 expert loop does not convert.

Supported: Llama, Mistral, Qwen2, Qwen3 (q/k norm per head), Qwen2-MoE (shared
expert with sigmoid gate), Mixtral, OLMoE (q/k norm over the projection).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

DENSE_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
MOE_TYPES = {"qwen2_moe", "mixtral", "olmoe"}
SUPPORTED_TYPES = DENSE_TYPES | MOE_TYPES
# Rope types whose inverse frequencies are fixed at load time (no dynamic rescale).
STATIC_ROPE = {"default", "linear", "llama3", "yarn"}


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
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        num_layers=config.num_hidden_layers,
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _sliding_window(config) -> int | None:
    """The attention window, or None when every layer attends to everything."""
    model_type = config.model_type
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    if model_type in ("qwen2", "qwen2_moe", "qwen3"):
        return window if getattr(config, "use_sliding_window", False) else None
    if model_type in ("mistral", "mixtral"):
        return window
    return None


class ShardModule(nn.Module):
    """Layers [start, end) of `hf_model`, plus embedding / head at the ends.

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
        if config.model_type not in SUPPORTED_TYPES:
            raise ValueError(
                f"model type {config.model_type!r} is not supported for pipeline shards "
                f"(supported: {', '.join(sorted(SUPPORTED_TYPES))})"
            )
        total = config.num_hidden_layers
        if not 0 <= start < end <= total:
            raise ValueError(f"layer range [{start}, {end}) is not inside [0, {total})")
        self.config = config
        self.geo = geometry(config)
        self.first = start == 0
        self.last = end == total
        self.with_next_token = with_next_token
        self.model_type = config.model_type
        self.num_heads = config.num_attention_heads
        self.groups = self.num_heads // self.geo.num_kv_heads
        self.window = _sliding_window(config)
        base = hf_model.model
        self.embed = base.embed_tokens if self.first else None
        self.layers = nn.ModuleList(base.layers[i] for i in range(start, end))
        self.norm = base.norm if self.last else None
        self.lm_head = hf_model.lm_head if self.last else None
        rotary = base.rotary_emb
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type not in STATIC_ROPE:
            raise ValueError(f"rope type {rope_type!r} is not supported for pipeline shards")
        self.register_buffer("inv_freq", rotary.inv_freq.detach().float().clone(), persistent=False)
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))

    # -- pieces -----------------------------------------------------------

    def _rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids [1, n] -> freqs [1, n, d/2] -> cos/sin [1, 1, n, d]
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scale)[:, None]
        sin = (emb.sin() * self.rope_scale)[:, None]
        return cos, sin

    def _mask(self, attention_mask: torch.Tensor, n: int) -> torch.Tensor:
        # attention_mask [1, T] with T = past + n -> bool [1, 1, n, T]
        total = attention_mask.shape[1]
        past = total - n
        kv_idx = torch.arange(total, device=attention_mask.device)  # [T]
        q_idx = torch.arange(n, device=attention_mask.device) + past  # [n] physical query slots
        allowed = kv_idx[None, :] <= q_idx[:, None]  # [n, T] causal
        if self.window is not None:
            allowed = allowed & (q_idx[:, None] - kv_idx[None, :] < self.window)
        visible = attention_mask[:, None, None, :] != 0  # [1, 1, 1, T]
        return visible & allowed[None, None]

    def _attention(self, attn, x, cos, sin, mask, past_k, past_v):
        b, n, _ = x.shape
        hd = self.geo.head_dim
        q = attn.q_proj(x)
        k = attn.k_proj(x)
        v = attn.v_proj(x)
        if self.model_type == "olmoe":
            q, k = attn.q_norm(q), attn.k_norm(k)  # norm over the whole projection
            clip = getattr(self.config, "clip_qkv", None)
            if clip is not None:
                q, k, v = (t.clamp(-clip, clip) for t in (q, k, v))
        q = q.view(b, n, -1, hd)  # [b, n, heads, hd]
        k = k.view(b, n, -1, hd)
        v = v.view(b, n, -1, hd)
        if self.model_type == "qwen3":
            q, k = attn.q_norm(q), attn.k_norm(k)  # per-head norm
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, n, hd]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k_all = torch.cat((past_k, k), dim=2)  # [b, kv_heads, past + n, hd]
        v_all = torch.cat((past_v, v), dim=2)
        k_rep, v_rep = k_all, v_all
        if self.groups > 1:
            # repeat_kv: [b, kv, T, hd] -> [b, kv, g, T, hd] -> [b, kv*g, T, hd]
            t = k_all.shape[2]
            k_rep = k_all[:, :, None].expand(b, self.geo.num_kv_heads, self.groups, t, hd).reshape(b, self.num_heads, t, hd)
            v_rep = v_all[:, :, None].expand(b, self.geo.num_kv_heads, self.groups, t, hd).reshape(b, self.num_heads, t, hd)
        out = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask, scale=attn.scaling)
        out = out.transpose(1, 2).reshape(b, n, -1)  # [b, n, heads*hd]
        return attn.o_proj(out), k_all, v_all

    def _moe(self, block, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        flat = x.reshape(-1, h)  # [T, H]
        gate = block.gate
        probs = F.softmax(F.linear(flat, gate.weight).float(), dim=-1)  # [T, E]
        top_v, top_i = torch.topk(probs, gate.top_k, dim=-1)  # [T, k]
        if self.model_type == "mixtral" or getattr(gate, "norm_topk_prob", False):
            top_v = top_v / top_v.sum(dim=-1, keepdim=True)
        weights = torch.zeros_like(probs).scatter(1, top_i, top_v).to(flat.dtype)  # [T, E]
        experts = block.experts
        # Two plain matmuls over all experts at once (exact: the down projection
        # is linear, so weighting before it equals weighting after it):
        # gate_up_proj [E, 2I, H] -> [E*2I, H]; down_proj [E, H, I] -> [H, E*I]
        num_e, two_i, _ = experts.gate_up_proj.shape
        gate_up = F.linear(flat, experts.gate_up_proj.reshape(num_e * two_i, h))  # [T, E*2I]
        g, u = gate_up.view(-1, num_e, two_i).chunk(2, dim=-1)  # [T, E, I] each
        act = experts.act_fn(g) * u * weights[:, :, None]  # [T, E, I]
        down = experts.down_proj.permute(1, 0, 2).reshape(h, num_e * (two_i // 2))
        out = F.linear(act.reshape(-1, num_e * (two_i // 2)), down)  # [T, H]
        if self.model_type == "qwen2_moe":
            shared = block.shared_expert(flat)
            out = out + torch.sigmoid(block.shared_expert_gate(flat)) * shared
        return out.reshape(b, n, h)

    # -- forward ----------------------------------------------------------

    def forward(self, x, attention_mask, position_ids, *past):
        hidden = self.embed(x) if self.first else x
        n = hidden.shape[1]
        cos, sin = self._rope(position_ids)
        mask = self._mask(attention_mask, n)
        present = []
        for i, layer in enumerate(self.layers):
            residual = hidden
            h = layer.input_layernorm(hidden)
            h, k_all, v_all = self._attention(layer.self_attn, h, cos, sin, mask, past[2 * i], past[2 * i + 1])
            present += [k_all, v_all]
            hidden = residual + h
            residual = hidden
            h = layer.post_attention_layernorm(hidden)
            h = self._moe(layer.mlp, h) if self.model_type in MOE_TYPES and hasattr(layer.mlp, "experts") else layer.mlp(h)
            hidden = residual + h
        if not self.last:
            return (hidden, *present)
        logits = self.lm_head(self.norm(hidden)).float()  # [1, n, V]
        if self.with_next_token:
            return (logits, torch.argmax(logits, dim=-1), *present)
        return (logits, *present)
