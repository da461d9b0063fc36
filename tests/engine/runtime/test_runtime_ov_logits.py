"""logits_to_keep: the IR computes only the logits asked for, and they are the model's own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

ov = pytest.importorskip("openvino")

from engine.models import ensure_demo  # noqa: E402
from engine.runtime.ov_backend import IR_NAME, OVConfig, OVModel, ensure_ir  # noqa: E402
from engine.runtime.ov_logits import LOGITS_TO_KEEP, add_logits_to_keep, find_lm_head  # noqa: E402

EXACT = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
IDS = np.array([[5, 17, 99, 4, 250, 8, 61, 3, 42, 7]], np.int64)  # [1, 10]


@pytest.fixture(scope="module")
def ir() -> Path:
    return ensure_ir(ensure_demo("demo"))


def _feed(n: int) -> dict[str, np.ndarray]:
    return {"input_ids": IDS[:, :n], "attention_mask": np.ones((1, n), np.int64),
            "position_ids": np.arange(n, dtype=np.int64)[None], "beam_idx": np.zeros(1, np.int32)}


def _logits(compiled, keep: int | None, n: int = 10) -> np.ndarray:
    req = compiled.create_infer_request()
    req.reset_state()
    feed = _feed(n)
    if keep is not None:
        feed[LOGITS_TO_KEEP] = np.array([keep], np.int64)
    req.infer(feed)
    return req.get_tensor("logits").data.copy()  # [1, rows, vocab]


def test_kept_rows_are_the_full_models_rows(ir: Path) -> None:
    core = ov.Core()
    full = _logits(core.compile_model(str(ir / IR_NAME), "CPU", EXACT), None)  # the unsliced IR
    model = core.read_model(str(ir / IR_NAME))
    assert add_logits_to_keep(model)
    sliced = core.compile_model(model, "CPU", EXACT)
    assert full.shape[:2] == (1, 10)
    every = _logits(sliced, 0)
    np.testing.assert_allclose(every, full, rtol=0, atol=1e-5)
    last = _logits(sliced, 1)
    assert last.shape == (1, 1, full.shape[2])
    np.testing.assert_allclose(last[0, 0], full[0, -1], rtol=0, atol=1e-5)
    three = _logits(sliced, 3)
    np.testing.assert_allclose(three[0], full[0, -3:], rtol=0, atol=1e-5)
    assert _logits(sliced, 50).shape[1] == 10  # more than n: every position
    assert _logits(sliced, 1, n=1).shape[1] == 1  # a decode step


def test_adding_twice_adds_one_input(ir: Path) -> None:
    model = ov.Core().read_model(str(ir / IR_NAME))
    assert add_logits_to_keep(model) and add_logits_to_keep(model)
    names = [n for p in model.get_parameters() for n in p.get_output_tensor(0).get_names()]
    assert names.count(LOGITS_TO_KEEP) == 1


def test_a_model_without_an_lm_head_is_left_alone() -> None:
    import openvino.opset13 as ops

    x = ops.parameter(ov.PartialShape([-1, -1, 8]), ov.Type.f32, name="x")
    y = ops.relu(x)
    y.output(0).get_tensor().set_names({"logits"})
    model = ov.Model([y], [x], "no-matmul")
    assert find_lm_head(model) is None
    assert not add_logits_to_keep(model)
    assert len(model.get_parameters()) == 1


def test_local_engine_streams_get_the_last_row_and_others_every_row(ir: Path) -> None:
    core = ov.Core()
    full = _logits(core.compile_model(str(ir / IR_NAME), "CPU", EXACT), None)
    m = OVModel(ir, OVConfig(precision="f32"))
    try:
        assert m.logits_to_keep and LOGITS_TO_KEEP in m.input_names
        stream = m.new_stream()
        np.testing.assert_allclose(stream.prefill(IDS[0].tolist()), full[0, -1], rtol=0, atol=1e-5)
        assert stream.req.get_tensor("logits").shape[1] == 1  # only the last row was computed
        # what speculative verify steps use: a request from `compiled` sees every position
        np.testing.assert_allclose(_logits(m.compiled, None), full, rtol=0, atol=1e-5)
    finally:
        m.close()
