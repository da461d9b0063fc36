"""Logits processing and token sampling, pure numpy.

Order (the same as transformers): repetition penalty -> temperature -> top-k
-> top-p -> draw. Temperature 0 means greedy (argmax after the penalty; ties go
to the lowest id, as in transformers). Each request owns one
numpy.random.Generator seeded by SamplingParams.seed (OS entropy without one),
so a seeded request draws the same tokens on every run whatever else runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engine.protocol.messages import MAX_TOKEN_CHARS, SamplingParams, TokenLogprob


@dataclass(frozen=True)
class SamplerConfig:
    temperature: float = 0.0  # 0 = greedy; otherwise logits are divided by it
    top_k: int = 0  # keep only the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set of tokens whose mass reaches top_p; 1 = off
    repetition_penalty: float = 1.0  # CTRL rule on tokens already seen; 1 = off
    seed: int | None = None  # RNG seed; None = OS entropy

    @classmethod
    def from_params(cls, p: SamplingParams) -> "SamplerConfig":
        return cls(p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.seed)


def apply_repetition_penalty(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """CTRL: for tokens in `seen`, divide positive logits by `penalty` and
    multiply negative ones by it. logits: [vocab] float32; seen: [n] int ids."""
    if penalty == 1.0 or seen.size == 0:
        return logits
    out = logits.copy()
    ids = np.unique(seen[(seen >= 0) & (seen < logits.shape[-1])])
    vals = out[ids]
    out[ids] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def apply_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Set every logit below the k-th largest to -inf (ties at the k-th are kept)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = np.partition(logits, -k)[-k]
    return np.where(logits < kth, -np.inf, logits).astype(np.float32)


def apply_top_p(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the most likely tokens until their probability mass reaches p
    (at least one token); the rest get -inf."""
    if p >= 1.0:
        return logits
    order = np.argsort(-logits, kind="stable")  # [vocab], most likely first
    probs = softmax(logits[order])
    mass_before = np.cumsum(probs) - probs  # mass of the tokens ranked above each one
    drop = order[mass_before >= p]
    out = logits.copy()
    out[drop] = -np.inf
    return out


def softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = np.exp(x - np.max(x))
    return x / x.sum()


def process_logits(logits: np.ndarray, seen: np.ndarray, cfg: SamplerConfig) -> np.ndarray:
    """Penalty, temperature, top-k, top-p. Returns processed logits [vocab]
    (for greedy only the penalty is applied)."""
    x = apply_repetition_penalty(np.asarray(logits, dtype=np.float32), seen, cfg.repetition_penalty)
    if cfg.temperature == 0.0:
        return x
    x = x / np.float32(cfg.temperature)
    x = apply_top_k(x, cfg.top_k)
    return apply_top_p(x, cfg.top_p)


def draw(logits: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from softmax(logits) by inverse CDF (one uniform per draw)."""
    probs = softmax(logits)
    cdf = np.cumsum(probs)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), probs.shape[0] - 1))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    x = x - np.max(x)
    return x - np.log(np.exp(x).sum())


def token_logprob(logits: np.ndarray, token: int, n: int, text_of: Callable[[int], str]) -> TokenLogprob:
    """The picked token's logprob under the raw logits [vocab] (what the model says, before
    temperature, top-k/top-p and penalties reshape it for the draw) and the n likeliest tokens."""
    lp = log_softmax(logits)
    top = np.zeros(0, dtype=np.int64)
    if n:  # the n best without sorting the vocabulary (128 k entries on Llama 3): partition, then sort n
        top = np.argpartition(-lp, n - 1)[:n] if n < lp.shape[0] else np.arange(lp.shape[0])
        top = top[np.lexsort((top, -lp[top]))]  # best first; equal logprobs: the lower id first
    return TokenLogprob(token_id=int(token), text=text_of(int(token))[:MAX_TOKEN_CHARS],
                        logprob=min(float(lp[token]), 0.0),
                        top_ids=tuple(int(t) for t in top),
                        top_texts=tuple(text_of(int(t))[:MAX_TOKEN_CHARS] for t in top),
                        top_logprobs=tuple(min(float(lp[t]), 0.0) for t in top))


class Sampler:
    """Per-request sampler: holds the config, the RNG and the seen tokens."""

    def __init__(self, cfg: SamplerConfig, prompt_ids: list[int] | tuple[int, ...] = ()) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self._seen = list(prompt_ids)  # prompt + output ids, for the repetition penalty

    def sample(self, logits: np.ndarray) -> int:
        """Pick the next token from last-position logits [vocab]; remembers it."""
        seen = np.asarray(self._seen, dtype=np.int64) if self.cfg.repetition_penalty != 1.0 else _EMPTY
        x = process_logits(logits, seen, self.cfg)
        token = int(np.argmax(x)) if self.cfg.temperature == 0.0 else draw(x, self.rng)
        self._seen.append(token)
        return token


_EMPTY = np.zeros(0, dtype=np.int64)
