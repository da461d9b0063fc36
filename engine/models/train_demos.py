"""`flotilla models train-demos`: train the demo models on the demo corpus.

The recipe: the corpus of engine.models.demo_corpus (this interpreter's stdlib
+ the project's docs), a byte-level BPE tokenizer trained on its training split
(shared by every trained demo, so demo-draft can draft for demo), then each
demo's own architecture (the dimensions of its random recipe in
engine.models.demo) trained from a fixed seed with AdamW on random windows of
the token stream (half of each batch cut from chat-form text made from the same
files, engine.models.demo_chat, so a chat turn is answered and ended), on CPU,
in f32, one thread, deterministic algorithms — so a
rerun on the same machine, Python and torch rebuilds the same bytes (another
CPU or torch may round differently: the recipe JSON's held-out figures are the
tolerance to compare against).

Weights are stored as fp16 (half the bytes; trained values are small, well
inside fp16's range) and held-out figures are measured on those stored values;
engine.models.demo upcasts them to f32 when it builds the demo folder.
"""

from __future__ import annotations

import json
import math
import platform
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from engine.models.demo_chat import chat_pairs
from engine.models.demo_corpus import Corpus, build_corpus
from engine.models.demo_eval import eval_chunks, evaluate, router_stats
from engine.models.errors import ModelError

TRAINED_FORMAT = 1  # bumped when the layout of a trained folder or its recipe JSON changes
RECIPE_FILE = "flotilla-train.json"
STORAGE_DTYPE = "fp16"  # how weights are stored in assets; the demo folder upcasts to f32


@dataclass(frozen=True)
class TrainConfig:
    """How one demo is trained (defaults: the shipped weights' recipe)."""

    steps: int  # optimizer steps
    batch: int = 8  # sequences per step
    seq_len: int = 128  # tokens per sequence
    lr: float = 3e-3  # peak AdamW learning rate (small models take a high one)
    warmup: int = 50  # linear warm-up steps, then cosine decay to lr * final_lr_frac
    final_lr_frac: float = 0.1  # where the cosine ends
    weight_decay: float = 0.1  # AdamW decoupled weight decay on matrices
    grad_clip: float = 1.0  # global grad-norm clip: keeps the high lr stable
    seed: int = 1234  # torch seed for init and for the window sampler
    init_std: float = 0.02  # initializer_range while training (the random demos use 0.1)
    router_aux_coef: float = 0.001  # MoE load-balancing loss weight (Qwen2-MoE's default)
    threads: int = 1  # torch threads: fixed, results depend on the count
    chat_share: float = 0.5  # share of each batch's windows cut from chat-form text (engine.models.demo_chat)


# Steps per demo: 2-20 minutes each on one core of a shared 2-core EPYC (the 8-layer Llama
# needs the most tokens to read like Python; the 2-layer draft learns fastest per step).
DEFAULT_STEPS = {"demo": 1800, "demo-draft": 2500, "demo-qwen3": 1000, "demo-moe": 900, "demo-relu": 1800}
TRAIN_ORDER = ["demo", "demo-draft", "demo-qwen3", "demo-moe", "demo-relu"]
TOKENIZER_VOCAB = 2048  # as the random demos: embeddings stay a small part of a few MB


@dataclass
class TrainResult:
    """What one training run produced."""

    demo_id: str  # which demo
    out: Path  # the written folder
    recipe: dict[str, Any] = field(default_factory=dict)  # the recipe JSON written beside the weights


# --------------------------------------------------------------------------- tokenizer + data

def train_tokenizer(texts: list[str], vocab: int = TOKENIZER_VOCAB):
    """A byte-level BPE on the training texts, with the demos' special tokens and
    chat template. Deterministic: same texts, same merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from engine.models.demo import CHAT_TEMPLATE, SPECIAL_TOKENS

    bpe = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    # Whole files, not lines: newlines followed by indentation become tokens, as code needs.
    bpe.train_from_iterator(texts, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  bos_token=None, clean_up_tokenization_spaces=False)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tokenizer_digest(tok) -> str:
    """sha256[:16] of the tokenizer's serialised model: equal digests, same token ids."""
    import hashlib

    return hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()[:16]


