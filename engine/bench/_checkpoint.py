"""Random-weight checkpoints with the layer shapes of published models, built by streaming.

The one builder of every benchmark's random checkpoint (scale, moe, sparse, and the random
Llamas of local, serve and prompt-cache: PRESETS). `flotilla bench scale` needs a model of real size (Llama-3.1-8B: 16 GB in bf16) as a user
downloads it: several bf16 safetensors files, model.safetensors.index.json, a config.json
of the real transformers config class and a tokenizer. No hub is reachable, so the weights
are random (seeded, so the same spec always gives the same bytes) and the tokenizer is the
demo BPE tokenizer (engine/models/demo.py); the embedding and the head keep the model's own
128256 rows (config.vocab_size), the tokenizer only ever produces its first ids.

Streaming: each file's header is computed from the shapes first, then every tensor is
drawn in row blocks of at most BLOCK_ELEMENTS, converted to bf16 and appended, so building
16 GB needs a few hundred MB of RAM. The folder is built under a temporary name next to its
place in the cache and renamed when complete: a killed build leaves no half model (its
temporary folder is removed by the next build once its builder is gone). Free disk is
checked first.

Weights: every matrix ~ N(0, init_std) (the published initializer_range, 0.02), norms 1 (as
transformers initialises them). With 0.02 the residual stream stays O(10) over 32 layers and
the logits O(1): finite in bf16/fp16, with a different argmax at most positions.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

CHECKPOINT_FORMAT = 1  # bumped when the layout or the drawing of weights changes
BLOCK_ELEMENTS = 1 << 24  # elements drawn at once (64 MB of f32): bounds the builder's memory
MARKER = "flotilla-checkpoint.json"  # written last inside the folder: the build is complete
DISK_SLACK_BYTES = 256 << 20  # free space kept beyond the checkpoint itself


class CheckpointError(RuntimeError):
    """The checkpoint cannot be built; `code` is stable, str(e) is for people."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass(frozen=True)
