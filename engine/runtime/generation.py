"""The generation loop, as small steps a scheduler can interleave.

    gen = Generation.create(request, prompt_ids, stream, tokenizer, eos_ids, limit)
    step(gen)   -> a TokenEvent, or None while a long prompt is still prefilling

step() does one unit of work: a prefill chunk, or (prefill done) pick the next
token from the last logits, detokenize it, decide whether the answer ended,
and -- only when it goes on -- run the model on that token on the next step.
A request ends with "stop" (EOS or a stop string), "length" (max_tokens or
the context is full), or is ended from outside with finished(gen, reason).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.protocol.messages import MAX_TOKEN_CHARS, GenerateRequest, Timings, TokenEvent, TokenLogprob, Usage
from engine.runtime import constraint as _constraint
from engine.runtime import tool_format
from engine.runtime.backend import ModelStream
from engine.runtime.constraint import Constraint
from engine.runtime.detokenize import Detokenizer
from engine.runtime.errors import RequestError
from engine.runtime.sampling import Sampler, SamplerConfig, token_logprob


@dataclass
class Generation:
    request: GenerateRequest  # what was asked
    prompt_ids: list[int]  # templated prompt tokens
    stream: ModelStream  # this request's KV state
    sampler: Sampler  # per-request RNG and logits processing
    detok: Detokenizer  # text deltas, EOS and stop strings
    max_new: int  # new tokens allowed (max_tokens, capped by the context)
    chunk: int = 512  # prompt tokens per prefill step
    t_submit: float = field(default_factory=time.perf_counter)  # perf_counter at submit
    t_start: float | None = None  # prefill began
    t_first: float | None = None  # first token picked
    prefilled: int = 0  # prompt tokens already in the KV state
    cached: int = 0  # of them, taken over from an earlier request with the stream (prompt caching)
    output_ids: list[int] = field(default_factory=list)  # generated tokens
    pending: int | None = None  # last token, not yet fed to the model
    logits: np.ndarray | None = None  # float32 [vocab] for the next pick
    finish_reason: str | None = None  # set once the answer ended
    constraint: Constraint | None = None  # the grammar the answer must follow (JSON schema, forced tool call)

    @classmethod
    def create(cls, request: GenerateRequest, prompt_ids: list[int], stream: ModelStream,
               tokenizer: Any, eos_ids: frozenset[int], context_length: int,
               chunk: int = 512, t_submit: float | None = None) -> "Generation":
        """context_length bounds prompt + answer; raises RequestError (a ValueError) if the
        prompt is empty or does not fit, GrammarError (one too) if its grammar does not compile."""
        if not prompt_ids:
            raise RequestError("the prompt is empty (no tokens after templating)")
        if len(prompt_ids) >= context_length:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens but the context holds "
                               f"{context_length} (prompt + answer); shorten the conversation",
                               "context_length_exceeded")
        s = request.sampling
        return cls(
            request=request, prompt_ids=list(prompt_ids), stream=stream,
            sampler=Sampler(SamplerConfig.from_params(s), prompt_ids),
            detok=Detokenizer(tokenizer, prompt_ids, s.stop, frozenset() if s.ignore_eos else eos_ids),
            max_new=min(s.max_tokens, context_length - len(prompt_ids)), chunk=chunk,
            t_submit=time.perf_counter() if t_submit is None else t_submit,
            constraint=_constraint.for_request(request, tokenizer, eos_ids, tool_format.of(tokenizer)),
            # a stream that kept an earlier request's KV for this prompt's first ids (the OpenVINO
            # backend's prompt cache) says how many; other streams start empty
            prefilled=getattr(stream, "cached", 0), cached=getattr(stream, "cached", 0))

    @property
    def request_id(self) -> str:
        return self.request.request_id


def prefill_step(gen: Generation) -> None:
    """Feed the next chunk of the prompt; sets gen.logits after the last one."""
    if gen.t_start is None:
        gen.t_start = time.perf_counter()
    part = gen.prompt_ids[gen.prefilled:gen.prefilled + gen.chunk]
    logits = gen.stream.prefill(part)
    gen.prefilled += len(part)
    if gen.prefilled == len(gen.prompt_ids):
        gen.logits = logits


def decode_one(gen: Generation) -> TokenEvent:
    """Pick one token (feeding the previous one first) and return its event."""
    if gen.pending is not None:
        gen.logits = gen.stream.decode(gen.pending)
        gen.pending = None
    logits, gen.logits = gen.logits, None
    return accept(gen, pick(gen, logits), logits)


def pick(gen: Generation, logits: np.ndarray) -> int:
    """The next token from a logits row [vocab]: the grammar's mask (when the answer
    has one), then the sampler. The one copy of this step (the pipeline's coordinator
    calls it too)."""
    if gen.constraint is not None:
        logits = gen.constraint.masked(logits)
    return gen.sampler.sample(logits)


def accept(gen: Generation, token: int, logits: np.ndarray | None = None,
           logprob: float | None = None) -> TokenEvent:
    """Take a picked token into the answer: its text, a stop string, the length limit or
    a completed grammar ending it, its logprob when asked for (from the raw logits row it
    was picked from, or -- an engine that picks elsewhere -- the logprob it reports, which
    has no alternatives). The one copy of this step; every engine's decode loop ends in it."""
    lp = _logprob(gen, token, logits, logprob)
    if gen.t_first is None:
        gen.t_first = time.perf_counter()
    gen.output_ids.append(token)
    if gen.constraint is not None:
        gen.constraint.advance(token)
    delta = gen.detok.push(token)
    if delta.stopped:
        return finished(gen, "stop", delta.text, (token,), logprobs=lp)
    if gen.constraint is not None and gen.constraint.complete:
        return finished(gen, "stop", delta.text + gen.detok.finish(), (token,), logprobs=lp)
    if len(gen.output_ids) >= gen.max_new:
        return finished(gen, "length", delta.text + gen.detok.finish(), (token,), logprobs=lp)
    gen.pending = token
    return TokenEvent(gen.request_id, text=delta.text, token_ids=(token,), logprobs=lp)


