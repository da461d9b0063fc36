"""Weight compression of a shard's OpenVINO model with NNCF (data-free).

`export.export_shard` calls `compress_model` for precision "int8" / "int4"
after the shard is made stateful and before it is saved, so a compressed shard
is the same graph (same inputs, outputs, KV states, beam_idx Gather) with its
MatMul (and embedding Gather) weights stored as int8 / int4 plus scales and
decompressed in the graph (NNCF's "dequantize" format, which the CPU and GPU
plugins fold into their FullyConnected kernels). Activations, the KV cache
and the SDPA stay as they were, so the fused SDPA-with-KV-cache survives.

  int8  INT8_ASYM per output channel on every weight.
  int4  INT4_SYM (default) or INT4_ASYM with groups of `INT4_GROUP_SIZE`
        input channels; NNCF keeps the embedding and the LM head in int8
        (its default backup mode), which protects quality most. When a
        layer's input width is not a multiple of the group size, the group
        is shrunk to a divisor (NNCF's ADJUST fallback, not below 32) rather
        than failing.
No calibration data is used (no AWQ / scale estimation / GPTQ): shards are
exported on the user's PC from a model alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

COMPRESSED = ("int8", "int4")
INT4_GROUP_SIZE = 128  # input channels sharing one int4 scale (the usual choice for LLMs)
INT4_MIN_GROUP_SIZE = 32  # smallest group ADJUST may shrink to


@dataclass(frozen=True)
class CompressionSpec:
    """How one precision label maps onto nncf.compress_weights."""

    mode: str  # nncf.CompressWeightsMode value, e.g. "int8_asym"
    group_size: int | None  # input channels per scale (None: per output channel)
    ratio: float | None  # share of weights at `mode`, the rest at the backup int8 (int4 only)


def spec_for(precision: str, *, int4_mode: str = "int4_sym", group_size: int = INT4_GROUP_SIZE) -> CompressionSpec:
    if precision == "int8":
        return CompressionSpec("int8_asym", None, None)
    if precision == "int4":
        if int4_mode not in ("int4_sym", "int4_asym"):
            raise ValueError(f"int4 mode must be int4_sym or int4_asym, not {int4_mode!r}")
        if group_size <= 0:
            raise ValueError(f"group size must be positive, not {group_size}")
        return CompressionSpec(int4_mode, group_size, 1.0)
    raise ValueError(f"precision must be one of {COMPRESSED} to compress weights, not {precision!r}")


def compress_model(ov_model: Any, precision: str, *, int4_mode: str = "int4_sym",
                   group_size: int = INT4_GROUP_SIZE) -> Any:
    """Return `ov_model` with its weights compressed to `precision` ("int8" | "int4")."""
    try:
        import nncf
        from nncf.quantization.advanced_parameters import (
            AdvancedCompressionParameters,
            GroupSizeFallbackMode,
        )
    except ImportError as e:  # pragma: no cover - depends on the install
        raise RuntimeError(f"{precision} shards need NNCF weight compression: pip install nncf ({e})") from e

    spec = spec_for(precision, int4_mode=int4_mode, group_size=group_size)
    nncf.set_log_level(logging.WARNING)
    kwargs: dict[str, Any] = {"mode": nncf.CompressWeightsMode(spec.mode)}
    if spec.group_size is not None:
        kwargs.update(
            group_size=spec.group_size, ratio=spec.ratio,
            advanced_parameters=AdvancedCompressionParameters(
                group_size_fallback_mode=GroupSizeFallbackMode.ADJUST,
                min_adjusted_group_size=INT4_MIN_GROUP_SIZE,
            ),
        )
    return nncf.compress_weights(ov_model, **kwargs)


def weight_precisions(ov_model: Any) -> dict[str, int]:
    """Element type -> count of weight Constants feeding a Convert (compressed
    weights are stored as u8/i8/u4/i4 constants decompressed in-graph)."""
    counts: dict[str, int] = {}
    for op in ov_model.get_ops():
        if op.get_type_name() != "Constant":
            continue
        kind = op.get_output_element_type(0).get_type_name()
        if kind in ("u8", "i8", "u4", "i4"):
            counts[kind] = counts.get(kind, 0) + 1
    return counts
