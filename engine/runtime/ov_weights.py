"""Weight precision of a local OpenVINO export: the labels, "auto", and optimum's settings.

Labels are the team's: "f32", "bf16", "fp16", "int8", "int4" (the pipeline
exporter and planner use the same). "auto" is the checkpoint's own dtype (bf16
for a bf16 checkpoint, never f32 by default). optimum-intel on its own would
compress any model of 1 B parameters or more to int8 (`main_export` with no
OVConfig); Flotilla always passes an explicit one, so the export holds the
precision that was asked for and nothing else:

    f32   OVConfig(dtype="fp32")                               weights as f32
    bf16  the model loaded in bf16, OVConfig() with no dtype     bf16 constants
    fp16  OVConfig(dtype="fp16")                               fp16 constants
    int8  exported at the checkpoint's dtype, then NNCF int8_asym, one scale per output
          channel (what OVWeightQuantizationConfig(bits=8, sym=False) / `--weight-format int8` runs)
    int4  the same, then NNCF int4_sym in groups of 128, ratio 1.0 (`--weight-format int4 --sym
          --group-size 128`); NNCF keeps the embedding and the LM head at int8_asym, as optimum does

The cache folder of an export is keyed by the concrete label, so formats never
collide (engine.runtime.ov_backend.export_dir).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from engine.models.config_file import try_text_config

WEIGHT_LABELS = ("f32", "bf16", "fp16", "int8", "int4")  # most precise first
WEIGHT_CHOICES = ("auto",) + WEIGHT_LABELS  # what `flotilla chat --weights` accepts
_SAFETENSORS = {"F32": "f32", "BF16": "bf16", "F16": "fp16"}
_CONFIG = {"float32": "f32", "bfloat16": "bf16", "float16": "fp16"}
INT4_GROUP = 128  # int4 group size (optimum-intel's default)


class WeightsError(ValueError):
    """A weight label that is not one of WEIGHT_CHOICES (code: bad-weights)."""

    code = "bad-weights"


def checkpoint_dtype(src: Path) -> str:
    """The dtype holding most weight bytes in src's safetensors headers ("f32" | "bf16" | "fp16"),
    else config.json's dtype, else "f32". Reads headers only, never the weights."""
    counts: dict[str, int] = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        for name, info in _header(f).items():
            if name == "__metadata__" or not isinstance(info, dict):
                continue
            label = _SAFETENSORS.get(str(info.get("dtype")))
            begin, end = info.get("data_offsets", (0, 0))
            if label is not None:
                counts[label] = counts.get(label, 0) + int(end) - int(begin)
    if counts:
        return max(counts, key=lambda k: (counts[k], k))
    config = try_text_config(src)
    name = str(config.get("dtype") or config.get("torch_dtype") or "").replace("torch.", "")
    return _CONFIG.get(name, "f32")


def _header(path: Path) -> dict[str, Any]:
    """A safetensors file's JSON header (8-byte little-endian length, then JSON)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                return {}
            return json.loads(f.read(size))
    except (OSError, ValueError, struct.error):
        return {}


def resolve_weights(src: Path, weights: str = "auto") -> str:
    """The concrete label for an export of src: `weights`, or the checkpoint's dtype for "auto"."""
    if weights not in WEIGHT_CHOICES:
        raise WeightsError(f"weight precision {weights!r} is not one of {', '.join(WEIGHT_CHOICES)}")
    return checkpoint_dtype(src) if weights == "auto" else weights


def export_arguments(label: str, checkpoint: str) -> dict[str, Any]:
    """Keyword arguments for optimum's main_export giving float weights for `label`: the label
    itself for f32/bf16/fp16; for int8/int4 the base that `compress_ir` then quantizes (the
    checkpoint's own dtype, so no f32 copy of a 16-bit model is ever made)."""
    import torch
    from optimum.intel import OVConfig

    if label not in WEIGHT_LABELS:
        raise WeightsError(f"weight precision {label!r} is not one of {', '.join(WEIGHT_LABELS)}")
    if label in ("int8", "int4"):
        label = checkpoint if checkpoint in ("bf16", "fp16") else "f32"
    if label == "f32":
        return {"ov_config": OVConfig(dtype="fp32"), "model_loading_kwargs": {"torch_dtype": torch.float32}}
    if label == "fp16":
        return {"ov_config": OVConfig(dtype="fp16")}
    # An OVConfig with no dtype and no quantization: optimum neither casts nor compresses.
    return {"ov_config": OVConfig(), "model_loading_kwargs": {"torch_dtype": torch.bfloat16}}


def compress_ir(folder: Path, label: str, xml_name: str = "openvino_model.xml") -> None:
    """Quantize the weights of an exported IR in place for int8/int4 (a no-op for float labels),
    with the data-free NNCF compression optimum-intel applies for `--weight-format int8|int4`."""
    if label not in ("int8", "int4"):
        return
    import nncf
    import openvino as ov

    xml = Path(folder) / xml_name
    model = ov.Core().read_model(str(xml))
    if label == "int8":
        model = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
    else:
        model = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT4_SYM, group_size=INT4_GROUP,
                                      ratio=1.0)
    tmp = xml.with_name(".compressed-" + xml.name)
    ov.save_model(model, str(tmp), compress_to_fp16=False)
    del model
    tmp.with_suffix(".bin").replace(xml.with_suffix(".bin"))
    tmp.replace(xml)
