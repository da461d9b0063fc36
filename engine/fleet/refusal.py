"""An agent's refusal of a stage, as the launcher reports it: built from the
Refusal fields the agent sent (engine.protocol.errors), never from its text.

    try:
        launch_fleet(keys, peers, cfg, plan=plan)
    except StageRefused as e:            # also a PlanError and a FleetError
        for r in e.refusals:             # one per refusing stage
            r.stage, r.refusal.reason, r.refusal.need_bytes, r.refusal.limit_bytes
        str(e)                           # one line: stage, peer, device, why, numbers

An agent refuses at two steps: "prepare" (its disk cannot take the shard;
before any byte travels) and "load" (the worker would not fit its owner's
policy or its free RAM, the device is not shared, the PC is busy, or the
owner is back). Either way the plan cannot run on the fleet as it is, so
StageRefused is a PlanError whose issues name the stage (code = the reason),
which the app and engine.client already show and pass through.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.fleet.client import FleetError
from engine.planner.plan import PlanError, PlanIssue
from engine.protocol.errors import Refusal

# What each reason means to the person launching, and how its limit_bytes reads.
_WHY = {
    "not_sharing": "its owner does not share the PC right now",
    "device": "the device is not one its owner shares",
    "policy_cap": "over its owner's RAM limit for fleet work",
    "ram": "not enough free RAM",
    "cpu_busy": "the PC is too busy to start work",
    "disk": "not enough free disk for the shard",
}
_LIMIT = {
    "policy_cap": "the limit leaves {}",
    "ram": "{} free after the OS reserve",
    "disk": "{} free",
}
STEPS = ("prepare", "load")  # where the agent refused: before the transfer, or at the worker's start


def size(nbytes: int) -> str:
    """'3.12 GB' or '512.0 MB': a refusal is often about a few MB of margin."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def describe(refusal: Refusal) -> str:
    """A refusal in a few words with its numbers: 'not enough free RAM: needs 3.10 GB, 2.00 GB free
    after the OS reserve'."""
    why = _WHY[refusal.reason]
    limit = _LIMIT.get(refusal.reason)
    if limit is None:
        return why
    return f"{why}: needs {size(refusal.need_bytes)}, {limit.format(size(refusal.limit_bytes))}"


@dataclass(frozen=True)
class StageRefusal:
    """One stage an agent refused."""

    stage: int  # index of the stage in the plan
    start: int  # its first layer
    end: int  # its last layer + 1
    peer: str  # the agent's hostname
    fingerprint: str  # its key's fingerprint (hostnames are not unique)
    device: str  # the device the stage asked for
    step: str  # one of STEPS
    refusal: Refusal  # the agent's why, from the wire

    def why(self) -> str:
        """The reason and numbers alone (a stage row already names the peer and layers)."""
        return describe(self.refusal)

    def line(self) -> str:
        """One line naming the stage, the peer, the device, the reason and the numbers."""
        return (f"{self.peer} ({self.fingerprint}) refused stage {self.stage} (layers {self.start}–{self.end} "
                f"on {self.device}): {self.why()}")


class StageRefused(PlanError, FleetError):
    """Agents refused stages of the plan; .refusals has the fields, str(e) the lines."""

    def __init__(self, refusals: Sequence[StageRefusal]) -> None:
        self.refusals = tuple(sorted(refusals, key=lambda r: r.stage))
        issues = [PlanIssue(r.stage, r.refusal.reason, r.line(), shortfall_bytes=r.refusal.shortfall_bytes)
                  for r in self.refusals]
        super().__init__("; ".join(r.line() for r in self.refusals), issues)


__all__ = ["STEPS", "StageRefusal", "StageRefused", "describe", "size"]
