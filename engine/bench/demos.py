"""`flotilla bench demos`: what training gave the demo models, against their random builds.

For every demo id, on held-out corpus text it never trained on (engine.models.demo_corpus):
- held-out loss, perplexity and bits per byte of the trained build and of the random build
  (bits per byte compare across their two tokenizers);
- MoE: the routers' load entropy, busiest expert and top-1 stickiness (trained vs random);
- the FFN's temporal locality, as `flotilla sparse profile` measures it: per layer, the
  Jaccard overlap of consecutive tokens' active neuron sets — `demo` (SwiGLU, CATS
  threshold at 80 % sparsity) and `demo-relu` (ReLU, natural zeros), trained vs random,
  beside two independent sets of the same density and the papers' 0.82-0.85;
- the draft's teacher-forced top-1 agreement with `demo` (why it can draft for it);
- what a user sees: `demo`'s greedy continuation of `def fibonacci(n):` (raw prompt) and
  its greedy chat answers to a few first questions (chat template), with whether each
  answer ended by itself.
The recipe (steps, tokens, train time, corpus digest) comes from each demo's shipped
flotilla-train.json. All of it is deterministic on one machine; `--runs 3` shows it.
Training itself is `flotilla models train-demos`.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any, Callable

NAME = "demos"
HELP = "the trained demo models vs their random builds: held-out perplexity, FFN locality, routing, first chats"

CHAT_PROMPTS = ("Hello", "Tell me a story.", "How do I read a file in Python?", "What does `os.path.join` do?",
                "Write a function that adds two numbers.", "What is Flotilla?")
RAW_PROMPT = "def fibonacci(n):"
PAPER_JACCARD = "0.82-0.85"


def add_arguments(parser) -> None:
    parser.add_argument("--eval-chunks", type=int, default=None,
                        help="held-out pieces of ~400 bytes (default 96; --quick 12)")


@functools.lru_cache(maxsize=None)
def _loaded(demo_id: str, weights: str = "trained"):
    """(model, tokenizer) of a demo build, loaded once per process (held-out, draft and samples share them)."""
    from engine.models.demo import ensure_demo
    from engine.models.demo_eval import load_folder

    return load_folder(ensure_demo(demo_id, weights=weights))


def _heldout(ids: list[str], chunks: list[str], report: Callable[[str], None]) -> dict[str, Any]:
    from engine.models.demo import trained_recipe
    from engine.models.demo_eval import evaluate, router_stats

    rows: dict[str, Any] = {}
    for demo_id in ids:
        report(f"held-out text: {demo_id}, trained and random")
        row: dict[str, Any] = {}
        for label, weights in (("trained", "trained"), ("random", "random")):
            model, tok = _loaded(demo_id, weights)
            row[label] = evaluate(model, tok, chunks)
            routing = router_stats(model, tok, chunks[:32])
            if routing is not None:
                row[label]["routing"] = routing
                row[label]["routing_mean"] = {k: round(sum(r[k] for r in routing) / len(routing), 4)
                                              for k in ("entropy", "top_share", "sticky")}
        row["bits_per_byte_ratio"] = round(row["trained"]["bits_per_byte"] / row["random"]["bits_per_byte"], 4)
        recipe = trained_recipe(demo_id) or {}
        row["recipe"] = {"steps": recipe.get("train", {}).get("steps"), "tokens_seen": recipe.get("tokens_seen"),
                         "train_seconds": recipe.get("seconds"), "corpus": recipe.get("corpus", {}).get("digest"),
                         "chat_tokens": recipe.get("chat_tokens")}
        rows[demo_id] = row
    return rows


def _locality(text: Path, report: Callable[[str], None]) -> dict[str, Any]:
    from engine.models.demo import ensure_demo
    from engine.sparse.profile import overlap_profile

    out: dict[str, Any] = {}
    for demo_id in ("demo", "demo-relu"):
        row: dict[str, Any] = {}
        for label, weights in (("trained", "trained"), ("random", "random")):
            report(f"FFN locality: {demo_id}, {label}")
            prof = overlap_profile(ensure_demo(demo_id, weights=weights), sparsity=0.8, text=text)
            layers = prof["layers"]
            row[label] = {"jaccard_mean": prof["jaccard_mean"], "threshold": prof["threshold"],
                          "sparsity_mean": round(sum(r["sparsity"] for r in layers) / len(layers), 4),
                          "jaccard_if_independent_mean": round(
                              sum(r["jaccard_if_independent"] for r in layers) / len(layers), 4),
                          "per_layer": layers}
        row["paper_trained_models"] = PAPER_JACCARD
        out[demo_id] = row
    return out


def _draft_agreement(chunks: list[str]) -> dict[str, Any]:
    """Teacher-forced: how often the draft's argmax equals demo's on held-out text."""
    import torch

    from engine.models.demo_eval import one_thread

    target, tok = _loaded("demo")
    draft, _ = _loaded("demo-draft")
    sep = tok.convert_tokens_to_ids("<|endoftext|>")
    same = total = 0
    with torch.no_grad(), one_thread():
        for text in chunks:
            x = torch.tensor([[sep] + tok(text, add_special_tokens=False)["input_ids"]])
            a = target(input_ids=x).logits[0].argmax(-1)
            b = draft(input_ids=x).logits[0].argmax(-1)
            same += int((a == b).sum())
            total += a.numel()
    return {"top1_agreement": round(same / max(total, 1), 4), "positions": total}


def _samples(report: Callable[[str], None]) -> dict[str, Any]:
    """Greedy answers as a user sees them (transformers, f32)."""
    import torch

    from engine.models.demo_eval import one_thread

    report("greedy samples: a raw continuation and first chats")
    model, tok = _loaded("demo")
    eos = tok.eos_token_id
    with torch.no_grad(), one_thread():
        ids = tok(RAW_PROMPT, return_tensors="pt")["input_ids"]
        raw = model.generate(ids, max_new_tokens=48, do_sample=False)[0, ids.shape[1]:].tolist()
        chats = []
        for q in CHAT_PROMPTS:
            ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
            out = model.generate(ids, max_new_tokens=120, do_sample=False)[0, ids.shape[1]:].tolist()
            chats.append({"prompt": q, "answer": tok.decode([t for t in out if t != eos]),
                          "ended": eos in out, "tokens": len(out)})
    return {"fibonacci": {"prompt": RAW_PROMPT, "tokens": 48, "text": RAW_PROMPT + tok.decode(raw)},
            "chat": chats, "chat_ended_share": round(sum(c["ended"] for c in chats) / len(chats), 4)}


def run(args, report: Callable[[str], None]) -> dict[str, Any]:
    from engine.models.demo_corpus import build_corpus
    from engine.models.demo_eval import eval_chunks
    from engine.models.train_demos import TRAIN_ORDER

    count = args.eval_chunks or (12 if args.quick else 96)
    corpus = build_corpus()
    held = corpus.texts(held_out=True)
    chunks = eval_chunks(held, count=count)
    heldout = _heldout(TRAIN_ORDER, chunks, report)
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "heldout.txt"  # the locality profile reads held-out text too
        text.write_text("".join(eval_chunks(held, count=count * 2)), encoding="utf-8")
        locality = _locality(text, report)
    return {"corpus": {"digest": corpus.digest, "python": corpus.python, "heldout_pieces": len(chunks),
                       "heldout_bytes": sum(len(c.encode()) for c in chunks)},
            "heldout": heldout, "locality": locality, "draft": _draft_agreement(chunks),
            "samples": _samples(report)}