class CheckpointSpec:
    """Shapes of a Llama-family decoder (transformers LlamaConfig), or of a Qwen3-MoE or
    Mixtral one (experts saved per expert, as the hub checkpoints ship), and how to draw it."""

    name: str  # folder name prefix in the cache, e.g. "llama-3.1-8b-shape"
    hidden_size: int  # model width
    intermediate_size: int  # MLP width
    num_layers: int  # decoder layers
    num_heads: int  # attention heads
    num_kv_heads: int  # K/V heads (grouped-query attention)
    vocab_size: int  # embedding / head rows (kept even when the tokenizer is smaller)
    tie_word_embeddings: bool = False  # the head reuses the embedding (Llama-3.2-1B)
    rope_theta: float = 500000.0  # rotary base (Llama 3)
    rope_scaling: dict[str, Any] | None = None  # Llama-3 long-context rotary scaling
    max_position_embeddings: int = 131072  # the model's trained context
    rms_norm_eps: float = 1e-5  # RMSNorm epsilon
    init_std: float = 0.02  # std of every weight matrix (initializer_range)
    seed: int = 0  # base seed; each tensor draws from its own seed derived from its name
    max_file_bytes: int = 5 * 10**9  # target size of one safetensors file (HF uses ~5 GB)
    extra: dict[str, Any] = field(default_factory=dict)  # more config fields, verbatim
    # MoE shapes (arch "qwen3_moe" or "mixtral"; "llama" is dense). Left at their defaults
    # they are not part of the digest, so dense checkpoints keep the folders they had.
    arch: str = "llama"
    num_experts: int = 0  # routed experts per layer
    top_k: int = 0  # experts per token
    expert_intermediate: int = 0  # one expert's FFN width (Qwen3 moe_intermediate_size)
    head_dim_override: int = 0  # Qwen3: head_dim is not hidden / heads (0: hidden / heads)
    # The demo tokenizer padded to vocab_size with plain tokens, so every id the random model
    # can emit detokenizes (openvino_genai's detokenizer and transformers' agree on each one):
    # what the side-by-side benchmarks with openvino_genai need. Left False, not in the digest.
    pad_tokenizer: bool = False

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden_size // self.num_heads

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every weight, in the order transformers saves them."""
        h = self.hidden_size
        q, kv, d = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.head_dim
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab_size, h))]
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            out += [(p + "input_layernorm.weight", (h,)),
                    (p + "self_attn.q_proj.weight", (q, h)),
                    (p + "self_attn.k_proj.weight", (kv, h)),
                    (p + "self_attn.v_proj.weight", (kv, h)),
                    (p + "self_attn.o_proj.weight", (h, q))]
            if self.arch == "qwen3_moe":
                out += [(p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,))]
            out.append((p + "post_attention_layernorm.weight", (h,)))
            out += self._ffn(p)
        out.append(("model.norm.weight", (h,)))
        if not self.tie_word_embeddings:
            out.append(("lm_head.weight", (self.vocab_size, h)))
        return out

    def _ffn(self, p: str) -> list[tuple[str, tuple[int, ...]]]:
        h = self.hidden_size
        if self.arch == "llama":
            i = self.intermediate_size
            return [(p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                    (p + "mlp.down_proj.weight", (h, i))]
        i, E = self.expert_intermediate, self.num_experts
        if self.arch == "qwen3_moe":
            out = [(p + "mlp.gate.weight", (E, h))]
            for e in range(E):
                x = f"{p}mlp.experts.{e}."
                out += [(x + "gate_proj.weight", (i, h)), (x + "up_proj.weight", (i, h)),
                        (x + "down_proj.weight", (h, i))]
            return out
        if self.arch == "mixtral":
            out = [(p + "block_sparse_moe.gate.weight", (E, h))]
            for e in range(E):
                x = f"{p}block_sparse_moe.experts.{e}."
                out += [(x + "w1.weight", (i, h)), (x + "w2.weight", (h, i)), (x + "w3.weight", (i, h))]
            return out
        raise CheckpointError("bad_spec", f"unknown architecture {self.arch!r} (llama, qwen3_moe, mixtral)")

    @property
    def expert_bytes(self) -> int:
        """Bytes of the routed experts in bf16 (0 for a dense model)."""
        return 2 * sum(_numel(s) for n, s in self.tensors() if ".experts." in n)

    @property
    def config_class(self) -> str:
        return {"llama": "LlamaConfig", "qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig"}[self.arch]

    @property
    def params(self) -> int:
        return sum(_numel(s) for _, s in self.tensors())

    @property
    def nbytes(self) -> int:
        """Bytes of the weights in bf16 (the files add a few KB of headers)."""
        return 2 * self.params

    def config(self, eos_token_id: int | None, pad_token_id: int | None) -> dict[str, Any]:
        """Arguments of transformers.LlamaConfig for this spec."""
        cfg = dict(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                   intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
                   num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                   head_dim=self.head_dim, max_position_embeddings=self.max_position_embeddings,
                   rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                   tie_word_embeddings=self.tie_word_embeddings, initializer_range=self.init_std,
                   bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                   hidden_act="silu", attention_bias=False, mlp_bias=False)
        if self.rope_scaling:
            cfg["rope_scaling"] = dict(self.rope_scaling)
        if self.arch != "llama":
            for k in ("intermediate_size", "mlp_bias"):
                cfg.pop(k)
            cfg.update(num_experts_per_tok=self.top_k)
        if self.arch == "qwen3_moe":
            cfg.update(num_experts=self.num_experts, moe_intermediate_size=self.expert_intermediate,
                       intermediate_size=self.intermediate_size, decoder_sparse_step=1, mlp_only_layers=[],
                       norm_topk_prob=True)
        elif self.arch == "mixtral":
            cfg.update(num_local_experts=self.num_experts, intermediate_size=self.expert_intermediate)
            cfg.pop("head_dim")
        cfg.update(self.extra)
        return cfg

    def digest(self) -> str:
        """Identity of the bytes this spec builds (shapes, seed, std, layout, tokenizer corpus)."""
        from engine.models.demo import _corpus_digest

        spec = asdict(self)
        for name, default in _LATER_DEFAULTS.items():  # older specs hash as they did before these fields
            if spec[name] == default:
                del spec[name]
        blob = json.dumps({"v": CHECKPOINT_FORMAT, "spec": spec, "corpus": _corpus_digest(),
                           "block": BLOCK_ELEMENTS}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def scaled(self, **changes: Any) -> "CheckpointSpec":
        """The same recipe with other shapes (tests: a model of a few MB)."""
        return replace(self, **changes)


_LATER_DEFAULTS = {"arch": "llama", "num_experts": 0, "top_k": 0, "expert_intermediate": 0,
                   "head_dim_override": 0, "pad_tokenizer": False}

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

# meta-llama/Llama-3.1-8B: 8.03 B parameters, 16.06 GB in bf16.
LLAMA_3_1_8B = CheckpointSpec("llama-3.1-8b-shape", hidden_size=4096, intermediate_size=14336, num_layers=32,
                              num_heads=32, num_kv_heads=8, vocab_size=128256,
                              rope_scaling={**_LLAMA3_ROPE, "factor": 8.0})
# meta-llama/Llama-3.2-1B: 1.24 B parameters (tied embeddings), 2.47 GB in bf16.
LLAMA_3_2_1B = CheckpointSpec("llama-3.2-1b-shape", hidden_size=2048, intermediate_size=8192, num_layers=16,
                              num_heads=32, num_kv_heads=8, vocab_size=128256, tie_word_embeddings=True,
                              rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}, max_file_bytes=2 * 10**9)


# Qwen/Qwen3-30B-A3B: 48 layers, 128 experts of width 768, top-8; 30.5 B parameters, 61 GB in bf16.
# Benchmarks build fewer layers (`scaled(num_layers=...)`) with the very same per-layer shapes.
QWEN3_30B_A3B = CheckpointSpec("qwen3-30b-a3b-shape", hidden_size=2048, intermediate_size=6144, num_layers=48,
                               num_heads=32, num_kv_heads=4, vocab_size=151936, rope_theta=1000000.0,
                               max_position_embeddings=40960, rms_norm_eps=1e-6, arch="qwen3_moe",
                               num_experts=128, top_k=8, expert_intermediate=768, head_dim_override=128,
                               max_file_bytes=4 * 10**9)
# mistralai/Mixtral-8x7B-v0.1: 32 layers, 8 experts of width 14336, top-2; 46.7 B parameters, 93 GB in bf16.
MIXTRAL_8X7B = CheckpointSpec("mixtral-8x7b-shape", hidden_size=4096, intermediate_size=14336, num_layers=32,
                              num_heads=32, num_kv_heads=8, vocab_size=32000, rope_theta=1000000.0,
                              max_position_embeddings=32768, arch="mixtral", num_experts=8, top_k=2,
                              expert_intermediate=14336, max_file_bytes=4 * 10**9)


# Random Llamas of the local-engine benchmarks (`bench local`, `serve`, `prompt-cache`): the
# local engine side by side with openvino_genai, so their tokenizer covers the vocabulary.
# 0.90 B parameters, 1.8 GB in bf16 (Llama-3.2-1B's widths, 16 layers, a 32k vocabulary).
RANDOM_LLAMA_0_9B = CheckpointSpec("random-llama-0.9b", hidden_size=2048, intermediate_size=6144, num_layers=16,
                                   num_heads=32, num_kv_heads=8, vocab_size=32000, rope_theta=10000.0,
                                   max_position_embeddings=4096, seed=14, max_file_bytes=1 << 30,
                                   pad_tokenizer=True)
PRESETS: dict[str, CheckpointSpec] = {
    "random-llama-0.9b": RANDOM_LLAMA_0_9B,
    # a few MB: what the benchmarks' own tests run
    "random-llama-tiny": RANDOM_LLAMA_0_9B.scaled(name="random-llama-tiny", hidden_size=128, intermediate_size=256,
                                                  num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=4096),
}


def bench_model(spec: str, report: Callable[[str], None] | None = None) -> str:
    """A benchmark's --model: a preset's folder (built first if missing), else the spec as given
    (a demo id or a model folder, resolved by the engine)."""
    if spec in PRESETS:
        return str(ensure_checkpoint(PRESETS[spec], report=report))
    return spec


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tensor_seed(base: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{base}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def file_layout(spec: CheckpointSpec) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Tensors grouped into files of at most max_file_bytes (a tensor never spans files)."""
    files: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in spec.tensors():
        nb = 2 * _numel(shape)
        if files[-1] and size + nb > spec.max_file_bytes:
            files.append([])
            size = 0
        files[-1].append((name, shape))
        size += nb
    return files


