"""The per-device compile settings: no blob cache on CPU, a (weightless) one where compiling is slow.

The device is faked: compile_config is a pure function of the device string,
so GPU/NPU/AUTO choices are checked on a machine that has none of them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.runtime.ov_compile import CompileConfigError, compile_config, wants_blob_cache


@pytest.mark.parametrize("device", ["CPU", "cpu", "HETERO:CPU", "MULTI:CPU"])
def test_cpu_compiles_from_the_ir_without_a_blob(device: str, tmp_path: Path) -> None:
    cfg = compile_config(device, cache_dir=tmp_path / "blobs")
    assert "CACHE_DIR" not in cfg and "CACHE_MODE" not in cfg
    assert not (tmp_path / "blobs").exists()  # not even the folder is made
    assert not wants_blob_cache(device)


def test_gpu_gets_a_weightless_blob_cache(tmp_path: Path) -> None:
    for device in ("GPU", "GPU.1"):
        cfg = compile_config(device, cache_dir=tmp_path / "blobs")
        assert cfg["CACHE_DIR"] == str(tmp_path / "blobs") and cfg["CACHE_MODE"] == "OPTIMIZE_SIZE"
    assert (tmp_path / "blobs").is_dir()


def test_npu_and_devices_that_may_land_on_a_gpu_get_a_cache(tmp_path: Path) -> None:
    npu = compile_config("NPU", cache_dir=tmp_path)
    assert npu["CACHE_DIR"] == str(tmp_path) and "CACHE_MODE" not in npu  # NPU: the plugin's own blob
    for device in ("AUTO", "AUTO:GPU,CPU", "HETERO:GPU,CPU"):
        assert compile_config(device, cache_dir=tmp_path)["CACHE_DIR"] == str(tmp_path)


def test_no_cache_dir_means_no_cache_anywhere() -> None:
    for device in ("CPU", "GPU", "NPU", "AUTO"):
        assert "CACHE_DIR" not in compile_config(device)


def test_precision_hints_and_threads() -> None:
    unpinned = {"ENABLE_CPU_PINNING": False}
    assert compile_config("CPU") == unpinned  # the device's own precision: no hint
    assert compile_config("CPU", "f32") == {**unpinned, "INFERENCE_PRECISION_HINT": "f32",
                                            "KV_CACHE_PRECISION": "f32"}
    assert compile_config("GPU.0", "f32") == {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
    # plugins without a KV-precision property get the math hint only
    assert compile_config("NPU", "f32") == {"INFERENCE_PRECISION_HINT": "f32"}
    assert compile_config("AUTO", "f32") == {"INFERENCE_PRECISION_HINT": "f32"}
    assert compile_config("CPU", "bf16") == {**unpinned, "INFERENCE_PRECISION_HINT": "bf16"}
    assert compile_config("CPU", threads=3) == {**unpinned, "INFERENCE_NUM_THREADS": 3}


def test_the_cpu_plugin_takes_the_config_and_does_not_pin_threads() -> None:
    """The properties are real plugin keys: a CPU compile with them runs and reports no pinning
    (pinning moves the caller of every infer() with sched_setaffinity; ov_compile.py has the figures)."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    x = ops.parameter([1, 4], ov.Type.f32, name="x")
    model = ov.Model([ops.relu(x)], [x], "tiny")
    for precision in ("default", "f32"):
        compiled = ov.Core().compile_model(model, "CPU", compile_config("CPU", precision))
        assert compiled.get_property("ENABLE_CPU_PINNING") is False
        out = compiled.create_infer_request().infer({"x": np.array([[-1.0, 2.0, -3.0, 4.0]], np.float32)})
        assert out[0].tolist() == [[0.0, 2.0, 0.0, 4.0]]


def test_unknown_precision_is_refused_with_a_code() -> None:
    with pytest.raises(CompileConfigError) as e:
        compile_config("CPU", "int3")
    assert e.value.code == "unknown-precision" and "int3" in str(e.value)


def test_one_thread_never_computes_in_bf16_on_amx(monkeypatch) -> None:
    """OpenVINO 2026.4's CPU plugin dies with SIGFPE running bf16 on one thread on AMX Xeons:
    where the plugin's default math is bf16 and the CPU has AMX (or cannot tell), a one-thread
    CPU compile asks for f32; an explicit bf16 on one thread is refused there; more threads,
    f32/f16, GPUs, CPUs without bf16 and bf16 CPUs known to lack AMX are untouched."""
    from engine.runtime import ov_compile
    from engine.runtime.ov_compile import single_thread_precision

    bf16_cpu, avx2_cpu = ("BF16", "FP32", "INT8"), ("FP32", "INT8")
    assert single_thread_precision("default", 1, bf16_cpu, amx=True) == "f32"
    assert single_thread_precision("default", 1, bf16_cpu, amx=None) == "f32"  # cannot tell: the safe side
    assert single_thread_precision("default", 1, bf16_cpu, amx=False) == "default"
    assert single_thread_precision("bf16", 1, bf16_cpu, amx=False) == "bf16"
    assert single_thread_precision("default", 1, avx2_cpu, amx=True) == "default"
    assert single_thread_precision("default", 2, bf16_cpu, amx=True) == "default"
    assert single_thread_precision("f16", 1, bf16_cpu, amx=True) == "f16"
    with pytest.raises(CompileConfigError, match="one CPU thread"):
        single_thread_precision("bf16", 1, bf16_cpu, amx=True)
    monkeypatch.setattr(ov_compile, "cpu_capabilities", lambda: bf16_cpu)
    monkeypatch.setattr(ov_compile, "cpu_has_amx", lambda: True)
    assert compile_config("CPU", threads=1)["INFERENCE_PRECISION_HINT"] == "f32"
    assert "INFERENCE_PRECISION_HINT" not in compile_config("CPU", threads=2)
    assert "INFERENCE_PRECISION_HINT" not in compile_config("GPU", threads=1)
    monkeypatch.setattr(ov_compile, "allowed_cpus", lambda: 1)  # as under `taskset -c 0`
    assert compile_config("CPU")["INFERENCE_PRECISION_HINT"] == "f32"
    monkeypatch.setattr(ov_compile, "cpu_has_amx", lambda: False)
    assert "INFERENCE_PRECISION_HINT" not in compile_config("CPU")


def test_this_machine_says_whether_it_has_amx() -> None:
    """On Linux the answer comes from /proc/cpuinfo's flags (a bool, never a guess)."""
    import sys

    from engine.runtime.ov_compile import cpu_has_amx

    if sys.platform.startswith("linux"):
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
        assert cpu_has_amx() is ("amx_bf16" in flags)
    else:
        assert cpu_has_amx() in (True, False, None)
