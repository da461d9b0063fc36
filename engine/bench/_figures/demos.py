"""docs/demo-models.md's figure tables (see engine/bench/_figures/__init__.py for the rules).

Sources: `demos` (`flotilla bench demos`: held-out text, FFN locality, routing, the draft's
agreement), `sparse-demo-relu` / `sparse-demo-relu-random` (`flotilla bench sparse --shape
demo`) and `moe-demo` / `moe-demo-random` (`flotilla bench moe --shape demo`): the engines
on a trained demo beside the same demo with random weights, each run capped.
Tables with more than three columns hold several cells in a row's figure, separated by " | ".
"""

from __future__ import annotations

from engine.bench._report import REPO_ROOT, Row, Table

D = "demos"
DQ = "`flotilla bench demos`"
IDS = ("demo", "demo-draft", "demo-qwen3", "demo-moe", "demo-relu")


def _f(src: str, path: str, fmt: str = "g") -> str:
    return "{" + f"{src}:{path}|{fmt}" + "}"


def _heldout_row(demo_id: str) -> Row:
    p = f"heldout.{demo_id}."
    cells = (_f(D, p + "recipe.steps", "int") + " × " + _f(D, p + "recipe.tokens_seen", "int") + " tokens",
             _f(D, p + "recipe.train_seconds", "f0") + " s",
             _f(D, p + "trained.perplexity", "f1"), _f(D, p + "random.perplexity", "f0"),
             _f(D, p + "trained.bits_per_byte", "f2"), _f(D, p + "random.bits_per_byte", "f2"))
    return Row(f"`{demo_id}`", " | ".join(cells), DQ)


HELDOUT = Table(
    "demos-heldout",
    ("model", "steps × tokens seen | train time (recipe JSON) | held-out ppl, trained | random | "
     "bits/byte, trained | random", "how"),  # type: ignore[arg-type]
    tuple(_heldout_row(i) for i in IDS))


def _locality_row(demo_id: str, label: str) -> Row:
    p = f"locality.{demo_id}."
    cells = (_f(D, p + "trained.jaccard_mean", "f3"), _f(D, p + "random.jaccard_mean", "f3"),
             _f(D, p + "trained.jaccard_if_independent_mean", "f3"),
             _f(D, p + "trained.sparsity_mean", "pct"), _f(D, p + "random.sparsity_mean", "pct"),
             "{" + f"{D}:{p}paper_trained_models" + "}")
    return Row(label, " | ".join(cells), DQ)


LOCALITY = Table(
    "demos-locality",
    ("model, threshold", "Jaccard of consecutive tokens' active sets, trained | random | two independent sets "
     "of the trained density | sparsity, trained | random | papers' trained models", "how"),  # type: ignore[arg-type]
    (_locality_row("demo", "`demo` (SwiGLU), CATS at 80 % sparsity"),
     _locality_row("demo-relu", "`demo-relu` (ReLU), natural zeros")))


def _layer_row(layer: int) -> Row:
    cells = tuple(_f(D, f"locality.{demo_id}.{label}.per_layer.{layer}.{key}", fmt)
                  for demo_id in ("demo", "demo-relu") for label in ("trained", "random")
                  for key, fmt in (("jaccard", "f2"), ("sparsity", "pct")))
    return Row(str(layer), " | ".join(cells), DQ)


LOCALITY_LAYERS = Table(
    "demos-locality-layers",
    ("layer", "`demo` trained: Jaccard | sparsity | `demo` random: Jaccard | sparsity | `demo-relu` trained: "
     "Jaccard | sparsity | `demo-relu` random: Jaccard | sparsity", "how"),  # type: ignore[arg-type]
    tuple(_layer_row(i) for i in range(8)))


def _routing_row(label: str) -> Row:
    p = f"heldout.demo-moe.{label}.routing_mean."
    cells = (_f(D, p + "entropy", "f3"), _f(D, p + "top_share", "pct"), _f(D, p + "sticky", "pct"))
    return Row(f"`demo-moe`, {label}", " | ".join(cells), DQ)


ROUTING = Table(
    "demos-routing",
    ("router", "load entropy, mean of layers (1 = uniform) | busiest expert's share (uniform 12.5 %) | "
     "same top-1 expert as the previous token (uniform 12.5 %)", "how"),  # type: ignore[arg-type]
    (_routing_row("trained"), _routing_row("random")))

DRAFT = Table("demos-draft", ("what", "figure", "how"), (
    Row("`demo-draft`'s argmax equals `demo`'s (teacher-forced, held-out text)",
        f"{_f(D, 'draft.top1_agreement', 'pct')} of {_f(D, 'draft.positions', 'int')} positions", DQ),
    Row("`demo`'s greedy chat answers (chat template, 120 tokens at most) that end by themselves",
        f"{_f(D, 'samples.chat_ended_share', 'pct')}", DQ),
))

SQ = "`flotilla bench sparse --shape demo --sparsities 0.8 --model {}`"


def _sparse_row(src: str, demo_id: str) -> Row:
    cells = (_f(src, "overlap_jaccard.calibration_text_mean", "f3"),
             _f(src, "overlap_jaccard.independent_sets_same_density", "f3"),
             _f(src, "overlap_jaccard.sparsity_measured", "pct"),
             _f(src, "cache_hit_rate.ours", "pct"), _f(src, "bytes_read_per_token.ours", "int"),
             _f(src, "tok_s.ours", "f0"), _f(src, "tok_s.on_demand", "f0"), _f(src, "speedup_vs_on_demand", "x"),
             "{" + f"{src}:io.effective" + "}")
    return Row(f"`{demo_id}`", " | ".join(cells), SQ.format(demo_id))


SPARSE = Table(
    "demos-sparse",
    ("model (ReLU, f32, exact mode; cache: half the FFN)", "Jaccard (calibration text) | independent sets | "
     "sparsity | neuron-cache "
     "hit rate | bytes read / token | tok/s, ours | on-demand | ours over on-demand | reads",
     "how"),  # type: ignore[arg-type]
    (_sparse_row("sparse-demo-relu", "demo-relu"), _sparse_row("sparse-demo-relu-random", "demo-relu-random")))

MQ = "`flotilla bench moe --shape demo --model {}`"


def _moe_row(src: str, demo_id: str) -> Row:
    r = "results.{}.16."
    cells = (_f(src, r.format("bevy") + "hit_rate", "pct"), _f(src, r.format("on_demand") + "hit_rate", "pct"),
             _f(src, r.format("bevy") + "mb_per_token", "f3"), _f(src, r.format("on_demand") + "mb_per_token", "f3"),
             _f(src, r.format("bevy") + "tok_s", "f0"), _f(src, "speedup_vs_on_demand", "x"),
             _f(src, "speedup_vs_prefetch", "x"), "{" + f"{src}:io.effective" + "}")
    return Row(f"`{demo_id}`", " | ".join(cells), MQ.format(demo_id))


MOE = Table(
    "demos-moe",
    ("model (f32; cache 25 % of the experts; cap: setup + 16 MiB + cache), 16 requests",
     "hit rate, Bevy | on-demand | MB read / token, Bevy | on-demand | Bevy tok/s | Bevy over on-demand | "
     "over prefetch | reads", "how"),  # type: ignore[arg-type]
    (_moe_row("moe-demo", "demo-moe"), _moe_row("moe-demo-random", "demo-moe-random")))

FILE = REPO_ROOT / "docs" / "demo-models.md"
TABLES = (HELDOUT, LOCALITY, LOCALITY_LAYERS, ROUTING, DRAFT, SPARSE, MOE)
