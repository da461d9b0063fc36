"""The sparse engine: exact at threshold 0, the factory, budget changes mid-generation,
a too-small budget refused, predictors and overlap measured."""


import pytest
import torch

from engine.protocol.messages import GenerateRequest, SamplingParams
from engine.runtime.chat import prompt_ids
from engine.local.factory import EngineOptions, open_engine
from engine.core.interface import EngineError
from engine.sparse.engine import SparseConfig, SparseEngine
from engine_helpers import collect, reference_greedy

N = 24
PROMPT = "Once upon a time there was a small robot"


def greedy(rid, n=N):
    return GenerateRequest(rid, prompt=PROMPT, sampling=SamplingParams(max_tokens=n))


@pytest.mark.parametrize("spec,mode", [("demo", "exact"), ("demo", "predicted"), ("demo-qwen3", "exact")])
def test_threshold_zero_equals_dense_transformers(demo_dir, spec, mode):
    path = demo_dir(spec)
    budget = 400_000 if mode == "exact" else 600_000  # well below the FFN size: streaming happens
    cfg = SparseConfig(mode=mode, sparsity=0.0, cache_budget_bytes=budget, kv_precision="f32")  # transformers' KV
    with SparseEngine(path, spec, cfg) as eng:
        ref = reference_greedy(path, prompt_ids(eng.tokenizer, PROMPT), N)
        out, _, final = collect(eng.generate(greedy("a")))
        assert out == ref
        s = eng.stats()
        assert s["io"]["bytes_read"] > 0 and s["misses"] > 0


def test_relu_model_uses_natural_zeros_and_matches_dense(relu_model):
    # exact mode on a ReLU model: only neurons with relu(g) > 0 are read, output is the dense one
    cfg = SparseConfig(mode="exact", cache_budget_bytes=300_000, kv_precision="f32")
    with SparseEngine(relu_model, "relu", cfg) as eng:
        calib = eng.backend.calib
        assert calib.thresholds == [0.0] * 4 and 0.3 < calib.sparsity < 0.7
        ref = reference_greedy(relu_model, prompt_ids(eng.tokenizer, PROMPT), N)
        out, _, _ = collect(eng.generate(greedy("r")))
        assert out == ref
        s = eng.stats()["prefetch"]
        assert s["needed"] < 0.75 * 4 * 384 * (len(prompt_ids(eng.tokenizer, PROMPT)) + N)


def test_factory_opens_the_sparse_engine(demo_dir):
    demo_dir("demo")
    eng = open_engine("demo", "sparse", EngineOptions(cache_budget_bytes=3_000_000,
                                                      extra={"mode": "exact", "sparsity": 0.0}))
    try:
        assert eng.info.engine == "sparse"
        _, text, final = collect(eng.generate(greedy("f", 4)))
        assert final.finish_reason == "length"
    finally:
        eng.close()


def test_keys_and_values_are_16_bit_by_default(demo_dir):
    """An 8B Llama's context is 1 GiB of f32 KV; the engine reserves and keeps it at 16 bits (as the
    MoE engine), and at threshold 0 answers what dense transformers answers with 16-bit KV."""
    path = demo_dir("demo")
    base = dict(mode="exact", sparsity=0.0, cache_budget_bytes=400_000)
    with SparseEngine(path, "demo", SparseConfig(**base, kv_precision="f32")) as wide:
        wide_reserve = wide.stats()["kv_reserve_bytes"]
    with SparseEngine(path, "demo", SparseConfig(**base)) as eng:
        s = eng.stats()
        assert s["kv_precision"] == "f16" and s["kv_reserve_bytes"] * 2 == wide_reserve
        ids = prompt_ids(eng.tokenizer, PROMPT)
        out, _, final = collect(eng.generate(greedy("h")))
        assert out == reference_greedy(path, ids, N, kv_dtype=torch.float16)
        stream = eng.backend.new_stream(ids + out + ids)  # a follow-up: on the ended answer's kept cache
        assert stream.cached >= len(ids)
        assert {layer.keys.dtype for layer in stream.cache.layers} == {torch.float16}
        stream.close()
    with pytest.raises(EngineError, match="kv_precision must be one of f16, f32, not 'q4'"):
        SparseEngine(path, "demo", SparseConfig(**base, kv_precision="q4"))
    eng = open_engine("demo", "sparse", EngineOptions(precision="f32", cache_budget_bytes=400_000,
                                                      extra={"mode": "exact", "sparsity": 0.0}))
    try:  # exact math asked for: exact keys and values too
        assert eng.stats()["kv_precision"] == "f32" and eng.stats()["kv_reserve_bytes"] == wide_reserve
    finally:
        eng.close()


