"""engine/sparse/quality.py, checked for what it claims:

1. its teacher-forced simulation (transformers' dense model with every FFN
   restricted to |act(g)| > tau, and in predicted mode also to the own predictor's
   set) is what the sparse engine computes -- the engine's logits, through its
   store, cache and reads, equal the simulation's, prefill and decode alike;
2. its figures (top-1 agreement, perplexities, their change) are what an
   independent computation gives: the dense transformers model with a forward
   hook that recomputes each FFN from its raw weights, and the perplexity taken
   by hand from log-softmax, on the last 20 % of the corpus.

Nothing here depends on what the random-weight demo model says: only on two
computations of the same thing agreeing.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from engine.models.demo import CORPUS_PATH
from engine.sparse import quality
from engine.sparse.calibrate import CalibConfig, ensure_calibration
from engine.sparse.engine import SparseBackend, SparseConfig
from engine.sparse.weights import ffn_layout, mixed_linear

SPARSITY = 0.5  # the demo calibration test_sparse_engine.py uses too (built once, cached)
BUDGET = 600_000  # bytes: well below the demo's FFN, so bundles are evicted and read again
# The engine's decode (one token at a time, KV cache, gathered rows) and the simulation
# (whole sequence, full matrices) round differently: measured on this demo, the values a
# keep decision looks at (|act(g)|, the predictor's score) differ by up to 3.4e-6. A value
# that close to its cutoff falls either way, so the comparison runs with cutoffs placed
# in gaps of the sequence's values at least this far from every value:
MARGIN = 2e-5


@pytest.fixture(scope="module")
def demo(demo_dir):
    path = demo_dir("demo")
    assert ffn_layout(path).act == "silu"  # the independent FFN below is SwiGLU
    return path


@pytest.fixture(scope="module")
def calib(demo):
    return ensure_calibration(demo, CalibConfig(sparsity=SPARSITY))


@pytest.fixture(scope="module")
def tokenizer(demo):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo)


def _dense(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _held_out(tokenizer) -> list[list[int]]:
    """The last 20 % of the corpus in independent sequences of at most 256 tokens (the documented split)."""
    ids = tokenizer(CORPUS_PATH.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    held = ids[int(len(ids) * 0.8):]
    return [s for s in (held[i:i + 256] for i in range(0, len(held), 256)) if len(s) > 2]


def _mlps(model):
    return [layer.mlp for layer in model.model.layers]


def _restricting_hooks(model, calib, mode: str | None):
    """Forward hooks that replace each FFN's output by the restricted SwiGLU recomputed from
    its raw weights: y = W_down (silu(W_gate x) * keep * W_up x). mode None: no hooks (dense)."""
    if mode is None:
        return []

    def hook(l):
        def fn(mlp, args, _out):
            x = args[0]
            a = torch.nn.functional.silu(x @ mlp.gate_proj.weight.T)
            tau = calib.thresholds[l]
            keep = a.abs() > tau if tau > 0 else torch.ones_like(a, dtype=torch.bool)
            if mode == "predicted" and calib.own[l] is not None:
                keep = keep & calib.own[l].predict(x.reshape(-1, x.shape[-1])).reshape(a.shape)
            return (a * keep * (x @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
        return fn

    return [mlp.register_forward_hook(hook(l)) for l, mlp in enumerate(_mlps(model))]


def _logits(model, seqs, calib=None, mode=None) -> torch.Tensor:
    """Teacher-forced next-token logits of every position but each sequence's last: [T, V]."""
    hooks = _restricting_hooks(model, calib, mode)
    try:
        with torch.inference_mode():
            return torch.cat([model(input_ids=torch.tensor([s])).logits[0, :-1] for s in seqs])
    finally:
        for h in hooks:
            h.remove()


def _ppl(logits: torch.Tensor, labels: torch.Tensor) -> float:
    logp = torch.log_softmax(logits.double(), dim=-1)
    return math.exp(float(-logp.gather(1, labels[:, None]).mean()))


def _simulated(path, calib, mode, seqs) -> torch.Tensor:
    """quality.py's own simulation: its restricted forward on a dense model, its logits."""
    model = _dense(path)
    layout = ffn_layout(path)
    act = quality.activation(layout.act)
    for l, mlp in enumerate(_mlps(model)):
        mlp.forward = quality._restricted_forward(mlp, act, calib.thresholds[l], calib.own[l], mode)
    return quality.held_out_logits(model, seqs)


def _gap_middle(values: torch.Tensor, cutoff: float, near: int = 256) -> tuple[float, float]:
    """(the middle of the widest gap among the `near` values either side of cutoff, half its width)."""
    v = torch.sort(values.flatten()).values
    i = int(torch.searchsorted(v, torch.tensor(float(cutoff))))
    w = v[max(i - near, 0): i + near]
    gaps = w[1:] - w[:-1]
    j = int(torch.argmax(gaps))
    return float(w[j] + w[j + 1]) / 2, float(gaps[j]) / 2