def _header(tensors: list[tuple[str, tuple[int, ...]]]) -> bytes:
    """A safetensors header: u64 length + JSON (padded with spaces to 8 bytes)."""
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        nb = 2 * _numel(shape)
        meta[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nb]}
        offset += nb
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_tensor(f, spec: CheckpointSpec, name: str, shape: tuple[int, ...]) -> None:
    """Draw one tensor block by block (bf16 bytes appended to f)."""
    import torch

    if len(shape) == 1:  # RMSNorm weights: ones, as transformers initialises them
        f.write(torch.ones(shape, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes())
        return
    gen = torch.Generator().manual_seed(_tensor_seed(spec.seed, name))
    rows, cols = shape
    step = max(1, BLOCK_ELEMENTS // cols)
    for r in range(0, rows, step):
        block = torch.empty((min(step, rows - r), cols), dtype=torch.float32)
        block.normal_(0.0, spec.init_std, generator=gen)
        f.write(block.to(torch.bfloat16).view(torch.int16).numpy().tobytes())


def checkpoint_root(cache: Path | None = None) -> Path:
    from engine.models.demo import cache_root

    return Path(cache) if cache is not None else cache_root() / "checkpoints"


def checkpoint_path(spec: CheckpointSpec, cache: Path | None = None) -> Path:
    return checkpoint_root(cache) / f"{spec.name}-{spec.digest()}"


def checkpoint_bytes(path: Path) -> int:
    """Bytes of a checkpoint's safetensors files."""
    return sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))


