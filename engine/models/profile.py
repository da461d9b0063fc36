"""Model profiles: the numbers planners need, read without loading weights.

Sizes come from the safetensors headers (shape x dtype of every tensor, i.e.
the bytes really stored), grouped by decoder layer. When there are no headers
(OpenVINO IR, pytorch_model.bin) they are computed from config.json and then
scaled so that they add up to the real size of the weight files: a compressed
(int8/int4) IR is smaller than its config suggests, and a planner must see the
bytes a peer will actually hold.

Tied embeddings: when the LM head shares the embedding matrix, head_bytes
still counts that matrix. A pipeline puts the embedding on the first stage and
the head on the last one, usually different peers, and each shard then holds
its own copy (the OpenVINO shard export duplicates it). So
    embedding_bytes + sum(bytes_per_layer) + head_bytes
          == total_bytes + (embedding matrix if tied_embeddings)
and total_bytes stays the bytes on disk, what a single-node runtime needs.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from engine.models.errors import ModelError
from engine.models.ref import ResolvedModel, read_safetensors_header, safetensors_files

PROFILE_VERSION = 1

# `model.layers.3.` (Llama family), `transformer.h.3.` (GPT-2), `...blocks.3.`.
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
# Per-expert tensors `mlp.experts.5.up_proj.weight` (Qwen-MoE, Mixtral's
# block_sparse_moe.experts.5.w1, OLMoE) versus the stacked layout of
# transformers 5 in memory: `mlp.experts.gate_up_proj` of shape [E, 2I, H].
_EXPERT_ONE = re.compile(r"\.experts\.(\d+)\.")
_EXPERT_STACKED = re.compile(r"\.experts\.[A-Za-z_]+(?:\.weight|\.bias)?$")
_EMBED_KEYS = ("embed_tokens", "wte", "wpe", "word_embeddings", "embed_positions", "embed_in")
_HEAD_MATRIX = ("lm_head.", "embed_out.")

_DTYPE_NAMES = {"float32": 4, "float": 4, "float64": 8, "double": 8, "bfloat16": 2,
                "float16": 2, "half": 2}
# Used when config.json has no context length at all: a conservative value
# that keeps KV-cache estimates meaningful rather than zero.
_DEFAULT_CONTEXT = 2048


@dataclass(frozen=True)
class ExpertInfo:
    """Mixture-of-experts layout (per MoE layer; all MoE layers are alike)."""

    num_experts: int  # routed experts per MoE layer
    top_k: int  # experts each token is routed to
    bytes_per_expert: int  # one routed expert of one layer (gate + up + down)
    shared_expert_bytes: int  # always-on shared expert(s) + their gate, per MoE layer; 0 if none
    moe_layers: tuple[int, ...]  # indices of decoder layers that have experts


@dataclass(frozen=True)
class ModelProfile:
    """Shape and size of a causal LM, as planners and the UI need them."""

    model_id: str  # display name from ResolvedModel
    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # config model_type, e.g. "llama"
    num_layers: int  # decoder layers
    hidden_size: int  # residual stream width
    intermediate_size: int  # dense FFN width (MoE models: the config value, may be unused)
    num_heads: int  # attention (query) heads
    num_kv_heads: int  # key/value heads (GQA); == num_heads for MHA
    head_dim: int  # per-head width
    vocab_size: int  # tokenizer / embedding rows
    dtype_bytes: int  # bytes per weight element from config dtype (4 f32, 2 bf16/f16)
    bytes_per_layer: tuple[int, ...]  # stored weight bytes of each decoder layer
    embedding_bytes: int  # token (and position) embeddings
    head_bytes: int  # lm_head + final norm (+ the embedding matrix again if tied)
    total_bytes: int  # all weight bytes on disk (shared matrices once)
    kv_bytes_per_token: int  # f32 KV cache for one token over all layers
    max_context: int  # max_position_embeddings (or equivalent)
    tied_embeddings: bool = False  # lm_head shares the embedding matrix
    experts: ExpertInfo | None = None  # None for dense models

    def kv_bytes(self, tokens: int, dtype_bytes: int = 4) -> int:
        """KV cache bytes for `tokens` tokens with `dtype_bytes` per element."""
        return int(tokens) * 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def layer_range_bytes(self, start: int, end: int) -> int:
        """Weight bytes of the half-open layer range [start, end)."""
        return sum(self.bytes_per_layer[start:end])

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (tuples become lists)."""
        d = asdict(self)
        d["bytes_per_layer"] = list(self.bytes_per_layer)
        if self.experts is not None:
            d["experts"]["moe_layers"] = list(self.experts.moe_layers)
        d["version"] = PROFILE_VERSION
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelProfile:
        """Inverse of to_dict; unknown keys are ignored, missing ones rejected."""
        if not isinstance(data, dict):
            raise ModelError("malformed model profile: expected a JSON object")
        if data.get("version", PROFILE_VERSION) != PROFILE_VERSION:
            raise ModelError(f"model profile version {data.get('version')} is not supported "
                             f"(expected {PROFILE_VERSION}); re-profile the model")
        try:
            kw = {f.name: data[f.name] for f in fields(cls) if f.name in data}
            missing = [f.name for f in fields(cls)
                       if f.name not in data and f.name not in ("tied_embeddings", "experts")]
            if missing:
                raise ModelError(f"malformed model profile: missing {', '.join(missing)}")
            kw["bytes_per_layer"] = tuple(int(b) for b in kw["bytes_per_layer"])
            exp = kw.get("experts")
            if exp is not None:
                kw["experts"] = ExpertInfo(
                    num_experts=int(exp["num_experts"]), top_k=int(exp["top_k"]),
                    bytes_per_expert=int(exp["bytes_per_expert"]),
                    shared_expert_bytes=int(exp["shared_expert_bytes"]),
                    moe_layers=tuple(int(i) for i in exp["moe_layers"]))
            return cls(**kw)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelError(f"malformed model profile: bad field ({e})") from None