def _logprob(gen: Generation, token: int, logits: np.ndarray | None,
             logprob: float | None) -> tuple[TokenLogprob, ...]:
    n = gen.request.sampling.logprobs
    if n is None:
        return ()
    if logits is not None:
        return (token_logprob(logits, token, n, gen.detok.token_text),)
    if logprob is not None and n == 0:
        text = gen.detok.token_text(token)[:MAX_TOKEN_CHARS]
        return (TokenLogprob(int(token), text, min(float(logprob), 0.0)),)
    raise ValueError("logprobs were asked for but the token came without its logits row")


def step(gen: Generation) -> TokenEvent | None:
    """One unit of work: a prefill chunk (-> None) or one token (-> its event)."""
    if gen.prefilled < len(gen.prompt_ids):
        prefill_step(gen)
        if gen.logits is None:
            return None
    return decode_one(gen)


def decode_n(gen: Generation, n: int | None = None) -> list[TokenEvent]:
    """Run up to n token steps (all of them when None) -- for scripts and tests."""
    events: list[TokenEvent] = []
    while gen.finish_reason is None and (n is None or len(events) < n):
        ev = step(gen)
        if ev is not None:
            events.append(ev)
    return events


def finished(gen: Generation, reason: str, text: str = "", token_ids: tuple[int, ...] = (),
             error: str | None = None, logprobs: tuple[TokenLogprob, ...] = (),
             error_code: str | None = None) -> TokenEvent:
    """The final event of a request (usage and timings included); an error's code is one of
    EVENT_ERROR_CODES ("engine" when not given)."""
    gen.finish_reason = reason
    if reason in ("cancelled", "error") and not gen.detok.done:
        text += gen.detok.finish() if reason == "cancelled" else ""
    return TokenEvent(gen.request_id, text=text, token_ids=token_ids, finish_reason=reason,
                      usage=Usage(len(gen.prompt_ids), len(gen.output_ids), gen.cached),
                      timings=timings(gen), error=error, logprobs=logprobs, error_code=error_code)


def timings(gen: Generation, now: float | None = None) -> Timings:
    end = time.perf_counter() if now is None else now
    start = gen.t_start if gen.t_start is not None else end
    first = gen.t_first if gen.t_first is not None else end
    n = len(gen.output_ids)
    rate = (n - 1) / (end - first) if n >= 2 and end > first else 0.0
    return Timings(queued_s=max(0.0, start - gen.t_submit), ttft_s=max(0.0, first - gen.t_submit),
                   total_s=max(0.0, end - gen.t_submit), decode_tok_s=rate)
