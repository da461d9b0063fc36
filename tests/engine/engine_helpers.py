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


def reference_greedy(path: Path, ids: list[int], n: int, ignore_eos: bool = False, kv_dtype=None) -> list[int]:
    """transformers generate(do_sample=False): the new token ids (EOS included).
    ignore_eos: exactly n tokens, going on past EOS (as SamplingParams.ignore_eos).
    kv_dtype (e.g. torch.float16): the cache keeps keys and values at it (engine/runtime/torch_kv.py)."""
    import torch

    from engine.runtime.torch_kv import new_cache

    model = reference_model(path)
    x = torch.tensor([ids], dtype=torch.long)
    past = new_cache(model.config, kv_dtype) if kv_dtype is not None else None  # None: transformers' own
    with torch.inference_mode():
        if not ignore_eos:
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                 past_key_values=past)
            return out[0, len(ids):].tolist()
        new, cur = [], x
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


def check_follow_up_answers_as_uncached(engine, ask, first, chunk: int) -> None:
    """The exact prompt cache (a pipeline's prompt_cache_exact) on a two-turn chat after `first`
    (a system prompt long enough for several prefill chunks): the follow-up reuses whole chunks
    of turn 1's prompt only, and its greedy answer is the one a request gets with the cache off.
    ask(rid, messages) -> collect()'s (ids, text, final event)."""
    _ids1, text1, end1 = ask("c1", first)
    second = first + chat(("assistant", text1), ("user", "And lakes?"))
    ids2, _, end2 = ask("c2", second)
    cached = end2.usage.cached_tokens
    assert cached % chunk == 0 and end1.usage.prompt_tokens - chunk < cached <= end1.usage.prompt_tokens
    engine.set_prompt_cache(0)
    try:
        ids3, _, end3 = ask("c3", second)
    finally:
        engine.set_prompt_cache(engine.config.prompt_cache)
    assert end3.usage.cached_tokens == 0
    assert ids2 == ids3


WATER = ("system", "You answer questions about the water of the world. " * 12)  # several chunks' worth


def ask_chat(engine, rid: str, messages, n: int = 12):
    """collect() of a greedy chat request of n tokens."""
    from engine.protocol.messages import GenerateRequest, SamplingParams

    req = GenerateRequest(rid, messages=messages, sampling=SamplingParams(max_tokens=n))
    return collect(engine.stream(engine.submit(req), timeout=300))


def check_follow_up_prefills_only_what_is_new(engine, ref_path: Path) -> None:
    """A two-turn chat on an engine that keeps KV to the token: turn 2 takes over turn 1's
    prompt and answer (all but the answer's last id, never fed back), prefills the rest,
    and answers what transformers answers from the whole prompt (greedy); with the cache
    off the same turn is prefilled in full and answered the same."""
    from engine.runtime.chat import chat_ids

    first = chat(WATER, ("user", "Tell me about rivers."))
    _ids1, text1, end1 = ask_chat(engine, "t1", first)
    assert end1.usage.cached_tokens == 0
    second = first + chat(("assistant", text1), ("user", "And lakes?"))
    ids2, _, end2 = ask_chat(engine, "t2", second)
    assert end1.usage.prompt_tokens <= end2.usage.cached_tokens < end2.usage.prompt_tokens
    prompt = chat_ids(engine.tokenizer, second)
    assert ids2 == reference_greedy(ref_path, prompt, len(ids2))[:len(ids2)]
    engine.set_prompt_cache(0)
    try:
        ids3, _, end3 = ask_chat(engine, "t3", second)
    finally:
        engine.set_prompt_cache(1)
    assert end3.usage.cached_tokens == 0 and ids3 == ids2
