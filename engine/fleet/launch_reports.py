"""What a fleet launch tells its caller: progress lines, each stage's steps as fields
(StageProgress), and the agents' events about its stages (FleetEvent)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.protocol.control import AgentEvent

Progress = Callable[[str, float], None]
STAGE_PHASES = ("export", "pack", "send", "have", "start")  # StageProgress.phase, in launch order


@dataclass(frozen=True)
class StageProgress:
    """One stage's launch step, for programs (the app's per-stage bars): what the progress
    line says in words, said as fields, so no caller parses the words."""

    stage: int  # ring position
    phase: str  # one of STAGE_PHASES: export (or pack a cached export), send, have (the peer has it), start
    fraction: float  # of this phase, 0..1
    message: str  # the same one line the Progress callback got


@dataclass(frozen=True)
class FleetEvent:
    """An agent event about a stage of this pipeline."""

    stage: int  # ring index of the stage concerned
    peer_name: str  # the agent's host name (for people)
    node_id: str  # the agent
    event: AgentEvent  # what the agent pushed
    message: str  # one line for people
