"""The MoE engine keeps a checkpoint as it ships: a bf16 checkpoint gives a bf16 expert store of
the checkpoint's expert bytes and bf16 resident weights (q/k/v held once), computes what
transformers computes on those very weights (f32 math), reserves a bounded KV up front, and
turns bad input into one clear line."""

from __future__ import annotations

import json
import shutil
import threading

import numpy as np
import pytest
import torch

from engine.moe import engine as moe_engine
from engine.moe import model as moe_model
from engine.moe.convert import convert
from engine.moe.engine import MoEConfig, MoEEngine
from engine.moe.recipes import TINY_MIXTRAL_BF16, TINY_QWEN3_MOE_BF16
from engine.moe.store import BLOB_FILE, REST_FILE, ExpertStore, StoreError, align_up
from engine.protocol.messages import GenerateRequest, SamplingParams
from engine.runtime import stored, widen_kernel
from engine.runtime.stored import ALL_ROWS, linear
from engine.core.interface import EngineError

RECIPES = {"qwen3_moe": TINY_QWEN3_MOE_BF16, "mixtral": TINY_MIXTRAL_BF16}
NEW_TOKENS = 32
PROMPTS = ["Once upon a time", "The robot", "Hello there my friend"]


@pytest.fixture(scope="module")
def bf16_model():
    """bf16_model(arch) -> (checkpoint folder, store folder at the checkpoint's dtype)."""
    from engine.models.demo import ensure_recipe
    from engine.models.ref import resolve_model
    from engine.moe.convert import ensure_store

    made = {}

    def get(arch: str, weights: str | None = None):
        if (arch, weights) not in made:
            path = ensure_recipe(RECIPES[arch])
            made[(arch, weights)] = (path, ensure_store(path, resolve_model(str(path)).fingerprint, weights=weights))
        return made[(arch, weights)]

    return get


def _tensor_bytes(folder, experts: bool, skip: tuple[str, ...] = ()) -> int:
    """Bytes of the checkpoint's expert tensors (experts=True) or of all the others (but `skip`)."""
    from safetensors import safe_open

    total = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                if (".experts." in name) == experts and name not in skip:
                    t = h.get_slice(name)
                    n = {"BF16": 2, "F16": 2, "F32": 4}[t.get_dtype()]
                    for d in t.get_shape():
                        n *= d
                    total += n
    return total


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_bf16_checkpoint_gives_a_bf16_store_of_its_own_bytes(bf16_model, arch):
    path, store_dir = bf16_model(arch)
    index = ExpertStore(store_dir).index
    assert (index.dtype, index.source_dtype) == ("bf16", "bf16")
    assert {p.dtype for p in index.parts} == {"bf16"}
    expert = _tensor_bytes(path, experts=True)
    on_disk = (store_dir / BLOB_FILE).stat().st_size
    assert on_disk == len(index.blobs) * align_up(index.data_bytes)
    assert abs(on_disk - expert) <= 0.05 * expert, (on_disk, expert)
    rest = _tensor_bytes(path, experts=False)
    assert abs((store_dir / REST_FILE).stat().st_size - rest) <= 0.05 * rest


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_resident_weights_stay_bf16_and_are_held_once(bf16_model, arch):
    path, store_dir = bf16_model(arch)
    with MoEEngine(store_dir, "t", MoEConfig(torch_threads=1, max_concurrent=1, context_length=64)) as eng:
        model = eng.model
        for qkv in model.qkv:
            assert qkv.weight.dtype == torch.bfloat16
        assert model.model.lm_head.weight.dtype == torch.bfloat16
        assert model.model.model.embed_tokens.weight.dtype == torch.bfloat16
        assert all(lay.self_attn.q_proj is None for lay in model.layers)  # only the fused copy is kept
        emb = model.model.model.embed_tokens
        assert emb.mapped and not model.model.config.tie_word_embeddings  # a view of the file, read a row a token
        assert emb.weight.data_ptr() != model.model.lm_head.weight.data_ptr()
        rest = _tensor_bytes(path, experts=False, skip=("model.embed_tokens.weight",))
        # norms and routers are widened to f32 (a few KB here); nothing else is held twice or in f32,
        # and the untied embedding table is not held at all
        assert rest <= eng.memory["resident_bytes"] <= 1.05 * rest, (eng.memory, rest)


