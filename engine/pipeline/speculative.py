"""Speculative decoding over the pipeline ring (the coordinator's side).

The coordinator keeps its step loop; for a speculating stream it asks this
module for the next step and hands it the result:

    spec = ring.open(request, gen)       # at admission (None: no speculation)
    step, ids = spec.build(flight)       # once the prompt is in: [pending, d1..dk]
    tokens = spec.on_result(flight, msg, tensors)   # the tokens to emit

Each verify step carries k+1 tokens through every stage in one pass
(want_all: the last stage returns the argmax of every position, or every
logits row when the request samples). Rejected drafts stay in every stage's
KV state: the next step's `hide` names their physical positions, `position`
follows the logical length, and `compact` asks the stages to drop hidden
positions once their share crosses the configured threshold. The
coordinator mirrors the stages' masks (a VisibleMask per stream), so it
knows the physical ranges and when to compact.

Interleaving is unchanged: a stream still has at most one step in the ring,
so several streams speculate at once through the same stages. The draft
model (if any) runs here, on the coordinator, between a stream's result and
its next step.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from engine.protocol.messages import GenerateRequest
from engine.protocol.pipeline import StageResult, StageStep
from engine.runtime.generation import Generation
from engine.speculative.config import SpecConfig
from engine.runtime.kv_state import VisibleMask
from engine.speculative.session import SpecSession
from engine.speculative.speculation import Speculation

log = logging.getLogger(__name__)


class RingSpeculation(Speculation):
    """The coordinator's speculation (engine/speculative/speculation.py), with totals summed
    over finished streams for the benchmarks."""

    def __init__(self, config: SpecConfig, model_id: str, vocab: int, device: str = "CPU",
                 precision: str = "default", progress: Any = None) -> None:
        # drafted, accepted, rejections, verify steps, compactions
        self.totals = {"proposed": 0, "accepted": 0, "rejections": 0, "steps": 0, "compactions": 0}
        super().__init__(config, model_id, vocab, device, precision, progress)

    def open(self, request: GenerateRequest, gen: Generation) -> "StreamSpeculation | None":
        session = self.new_session(request, gen)
        return None if session is None else StreamSpeculation(session, self.config, self.totals)


class StreamSpeculation:
    """One stream's speculation over the ring: a mirror of the stages' masks."""

    def __init__(self, session: SpecSession, config: SpecConfig, totals: dict | None = None) -> None:
        self.session = session
        self.config = config
        self.totals = totals if totals is not None else {}
        self.mask = VisibleMask()  # mirror of every stage's visibility bits for this stream
        self.hide: list[int] = []  # flattened [start, end) ranges the next step hides
        self.verifying = False  # the step in flight is a verify step
        self.stream_id = ""  # the ring stream the mirror describes (a recovery renames streams)
        self.compacted = 0  # compactions asked of the stages
        self.stage_ms = 0.0  # summed compute ms of the stages on verify steps

    def ready(self, gen: Generation) -> bool:
        """Prompt in and a pending token: the next step is a verify step."""
        return gen.prefilled >= len(gen.prompt_ids) and gen.pending is not None

    def build(self, f: Any) -> tuple[StageStep, np.ndarray]:
        """The next verify step of flight f and its token ids [1, k+1]."""
        if f.stream_id != self.stream_id or self.mask.length != f.past:
            # Plain steps went out (the prompt), or a recovery replayed the stream under a new
            # id (prompt + answer re-prefilled, nothing hidden): the stages hold f.past visible tokens.
            self.mask.reset()
            self.mask.commit(f.past)
            self.hide = []
            self.stream_id = f.stream_id
        ids = self.session.draft()  # [pending, d1..dk]
        past = self.mask.length
        hide = tuple(self.hide)
        compact = (self.mask.hidden >= self.config.compact_min_hidden
                   and self.mask.hidden_fraction >= self.config.compact_fraction)
        if compact:
            self.mask.compacted()  # the stages drop hidden positions before running the step
            self.compacted += 1
        self.hide = []
        step = StageStep(f.stream_id, f.seq, past, reset=False, want_token=True,
                         want_logits=self.session.needs_logits, position=self.mask.visible,
                         hide=hide, compact=compact, want_all=True)
        self.verifying = True
        return step, np.array([ids], np.int64)  # token ids [1, k+1]

    def on_result(self, f: Any, msg: StageResult, tensors: list[np.ndarray], n: int) -> list[int]:
        """Tokens to emit for a verify step of n positions; sets f.past (physical)."""
        self.verifying = False
        start = self.mask.length
        self.mask.commit(n)
        f.past = self.mask.length
        self.stage_ms += sum(msg.stage_ms)
        if self.session.needs_logits:
            if len(tensors) != 1 or tensors[0].ndim != 2 or tensors[0].shape[0] != n:
                raise ValueError("the last stage did not return a logits row per position")
            tokens = self.session.verify(logits=tensors[0])
        else:
            if len(msg.tokens) != n:
                raise ValueError("the last stage did not return a token per position")
            tokens = self.session.verify(target_tokens=msg.tokens)
        r = self.session.rejected
        if r:
            end = start + n
            self.mask.hide(end - r, end)
            self.hide += [end - r, end]
        return tokens

    def is_verify_result(self, f: Any, msg: StageResult) -> bool:
        """The result answers our verify step (not a plain or replayed step)."""
        if not self.verifying:
            return False
        if f.stream_id != self.stream_id or not msg.tokens:
            self.verifying = False  # the stream was replayed meanwhile: that step is gone
            self.session.current = None
            return False
        return True

    def on_ring_reset(self, f: Any) -> None:
        """A recovery (engine/pipeline/recovery.py) renamed the stream and replays prompt +
        answer onto the new ring, nothing hidden: a verify step in flight is gone, and the
        next build() re-syncs the mirror with what the new stages hold (f.past)."""
        self.verifying = False
        self.session.current = None
        self.hide = []
        self.stream_id = ""

    def close(self) -> None:
        a = self.session.adaptive
        for key, v in (("proposed", a.proposed_total), ("accepted", a.accepted_total),
                       ("rejections", a.rejections_total), ("steps", self.session.steps),
                       ("compactions", self.compacted)):
            self.totals[key] = self.totals.get(key, 0) + v
        a.proposed_total = a.accepted_total = a.rejections_total = self.session.steps = self.compacted = 0
        self.session.close()
