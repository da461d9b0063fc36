"""Shared pieces of the speculative tests (imported by name: tests/engine/speculative is on sys.path)."""

from __future__ import annotations

from engine_helpers import chat

PROMPTS = (
    chat(("user", "Tell me a story about a robot.")),
    # repetitive text, so prompt lookup finds n-grams (and has drafts rejected too)
    chat(("user", "the cat sat on the mat. the cat sat on the mat. the cat sat on the hat. the cat")),
)
DRAFT_SIGMA = 0.03  # weight noise of the test draft: partial acceptance on demo (rollback exercised)


def run_pair(engine, tag: str, spec, max_tokens: int = 40, timeout: float = 60.0):
    """Both prompts submitted at once (interleaved); returns [(token ids, events), ...]."""
    from engine.protocol.messages import GenerateRequest, SamplingParams

    ids = [engine.submit(GenerateRequest(f"{tag}-{i}", messages=m, sampling=SamplingParams(max_tokens=max_tokens),
                                         speculative=spec)) for i, m in enumerate(PROMPTS)]
    out = []
    for rid in ids:
        events = list(engine.stream(rid, timeout=timeout))
        assert events[-1].finish_reason in ("stop", "length"), events[-1].error
        out.append(([t for e in events for t in e.token_ids], len(events)))
    return out
