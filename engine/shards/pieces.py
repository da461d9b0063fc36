"""Traceable pieces of a HF causal LM: embedding, one decoder layer, head.

The exporter traces a shard piece by piece (export.py) and stitches the
OpenVINO pieces into one stateful graph. Each piece is an nn.Module made from
a transformers CausalLM that reads only its own submodules, so the other
weights may stay on the meta device; it holds those submodules (never their
tensors), so weights loaded after the piece is built are the ones it runs.

  EmbedPiece(m)    forward(input_ids int64 [1, n]) -> hidden f32 [1, n, H]
  LayerPiece(m, i) forward(hidden f32 [1, n, H], attention_mask int64 [1, T],
                           position_ids int64 [1, n], past_k f32 [1, kv, P, hd],
                           past_v f32 [1, kv, P, hd])
                   -> (hidden f32 [1, n, H], present_k [1, kv, T, hd], present_v [1, kv, T, hd])
  HeadPiece(m)     forward(hidden f32 [1, n, H]) -> logits f32 [1, n, V]
with T = P + n. attention_mask marks each physical KV slot visible (1) or
hidden (0, speculative rollback); position_ids are logical positions.

LayerPiece is generic: it calls transformers' own decoder layer with
  - position_embeddings (cos, sin) computed in-graph from position_ids with the
    model's rotary parameters (its own rotary class, per layer type for
    Gemma 3; longrope's short/long switch as an in-graph select);
  - an explicit boolean mask [1, 1, n, T]: visible AND causal over physical
    slots AND the layer's sliding window, if any (planner.architectures.layer_window);
  - a one-layer cache whose update() concatenates the past K/V given as inputs
    with the new ones and keeps the result as present K/V;
  - attention through `_attention`, registered as a transformers attention
    implementation on a private copy of the config: repeat_kv after the concat
    then F.scaled_dot_product_attention, the pattern OpenVINO's CPU
    StatefulSDPAFusion folds into one SDPA-with-KV-cache node once the exporter
    reads the past through Gather(ReadValue, beam_idx). Gemma 2's attention
    logit softcapping has no SDPA form: those layers run eager attention.
Only MoE experts are replaced (shards.moe.SparseExperts), since transformers'
expert loop depends on tensor values; the replacement runs each expert on the
tokens routed to it.

Everything here traces with f32 activations under OpenVINO's 16-bit path
(`__make_16bit_traceable`: nn.Linear / nn.Embedding keep 16-bit weights,
other parameters become f32): no Python branch on tensor values; the only
data-dependent shapes are the MoE experts' token rows (NonZero in the graph).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from engine.planner.architectures import ARCHITECTURES, check_supported, layer_window
from engine.shards.moe import SparseExperts, is_stacked_experts

ATTENTION_IMPL = "flotilla_shard"  # name of `_attention` in transformers' AttentionInterface


# -- attention ---------------------------------------------------------------


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # [b, kv, T, hd] -> [b, kv, g, T, hd] -> [b, kv*g, T, hd] (after the concat: keeps the SDPA fusion)
    if groups == 1:
        return x
    b, kv, t, hd = x.shape
    return x[:, :, None].expand(b, kv, groups, t, hd).reshape(b, kv * groups, t, hd)


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **_kwargs):
    """transformers attention-interface signature; query [b, heads, n, hd], key/value
    [b, kv, T, hd] (already past + new), attention_mask bool [b, 1, n, T]."""
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    if softcap is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    else:  # Gemma 2: scores -> tanh(scores / cap) * cap before the mask, as transformers' eager path
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        scores = torch.matmul(query, key.transpose(2, 3)) * scale  # [b, heads, n, T]
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(probs, value)
    return out.transpose(1, 2).contiguous(), None  # [b, n, heads, hd]


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_IMPL, _attention)


_register_attention()


class _PastKV:
    """The one Cache call a decoder layer makes, for explicit past K/V inputs."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor):
        self.key, self.value = key, value  # [1, kv, P, hd]; present after update(): [1, kv, P + n, hd]

    def update(self, key_states, value_states, layer_idx=None, cache_kwargs=None):
        self.key = torch.cat((self.key, key_states), dim=2)
        self.value = torch.cat((self.value, value_states), dim=2)
        return self.key, self.value


def visibility_mask(attention_mask: torch.Tensor, n: int, window: int | None) -> torch.Tensor:
    """attention_mask int64 [1, T] -> bool [1, 1, n, T]: the n queries sit in the last n physical slots."""
    total = attention_mask.shape[1]
    kv_idx = torch.arange(total, device=attention_mask.device)  # [T]
    q_idx = torch.arange(n, device=attention_mask.device) + (total - n)  # [n]
    allowed = kv_idx[None, :] <= q_idx[:, None]  # [n, T] causal
    if window is not None:
        allowed = allowed & (q_idx[:, None] - kv_idx[None, :] < window)
    visible = attention_mask[:, None, None, :] != 0  # [1, 1, 1, T]
    return visible & allowed[None, None]


# -- rotary embeddings -------------------------------------------------------


