"""The sparse engine's cache budget follows the MoE engine's rule: decided once attention and
embeddings are loaded, from what this process may still take, after the KV reserve; a budget
that does not fit is refused with both numbers, in one line."""

from __future__ import annotations

import pytest

from engine.runtime.budget import CODE_RESIDENT_BYTES
from engine.sparse import engine as sparse_engine
from engine.sparse.cache import BudgetError
from engine.sparse.engine import SparseConfig, SparseEngine, kv_reserve_bytes


def test_kv_reserve_is_context_times_requests():
    from transformers import LlamaConfig

    c = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32)
    assert kv_reserve_bytes(c, 4096, 2) == 2 * 32 * 8 * 128 * 4 * 4096 * 2


def test_auto_budget_is_what_is_left_and_fits(wide_model_bf16, monkeypatch):
    monkeypatch.setattr(sparse_engine, "memory_room", lambda: 400 * 10**6)
    with SparseEngine(wide_model_bf16, "t", SparseConfig(sparsity=0.5, context_length=256)) as eng:
        st = eng.stats()
        left = 400 * 10**6 - st["kv_reserve_bytes"] - st["working_bytes"] - CODE_RESIDENT_BYTES
        assert st["cache_budget_bytes"] == min(left, eng.backend.layout.num_layers * eng.backend.layout.neurons
                                               * eng.backend.rt.store.cache_slot_bytes)
        assert eng.context_length == 256


def test_a_budget_above_what_fits_is_refused_with_both_numbers(wide_model_bf16, monkeypatch):
    monkeypatch.setattr(sparse_engine, "memory_room", lambda: 100 * 10**6)
    with pytest.raises(BudgetError) as e:
        SparseEngine(wide_model_bf16, "t", SparseConfig(sparsity=0.5, cache_budget_bytes=90 * 10**6,
                                                        context_length=256))
    msg = str(e.value)
    assert "90 MB does not fit" in msg and "100 MB free" in msg and "\n" not in msg
