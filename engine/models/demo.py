"""Demo models: tiny models built locally, deterministically, without a hub.

Each demo id (`demo`, `demo-qwen3`, `demo-moe`, `demo-draft`) has two builds:

- **trained** (the default when assets/demo/trained/<id>/ is present): weights
  trained by `flotilla models train-demos` (engine.models.train_demos) on the
  Python stdlib + the project's docs, shipped as fp16 safetensors and upcast
  here, exactly, to the f32 the demo folder runs at — the folder's values are
  bit for bit the shipped ones.
- **random**: the id's *recipe* — a real transformers config class with small
  dimensions, random weights drawn with a fixed seed and initializer_range ~0.1
  (with the usual 0.02, greedy decoding of a random model collapses into one
  repeated token and comparisons prove nothing), and a BPE tokenizer trained on
  the bundled assets/demo/corpus.txt with a ChatML chat template. Asked for as
  `<id>-random` (e.g. `--model demo-random`), `ensure_demo(id, weights="random")`,
  or for every demo id with FLOTILLA_DEMO_WEIGHTS=random.

Builds are written to a temporary folder and renamed into place, so an
interrupted build never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from engine.models.errors import ModelError

# Bumped whenever a recipe or the tokenizer training changes, so that caches
# built by an older Flotilla are rebuilt rather than silently reused.
RECIPE_VERSION = 1

CORPUS_PATH = Path(__file__).resolve().parent.parent.parent / "assets" / "demo" / "corpus.txt"
# Trained weights shipped with the project, one folder per demo id (engine.models.train_demos).
TRAINED_ROOT = CORPUS_PATH.parent / "trained"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB = 2048


@dataclass(frozen=True)
class DemoRecipe:
    """How one demo model is built."""

    demo_id: str  # the name users type: `--model demo`
    config_class: str  # a transformers config class name
    config: dict[str, Any]  # small dimensions; vocab and special ids are added
    seed: int  # torch seed for the random weights
    description: str  # one line for `flotilla models list`
    tokenizer_of: str | None = None  # share another recipe's tokenizer (drafts)
    extra: dict[str, Any] = field(default_factory=dict)
    # Weights as saved: "f32", "bf16" or "fp16" (drawn in f32 with the seed, then cast),
    # so tests can build checkpoints stored like real ones (bf16) from the same draw.
    dtype: str = "f32"

    def fingerprint(self) -> str:
        spec = {"v": RECIPE_VERSION, "cls": self.config_class, "cfg": self.config,
                "seed": self.seed, "corpus": _corpus_digest()}
        if self.dtype != "f32":  # f32 recipes keep the fingerprint (and cache folder) they always had
            spec["dtype"] = self.dtype
        blob = json.dumps(spec, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


_COMMON = dict(initializer_range=0.1, max_position_embeddings=4096, tie_word_embeddings=False)

RECIPES: dict[str, DemoRecipe] = {
    r.demo_id: r
    for r in [
        DemoRecipe(
            "demo", "LlamaConfig",
            dict(_COMMON, hidden_size=128, intermediate_size=352, num_hidden_layers=8,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5),
            seed=1, description="Llama-style dense, 8 layers, hidden 128 (random weights)",
        ),
        DemoRecipe(
            "demo-qwen3", "Qwen3Config",
            dict(_COMMON, hidden_size=128, intermediate_size=320, num_hidden_layers=6,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6),
            seed=2, description="Qwen3 dense, 6 layers, hidden 128 (random weights)",
        ),
        DemoRecipe(
            "demo-moe", "Qwen2MoeConfig",
            dict(_COMMON, hidden_size=128, intermediate_size=256, moe_intermediate_size=96,
                 shared_expert_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 norm_topk_prob=False, rms_norm_eps=1e-6),
            seed=3, description="Qwen2-MoE, 4 layers x 8 experts (top-2) + shared expert (random weights)",
        ),
        DemoRecipe(
            "demo-draft", "LlamaConfig",
            dict(_COMMON, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5),
            seed=4, description="small Llama draft sharing demo's tokenizer (random weights)",
            tokenizer_of="demo",
        ),
        DemoRecipe(
            # ReLU FFN (as the sparsity literature "ReLU-fies" Llama): neurons whose gate is
            # negative are exactly zero, so the sparse engine skips them at no loss of quality
            "demo-relu", "LlamaConfig",
            dict(_COMMON, hidden_size=128, intermediate_size=352, num_hidden_layers=8,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, hidden_act="relu"),
            seed=5, description="Llama with a ReLU FFN (sparse-engine demo), 8 layers, hidden 128 (random weights)",
        ),
    ]
}


# The random-weight recipes, whatever RECIPES' descriptions say (see below).
RANDOM_RECIPES: dict[str, DemoRecipe] = dict(RECIPES)

RANDOM_SUFFIX = "-random"  # `demo-random`: the random-weight build of `demo`
WEIGHTS_ENV = "FLOTILLA_DEMO_WEIGHTS"  # "random" forces random builds of every demo id
WEIGHTS_CHOICES = ("auto", "trained", "random")  # auto = trained when shipped, else random
TRAINED_BUILD = 1  # bumped when the way a demo folder is built from trained assets changes
_TRAINED_FILES = ("config.json", "model.safetensors", "flotilla-train.json")


def demo_ids() -> list[str]:
    """The demo ids users pick from (each also answers as `<id>-random`)."""
    return list(RECIPES)


def is_demo_id(name: str) -> bool:
    return _split_id(name)[0] is not None


def _split_id(name: str) -> tuple[str | None, bool]:
    """(base demo id or None, random forced by the id)."""
    if name in RECIPES:
        return name, False
    if isinstance(name, str) and name.endswith(RANDOM_SUFFIX) and name[: -len(RANDOM_SUFFIX)] in RECIPES:
        return name[: -len(RANDOM_SUFFIX)], True
    return None, False


def trained_dir(demo_id: str) -> Path | None:
    """The shipped trained weights of a demo id, or None when this checkout has none."""
    d = TRAINED_ROOT / demo_id
    return d if all((d / f).is_file() for f in _TRAINED_FILES) else None


def weights_of(demo_id: str, weights: str = "auto") -> str:
    """Which build `ensure_demo(demo_id, weights=...)` gives: "trained" or "random"."""
    base, forced_random = _split_id(demo_id)
    if base is None:
        raise ModelError(f"unknown demo model {demo_id!r}; demo models: {', '.join(RECIPES)}")
    if weights not in WEIGHTS_CHOICES:
        raise ModelError(f"demo weights must be one of {', '.join(WEIGHTS_CHOICES)}, not {weights!r}")
    if forced_random or weights == "random":
        return "random"
    if weights == "auto" and os.environ.get(WEIGHTS_ENV, "").strip().lower() == "random":
        return "random"
    if trained_dir(base) is None:
        if weights == "trained":
            raise ModelError(f"no trained weights for {base} in {TRAINED_ROOT} "
                             "(run `flotilla models train-demos`)")
        return "random"
    return "trained"


def trained_recipe(demo_id: str) -> dict[str, Any] | None:
    """The shipped recipe JSON of a trained demo (corpus digest, seed, steps, held-out figures)."""
    d = trained_dir(_split_id(demo_id)[0] or demo_id)
    return json.loads((d / "flotilla-train.json").read_text()) if d else None


def _default_description(recipe: DemoRecipe) -> str:
    """What `flotilla models list` says of a demo id: of the build it gives by default."""
    if weights_of(recipe.demo_id) == "random":
        return recipe.description
    return recipe.description.replace(" (random weights)", "") + " (trained on the Python stdlib + docs)"


# RECIPES keeps the random recipes (the same fingerprints and cache folders as
# always); only the description follows the default build.
RECIPES = {k: replace(r, description=_default_description(r)) for k, r in RANDOM_RECIPES.items()}

_FINGERPRINTS: dict[tuple, str] = {}


def trained_fingerprint(demo_id: str) -> str:
    """Identity of a trained demo: a hash of its shipped files' bytes."""
    d = trained_dir(demo_id)
    if d is None:
        raise ModelError(f"no trained weights for {demo_id} in {TRAINED_ROOT}")
    files = sorted(p for p in d.iterdir() if p.is_file())
    key = (str(d), tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files))
    if key not in _FINGERPRINTS:
        h = hashlib.sha256(f"trained-build-{TRAINED_BUILD}".encode())
        for p in files:
            h.update(p.name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
        _FINGERPRINTS[key] = h.hexdigest()[:16]
    return _FINGERPRINTS[key]


def cache_root() -> Path:
    """Where demo models live: $FLOTILLA_CACHE or the user cache folder."""
    env = os.environ.get("FLOTILLA_CACHE")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("flotilla", appauthor=False))


