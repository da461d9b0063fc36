"""One request's speculation, independent of where the target runs.

    s = SpecSession(gen, drafter, settings, vocab)
    feed = s.draft()                 # [pending, d1..dk]: what the target runs next
    tokens = s.verify(target_tokens=..., logits=...)   # what to emit
    event = emit_tokens(gen, tokens) # detokenize, stop, length

The transport (LocalEngine's masked stream, or the pipeline ring) runs `feed`
as one step with every position's output, then hides the last
`s.rejected` positions of that step (mask-based rollback).
"""

from __future__ import annotations

import time
from typing import Sequence

import msgspec
import numpy as np

from engine.protocol.messages import TokenEvent
from engine.runtime.generation import Generation, accept
from engine.runtime.sampling import process_logits, softmax
from engine.speculative.adaptive import AdaptiveK
from engine.speculative.config import SpecSettings
from engine.speculative.drafts import Draft, Drafter
from engine.speculative.verify import greedy_accept, speculative_sample


class SpecSession:
    def __init__(self, gen: Generation, drafter: Drafter, settings: SpecSettings, vocab: int) -> None:
        self.gen = gen
        self.drafter = drafter
        self.settings = settings
        self.vocab = vocab
        self.cfg = gen.sampler.cfg
        self.adaptive = AdaptiveK(settings.k, settings.k_max, settings.adaptive)
        # Greedy without a penalty verifies on the target's own argmax tokens; anything
        # else needs every position's logits row.
        self.needs_logits = not (self.cfg.temperature == 0.0 and self.cfg.repetition_penalty == 1.0)
        self.current: Draft | None = None  # the draft in flight
        self.rejected = 0  # drafts of the last verified step that were rejected (to hide)
        self._t_sent = 0.0
        self.steps = 0  # verify steps done

    def context(self) -> list[int]:
        return self.gen.prompt_ids + self.gen.output_ids

    def draft(self) -> list[int]:
        """Tokens for the target's next step: the pending token, then the drafts."""
        gen = self.gen
        if gen.pending is None:
            raise RuntimeError("nothing pending: the first token comes from the prefill")
        room = gen.max_new - len(gen.output_ids) - 1  # drafts + 1 bonus token must fit
        k = max(0, min(self.adaptive.k, room))
        self.current = self.drafter.propose(self.context(), k, self.cfg, gen.sampler.rng, self.vocab)
        self._t_sent = time.perf_counter()
        return [gen.pending, *self.current.tokens]

    def verify(self, target_tokens: Sequence[int] | None = None, logits: np.ndarray | None = None) -> list[int]:
        """Tokens to emit for the step in flight (target_tokens [k+1] or logits [k+1, V])."""
        d = self.current
        if d is None:
            raise RuntimeError("no draft in flight")
        k = len(d.tokens)
        step_ms = (time.perf_counter() - self._t_sent) * 1000.0
        if not self.needs_logits:
            if target_tokens is None or len(target_tokens) != k + 1:
                raise ValueError("the target returned no token for every position")
            out = greedy_accept(d.tokens, target_tokens)
        else:
            if logits is None or logits.ndim != 2 or logits.shape[0] != k + 1:
                raise ValueError("the target returned no logits row for every position")
            out = self._sample(d, logits)
        accepted = len(out) - 1
        self.rejected = k - accepted
        self.adaptive.update(k, accepted, d.ms, step_ms)
        self.current = None
        self.steps += 1
        return out

    def _sample(self, d: Draft, logits: np.ndarray) -> list[int]:
        """Target probabilities per position (the request's processing), then the rule."""
        seen = self.context()
        rows = []
        for j in range(len(d.tokens) + 1):
            s = np.asarray(seen, np.int64) if self.cfg.repetition_penalty != 1.0 else _EMPTY
            x = process_logits(logits[j], s, self.cfg)
            if self.cfg.temperature == 0.0:  # greedy with a penalty: one-hot on the argmax
                p = np.zeros(x.shape[0]); p[int(np.argmax(x))] = 1.0
            else:
                p = softmax(x)
            rows.append(p)
            if j < len(d.tokens):
                seen.append(d.tokens[j])
        p = np.stack(rows)  # [k+1, V]
        q = d.q
        if q is not None and q.shape[1] != p.shape[1]:
            w = min(q.shape[1], p.shape[1])
            q2 = np.zeros((q.shape[0], p.shape[1])); q2[:, :w] = q[:, :w]
            q = q2
        if self.cfg.temperature == 0.0:
            q = None  # a greedy draft is deterministic
        return speculative_sample(d.tokens, p, q, self.gen.sampler.rng)

    def close(self) -> None:
        self.drafter.close()


_EMPTY = np.zeros(0, np.int64)


def emit_tokens(gen: Generation, tokens: Sequence[int]) -> TokenEvent:
    """Append verified tokens to the answer through generation.accept (the one token step:
    EOS/stop strings, length), as one event carrying every token kept (final when the answer
    ended); tokens after the end are dropped. Leaves gen.pending at the last token."""
    text, kept = "", []
    for token in tokens:
        event = accept(gen, int(token))
        text += event.text
        kept.extend(event.token_ids)
        if event.finish_reason is not None:
            return msgspec.structs.replace(event, text=text, token_ids=tuple(kept))
    return TokenEvent(gen.request_id, text=text, token_ids=tuple(kept))
