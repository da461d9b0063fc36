"""Weight compression of a shard's OpenVINO model with NNCF (data-free).

`export.export_shard` calls `compress_piece` for precision "int8" / "int4" on
every piece it traces (embedding, each layer, head) before stitching them, so
a compressed shard is the same graph (same inputs, outputs, KV states, beam_idx Gather) with its
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
                   group_size: int = INT4_GROUP_SIZE, all_layers: bool = False) -> Any:
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
            group_size=spec.group_size, ratio=spec.ratio, all_layers=all_layers,
            advanced_parameters=AdvancedCompressionParameters(
                group_size_fallback_mode=GroupSizeFallbackMode.ADJUST,
                min_adjusted_group_size=INT4_MIN_GROUP_SIZE,
            ),
        )
    return nncf.compress_weights(ov_model, **kwargs)


def compress_piece(ov_model: Any, precision: str, kind: str) -> Any:
    """Compress one piece of a streamed export (engine/shards/export.py).

    The exporter compresses a shard piece by piece, so NNCF never sees the
    whole model and cannot pick the embedding and the LM head for its int8
    backup by position; this does what it would do on the whole model:
    the layers go through NNCF (int8: INT8_ASYM; int4: INT4 on every MatMul —
    `all_layers`, the last MatMul of a piece is not the model's head); the
    embedding and head pieces (traced alone) get INT8_ASYM per row from
    `int8_rows`, which quantises a block of rows at a time: NNCF holds ~5x a
    weight's 16-bit size while compressing it (measured: 2.65 GB anonymous for
    the 0.5 GB embedding of a 128k vocabulary), more than a capped exporter
    has, while the embedding and head are the largest single weights.
    """
    if kind in ("embed", "head"):
        return compress_rows_int8(ov_model)
    return compress_model(ov_model, precision, all_layers=(precision == "int4"))


ROWS_PER_BLOCK = 8192  # rows quantised at once: 8192 x 8192 hidden = 256 MB in f32


def compress_rows_int8(ov_model: Any, min_elements: int = 4096) -> Any:
    """Replace every 2-D float Constant of at least `min_elements` (the embedding,
    LM head: [rows, H]) by INT8_ASYM with one scale and zero point per row, in
    NNCF's own decompression pattern (u8 -> Convert f16 -> Subtract zero point
    -> Multiply f16 scale -> Convert f32), which the plugins fold into their
    Gather / FullyConnected kernels."""
    import numpy as np
    import openvino as ov
    from openvino import opset13

    for const in [op for op in ov_model.get_ops() if op.get_type_name() == "Constant"]:
        etype = const.get_output_element_type(0)
        shape = list(const.get_output_shape(0))
        if etype not in (ov.Type.bf16, ov.Type.f16, ov.Type.f32) or len(shape) != 2 \
                or shape[0] * shape[1] < min_elements:
            continue
        data = const.get_data()  # shares the constant's memory; bf16 arrives as raw 16-bit words
        rows = shape[0]
        q = np.empty(shape, np.uint8)
        zp = np.empty((rows, 1), np.uint8)
        scale = np.empty((rows, 1), np.float16)
        for r0 in range(0, rows, ROWS_PER_BLOCK):
            block = data[r0:r0 + ROWS_PER_BLOCK]
            if etype == ov.Type.bf16:
                w = (block.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            else:
                w = block.astype(np.float32)
            lo = np.minimum(w.min(axis=1, keepdims=True), 0.0)  # [b, 1]; zero stays exact
            hi = np.maximum(w.max(axis=1, keepdims=True), 0.0)
            s16 = ((hi - lo) / 255.0).astype(np.float16)  # stored in f16, as NNCF does
            s16[s16 == 0] = 1.0  # an all-zero row (a padding embedding): q = z = 0 whatever the scale
            s = s16.astype(np.float32)  # quantise with the scale that is stored
            z = np.clip(np.round(-lo / s), 0, 255)
            q[r0:r0 + len(w)] = np.clip(np.round(w / s) + z, 0, 255).astype(np.uint8)  # [b, H]
            zp[r0:r0 + len(w)] = z.astype(np.uint8)
            scale[r0:r0 + len(w)] = s.astype(np.float16)
            del w
        name = const.get_friendly_name()
        deq = opset13.convert(opset13.constant(q, dtype=ov.Type.u8, name=name), ov.Type.f16)
        deq = opset13.subtract(deq, opset13.convert(opset13.constant(zp, dtype=ov.Type.u8), ov.Type.f16),
                               name=f"{name}/zero_point/subtract")
        deq = opset13.multiply(deq, opset13.constant(scale, dtype=ov.Type.f16), name=f"{name}/fq_weights")
        deq = opset13.convert(deq, ov.Type.f32)
        for target in list(const.output(0).get_target_inputs()):
            node = target.get_node()
            if node.get_type_name() == "Convert" and node.get_output_element_type(0) == ov.Type.f32:
                for t2 in list(node.output(0).get_target_inputs()):  # skip the old decompression
                    t2.replace_source_output(deq.output(0))
            else:
                target.replace_source_output(deq.output(0))
        del data
    ov_model.validate_nodes_and_infer_types()
    return ov_model


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