def demo_path(demo_id: str, weights: str = "auto") -> Path:
    """Where ensure_demo(demo_id, weights=...) puts (or has put) the demo folder."""
    base = _split_id(demo_id)[0]
    if weights_of(demo_id, weights) == "random":
        return recipe_path(RANDOM_RECIPES[base])
    return cache_root() / "demo" / f"{base}-trained-{trained_fingerprint(base)}"


def recipe_path(recipe: DemoRecipe) -> Path:
    return cache_root() / "demo" / f"{recipe.demo_id}-{recipe.fingerprint()}"


def ensure_demo(demo_id: str, progress: Callable[[str, float], None] | None = None,
                weights: str = "auto") -> Path:
    """Return the folder of a demo model, building it first if it is missing.
    weights: "auto" (trained when shipped, else random; FLOTILLA_DEMO_WEIGHTS=random
    forces random), "trained" (error when not shipped) or "random"."""
    base = _split_id(demo_id)[0]
    if weights_of(demo_id, weights) == "random":
        return ensure_recipe(RANDOM_RECIPES[base], progress)
    return _ensure_trained(base, progress)


def _ensure_trained(demo_id: str, progress: Callable[[str, float], None] | None) -> Path:
    """Build the demo folder from the shipped trained weights: every file copied,
    the weights upcast (exactly) to the recipe's runtime dtype."""
    target = demo_path(demo_id, "trained")
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    import torch
    from safetensors.torch import load_file, save_file

    report = progress or (lambda _msg, _frac: None)
    src = trained_dir(demo_id)
    recipe = json.loads((src / "flotilla-train.json").read_text())
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    runtime = dtypes[recipe.get("runtime_dtype", "f32")]
    with _building(target, demo_id) as tmp:
        report(f"unpacking trained {demo_id}", 0.3)
        for p in sorted(src.iterdir()):
            if p.is_file() and p.name != "model.safetensors":
                shutil.copyfile(p, tmp / p.name)
        tensors = {k: v.to(runtime) for k, v in load_file(src / "model.safetensors").items()}
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "flotilla-demo.json").write_text(
            json.dumps({"demo_id": demo_id, "fingerprint": trained_fingerprint(demo_id), "weights": "trained",
                        "description": RECIPES[demo_id].description}, indent=2)
        )
    report(f"{demo_id} ready", 1.0)
    return target