def test_budget_too_small_is_refused_with_the_minimum(demo_dir):
    path = demo_dir("demo")
    with pytest.raises(EngineError, match=r"minimum for this model and mode is .* \((\d+) bytes\)"):
        open_engine("demo", "sparse", EngineOptions(cache_budget_bytes=10_000,
                                                    extra={"mode": "exact", "sparsity": 0.0}))
    with SparseEngine(path, "demo", SparseConfig(mode="exact", sparsity=0.0, cache_budget_bytes=2_000_000)) as eng:
        minimum = eng.backend.min_budget
        with pytest.raises(EngineError, match=f"minimum is .*{minimum} bytes"):
            eng.set_cache_budget(minimum - 1)


def test_budget_moves_mid_generation_output_identical(demo_dir):
    path = demo_dir("demo")
    cfg = SparseConfig(mode="exact", sparsity=0.5, cache_budget_bytes=2_500_000)
    with SparseEngine(path, "demo", cfg) as eng:
        calm, _, _ = collect(eng.generate(greedy("calm", 40)))
        minimum = eng.backend.min_budget
        seen = []
        rid = eng.submit(greedy("moving", 40))
        ids = []
        for i, ev in enumerate(eng.stream(rid)):
            ids += ev.token_ids
            c = eng.runtime.cache
            seen.append((c.budget_bytes, c.used_rows * c.row_bytes))
            if i == 10:
                eng.set_cache_budget(minimum)  # down to the minimum
            if i == 25:
                eng.set_cache_budget(2_500_000)  # and back up
        assert ids == calm
        low = [u for b, u in seen[12:25]]
        assert max(low) <= minimum  # the cache's bytes followed the budget down
        assert seen[-1][0] > 2_000_000


def test_predictor_and_overlap_are_measured(demo_dir):
    from engine.sparse.calibrate import CalibConfig, ensure_calibration, summary
    from engine.sparse.profile import overlap_profile

    path = demo_dir("demo")
    s = summary(ensure_calibration(path, CalibConfig(sparsity=0.8)))
    for k in ("own_recall", "ahead_recall", "temporal_recall", "own_precision", "temporal_precision"):
        assert 0.0 < s[k] <= 1.0
    assert s["own_recall"] > s["temporal_recall"]  # random weights: little temporal locality
    prof = overlap_profile(path, 0.8)
    assert len(prof["layers"]) == 8
    for row in prof["layers"]:
        assert 0.0 < row["jaccard"] < 1.0 and abs(row["sparsity"] - 0.8) < 0.05


def test_the_trained_relu_demo_skips_its_zeros_and_matches_dense():
    # the shipped demo-relu (trained): exact mode reads only neurons with relu(g) > 0 and answers
    # what transformers answers; a trained ReLU FFN leaves most neurons at zero for each token
    from engine.models.demo import ensure_demo

    path = ensure_demo("demo-relu")
    cfg = SparseConfig(mode="exact", cache_budget_bytes=600_000, kv_precision="f32")
    with SparseEngine(path, "demo-relu", cfg) as eng:
        calib = eng.backend.calib
        assert calib.thresholds == [0.0] * 8 and calib.sparsity > 0.5
        ids = prompt_ids(eng.tokenizer, PROMPT)
        ref = reference_greedy(path, ids, N)
        out, _, _ = collect(eng.generate(greedy("t")))
        assert out == ref
        assert eng.stats()["prefetch"]["needed"] < 0.5 * 8 * 352 * (len(ids) + N)