def _generate(store_dir, n_requests: int, **cfg):
    logits: dict[str, list[np.ndarray]] = {}
    lock = threading.Lock()

    def hook(sid, x):
        with lock:
            logits.setdefault(sid, []).append(x.copy())

    index = ExpertStore(store_dir).index
    config = MoEConfig(fetch_threads=2, torch_threads=1, kv_precision="f32", max_concurrent=4,
                       cache_budget_bytes=3 * index.top_k * index.blob_bytes, **cfg)
    with MoEEngine(store_dir, "t", config, logits_hook=hook) as eng:
        ids = [eng.submit(GenerateRequest(f"r{i}", prompt=PROMPTS[i % len(PROMPTS)],
                                          sampling=SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)))
               for i in range(n_requests)]
        out = {}
        for i, rid in enumerate(ids):
            events = list(eng.stream(rid, timeout=120))
            assert events[-1].error is None, events[-1].error
            out[rid] = (PROMPTS[i % len(PROMPTS)], [t for e in events for t in e.token_ids])
        tok = eng.tokenizer
    return out, logits, tok


def _reference_logits(path, tok, prompt: str, tokens: list[int]) -> np.ndarray:
    """transformers on the checkpoint's bf16 weights, widened to f32 (exactly): [steps, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok(prompt)["input_ids"]
    with torch.inference_mode():
        return model(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1:].numpy()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_bf16_logits_match_transformers_over_32_tokens(bf16_model, arch):
    path, store_dir = bf16_model(arch)
    out, logits, tok = _generate(store_dir, n_requests=3)
    for rid, (prompt, tokens) in out.items():
        assert len(tokens) == NEW_TOKENS
        ref = _reference_logits(path, tok, prompt, tokens)
        got = np.stack(logits[rid])
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
        assert tokens == ref.argmax(-1).tolist()


def test_int8_store_halves_the_expert_bytes_and_stays_close(bf16_model):
    path, store_dir = bf16_model("qwen3_moe", "int8")
    index = ExpertStore(store_dir).index
    assert (index.dtype, index.source_dtype) == ("int8", "bf16")
    expert = _tensor_bytes(path, experts=True)
    data = index.data_bytes * len(index.blobs)
    scales = sum(4 * p.shape[0] for p in index.parts if p.name.endswith("_scale")) * len(index.blobs)
    assert data <= expert / 2 + scales + 64 * len(index.blobs)
    out, logits, tok = _generate(store_dir, n_requests=1)
    (prompt, tokens), = out.values()
    ref = _reference_logits(path, tok, prompt, tokens)
    got = np.stack(next(iter(logits.values())))
    # per-row int8 keeps the logits within a few percent (RMS) of the bf16 model's
    rel = float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref ** 2)))
    assert rel <= 0.05, rel


def test_the_engine_gives_torch_threads_back_when_it_closes(bf16_model):
    # torch's thread count is process-wide: an in-process engine (the app, the tests) that left it
    # at its own choice changed the numerics of everything that ran after it
    _, store_dir = bf16_model("qwen3_moe")
    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    with MoEEngine(store_dir, "t", MoEConfig(torch_threads=want, max_concurrent=1, context_length=32)):
        assert torch.get_num_threads() == want
    assert torch.get_num_threads() == before


def test_kv_reserve_is_fixed_up_front_and_a_long_prompt_is_refused(bf16_model):
    _, store_dir = bf16_model("qwen3_moe")
    cfg = MoEConfig(torch_threads=1, max_concurrent=2, context_length=48, fetch_threads=1)
    with MoEEngine(store_dir, "t", cfg) as eng:
        kv = eng.model.kv
        assert kv.k[0].dtype == torch.float16
        assert eng.memory["kv_reserve_bytes"] == kv.nbytes == (2 * eng.model.num_layers * 2 * eng.model.kv_heads
                                                               * 48 * eng.model.head_dim * 2)
        shapes = [tuple(t.shape) for t in kv.k]
        ids = [eng.submit(GenerateRequest(f"r{i}", prompt="Hello", sampling=SamplingParams(max_tokens=8)))
               for i in range(5)]  # more requests than KV slots: they wait in line
        for rid in ids:
            assert list(eng.stream(rid, timeout=60))[-1].error is None
        long = eng.submit(GenerateRequest("long", prompt="word " * 200, sampling=SamplingParams(max_tokens=4)))
        last = list(eng.stream(long, timeout=60))[-1]
        assert last.finish_reason == "error" and "context" in last.error
        assert [tuple(t.shape) for t in kv.k] == shapes  # nothing grew


def test_a_budget_above_what_fits_is_refused_with_both_numbers(bf16_model, monkeypatch):
    _, store_dir = bf16_model("qwen3_moe")
    monkeypatch.setattr(moe_engine, "memory_room", lambda: 200 * 10**6)
    with pytest.raises(EngineError) as e:
        MoEEngine(store_dir, "t", MoEConfig(cache_budget_bytes=150 * 10**6, torch_threads=1, max_concurrent=1))
    msg = str(e.value)
    assert "150 MB does not fit" in msg and "200 MB free" in msg and "\n" not in msg
    monkeypatch.setattr(moe_engine, "memory_room", lambda: 10**6)
    with pytest.raises(EngineError, match="no room for the expert cache"):
        MoEEngine(store_dir, "t", MoEConfig(torch_threads=1, max_concurrent=1))


def _sharded_copy(src, dst):
    """The bf16 checkpoint saved as two safetensors files with an index, as the hub ships it."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    names = sorted(tensors)
    half = len(names) // 2
    files = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, part in files.items():
        save_file({n: tensors[n] for n in part}, str(dst / fname))
        weight_map.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