@contextmanager
def _building(target: Path, demo_id: str) -> Iterator[Path]:
    """A temp folder next to target, renamed onto it when the block ends and removed if it
    fails, so a cache folder is whole or absent. Another process finishing the same build
    first is fine: theirs is identical."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{demo_id}-", dir=target.parent))
    try:
        yield tmp
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def ensure_recipe(recipe: DemoRecipe, progress: Callable[[str, float], None] | None = None) -> Path:
    """Build any recipe (also ones made up by tests and benchmarks, e.g. a tiny
    Mixtral or a compute-bound dense model) into the cache, once."""
    target = recipe_path(recipe)
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    demo_id = recipe.demo_id
    report = progress or (lambda _msg, _frac: None)
    with _building(target, demo_id) as tmp:
        report(f"training tokenizer for {demo_id}", 0.1)
        tok = _tokenizer(recipe.tokenizer_of or demo_id)
        report(f"initialising {demo_id} weights", 0.5)
        _build_model(recipe, tok, tmp)
        tok.save_pretrained(tmp)
        (tmp / "flotilla-demo.json").write_text(
            json.dumps({"demo_id": demo_id, "fingerprint": recipe.fingerprint(),
                        "description": recipe.description}, indent=2)
        )
    report(f"{demo_id} ready", 1.0)
    return target


def _corpus_digest() -> str:
    return hashlib.sha256(CORPUS_PATH.read_bytes()).hexdigest()[:16]


_TOKENIZERS: dict[str, Any] = {}


def _tokenizer(owner_id: str):
    """Train (once per process) the BPE tokenizer of a demo recipe."""
    if owner_id in _TOKENIZERS:
        return _TOKENIZERS[owner_id]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if not CORPUS_PATH.exists():
        raise ModelError(f"demo corpus missing: {CORPUS_PATH} (is the checkout complete?)")
    text = CORPUS_PATH.read_text(encoding="utf-8")
    bpe = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in text.splitlines() if line.strip()]
    bpe.train_from_iterator(lines, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    _TOKENIZERS[owner_id] = tok
    return tok


def _build_model(recipe: DemoRecipe, tok, out: Path) -> None:
    import torch
    import transformers

    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if recipe.dtype not in dtypes:
        raise ModelError(f"demo recipe {recipe.demo_id}: dtype must be one of {', '.join(dtypes)}, "
                         f"not {recipe.dtype!r}")

    config_cls = getattr(transformers, recipe.config_class)
    config = config_cls(
        vocab_size=len(tok),
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        **recipe.config,
    )
    torch.manual_seed(recipe.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if recipe.dtype != "f32":
        model = model.to(dtypes[recipe.dtype])
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True, max_shard_size="100GB")
