"""Weight precision of the local engine's export: "auto", the cache key, and a real int8 export."""

from __future__ import annotations

import collections
import json
import struct
from pathlib import Path

import numpy as np
import pytest

ov = pytest.importorskip("openvino")

from engine.models import ensure_demo  # noqa: E402
from engine.runtime.errors import BackendError  # noqa: E402
from engine.runtime.ov_backend import IR_NAME, OVConfig, OVModel, ensure_ir, export_dir  # noqa: E402
from engine.runtime.ov_weights import WeightsError, checkpoint_dtype, resolve_weights  # noqa: E402


def _safetensors(path: Path, tensors: dict[str, tuple[str, int]]) -> None:
    """A header-only safetensors file: name -> (dtype, bytes); the data is zeros."""
    header, offset = {}, 0
    for name, (dtype, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": [nbytes // 2], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(offset))


def test_auto_is_the_checkpoints_own_dtype(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "float32"}))
    _safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": ("BF16", 4096), "norm": ("F32", 64)})
    _safetensors(tmp_path / "model-00002-of-00002.safetensors", {"b": ("BF16", 4096)})
    assert checkpoint_dtype(tmp_path) == "bf16"  # the bytes say bf16, whatever config.json says
    assert resolve_weights(tmp_path, "auto") == "bf16"
    assert resolve_weights(tmp_path, "int4") == "int4"
    only_config = tmp_path / "cfg"
    only_config.mkdir()
    (only_config / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert checkpoint_dtype(only_config) == "fp16"
    assert checkpoint_dtype(ensure_demo("demo")) == "f32"  # demo models are saved in f32: never cast


def test_formats_do_not_share_a_cache_folder(tmp_path: Path) -> None:
    src = ensure_demo("demo")
    folders = {w: export_dir(src, tmp_path, w) for w in ("f32", "bf16", "fp16", "int8", "int4")}
    assert len(set(folders.values())) == 5
    assert export_dir(src, tmp_path, "auto") == folders["f32"]
    assert all(f"-{w}-" in folders[w].name for w in folders)


def test_bad_labels_and_fixed_irs_are_refused() -> None:
    with pytest.raises(WeightsError) as e:
        resolve_weights(ensure_demo("demo"), "int3")
    assert e.value.code == "bad-weights"
    ir = ensure_ir(ensure_demo("demo"))
    assert ensure_ir(ir) == ir  # an IR folder is used as it is...
    with pytest.raises(BackendError, match="fixed when it was exported"):
        ensure_ir(ir, weights="int8")  # ...and cannot be re-quantized by asking


def _weight_types(xml: Path) -> collections.Counter:
    """Element type -> elements held in large constants (the weight matrices)."""
    counts: collections.Counter = collections.Counter()
    for op in ov.Core().read_model(str(xml)).get_ops():
        if op.get_type_name() == "Constant" and int(np.prod(op.shape)) >= 1024:
            counts[op.get_element_type().get_type_name()] += int(np.prod(op.shape))
    return counts


def test_int8_export_holds_int8_weights_and_still_answers(capsys: pytest.CaptureFixture) -> None:
    from engine.cli.main import main

    src = ensure_demo("demo")
    code = main(["chat", "--model", "demo", "--weights", "int8", "-p", "Tell me a story", "--max-tokens", "6",
                 "--precision", "f32"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert out.out.strip()  # an answer was streamed
    int8_ir = export_dir(src, None, "int8")
    types = _weight_types(int8_ir / IR_NAME)
    quantized = types["u8"] + types["i8"]
    floats = types["f32"] + types["f16"] + types["bf16"]
    assert quantized > 0 and quantized > 20 * floats, types  # the matrices are 8-bit; scales stay float
    f32_ir = ensure_ir(src)
    assert (int8_ir / "openvino_model.bin").stat().st_size < 0.4 * (f32_ir / "openvino_model.bin").stat().st_size
    # the int8 model's greedy tokens stay close to f32 ones (reported, not gated: 8-bit rounding)
    tokens = {}
    for label, ir in (("f32", f32_ir), ("int8", int8_ir)):
        m = OVModel(ir, OVConfig(precision="f32"))
        stream = m.new_stream()
        logits, picked = stream.prefill([5, 17, 99, 4, 250]), []
        for _ in range(6):
            picked.append(int(np.argmax(logits)))
            logits = stream.decode(picked[-1])
        assert np.isfinite(logits).all()
        tokens[label] = picked
        m.close()
    print(f"int8 vs f32 greedy tokens: {tokens}")
