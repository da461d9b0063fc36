"""Speculation settings: the engine's defaults and one request's resolved ones."""

from __future__ import annotations

from dataclasses import dataclass

from engine.protocol.messages import MAX_SPEC_K, SPECULATIVE_MODES, SpeculativeParams

# Compaction threshold, measured by `flotilla bench spec` (docs/speculative.md):
# a hidden KV position costs attention work on every later step, while
# compacting costs one copy of the whole state (~0.3-0.6 ms per MiB on CPU).
# Compacting once a third of the state is hidden keeps the attention overhead
# at most 1.5x and amortises the copy over many steps.
COMPACT_FRACTION = 0.33
COMPACT_MIN_HIDDEN = 64  # ...and never for fewer hidden positions than this


@dataclass(frozen=True)
class SpecConfig:
    """An engine's speculation defaults (from the CLI, or the app)."""

    mode: str = "off"  # default mode for requests that do not say: off | draft | lookup
    k: int = 4  # drafted tokens per step (start value when adaptive)
    k_max: int = 8  # adaptive K never goes above this
    adaptive: bool = True  # adapt K to the running acceptance rate
    draft_model: str | None = None  # draft model spec (demo id, folder); None = the target's known draft
    compact_fraction: float = COMPACT_FRACTION  # compact the KV state once this share is hidden
    compact_min_hidden: int = COMPACT_MIN_HIDDEN  # ... and at least this many positions are
    lookup_max_ngram: int = 3  # prompt lookup: longest suffix n-gram matched
    lookup_min_ngram: int = 1  # ... shortest

    def __post_init__(self) -> None:
        if self.mode not in SPECULATIVE_MODES:
            raise ValueError(f"speculative mode must be one of {', '.join(SPECULATIVE_MODES)}")
        if not 1 <= self.k <= MAX_SPEC_K or not 1 <= self.k_max <= MAX_SPEC_K:
            raise ValueError(f"k and k_max must be in 1..{MAX_SPEC_K}")
        if not 0.0 < self.compact_fraction <= 1.0:
            raise ValueError("compact_fraction must be in (0, 1]")

    def resolve(self, params: SpeculativeParams | None) -> "SpecSettings":
        """The settings of one request: its own field wins over these defaults."""
        if params is None:
            return SpecSettings(self.mode, self.k, max(self.k, self.k_max), self.adaptive)
        k = params.k if params.k is not None else self.k
        return SpecSettings(params.mode, k, max(k, self.k_max), params.adaptive)


@dataclass(frozen=True)
class SpecSettings:
    """One request's speculation."""

    mode: str  # off | draft | lookup
    k: int  # drafted tokens per step (start value when adaptive)
    k_max: int  # adaptive ceiling
    adaptive: bool  # adapt K from the acceptance rate

    @property
    def on(self) -> bool:
        return self.mode != "off"


def known_draft(model_id: str) -> str | None:
    """The draft model that goes with a target, when Flotilla knows one."""
    return {"demo": "demo-draft"}.get(model_id)