def token_stream(tok, texts: list[str]):
    """One long int64 tensor: every text's ids followed by <|endoftext|>."""
    import torch

    sep = tok.convert_tokens_to_ids("<|endoftext|>")
    ids: list[int] = []
    for enc in tok(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(sep)
    return torch.tensor(ids, dtype=torch.long)


# --------------------------------------------------------------------------- training

def build_untrained(demo_id: str, tok, cfg: TrainConfig):
    """The demo's architecture (its random recipe's dimensions), freshly initialised."""
    import torch
    import transformers

    from engine.models.demo import RANDOM_RECIPES

    recipe = RANDOM_RECIPES[demo_id]
    config_cls = getattr(transformers, recipe.config_class)
    config = config_cls(vocab_size=len(tok), bos_token_id=None,
                        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                        **dict(recipe.config, initializer_range=cfg.init_std))
    if hasattr(config, "router_aux_loss_coef"):
        config.router_aux_loss_coef = cfg.router_aux_coef
    torch.manual_seed(cfg.seed)
    # eager attention: on this CPU its backward is faster than sdpa's for 128-token windows
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                         attn_implementation="eager")


def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (cfg.final_lr_frac + (1 - cfg.final_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def chat_token_stream(tok, pairs):
    """The chat pairs rendered in the demos' ChatML, as one token stream (the special
    tokens are single ids: the template's own)."""
    return token_stream(tok, [p.render() for p in pairs])


def _windows(stream, count: int, seq_len: int, gen) -> list:
    """`count` random windows of seq_len + 1 tokens of a stream."""
    import torch

    span = len(stream) - seq_len - 1
    if span <= 0:
        raise ModelError(f"corpus too small for seq_len {seq_len}: {len(stream)} tokens")
    starts = torch.randint(0, span, (count,), generator=gen)
    return [stream[s:s + seq_len + 1] for s in starts.tolist()]


def train_model(model, stream, cfg: TrainConfig, report: Callable[[str, float], None], label: str,
                chat_stream=None) -> dict:
    """AdamW on random windows of the token stream (and, for cfg.chat_share of each
    batch, of the chat stream); returns timing and the last losses."""
    import torch

    moe = bool(getattr(model.config, "num_experts", None))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    keep = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": keep, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed)
    n_chat = round(cfg.batch * cfg.chat_share) if chat_stream is not None else 0
    model.train()
    t0, losses = time.monotonic(), []
    # grad on explicitly: a process that ran an engine first may have turned it off globally
    # (the sparse engine calls torch.set_grad_enabled(False))
    with torch.enable_grad():
        for step in range(cfg.steps):
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, cfg)
            rows = _windows(stream, cfg.batch - n_chat, cfg.seq_len, gen)
            if n_chat:
                rows += _windows(chat_stream, n_chat, cfg.seq_len, gen)
            x = torch.stack(rows)  # [batch, seq_len + 1]
            kwargs = {"output_router_logits": True} if moe else {}
            out = model(input_ids=x[:, :-1], labels=x[:, :-1], **kwargs)  # HF shifts labels itself
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(out.loss.item())
            if step % 10 == 0 or step == cfg.steps - 1:
                el = time.monotonic() - t0
                eta = el / (step + 1) * (cfg.steps - step - 1)
                recent = sum(losses[-10:]) / len(losses[-10:])
                report(f"{label}: step {step + 1}/{cfg.steps} loss {recent:.3f} "
                       f"({el:.0f} s, ~{eta:.0f} s left)", (step + 1) / cfg.steps)
    return {"seconds": round(time.monotonic() - t0, 1),
            "final_train_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4)}


def _round_to_storage(model) -> None:
    """Replace every weight by its fp16-stored value, so figures measure what ships."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.float16).to(torch.float32))


def shipped_layout(state: dict[str, Any]) -> dict[str, Any]:
    """MoE experts as real checkpoints ship them, one tensor per expert and projection
    (transformers 5 stacks them only in memory; engine/models/checkpoint.py restacks):
    experts.gate_up_proj [E, 2I, H] -> experts.e.gate_proj / up_proj.weight [I, H] each,
    experts.down_proj [E, H, I] -> experts.e.down_proj.weight [H, I]."""
    out: dict[str, Any] = {}
    for name, t in state.items():
        if name.endswith(".experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith(".experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out


def save_trained(model, tok, out: Path, recipe: dict[str, Any]) -> None:
    """Write a trained demo folder: fp16 safetensors, config saying f32 (the dtype
    the demo folder runs at), tokenizer, generation config, recipe JSON."""
    import torch
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.config.dtype = "float32"
    model.config.architectures = [type(model).__name__]  # save_pretrained of a model writes it; config's alone does not
    model.config.save_pretrained(tmp)
    model.generation_config.do_sample = False
    model.generation_config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(dict(sorted(shipped_layout(state).items())), tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / RECIPE_FILE).write_text(json.dumps(recipe, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def train_demo(demo_id: str, corpus: Corpus, tok, stream, cfg: TrainConfig, out_root: Path,
               report: Callable[[str, float], None], chunks: list[str], chat_stream=None) -> TrainResult:
    """Train one demo and write it under out_root/demo_id."""
    import torch
    import transformers

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)
    try:
        model = build_untrained(demo_id, tok, cfg)
        untrained = evaluate(model, tok, chunks)
        timing = train_model(model, stream, cfg, report, demo_id, chat_stream=chat_stream)
        _round_to_storage(model)
        held = evaluate(model, tok, chunks)
        routing = router_stats(model, tok, chunks[:32])
    finally:  # a caller's process (a test, the app) keeps its own settings
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    recipe = {
        "format": TRAINED_FORMAT, "demo_id": demo_id, "train": asdict(cfg),
        "storage_dtype": STORAGE_DTYPE, "runtime_dtype": "f32",
        "corpus": corpus.manifest(), "train_tokens": len(stream), "tokenizer_sha256": tokenizer_digest(tok),
        "chat_tokens": 0 if chat_stream is None else len(chat_stream),
        "heldout": held, "heldout_untrained_init": untrained,
        "tokens_seen": cfg.steps * cfg.batch * cfg.seq_len, **timing,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "machine": platform.machine(),
    }
    if routing is not None:
        recipe["routing"] = routing
    out = out_root / demo_id
    save_trained(model, tok, out, recipe)
    return TrainResult(demo_id, out, recipe)


def shared_tokenizer_dir(out_root: Path) -> Path | None:
    """The trained demo folder in out_root whose tokenizer a partial run reuses (demo's first)."""
    for demo_id in TRAIN_ORDER:
        if (Path(out_root) / demo_id / "tokenizer.json").is_file():
            return Path(out_root) / demo_id
    return None


def train_demos(only: list[str] | None = None, steps: int | None = None, out_root: Path | None = None,
                report: Callable[[str, float], None] | None = None, max_train_bytes: int | None = None,
                overrides: dict[str, Any] | None = None, eval_count: int = 96) -> list[TrainResult]:
    """Train the demos named in `only` (default: all five) into out_root
    (default: assets/demo/trained). A run of all five trains the tokenizer; a run
    of some reuses the tokenizer already in out_root, so every demo there shares
    one (demo-draft drafts for demo). steps overrides DEFAULT_STEPS; overrides
    changes other TrainConfig fields (tests: a tiny batch)."""
    from engine.models.demo import TRAINED_ROOT, RANDOM_RECIPES

    ids = only or TRAIN_ORDER
    unknown = [i for i in ids if i not in RANDOM_RECIPES]
    if unknown:
        raise ModelError(f"unknown demo id(s): {', '.join(unknown)}; demos: {', '.join(TRAIN_ORDER)}")
    report = report or (lambda _m, _f: None)
    out_root = Path(out_root or TRAINED_ROOT)
    out_root.mkdir(parents=True, exist_ok=True)
    report("reading the corpus", 0.0)
    corpus = build_corpus(max_train_bytes=max_train_bytes)
    train_texts = corpus.texts(held_out=False)
    shared = None if set(ids) >= set(TRAIN_ORDER) else shared_tokenizer_dir(out_root)
    if shared is not None:
        # Some demos only: keep the one tokenizer the others in out_root were trained with
        # (the docs in the corpus change between commits, and so would a retrained tokenizer).
        from transformers import AutoTokenizer

        report(f"reusing the tokenizer of {shared}", 0.0)
        tok = AutoTokenizer.from_pretrained(shared)
        # loading adds "is_local" to what it saves: the same tokenizer must write the same
        # bytes whichever run trained it
        tok.init_kwargs.pop("is_local", None)
    else:
        report(f"training the tokenizer on {sum(len(t) for t in train_texts) / 1e6:.1f} M characters", 0.0)
        tok = train_tokenizer(train_texts)
    stream = token_stream(tok, train_texts)
    chat_stream = chat_token_stream(tok, chat_pairs(corpus.named_texts(held_out=False)))
    chunks = eval_chunks(corpus.texts(held_out=True), count=eval_count)
    results = []
    for demo_id in ids:
        cfg = TrainConfig(steps=steps or DEFAULT_STEPS[demo_id])
        if overrides:
            cfg = replace(cfg, **overrides)
        results.append(train_demo(demo_id, corpus, tok, stream, cfg, out_root, report, chunks, chat_stream))
    return results
