"""Draft sources: where the K speculative tokens of a step come from.

    propose(context, k, sampling) -> Draft(tokens, q)

`context` is the whole logical sequence so far (prompt + answer, the last
token not yet run by the target). `q` holds the draft's probabilities
float64 [len(tokens), V] the tokens were drawn from (sampling), or None for a
deterministic draft (greedy, or prompt lookup: q = one-hot).

LookupDraft: model-free prompt lookup. Find the latest earlier occurrence of
the context's last n tokens (n = max..min) and propose what followed it.

ModelDraft: a small model sharing the target's tokenizer (`demo-draft` for
`demo`), compiled with OpenVINO on the coordinator. It keeps its own KV state
with the same mask-based rollback as the target: tokens of its state that
the context no longer has are hidden, the missing ones fed in one call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np

from engine.runtime.sampling import SamplerConfig, process_logits, softmax
from engine.runtime.stateful_stream import StatefulStream
from engine.speculative.verify import draw_from


@dataclass
class Draft:
    tokens: list[int]  # drafted tokens, at most k
    q: np.ndarray | None  # float64 [len(tokens), V] draft probabilities, None = deterministic
    ms: float = 0.0  # time spent drafting


class Drafter(Protocol):
    def propose(self, context: Sequence[int], k: int, sampling: SamplerConfig,
                rng: np.random.Generator, vocab: int) -> Draft: ...

    def close(self) -> None: ...


class LookupDraft:
    """Prompt lookup (n-gram) drafting; no model, no state."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, context: Sequence[int], k: int, sampling: SamplerConfig | None = None,
                rng: np.random.Generator | None = None, vocab: int = 0) -> Draft:
        t = time.perf_counter()
        return Draft(lookup(context, k, self.max_ngram, self.min_ngram), None,
                     (time.perf_counter() - t) * 1000.0)

    def close(self) -> None:
        pass


def lookup(context: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """The k tokens that followed the latest earlier match of the context's suffix."""
    seq = np.asarray(context, dtype=np.int64)
    n_all = seq.shape[0]
    if k <= 0:
        return []
    for n in range(min(max_ngram, n_all - 1), min_ngram - 1, -1):
        suffix = seq[n_all - n:]
        # windows[i] = seq[i:i+n] for i in 0..n_all-n-1 (the suffix itself excluded)
        windows = np.lib.stride_tricks.sliding_window_view(seq[:n_all - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start:start + k].tolist()
    return []


class DraftModel:
    """A compiled draft model; new_drafter() gives each stream its own state."""

    def __init__(self, source: Path, device: str = "CPU", precision: str = "default",
                 progress: Any = None) -> None:
        from engine.runtime.ov_backend import OVConfig, OVModel

        self.model = OVModel(Path(source), OVConfig(device=device, precision=precision), progress)
        names = self.model.input_names
        missing = {"attention_mask", "position_ids"} - names
        if missing:
            from engine.runtime.errors import BackendError

            raise BackendError(f"the draft model needs inputs {sorted(missing)} for mask-based rollback")
        self.model_dir = self.model.model_dir
        self.vocab = int(self.model.compiled.output("logits").get_partial_shape()[2].get_length())

    def new_drafter(self, compact_fraction: float = 0.33, compact_min_hidden: int = 64) -> "ModelDraft":
        return ModelDraft(self, compact_fraction, compact_min_hidden)

    def close(self) -> None:
        self.model.close()


class ModelDraft:
    """One stream's draft model state, rolled back by masking."""

    def __init__(self, model: DraftModel, compact_fraction: float, compact_min_hidden: int) -> None:
        self.model = model
        self.state = StatefulStream(model.model.compiled.create_infer_request(), model.model.input_names)
        self.state.reset()
        self.consumed: list[int] = []  # logical tokens whose K/V are visible, in order
        self.last_logits: np.ndarray | None = None  # after consumed[-1]
        self.compact_fraction = compact_fraction
        self.compact_min_hidden = compact_min_hidden
        self.chunk = model.model.chunk

    def _run(self, ids: Sequence[int]) -> np.ndarray:
        """Append ids; return the last position's logits [V]."""
        arr = np.asarray(ids, dtype=np.int64).reshape(1, -1)  # [1, n]
        logits = None
        for s in range(0, arr.shape[1], self.chunk):
            part = arr[:, s:s + self.chunk]
            self.state.infer({"input_ids": part}, part.shape[1])
            logits = np.array(self.state.request.get_tensor("logits").data[0, -1], dtype=np.float32)  # [V]
        self.consumed.extend(int(t) for t in ids)
        return logits

    def _sync(self, context: Sequence[int]) -> np.ndarray:
        """Make the visible state equal context; return the logits after it."""
        common = 0
        limit = min(len(self.consumed), len(context))
        while common < limit and self.consumed[common] == context[common]:
            common += 1
        if common == len(context) and common == len(self.consumed) and self.last_logits is not None:
            return self.last_logits
        if common == len(context):  # the context is a prefix of the state: re-run its last token
            common -= 1
        if common < len(self.consumed):  # hide what the context no longer has (a rejected tail)
            keep = self.state.mask.keep_index()  # logical -> physical
            self.state.hide_ranges(x for p in keep[common:] for x in (int(p), int(p) + 1))
            del self.consumed[common:]
            self.state.compact_if(self.compact_fraction, self.compact_min_hidden)
        self.last_logits = self._run(context[common:])
        return self.last_logits

    def propose(self, context: Sequence[int], k: int, sampling: SamplerConfig,
                rng: np.random.Generator, vocab: int) -> Draft:
        t = time.perf_counter()
        if k <= 0:
            return Draft([], None, 0.0)
        logits = self._sync(context)
        greedy = sampling.temperature == 0.0
        seen = list(context) if sampling.repetition_penalty != 1.0 else []
        tokens: list[int] = []
        rows = []
        for i in range(k):
            x = process_logits(logits, np.asarray(seen, np.int64), sampling)
            if greedy:
                d = int(np.argmax(x))
            else:
                q = np.zeros(max(vocab, x.shape[0]), np.float64)
                q[:x.shape[0]] = softmax(x)  # [V] (padded to the target's width)
                d = draw_from(q, rng)
                rows.append(q[:vocab] if vocab else q)
            tokens.append(d)
            if seen:
                seen.append(d)
            if i + 1 < k:
                logits = self._run([d])
                self.last_logits = logits
        q_rows = None if greedy else np.stack(rows)
        return Draft(tokens, q_rows, (time.perf_counter() - t) * 1000.0)

    def close(self) -> None:
        self.state = None