class Rope(nn.Module):
    """cos/sin [1, n, rotary_dim] from position_ids, as the model's rotary module computes them.

    The inverse frequencies come from a fresh instance of the model's own rotary
    class (config only, on CPU), so llama3 / yarn / linear scaling, Phi-3's
    partial rotary dim and Gemma 3's per-layer-type bases are transformers'.
    """

    def __init__(self, hf_model, layer_type: str | None):
        super().__init__()
        config = hf_model.config
        rotary_cls = type(hf_model.model.rotary_emb)
        with torch.device("cpu"):
            ref = rotary_cls(config, device="cpu")
        prefix = f"{layer_type}_" if layer_type and hasattr(ref, f"{layer_type}_inv_freq") else ""
        self.register_buffer("inv_freq", getattr(ref, f"{prefix}inv_freq").detach().float().clone(), persistent=False)
        self.scaling = float(getattr(ref, f"{prefix}attention_scaling"))
        params = config.rope_parameters[layer_type] if prefix else config.rope_parameters
        self.original_max: int | None = None
        if (params or {}).get("rope_type") == "longrope":
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            # transformers (dynamic_rope_update) uses the long factors for a call
            # whose max(position_ids) + 1 exceeds the pretraining length.
            self.original_max = int(params["original_max_position_embeddings"])
            kwargs = {"layer_type": layer_type} if prefix else {}
            long_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=self.original_max + 1, **kwargs)
            self.register_buffer("long_inv_freq", long_inv.detach().float().clone(), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq
        if self.original_max is not None:
            use_long = position_ids.max() + 1 > self.original_max  # bool scalar, in-graph
            inv_freq = torch.where(use_long, self.long_inv_freq, self.inv_freq)
        # [1, d/2, 1] @ [1, 1, n] -> [1, d/2, n] -> [1, n, d/2]
        inv = inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1)
        freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # [1, n, d]
        return emb.cos() * self.scaling, emb.sin() * self.scaling


# -- pieces ------------------------------------------------------------------


def _shallow_clone(module: nn.Module) -> nn.Module:
    """The same module with its own child table: replacing a child of the clone
    leaves transformers' model as it is (submodules and weights stay shared)."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    return clone


def _plain_embedding(src: nn.Embedding) -> nn.Embedding:
    """`src` as an exact nn.Embedding (OpenVINO's 16-bit path keeps only those
    weights 16-bit; Gemma's scaled subclass would be cast to f32). The parameter
    table is src's own dict, so weights loaded into src later are seen here."""
    if type(src) is nn.Embedding:
        return src
    emb = nn.Embedding(src.num_embeddings, src.embedding_dim, padding_idx=src.padding_idx, device="meta")
    emb._parameters = src._parameters
    return emb


class EmbedPiece(nn.Module):
    """Token embedding (x sqrt(H) for Gemma): input_ids int64 [1, n] -> hidden f32 [1, n, H]."""

    def __init__(self, hf_model):
        super().__init__()
        check_supported(hf_model.config)
        src = hf_model.model.embed_tokens
        self.embed = _plain_embedding(src)
        # Gemma's Gemma{2,3}TextScaledWordEmbedding multiplies by sqrt(hidden_size).
        self.scale = float(getattr(src, "scalar_embed_scale", 1.0))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids).float()
        return hidden * self.scale if self.scale != 1.0 else hidden


class HeadPiece(nn.Module):
    """Final norm + LM head (+ Gemma 2's final logit softcapping): hidden [1, n, H] -> logits f32 [1, n, V].

    A tied head is transformers' lm_head module, whose weight is the embedding
    matrix (the exporter's loader fills it from `model.embed_tokens.weight`).
    """

    def __init__(self, hf_model):
        super().__init__()
        check_supported(hf_model.config)
        self.norm = hf_model.model.norm
        self.lm_head = hf_model.lm_head
        self.softcap = getattr(hf_model.config, "final_logit_softcapping", None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden)).float()  # [1, n, V]
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class LayerPiece(nn.Module):
    """Decoder layer `index` with explicit KV: see the module docstring for I/O."""

    def __init__(self, hf_model, index: int):
        super().__init__()
        config = hf_model.config
        check_supported(config)
        layers = hf_model.model.layers
        if not 0 <= index < len(layers):
            raise ValueError(f"layer {index} is not inside [0, {len(layers)})")
        src = layers[index]
        self.index = index
        self.window = layer_window(config, index)
        layer_types = getattr(config, "layer_types", None)
        self.rope = Rope(hf_model, layer_types[index] if layer_types else None)
        self.softcapped = getattr(config, "attn_logit_softcapping", None) is not None

        layer = _shallow_clone(src)
        attn = _shallow_clone(src.self_attn)
        attn.config = copy.copy(src.self_attn.config)
        attn.config._attn_implementation_internal = ATTENTION_IMPL  # this clone only, not the model's config
        layer.self_attn = attn
        experts = getattr(src.mlp, "experts", None)
        if experts is not None:
            if not (ARCHITECTURES[config.model_type].moe and is_stacked_experts(experts)):
                raise ValueError(f"layer {index} of {config.model_type!r} has experts of an unknown layout")
            mlp = _shallow_clone(src.mlp)
            mlp.experts = SparseExperts(experts)
            layer.mlp = mlp
        self.layer = layer

    def forward(self, hidden, attention_mask, position_ids, past_k, past_v):
        mask = visibility_mask(attention_mask, hidden.shape[1], self.window)
        cos, sin = self.rope(position_ids)
        cache = _PastKV(past_k, past_v)
        out = self.layer(hidden, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                         use_cache=True, position_embeddings=(cos, sin))
        if isinstance(out, tuple):  # older decoder layers return (hidden, ...)
            out = out[0]
        return out, cache.key, cache.value


def piece_modules(hf_model, kind: str, index: int | None = None) -> list[tuple[str, nn.Module]]:
    """(module name, module) of transformers' model whose weights a piece reads:
    kind "embed", "layer" (with index) or "head"."""
    base = hf_model.model
    if kind == "embed":
        return [("model.embed_tokens", base.embed_tokens)]
    if kind == "head":
        return [("model.norm", base.norm), ("lm_head", hf_model.lm_head)]
    if kind == "layer" and index is not None:
        return [(f"model.layers.{index}", base.layers[index])]
    raise ValueError(f"unknown piece kind {kind!r}")