def _cutoffs_in_gaps(path, calib, mode, seq):
    """A copy of calib whose cutoffs (tau, and in predicted mode the own predictor's) each sit
    in the middle of a gap of the values that decision sees on seq, a hair from the calibrated
    one; and the smallest half-gap. Layer by layer: layer l's inputs depend on layers < l only."""
    c = copy.deepcopy(calib)
    model = _dense(path)
    act = quality.activation(ffn_layout(path).act)
    mlps = _mlps(model)
    margin = math.inf
    for l in range(len(mlps)):
        for m, mlp in enumerate(mlps):
            mlp.forward = quality._restricted_forward(mlp, act, c.thresholds[m], c.own[m], mode)
        seen = {}
        hook = mlps[l].register_forward_pre_hook(lambda _m, args: seen.setdefault("x", args[0][0]))
        with torch.inference_mode():
            model(input_ids=torch.tensor([seq]))
            hook.remove()
            x = seen["x"]  # [T, h]
            c.thresholds[l], half = _gap_middle(act(mixed_linear(x, mlps[l].gate_proj.weight)).abs(), c.thresholds[l])
            margin = min(margin, half)
            if mode == "predicted" and c.own[l] is not None:
                cut, half = _gap_middle(c.own[l](x), float(c.own[l].cutoff))
                c.own[l].cutoff.fill_(cut)
                margin = min(margin, half)
    return c, margin


# --------------------------------------------------------------------------- 1. simulation == engine
@pytest.mark.parametrize("mode", ["exact", "predicted"])
def test_the_simulation_is_what_the_engine_computes(demo, calib, tokenizer, mode):
    seq = _held_out(tokenizer)[0][:48]
    calib, margin = _cutoffs_in_gaps(demo, calib, mode, seq)
    assert margin >= MARGIN, f"no cutoff gap of {MARGIN} on this sequence (widest found: {margin})"
    sim = _simulated(demo, calib, mode, [seq])  # [47, V]
    dense = _logits(_dense(demo), [seq])
    assert not torch.allclose(sim, dense, atol=1e-2)  # the restriction really removes neurons

    be = SparseBackend(demo, SparseConfig(mode=mode, sparsity=SPARSITY, cache_budget_bytes=BUDGET, kv_precision="f32"))
    try:
        assert be.rt.calib is be.calib  # the runtime reads this calibration at every call
        be.calib.thresholds[:] = calib.thresholds
        for own, moved in zip(be.calib.own, calib.own):
            if own is not None:  # None in exact mode: the engine does not use the predictors there
                own.cutoff.copy_(moved.cutoff)
        assert be.rt.cache.capacity < be.layout.num_layers * be.layout.neurons  # not everything fits
        # prefill path: the whole sequence at once
        with torch.inference_mode():
            prefill = be.model(input_ids=torch.tensor([seq])).logits[0, :-1]
        # decode path (what serving runs): one token at a time, teacher-forced
        stream = be.new_stream()
        rows = [stream.prefill(seq[:1])] + [stream.decode(t) for t in seq[1:-1]]
        stream.close()
        decode = torch.from_numpy(np.stack(rows))
        assert be.rt.store.stats.bytes_read > 0  # the FFN rows came from the store
    finally:
        be.close()
    torch.testing.assert_close(prefill, sim, atol=1e-4, rtol=0)
    torch.testing.assert_close(decode, sim, atol=1e-4, rtol=0)


# --------------------------------------------------------------------------- 2. the figures
def test_figures_match_an_independent_computation(demo, calib, tokenizer):
    calib0 = ensure_calibration(demo, CalibConfig(sparsity=0.0))  # tau 0, no predictors: the dense model
    model = _dense(demo)
    seqs = _held_out(tokenizer)
    labels = torch.cat([torch.tensor(s[1:]) for s in seqs])
    dense = _logits(model, seqs)
    rows = quality.evaluate(demo, {"0.0": calib0, str(SPARSITY): calib}, model=model, tokenizer=tokenizer)

    # The model it was handed is given back unchanged: no FFN left patched.
    assert all("forward" not in vars(mlp) for mlp in _mlps(model))
    torch.testing.assert_close(_logits(model, seqs), dense, atol=0, rtol=0)

    assert [(r["sparsity"], r["mode"]) for r in rows] == [
        ("0.0", "exact"), ("0.0", "predicted"), (str(SPARSITY), "exact"), (str(SPARSITY), "predicted")]
    ppl_dense = _ppl(dense, labels)
    tol = 2 / len(labels)  # a near-tie may break either way between two float orders: two tokens at most
    for r in rows:
        what = f"{r['sparsity']} {r['mode']}"
        c = calib0 if r["sparsity"] == "0.0" else calib
        sparse = _logits(model, seqs, c, r["mode"])
        assert r["ppl_dense"] == pytest.approx(ppl_dense, rel=1e-5, abs=1e-3), what
        assert r["ppl_sparse"] == pytest.approx(_ppl(sparse, labels), rel=1e-4, abs=1e-3), what
        agree = float((sparse.argmax(-1) == dense.argmax(-1)).double().mean())
        assert r["top1_agreement"] == pytest.approx(agree, abs=tol), what
        assert r["ppl_change_pct"] == pytest.approx(100 * (r["ppl_sparse"] / r["ppl_dense"] - 1), abs=0.01), what
        if r["sparsity"] == "0.0":  # threshold 0 is the dense model
            assert r["top1_agreement"] == 1.0 and r["ppl_change_pct"] == 0.0, what
            assert r["ppl_sparse"] == pytest.approx(ppl_dense, rel=1e-5), what
