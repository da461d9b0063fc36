"""Helpers of the engine tests (imported by name: tests/engine is on sys.path via conftest)."""

from __future__ import annotations

from pathlib import Path

DEMOS = ("demo", "demo-qwen3", "demo-moe")

# A multi-turn conversation: system + user + assistant + user.
CONVERSATION = (
    ("system", "You are a helpful assistant."),
    ("user", "Tell me a story about a robot."),
    ("assistant", "Once upon a time there was a small robot."),
    ("user", "What did the robot do next?"),
)


_REF_MODELS: dict[Path, object] = {}


def reference_model(path: Path):
    """The transformers model of a folder, float32, loaded once per session."""
    if path not in _REF_MODELS:
        import torch
        from transformers import AutoModelForCausalLM

        _REF_MODELS[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _REF_MODELS[path]


def reference_greedy(path: Path, ids: list[int], n: int, ignore_eos: bool = False) -> list[int]:
    """transformers generate(do_sample=False): the new token ids (EOS included).
    ignore_eos: exactly n tokens, going on past EOS (as SamplingParams.ignore_eos)."""
    import torch

    model = reference_model(path)
    x = torch.tensor([ids], dtype=torch.long)
    with torch.inference_mode():
        if not ignore_eos:
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)
            return out[0, len(ids):].tolist()
        new, past, cur = [], None, x
        for _ in range(n):  # plain argmax with the model's own KV cache: no stopping rule at all
            o = model(input_ids=cur, past_key_values=past, use_cache=True)
            past = o.past_key_values
            new.append(int(o.logits[0, -1].argmax()))
            cur = torch.tensor([[new[-1]]], dtype=torch.long)
        return new


def chat(*turns: tuple[str, str]):
    from engine.protocol.messages import ChatMessage

    return tuple(ChatMessage(r, c) for r, c in turns)


def collect(events) -> tuple[list[int], str, object]:
    """(token ids, text, final event) of a finished stream."""
    events = list(events)
    ids = [t for e in events for t in e.token_ids]
    return ids, "".join(e.text for e in events), events[-1]