def test_a_sharded_checkpoint_converts_and_a_missing_file_is_one_line(bf16_model, tmp_path):
    path, store_dir = bf16_model("qwen3_moe")
    sharded = _sharded_copy(path, tmp_path / "ckpt")
    out = convert(sharded, tmp_path / "store")
    assert (out / BLOB_FILE).read_bytes() == (store_dir / BLOB_FILE).read_bytes()
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(StoreError) as e:
        convert(sharded, tmp_path / "store2")
    assert "missing" in str(e.value) and "model-00002-of-00002.safetensors" in str(e.value)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "store2").exists()
    with pytest.raises(Exception) as e:
        MoEEngine.from_spec(str(sharded), MoEConfig(torch_threads=1))
    assert "model-00002-of-00002.safetensors" in str(e.value) and "\n" not in str(e.value)


def test_native_compute_multiplies_in_bf16_and_stays_near_the_f32_answer(bf16_model):
    """compute="native": the matmuls in the weights' bf16 (on any CPU; "auto" picks it only
    where the CPU has a bf16 kernel). Same weights, bf16 rounding: close to the f32
    reference, not equal to it; exact mode (f32 KV) keeps "auto" at f32.

    Judged per answer step over 16 steps, by the median and by most steps: this random
    model's router has near ties that bf16 rounding can cross, and where the
    rounding flips one, that step's logits belong to another expert, however right the
    matmuls are -- which steps flip depends on the CPU's bf16 kernel. A wrong product
    (another weight, a lost scale) is off at every step."""
    path, store_dir = bf16_model("qwen3_moe")
    seen: list[np.ndarray] = []
    cfg = MoEConfig(torch_threads=1, max_concurrent=1, context_length=64, compute="native")
    with MoEEngine(store_dir, "t", cfg, logits_hook=lambda _sid, x: seen.append(x.copy())) as eng:
        assert eng.memory["compute"] == "bf16" and eng.model.native_rows == ALL_ROWS
        assert all(q.native_rows == ALL_ROWS for q in eng.model.qkv)
        assert eng.model.model.lm_head.native_rows == ALL_ROWS
        events = eng.generate(GenerateRequest("n", prompt=PROMPTS[0],
                                              sampling=SamplingParams(max_tokens=16, ignore_eos=True)))
        tok = eng.tokenizer
    tokens = [t for e in events for t in e.token_ids]
    assert events[-1].error is None and len(tokens) == 16
    ref = _reference_logits(path, tok, PROMPTS[0], tokens)
    got = np.stack(seen)
    assert got.shape == ref.shape
    per_step = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert per_step.min() > 1e-3, per_step  # bf16 products: not the f32 path (within 1e-4 of it, above)
    assert np.median(per_step) < 0.03, per_step  # bf16 activations: a rounding, not another model
    assert (per_step < 0.05).mean() >= 0.75, per_step
    with MoEEngine(store_dir, "t", MoEConfig(torch_threads=1, max_concurrent=1, context_length=64,
                                             kv_precision="f32")) as exact:
        assert exact.memory["compute"] == "f32" and exact.model.native_rows == 0