def profile_model(resolved: ResolvedModel) -> ModelProfile:
    """Profile a resolved model from its config and weight headers."""
    config = _text_config(_read_config(resolved.path))
    shape = _shape(config)
    L = shape["num_layers"]
    files = safetensors_files(resolved.path) if resolved.weights_format == "safetensors" else []
    if files:
        parts = _from_headers(files, L)
    else:
        parts = _from_config(config, shape, _weights_size(resolved))
    per_layer, embed, head, embed_matrix, total, tied, expert = parts
    if tied:
        head += embed_matrix
    experts = _experts(config, L, expert)
    kv = 2 * L * shape["num_kv_heads"] * shape["head_dim"] * 4
    return ModelProfile(
        model_id=resolved.model_id, architecture=resolved.architecture,
        model_type=str(config.get("model_type") or "unknown"),
        dtype_bytes=_dtype_bytes(config), bytes_per_layer=tuple(per_layer),
        embedding_bytes=embed, head_bytes=head, total_bytes=total,
        kv_bytes_per_token=kv, tied_embeddings=tied, experts=experts,
        max_context=int(_first(config, "max_position_embeddings", "n_positions",
                               "max_sequence_length", "seq_length") or _DEFAULT_CONTEXT),
        **shape)


# --------------------------------------------------------------------------- config

def _read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {path / 'config.json'}: {e}") from None


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    # Some causal LMs nest the decoder numbers under text_config.
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        return {**config["text_config"], "architectures": config.get("architectures")}
    return config


