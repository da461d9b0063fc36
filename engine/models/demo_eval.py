"""Held-out figures of the demo models: loss, perplexity, bits per byte, routing.

Measured on the held-out split of engine.models.demo_corpus, cut into pieces of
whole lines that do not depend on the tokenizer, so a trained demo (its own
tokenizer) and the random-weight demo (the corpus.txt tokenizer) are compared
on the same text: bits per byte compare directly, perplexities per token each
with its own tokenizer.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator


@contextmanager
def one_thread() -> Iterator[None]:
    """Tiny matmuls: one torch thread is faster than two fighting over a shared core
    (17 s vs 1 s for the same evaluation under load here); the caller's count is restored."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def eval_chunks(texts: list[str], chunk_bytes: int = 400, count: int = 96) -> list[str]:
    """Held-out evaluation pieces: runs of whole lines of about chunk_bytes, `count`
    of them spread evenly over the held-out text (same pieces whatever the tokenizer,
    so bits per byte compare across tokenizers)."""
    chunks: list[str] = []
    for text in texts:
        cur = ""
        for line in text.splitlines(keepends=True):
            cur += line
            if len(cur.encode()) >= chunk_bytes:
                if cur.strip():
                    chunks.append(cur)
                cur = ""
    if len(chunks) <= count:
        return chunks
    step = len(chunks) / count
    return [chunks[int(i * step)] for i in range(count)]


def evaluate(model, tok, chunks: list[str]) -> dict[str, float]:
    """Held-out loss of a causal LM on text pieces, each read from a fresh context
    after <|endoftext|>: nats per token, perplexity, bits per byte."""
    import torch

    sep = tok.convert_tokens_to_ids("<|endoftext|>")
    nll, tokens, nbytes = 0.0, 0, 0
    model.eval()
    with torch.no_grad(), one_thread():
        for text in chunks:
            ids = [sep] + tok(text, add_special_tokens=False)["input_ids"]
            x = torch.tensor([ids], dtype=torch.long)
            logits = model(input_ids=x).logits.float()
            logp = torch.log_softmax(logits[0, :-1], dim=-1)
            nll -= logp.gather(1, x[0, 1:, None]).sum().item()
            tokens += len(ids) - 1
            nbytes += len(text.encode())
    loss = nll / max(tokens, 1)
    return {"loss": round(loss, 4), "perplexity": round(math.exp(min(loss, 50.0)), 2),
            "bits_per_byte": round(nll / max(nbytes, 1) / math.log(2), 4), "tokens": tokens, "bytes": nbytes}


def router_stats(model, tok, chunks: list[str]) -> list[dict[str, float]] | None:
    """Per MoE layer: how tokens spread over experts (top-k picks) on held-out text.
    entropy = normalised entropy of the load (1.0 = uniform), top_share = the busiest
    expert's share of picks (uniform: 1/E), sticky = share of adjacent tokens whose
    top-1 expert is the same (uniform random: 1/E). None for a dense model."""
    import torch

    cfg = model.config
    experts, top_k = getattr(cfg, "num_experts", None), getattr(cfg, "num_experts_per_tok", None)
    if not experts:
        return None
    sep = tok.convert_tokens_to_ids("<|endoftext|>")
    counts = torch.zeros(cfg.num_hidden_layers, experts)
    same = torch.zeros(cfg.num_hidden_layers)
    pairs = 0
    model.eval()
    with torch.no_grad(), one_thread():
        for text in chunks:
            ids = [sep] + tok(text, add_special_tokens=False)["input_ids"]
            out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
            for layer, logits in enumerate(out.router_logits):  # [tokens, experts]
                picks = logits.float().topk(top_k, dim=-1).indices
                counts[layer] += torch.bincount(picks.flatten(), minlength=experts).float()
                same[layer] += (picks[1:, 0] == picks[:-1, 0]).sum()
            pairs += len(ids) - 1
    rows = []
    for layer in range(cfg.num_hidden_layers):
        p = counts[layer] / counts[layer].sum()
        ent = -(p * torch.log(p.clamp_min(1e-12))).sum().item() / math.log(experts)
        rows.append({"layer": layer, "entropy": round(ent, 3), "top_share": round(p.max().item(), 3),
                     "sticky": round(same[layer].item() / max(pairs, 1), 3)})
    return rows


def load_folder(folder: Path):
    """(model, tokenizer) of a demo folder, f32, eager attention, eval mode."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # a bar per load would drown the table
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager")
    return model.eval(), tok


def heldout_table(demo_ids: list[str], trained_root: Path | None = None, count: int = 96,
                  max_train_bytes: int | None = None,
                  report: Callable[[str, float], None] | None = None) -> list[dict[str, Any]]:
    """One row per demo: held-out figures of the trained weights (trained_root/<id>,
    default: the shipped ones, as ensure_demo builds them) next to the random build's."""
    from engine.models.demo import ensure_demo
    from engine.models.demo_corpus import build_corpus

    report = report or (lambda _m, _f: None)
    chunks = eval_chunks(build_corpus(max_train_bytes=max_train_bytes).texts(held_out=True), count=count)
    rows = []
    for i, demo_id in enumerate(demo_ids):
        report(f"evaluating {demo_id}", i / max(len(demo_ids), 1))
        folder = Path(trained_root) / demo_id if trained_root else ensure_demo(demo_id, weights="trained")
        row: dict[str, Any] = {"demo_id": demo_id}
        for label, path in (("trained", folder), ("random", ensure_demo(demo_id, weights="random"))):
            model, tok = load_folder(path)
            row[label] = evaluate(model, tok, chunks)
            routing = router_stats(model, tok, chunks[:32])
            if routing is not None:
                row[label]["routing"] = routing
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The printed table: perplexity per token and bits per byte, trained vs random."""
    lines = [f"{'model':12} {'ppl trained':>12} {'ppl random':>12} {'bits/byte trained':>18} {'random':>8}"]
    for r in rows:
        t, z = r["trained"], r["random"]
        lines.append(f"{r['demo_id']:12} {t['perplexity']:12.2f} {z['perplexity']:12.1f} "
                     f"{t['bits_per_byte']:18.3f} {z['bits_per_byte']:8.3f}")
        for label in ("trained", "random"):
            for layer in r[label].get("routing", []):
                lines.append(f"{'':12} {label} router layer {layer['layer']}: load entropy {layer['entropy']:.3f} "
                             f"(1 = uniform), top expert {layer['top_share']:.1%}, "
                             f"same top-1 as previous token {layer['sticky']:.1%}")
    return "\n".join(lines)
