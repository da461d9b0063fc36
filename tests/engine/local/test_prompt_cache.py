"""Prompt caching on the local engine (paged: whole KV blocks of ended answers) and on
the loop engine (its idle requests' KV, to the token): a follow-up turn keeps the KV of
the conversation so far and prefills only what is new, reports it as cached_tokens, and
answers exactly what transformers answers from the whole prompt (greedy, f32)."""

from __future__ import annotations

import openai
import pytest
from engine_helpers import WATER, ask_chat, chat, reference_greedy

from engine.runtime.chat import chat_ids
from engine.runtime.prompt_cache import MIN_REUSE
from engine.serve.api import ApiServer, create_app

N = 12


@pytest.fixture(scope="module", params=["local", "loop"])
def engine(request, demo_engine):
    if request.param == "local":
        yield demo_engine
        return
    from engine.scheduler.loop import LocalEngine

    with LocalEngine.from_spec("demo", precision="f32") as eng:
        yield eng


def _whole(engine, n: int) -> int:
    """n rounded down to what the engine can keep: whole KV blocks on the paged engine."""
    grain = engine.pool.block_size if hasattr(engine, "pool") else 1
    return n - n % grain


def _check_against_transformers(engine, demo_dir, messages, got: list[int]) -> None:
    ids = chat_ids(engine.tokenizer, messages)
    assert got == reference_greedy(demo_dir("demo"), ids, len(got))[:len(got)]


def test_a_follow_up_turn_prefills_only_what_is_new(engine, demo_dir):
    first = chat(WATER, ("user", "Tell me about rivers."))
    ids1, text1, end1 = ask_chat(engine, "t1", first)
    assert end1.usage.cached_tokens == 0
    second = first + chat(("assistant", text1), ("user", "And lakes?"))
    ids2, _, end2 = ask_chat(engine, "t2", second)
    # the first prompt and the answer's tokens but its last (never fed back) are reused
    assert end2.usage.cached_tokens >= _whole(engine, end1.usage.prompt_tokens) > 0
    assert end2.usage.cached_tokens < end2.usage.prompt_tokens
    _check_against_transformers(engine, demo_dir, second, ids2)


def test_an_edited_last_turn_keeps_the_shared_part_only(engine, demo_dir):
    base = chat(WATER, ("user", "Tell me about the sea."))
    ask_chat(engine, "e1", base)
    edited = chat(WATER, ("user", "Tell me about the moon instead."))
    ids, _, end = ask_chat(engine, "e2", edited)
    shared = len(chat_ids(engine.tokenizer, chat(WATER)))  # at least the system turn is shared
    assert 0 < _whole(engine, shared) <= end.usage.cached_tokens < len(chat_ids(engine.tokenizer, base))
    _check_against_transformers(engine, demo_dir, edited, ids)


def test_the_same_prompt_again_is_answered_the_same(engine):
    msgs = chat(WATER, ("user", "Name a river."))
    ids1, _, _ = ask_chat(engine, "s1", msgs)
    ids2, _, end = ask_chat(engine, "s2", msgs)
    # all but the last id (it must run for the next token's logits), in whole blocks on the paged engine
    assert ids1 == ids2 and end.usage.cached_tokens == _whole(engine, end.usage.prompt_tokens - 1)


def test_the_loops_cache_is_bounded_and_the_oldest_goes():
    """The loop engine keeps as many conversations as its pool of idle requests (2): a
    third one pushes the oldest out, whose follow-up is then prefilled in full."""
    from engine.scheduler.loop import LocalEngine

    with LocalEngine.from_spec("demo", precision="f32") as engine:
        convs = [chat(WATER, ("user", f"Question number {i} about water, please.")) for i in range(3)]
        ends = [ask_chat(engine, f"b{i}", c)[2] for i, c in enumerate(convs)]
        assert engine.backend.pool_size == 2
        again = [ask_chat(engine, f"b{i}x", convs[i])[2] for i in (2, 0)]
    assert again[0].usage.cached_tokens > ends[2].usage.prompt_tokens // 2  # kept
    # the first conversation was evicted: only the shared system turn can come from elsewhere
    assert again[1].usage.cached_tokens <= len(chat_ids(engine.tokenizer, chat(WATER))) + MIN_REUSE


def test_the_paged_cache_is_the_pool_and_the_oldest_blocks_go(demo_dir):
    """The paged engine keeps ended answers' blocks while the pool has room: with room for
    about two conversations, the newest is kept, the first one's blocks are re-used."""
    from engine.local.paged import PagedEngine

    with PagedEngine(demo_dir("demo"), "demo", precision="f32", max_blocks=12) as engine:
        convs = [chat(("system", f"Rule {i}. " + WATER[1]), ("user", "Tell me.")) for i in range(3)]
        ends = [ask_chat(engine, f"p{i}", c)[2] for i, c in enumerate(convs)]
        assert engine.pool.blocks_for(ends[0].usage.prompt_tokens + N) * 3 > 12  # three do not fit
        again = [ask_chat(engine, f"p{i}x", convs[i])[2] for i in (2, 0)]
    assert again[0].usage.cached_tokens == _whole(engine, ends[2].usage.prompt_tokens - 1) > 0  # kept
    assert again[1].usage.cached_tokens == 0  # evicted (its system turn differs from the first token on)


def test_the_api_reports_cached_tokens(engine):
    srv = ApiServer(create_app(engine)).start()
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        msgs = [{"role": WATER[0], "content": WATER[1]}, {"role": "user", "content": "Why is the sea salty?"}]
        a = client.chat.completions.create(model="demo", messages=msgs, max_tokens=8, temperature=0)
        msgs += [{"role": "assistant", "content": a.choices[0].message.content}, {"role": "user", "content": "Why?"}]
        b = client.chat.completions.create(model="demo", messages=msgs, max_tokens=8, temperature=0)
    finally:
        srv.stop()
    assert a.usage.prompt_tokens_details.cached_tokens < a.usage.prompt_tokens  # a new question: not all of it
    assert b.usage.prompt_tokens_details.cached_tokens >= _whole(engine, a.usage.prompt_tokens) > 0
