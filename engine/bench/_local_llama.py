"""A random-weight Llama of real shape, written layer by layer as sharded bf16 safetensors.

`flotilla bench local` compares the local engine with openvino_genai on a model
big enough for memory and memory bandwidth to matter (a few MB demo model
measures nothing). The checkpoint looks like a real Hugging Face download:
config.json, generation_config.json, model-0000i-of-0000N.safetensors with a
model.safetensors.index.json, and a tokenizer whose length equals the model's
vocabulary (the demo BPE tokenizer padded with plain added tokens, so every id
the random model can emit detokenizes, in transformers and in openvino_genai).

It never holds the model in memory: tensor names and shapes come from a
meta-device model, each tensor is drawn (seeded by its name, so the result is
deterministic whatever the order) and written into its shard file, and a shard
is flushed once it reaches `shard_bytes`. Peak ≈ one shard + one tensor.
Built once into <FLOTILLA_CACHE or user cache>/bench-models/, through a
temporary folder renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

BUILDER_VERSION = 2  # bump when the output of a given shape changes


@dataclass(frozen=True)
class LlamaShape:
    """The dimensions of a random Llama (defaults: 0.90 B parameters, 1.8 GB in bf16)."""

    hidden: int = 2048  # hidden_size
    layers: int = 16  # num_hidden_layers
    intermediate: int = 6144  # intermediate_size of the SwiGLU MLP
    heads: int = 32  # num_attention_heads (head_dim = hidden / heads)
    kv_heads: int = 8  # num_key_value_heads (GQA)
    vocab: int = 32000  # vocab_size; the tokenizer is padded to exactly this
    tied: bool = False  # tie_word_embeddings
    seed: int = 14  # base seed of every tensor
    std: float = 0.02  # initializer_range: normal(0, std) for every matrix; norms are ones
    shard_bytes: int = 1 << 30  # flush a safetensors file once it holds this much

    @property
    def name(self) -> str:
        return (f"random-llama-h{self.hidden}-l{self.layers}-i{self.intermediate}-a{self.heads}"
                f"-kv{self.kv_heads}-v{self.vocab}")

    def fingerprint(self) -> str:
        blob = json.dumps({"v": BUILDER_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def parameters(self) -> int:
        head_dim = self.hidden // self.heads
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        layer = attn + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * layer + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


PRESETS: dict[str, LlamaShape] = {
    "random-llama-0.9b": LlamaShape(),
    # a few MB: what the bench's fast test runs
    "random-llama-tiny": LlamaShape(hidden=128, layers=2, intermediate=256, heads=4, kv_heads=2, vocab=4096),
}


def bench_models_root() -> Path:
    from engine.models.demo import cache_root

    return cache_root() / "bench-models"


def checkpoint_path(shape: LlamaShape) -> Path:
    return bench_models_root() / f"{shape.name}-{shape.fingerprint()}"


def ensure_random_llama(shape: LlamaShape, progress: Callable[[str], None] | None = None) -> Path:
    """The checkpoint folder of `shape`, built first if missing."""
    target = checkpoint_path(shape)
    if (target / "model.safetensors.index.json").exists():
        return target
    report = progress or (lambda _m: None)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        report(f"building {shape.name} ({shape.parameters() / 1e9:.2f} B parameters, bf16) into {target}")
        tok = padded_tokenizer(shape.vocab)
        config = _config(shape, tok)
        config.save_pretrained(tmp)
        _write_generation_config(tmp, config)
        tok.save_pretrained(tmp)
        write_weights(config, shape, tmp, report)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "model.safetensors.index.json").exists():  # else another build won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


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
        raise ValueError(f"vocab {vocab} is smaller than the demo tokenizer ({size})")
    for i in range(size, vocab):
        table[f"<r{i}>"] = i  # printable ASCII: the byte-level decoder maps it to itself
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                  eos_token=base.eos_token, pad_token=base.pad_token, bos_token=None,
                                  clean_up_tokenization_spaces=False)
    tok.chat_template = base.chat_template
    return tok


def _config(shape: LlamaShape, tok):
    import torch
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096, rms_norm_eps=1e-5, initializer_range=shape.std,
        tie_word_embeddings=shape.tied, bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        architectures=["LlamaForCausalLM"], dtype=torch.bfloat16,
    )


def _write_generation_config(out: Path, config) -> None:
    gen = {"do_sample": False, "eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


def write_weights(config, shape: LlamaShape, out: Path, report: Callable[[str], None]) -> None:
    """Draw every tensor in bf16 and write sharded safetensors + the index, one shard in RAM at a time."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    tensors = [(n, tuple(t.shape)) for n, t in meta.state_dict().items()
               if not (shape.tied and n == "lm_head.weight")]
    del meta
    # Plan the files first (sizes are known), so the names carry the final count.
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in tensors:
        nbytes = 2 * _numel(dims)
        if groups[-1] and size + nbytes > shape.shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, dims))
        size += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        part = {name: _draw(name, dims, shape) for name, dims in group}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in part.values())
        weight_map.update({name: fname for name in part})
        del part
        report(f"  wrote {fname}")
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _numel(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _draw(name: str, dims: tuple[int, ...], shape: LlamaShape):
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(dims, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(shape.seed * 1_000_003 + zlib.crc32(name.encode()))
    return (torch.randn(dims, generator=g, dtype=torch.float32) * shape.std).to(torch.bfloat16)
