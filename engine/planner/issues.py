"""Why a plan cannot be made or does not fit: PlanError, PlanIssue and its FitHints."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

from engine.planner.json_form import _from_dict


class PlanError(ValueError):
    """No plan can be made or an edited plan is malformed; str(e) is for users."""

    def __init__(self, message: str, issues: Sequence[PlanIssue] = ()) -> None:
        super().__init__(message)
        self.issues = tuple(issues)  # the validation issues behind it, if any


def gb(nbytes: float) -> str:
    """Decimal gigabytes with one decimal: 41_234_000_000 -> '41.2 GB'."""
    return f"{nbytes / 1e9:.1f} GB"


@dataclass(frozen=True)
class FitHint:
    """One computed change that makes a plan fit (PlanIssue.hints, most useful first)."""

    code: str  # "weights" | "context" | "streams" | "add_peer"
    message: str  # a few words for the user: "int4 weights", "a 2048-token context"
    weight_precision: str | None = None  # "weights": the precision that fits
    context_length: int | None = None  # "context": the longest context that fits (tokens)
    streams: int | None = None  # "streams": the most streams that fit
    ram_bytes: int | None = None  # "add_peer": memory another peer must share for it to fit

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FitHint:
        return _from_dict(cls, d)


@dataclass(frozen=True)
class PlanIssue:
    stage: int | None  # index of the stage it concerns; None = the whole plan
    code: str  # machine tag: empty_plan, empty_range, out_of_range, gap, overlap, memory, ...
    message: str  # one precise sentence for the user
    shortfall_bytes: int = 0  # memory: bytes missing (need - what the peer or fleet shares)
    hints: tuple[FitHint, ...] = ()  # memory: what would make it fit, computed

    def to_dict(self) -> dict:
        return {**asdict(self), "hints": [h.to_dict() for h in self.hints]}
