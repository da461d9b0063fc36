"""The MoE engine computes what transformers computes: logits within 1e-4 (f32)
and identical greedy tokens, for Mixtral, Qwen2-MoE (shared expert), OLMoE and
Qwen3-MoE, under every scheduler (and Bevy in one wave and in two), several cache sizes, 1 and 8 concurrent requests."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from engine.moe.engine import MoEConfig, MoEEngine
from engine.moe.store import ExpertStore
from engine.protocol.messages import GenerateRequest, SamplingParams

PROMPTS = ["Once upon a time", "The robot", "Hello there my friend", "A", "In the beginning of",
           "Story time", "What is the", "Tell me"]
NEW_TOKENS = 4
_REF: dict = {}


def _reference(path):
    if path not in _REF:
        from transformers import AutoModelForCausalLM

        _REF[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _REF[path]


def _run(store_dir, scheduler: str, budget_experts: int, n_requests: int):
    index = ExpertStore(store_dir).index
    logits: dict[str, list[np.ndarray]] = {}
    lock = threading.Lock()

    def hook(sid, x):
        with lock:
            logits.setdefault(sid, []).append(x.copy())

    cfg = MoEConfig(scheduler=scheduler, cache_budget_bytes=budget_experts * index.blob_bytes,
                    fetch_threads=2, torch_threads=1, kv_precision="f32", max_concurrent=8)
    with MoEEngine(store_dir, "t", cfg, logits_hook=hook) as eng:
        ids = [eng.submit(GenerateRequest(f"r{i}", prompt=PROMPTS[i % len(PROMPTS)],
                                          sampling=SamplingParams(max_tokens=NEW_TOKENS)))
               for i in range(n_requests)]
        out = {}
        for i, rid in enumerate(ids):
            events = list(eng.stream(rid, timeout=60))
            assert events[-1].error is None, events[-1].error
            out[rid] = (PROMPTS[i % len(PROMPTS)], [t for e in events for t in e.token_ids])
        tok = eng.tokenizer
    return out, logits, tok


def _check(path, out, logits, tok):
    model = _reference(path)
    for rid, (prompt, tokens) in out.items():
        ids = tok(prompt)["input_ids"]
        seq = torch.tensor([ids + tokens[:-1]])
        with torch.inference_mode():
            ref = model(seq).logits[0, len(ids) - 1:].numpy()  # [steps, vocab]
        got = np.stack(logits[rid])
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
        assert tokens == ref.argmax(-1).tolist()  # greedy = argmax of the reference logits
        with torch.inference_mode():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert tokens == gen[0, len(ids):].tolist()[:len(tokens)]


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "olmoe", "qwen3_moe"])
@pytest.mark.parametrize("scheduler", ["bevy", "bevy_one_wave", "bevy_two_waves", "on_demand", "prefetch", "resident"])
def test_matches_transformers(moe_model, arch, scheduler):
    path, store_dir = moe_model(arch)
    index = ExpertStore(store_dir).index
    total = len(index.blobs)
    budgets = [total] if scheduler == "resident" else [index.top_k, 3 * index.top_k, total]
    if arch == "qwen3_moe":  # fewer combinations: same code paths as OLMoE
        budgets = budgets[:1]
    for budget in budgets:
        for n in (1, 8):
            out, logits, tok = _run(store_dir, scheduler, budget, n)
            _check(path, out, logits, tok)
