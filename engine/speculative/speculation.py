"""An engine's speculation: its defaults, its draft model, and a session per request that speculates.

The one copy behind the local engine's LocalSpeculation (engine/speculative/local.py)
and the pipeline coordinator's RingSpeculation (engine/pipeline/speculative.py): which
requests speculate (a request's own field, else the engine's default), which drafter a
request gets (the draft model, loaded once per engine, or prompt lookup), and the
SpecSession that drafts and verifies for it. What differs between the engines -- how a
verify step reaches the model -- stays in the subclasses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.protocol.messages import GenerateRequest
from engine.runtime.generation import Generation
from engine.speculative.config import SpecConfig, known_draft
from engine.speculative.drafts import DraftModel, LookupDraft
from engine.speculative.session import SpecSession


class Speculation:
    def __init__(self, config: SpecConfig, model_id: str, vocab: int, device: str = "CPU",
                 precision: str = "default", progress: Any = None) -> None:
        self.config = config
        self.model_id = model_id
        self.vocab = vocab  # the width of the target's logits
        self.device = device
        self.precision = precision
        self.progress = progress
        self.draft_model: DraftModel | None = None
        if config.mode == "draft" or config.draft_model:
            # at start, not at the first request that drafts: loading and compiling the draft inside
            # a scheduler turn stalls every running request for seconds (and, in a pipeline, leaves
            # the stages' pongs unread: a false "stopped answering" recovery on a cold cache)
            self._draft_model()

    def _draft_model(self) -> DraftModel:
        if self.draft_model is None:
            spec = self.config.draft_model or known_draft(self.model_id)
            if spec is None:
                raise ValueError(f"no draft model for {self.model_id}: start it with --draft-model")
            from engine.models import resolve_model

            path = Path(resolve_model(spec, self.progress).path)
            self.draft_model = DraftModel(path, self.device, self.precision, self.progress)
        return self.draft_model

    def wants(self, request: GenerateRequest) -> bool:
        """Whether a request speculates: its own field, else the engine's default (a request
        held to a grammar or asking logprobs says "off": GenerateRequest sees to that)."""
        return self.config.resolve(request.speculative).on

    def new_session(self, request: GenerateRequest, gen: Generation) -> SpecSession | None:
        """The drafting/verifying session of a request that speculates, else None."""
        settings = self.config.resolve(request.speculative)
        if not settings.on:
            return None
        if settings.mode == "draft":
            drafter = self._draft_model().new_drafter(self.config.compact_fraction,
                                                      self.config.compact_min_hidden)
        else:
            drafter = LookupDraft(self.config.lookup_max_ngram, self.config.lookup_min_ngram)
        return SpecSession(gen, drafter, settings, self.vocab)

    def close(self) -> None:
        if self.draft_model is not None:
            self.draft_model.close()
            self.draft_model = None