def _first(config: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if config.get(k) is not None:
            return config[k]
    return None


def _shape(config: dict[str, Any]) -> dict[str, int]:
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    heads = _first(config, "num_attention_heads", "n_head")
    if not (layers and hidden and heads):
        raise ModelError("config.json lacks num_hidden_layers / hidden_size / num_attention_heads; "
                         "cannot profile this model")
    kv = _first(config, "num_key_value_heads", "num_kv_heads", "n_head_kv")
    if kv is None:
        kv = 1 if config.get("multi_query") else heads
    return dict(
        num_layers=int(layers), hidden_size=int(hidden),
        intermediate_size=int(_first(config, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden),
        num_heads=int(heads), num_kv_heads=int(kv),
        head_dim=int(config.get("head_dim") or hidden // heads),
        vocab_size=int(config.get("vocab_size") or 0),
    )


def _dtype_bytes(config: dict[str, Any]) -> int:
    name = _first(config, "dtype", "torch_dtype")
    return _DTYPE_NAMES.get(str(name).replace("torch.", ""), 4) if name else 4


# --------------------------------------------------------------------------- headers

def _from_headers(files: list[Path], num_layers: int):
    per_layer = [0] * num_layers
    embed = head = embed_matrix = total = 0
    has_head_matrix = False
    expert: dict[int, dict[str, Any]] = {}  # layer -> counters, see _count_expert
    for f in files:
        for name, info in read_safetensors_header(f).items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            nbytes = int(end) - int(begin)
            total += nbytes
            m = _LAYER.search(name)
            if m and int(m.group(1)) < num_layers:
                i = int(m.group(1))
                per_layer[i] += nbytes
                _count_expert(expert.setdefault(i, {}), name[m.end():], info, nbytes)
            elif any(k in name for k in _EMBED_KEYS):
                embed += nbytes
                if "embed_tokens" in name or "wte" in name or "word_embeddings" in name or "embed_in" in name:
                    embed_matrix += nbytes
            else:
                # lm_head, final norm, and anything else outside the layers
                # (e.g. multi-token-prediction heads) sits with the head.
                head += nbytes
                has_head_matrix |= name.startswith(_HEAD_MATRIX) or ".lm_head." in name
    return per_layer, embed, head, embed_matrix, total, not has_head_matrix, expert


def _count_expert(acc: dict[str, Any], suffix: str, info: dict[str, Any], nbytes: int) -> None:
    """Accumulate the MoE tensors of one layer (suffix = name after `layers.i.`)."""
    one = _EXPERT_ONE.search("." + suffix)
    if one:
        e = int(one.group(1))
        acc.setdefault("per_expert", {}).setdefault(e, 0)
        acc["per_expert"][e] += nbytes
    elif _EXPERT_STACKED.search("." + suffix) and info.get("shape"):
        # Stacked [E, ...]: one expert's share is nbytes / E.
        n = int(info["shape"][0])
        acc["stacked"] = acc.get("stacked", 0) + nbytes // max(n, 1)
        acc["stacked_n"] = n
    elif "shared_expert" in suffix:
        acc["shared"] = acc.get("shared", 0) + nbytes


def _experts(config: dict[str, Any], num_layers: int, counted: dict[int, dict[str, Any]]) -> ExpertInfo | None:
    n = _first(config, "num_experts", "num_local_experts", "n_routed_experts")
    top_k = _first(config, "num_experts_per_tok", "moe_topk", "top_k")
    if not n or not top_k:
        return None
    moe_layers = sorted(i for i, c in counted.items() if c.get("per_expert") or c.get("stacked"))
    if moe_layers:
        c = counted[moe_layers[0]]
        per = c.get("per_expert")
        bytes_per_expert = max(per.values()) if per else int(c["stacked"])
        shared = int(c.get("shared", 0))
    else:  # no headers: the config-based estimate left its numbers here
        est = counted.get(-1, {})
        moe_layers = _config_moe_layers(config, num_layers)
        bytes_per_expert = int(est.get("expert", 0))
        shared = int(est.get("shared", 0))
    return ExpertInfo(num_experts=int(n), top_k=int(top_k), bytes_per_expert=bytes_per_expert,
                      shared_expert_bytes=shared, moe_layers=tuple(moe_layers))


def _config_moe_layers(config: dict[str, Any], num_layers: int) -> list[int]:
    """Which layers are sparse, by the rules of each family's config."""
    if not _first(config, "num_experts", "num_local_experts", "n_routed_experts"):
        return []
    if "first_k_dense_replace" in config:  # DeepSeek
        freq = int(config.get("moe_layer_freq") or 1)
        k = int(config["first_k_dense_replace"] or 0)
        return [i for i in range(num_layers) if i >= k and i % freq == 0]
    step = int(config.get("decoder_sparse_step") or 1)  # Qwen2/3-MoE; Mixtral/OLMoE: all
    dense = set(config.get("mlp_only_layers") or [])
    return [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]


# --------------------------------------------------------------------------- config estimate

def _weights_size(resolved: ResolvedModel) -> int:
    path = resolved.path
    if resolved.weights_format == "openvino":
        files = [path / "openvino_model.bin"]
    else:
        files = sorted(path.glob("pytorch_model*.bin"))
    return sum(f.stat().st_size for f in files if f.is_file())


def _from_config(config: dict[str, Any], s: dict[str, int], actual_total: int):
    """Parameter counts of a Llama/Qwen/Mixtral-style decoder, in bytes.

    Approximate for other families; scaled to the real weight-file size so
    compressed IRs are not overestimated.
    """
    H, I, hd = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    q, kv = s["num_heads"] * hd, s["num_kv_heads"] * hd
    mt = str(config.get("model_type") or "")
    bias = bool(config.get("attention_bias") or config.get("qkv_bias")) or mt in ("qwen2", "qwen2_moe")
    attn = H * q + 2 * H * kv + q * H + ((q + 2 * kv) if bias else 0)
    norms = 2 * H + (2 * hd if mt.startswith("qwen3") else 0)
    dense_mlp = 3 * H * I
    moe = set(_config_moe_layers(config, s["num_layers"]))
    n_exp = int(_first(config, "num_experts", "num_local_experts", "n_routed_experts") or 0)
    im = int(_first(config, "moe_intermediate_size") or I)
    expert = 3 * H * im
    shared_i = int(config.get("shared_expert_intermediate_size") or 0)
    shared = (3 * H * shared_i + H) if shared_i else 0
    layers = [attn + norms + ((n_exp * H + n_exp * expert + shared) if i in moe else dense_mlp)
              for i in range(s["num_layers"])]
    embed = s["vocab_size"] * H
    tied = bool(config.get("tie_word_embeddings", False))
    head = H + (0 if tied else s["vocab_size"] * H)
    params = sum(layers) + embed + head
    # Bytes per parameter: the real file size when known, else the config dtype.
    scale = actual_total / params if actual_total else float(_dtype_bytes(config))
    b = lambda x: int(round(x * scale))  # noqa: E731
    total = actual_total or b(params)
    est = {-1: {"expert": b(expert), "shared": b(shared)}}
    return [b(x) for x in layers], b(embed), b(head), b(embed), total, tied, est


__all__ = ["ExpertInfo", "ModelProfile", "profile_model", "PROFILE_VERSION"]