def is_built(path: Path) -> bool:
    return (Path(path) / MARKER).exists()


def ensure_checkpoint(spec: CheckpointSpec, cache: Path | None = None,
                      report: Callable[[str], None] | None = None) -> Path:
    """The folder of this spec's checkpoint, built first when missing (once, atomically)."""
    target = checkpoint_path(spec, cache)
    if is_built(target):
        return target
    say = report or (lambda _line: None)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(target)
    need = spec.nbytes + DISK_SLACK_BYTES
    free = shutil.disk_usage(target.parent).free
    if free < need:
        raise CheckpointError("disk_full", f"building {spec.name} needs {need / 1e9:.1f} GB free in "
                                           f"{target.parent}, only {free / 1e9:.1f} GB are")
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _build(spec, tmp, say)
        try:
            os.replace(tmp, target)
        except OSError:
            if not is_built(target):  # not another builder that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _remove_orphans(target: Path) -> None:
    """Temporary folders of builds whose process is gone (a killed build)."""
    for old in target.parent.glob(f".{target.name}.tmp-*"):
        try:
            pid = int(old.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
            if pid == os.getpid():
                raise ProcessLookupError
        except (ValueError, ProcessLookupError):
            shutil.rmtree(old, ignore_errors=True)
        except PermissionError:  # another user's live build
            pass


def padded_tokenizer(vocab: int):
    """The demo BPE tokenizer with its vocabulary padded to `vocab` entries.

    The padding entries go into the BPE vocabulary itself (no merge produces them, so
    encoding is unchanged; decoding knows them). As added tokens, 30 k of them would
    make every tokenizer load take seconds, which would be measured as engine load."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from engine.models.demo import _tokenizer

    base = _tokenizer("demo")
    spec = json.loads(base.backend_tokenizer.to_str())
    table = spec["model"]["vocab"]
    size = max(len(base), max(table.values()) + 1)
    if vocab < size:
        raise CheckpointError("bad_spec", f"vocab {vocab} is smaller than the demo tokenizer ({size})")
    for i in range(size, vocab):
        table[f"<r{i}>"] = i  # printable ASCII: the byte-level decoder maps it to itself
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                  eos_token=base.eos_token, pad_token=base.pad_token, bos_token=None,
                                  clean_up_tokenization_spaces=False)
    tok.chat_template = base.chat_template
    return tok


def _build(spec: CheckpointSpec, out: Path, say: Callable[[str], None]) -> None:
    import transformers

    from engine.models.demo import _tokenizer

    t0 = time.monotonic()
    tok = padded_tokenizer(spec.vocab_size) if spec.pad_tokenizer else _tokenizer("demo")
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    config = getattr(transformers, spec.config_class)(**spec.config(eos, pad))
    config.architectures = [spec.config_class.replace("Config", "ForCausalLM")]
    config.dtype = "bfloat16"
    config.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": eos,
                                                            "pad_token_id": pad}, indent=2))
    tok.save_pretrained(out)
    layout = file_layout(spec)
    names = [f"model-{k + 1:05d}-of-{len(layout):05d}.safetensors" for k in range(len(layout))]
    weight_map: dict[str, str] = {}
    total, done, shown = spec.nbytes, 0, -1
    say(f"building {spec.name}: {spec.params / 1e9:.2f} B parameters, {total / 1e9:.2f} GB bf16 "
        f"in {len(layout)} files -> {out.parent}")
    for fname, tensors in zip(names, layout):
        with open(out / fname, "wb") as f:
            f.write(_header(tensors))
            for name, shape in tensors:
                _write_tensor(f, spec, name, shape)
                weight_map[name] = fname
                done += 2 * _numel(shape)
                pct = int(100 * done / total)
                if pct // 10 != shown:
                    shown = pct // 10
                    say(f"  {spec.name}: {done / 1e9:.2f}/{total / 1e9:.2f} GB ({pct}%), "
                        f"{time.monotonic() - t0:.0f} s")
            f.flush()
            os.fsync(f.fileno())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / MARKER).write_text(json.dumps({"spec": asdict(spec), "digest": spec.digest(), "bytes": total,
                                          "files": names, "build_s": round(time.monotonic() - t0, 1)},
                                         indent=2))
