"""Which transformers architectures the pipeline can shard, decided from the config alone.

`check_supported(config)` runs at plan time, before any weight is read, and
refuses with one line (`UnsupportedArchitecture`, code
"unsupported_architecture") what the shard pieces (engine/shards/pieces.py) cannot
trace faithfully. `layer_window(config, i)` says which layers attend through a
sliding window, the one per-family rule the pieces cannot read off a module:
transformers decides it in each model's forward (from `layer_types`, from
`sliding_window`, or never), not in the decoder layer.
"""

from __future__ import annotations

from dataclasses import dataclass


class UnsupportedArchitecture(ValueError):
    """A model the pipeline cannot shard; str(e) is one line naming the model type and what is supported."""

    code = "unsupported_architecture"


@dataclass(frozen=True)
class ArchSpec:
    """How one model_type's decoder is sharded."""

    window: str  # "layer_types": per layer from config.layer_types; "config": config.sliding_window on
    #              every layer (None = off); "none": the model never builds a sliding mask
    moe: bool = False  # some layers hold stacked experts (run on their routed tokens only, engine/shards/moe.py)


# model_type -> spec. Each is covered by tests/engine/shards/test_shard_pieces.py
# (pieces vs transformers) and test_pipeline_architectures.py (exported shards).
ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("none"),  # Llama 2/3.x, SmolLM, DeepSeek-R1-Distill-Llama
    "mistral": ArchSpec("config"),  # Mistral 7B, Mistral-Nemo, Ministral
    "qwen2": ArchSpec("layer_types"),  # Qwen2, Qwen2.5, DeepSeek-R1-Distill-Qwen
    "qwen3": ArchSpec("layer_types"),
    "gemma2": ArchSpec("layer_types"),  # local/global layers, attention + final logit softcapping
    "gemma3_text": ArchSpec("layer_types"),  # Gemma 3 text-only checkpoints (Gemma3ForCausalLM)
    "phi3": ArchSpec("config"),  # Phi-3, Phi-3.5, Phi-4, Phi-4-mini (fused qkv / gate_up)
    "qwen2_moe": ArchSpec("layer_types", moe=True),  # shared expert with a sigmoid gate
    "qwen3_moe": ArchSpec("config", moe=True),  # Qwen3-30B-A3B family
    "mixtral": ArchSpec("config", moe=True),
    "olmoe": ArchSpec("none", moe=True),
}

# Rope types whose frequencies the pieces compute in-graph exactly as transformers
# does. "longrope" switches between short and long factors on max(position_ids),
# done with a select in the graph. Refused: "dynamic" (NTK rescaled from the
# longest sequence seen so far, a state the exported graph cannot hold) and any
# type this code has not been checked against.
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")

# Multimodal model types whose text decoder alone is a supported type.
_TEXT_DECODER_OF = {"gemma3": "gemma3_text"}


def supported_model_types() -> list[str]:
    """model_type values the pipeline can shard, sorted."""
    return sorted(ARCHITECTURES)


def _refuse(model_type: str, reason: str) -> UnsupportedArchitecture:
    return UnsupportedArchitecture(
        f"model type {model_type!r} cannot be split into pipeline shards: {reason} "
        f"(supported: {', '.join(supported_model_types())})")


def rope_types(config) -> list[str]:
    """The rope type of every rope the config declares (one per layer type for Gemma 3)."""
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_type" in params or "rope_theta" in params:
        return [params.get("rope_type", "default")]
    per_layer_type = {p.get("rope_type", "default") for p in params.values() if isinstance(p, dict)}
    return sorted(per_layer_type) or ["default"]


def check_model_folder(path) -> None:
    """check_supported on a model folder's config.json, before any weight is read
    (plan time); raises UnsupportedArchitecture, or ModelError for an unreadable config."""
    from engine.models.checkpoint import read_config

    check_supported(read_config(path))


def check_supported(config) -> None:
    """Raise UnsupportedArchitecture unless the pipeline can shard a model of this config."""
    model_type = getattr(config, "model_type", None) or "unknown"
    if model_type not in ARCHITECTURES:
        if getattr(config, "is_encoder_decoder", False):
            raise _refuse(model_type, "an encoder-decoder model, not a decoder-only language model")
        if model_type in _TEXT_DECODER_OF:
            raise _refuse(model_type, f"a multimodal checkpoint; only its text-only sibling "
                                      f"({_TEXT_DECODER_OF[model_type]}) is supported")
        if getattr(config, "vision_config", None) is not None or getattr(config, "text_config", None) is not None:
            raise _refuse(model_type, "a multimodal model (vision tower + text decoder)")
        raise _refuse(model_type, "not a supported decoder-only architecture")
    for rope_type in rope_types(config):
        if rope_type not in ROPE_TYPES:
            raise UnsupportedArchitecture(
                f"model type {model_type!r} uses rope type {rope_type!r}, which pipeline shards cannot "
                f"reproduce (supported rope types: {', '.join(ROPE_TYPES)})")
    if getattr(config, "use_bidirectional_attention", False):
        raise _refuse(model_type, "bidirectional attention (an embedding model, not a causal language model)")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise _refuse(model_type, f"{heads} attention heads do not split into {kv_heads} KV-head groups")


def layer_window(config, index: int) -> int | None:
    """The sliding attention window of decoder layer `index`, or None when it sees every past slot.

    Mirrors the mask each model's forward builds: transformers' sliding mask lets
    query slot q see key slot k when q - window < k <= q.
    """
    spec = ARCHITECTURES[config.model_type]
    window = getattr(config, "sliding_window", None) or None  # Qwen2-MoE says 0 for "off"
    if spec.window == "none" or window is None:
        return None
    if spec.window == "layer_types":
        types = getattr(config, "layer_types", None)
        return window if types is not None and types[index] == "sliding_attention" else None
    return window
