"""What a ring recovery asks of its provider: RingLoss in, the new ring out, or RecoveryImpossible."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence


class RecoveryImpossible(Exception):
    """The provider cannot rebuild the ring; str(e) tells the user why."""


@dataclass(frozen=True)
class RingLoss:
    """What the provider is asked to repair."""

    lost: tuple[int, ...]  # ring positions to replace (empty: re-wire the same stages)
    reason: str  # one line: which stage, what happened
    stages: tuple[Any, ...]  # the ring (StageLinks) when it happened, in order
    graceful: bool = False  # a migration the peer asked for: the lost stages still serve


class RingProvider(Protocol):
    """Supplies replacement stages. replan() may block (starting processes,
    loading shards); it runs on a helper thread."""

    def replan(self, loss: RingLoss) -> Sequence[Any]:
        """The new ring, in order, each stage started and reachable (StageLinks)."""

    def retire(self, links: Sequence[Any], reason: str) -> None:
        """Stages no longer in the ring: stop them (they may already be gone)."""


class _CallableProvider:
    def __init__(self, fn: Callable[[RingLoss], Sequence[Any]]) -> None:
        self.fn = fn

    def replan(self, loss: RingLoss) -> Sequence[Any]:
        return self.fn(loss)

    def retire(self, links: Sequence[Any], reason: str) -> None:
        pass


def replan_onto(model: Any, peers: Sequence[Any], request: Any, links: Any = None) -> Any:
    """For fleet launchers: the best plan over the peers still available (the
    lost ones removed). Raises RecoveryImpossible with the planner's reason
    (e.g. "needs 9.1 GB, the remaining peers have 6.0 GB") when none fits."""
    from engine.planner.plan import auto_plan
    from engine.planner.issues import PlanError

    if not peers:
        raise RecoveryImpossible("no peer is left to host the model")
    try:
        return auto_plan(model, peers, request, links)
    except PlanError as ex:
        raise RecoveryImpossible(f"the remaining peers cannot host the model: {ex}") from None