@pytest.mark.parametrize("kernel", [True, False], ids=["bf16-kernel", "avx2-only"])
def test_auto_compute_follows_the_cpu(bf16_model, monkeypatch, kernel):
    """compute="auto" on a CPU with a bf16 kernel: every matmul may run in bf16. On one
    without (AVX2, faked here on any CPU): every matmul -- attention, experts, head -- is
    widened (native_rows 0, compute "f32"), a decode step's few rows by the widening kernels
    (an expert's FFN in one fused call; stored.linear picks by rows, its own tests) and the
    prompt's by blocks; the answer completes."""
    monkeypatch.setattr(stored, "native_matmul", lambda dtype: kernel)
    calls: list[tuple[int, int]] = []  # (rows, native_rows) of every matmul over a 16-bit weight
    widened: list[int] = []  # rows of every product the widening kernel ran

    def spy(x, w, scale=None, bias=None, native_rows=0):
        if w.dtype == torch.bfloat16:
            calls.append((x.numel() // x.shape[-1], native_rows))
        return linear(x, w, scale, bias, native_rows)

    def kernel_spy(x, w, scale=None):
        widened.append(x.shape[0])
        return matmul(x, w, scale)

    def expert_spy(x, rows, *args):
        fused.append(len(rows))
        return expert(x, rows, *args)

    matmul, expert, fused = widen_kernel.matmul, widen_kernel.expert, []
    monkeypatch.setattr(stored, "linear", spy)  # StoredLinear's matmuls
    monkeypatch.setattr(moe_model, "linear", spy)  # the experts'
    monkeypatch.setattr(widen_kernel, "matmul", kernel_spy)
    monkeypatch.setattr(widen_kernel, "expert", expert_spy)
    _path, store_dir = bf16_model("qwen3_moe")
    rows = ALL_ROWS if kernel else 0
    prompt = " ".join(PROMPTS * 3)  # more tokens than widen_kernel.ROWS: a prefill's matmuls
    with MoEEngine(store_dir, "t", MoEConfig(torch_threads=1, max_concurrent=1, context_length=128)) as eng:
        assert eng.memory["compute"] == ("bf16" if kernel else "f32")
        widened.clear()  # warm()'s
        fused.clear()
        events = eng.generate(GenerateRequest("n", prompt=prompt,
                                              sampling=SamplingParams(max_tokens=4, ignore_eos=True)))
    assert events[-1].error is None and sum(len(e.token_ids) for e in events) == 4
    assert {n for _r, n in calls} == {rows}
    assert any(r == 1 for r, _n in calls) and any(r > widen_kernel.ROWS for r, _n in calls)  # answer steps, prompt
    if kernel:
        assert fused == []  # bf16 products: torch's
    else:  # every product of up to ROWS rows went through the kernel, and no more
        assert sorted(widened) == sorted(r for r, _n in calls if r <= widen_kernel.ROWS)
        # the answer steps' experts in one fused call each, the prompt's through linear
        assert fused and max(fused) <= widen_kernel.ROWS
        assert any(r > widen_kernel.ROWS for r, _n in calls)


def test_an_unknown_compute_is_one_line(bf16_model):
    _path, store_dir = bf16_model("mixtral")
    with pytest.raises(EngineError) as e:
        MoEEngine(store_dir, "t", MoEConfig(torch_threads=1, max_concurrent=1, compute="fp8"))
    assert "compute must be one of auto, native, f32" in str(e.value) and "\n" not in str(e.value)
