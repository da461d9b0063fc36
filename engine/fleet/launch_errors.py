"""Agents' answers refusing stages, as the launcher's errors: one StageRefused naming every
refusing stage (engine/fleet/refusal.py), else a FleetError naming the peer."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from engine.fleet.client import AgentRefused, FleetError
from engine.fleet.refusal import StageRefusal, StageRefused
from engine.fleet.ring_stage import _Stage

log = logging.getLogger(__name__)


def _refused(st: _Stage, e: AgentRefused, step: str) -> FleetError:
    """The error for an agent's answer refusing st at step: a StageRefused from the
    Refusal's fields when it said why; else a FleetError naming the peer with its message."""
    refusal = e.refusal
    if refusal is not None:
        log.warning("fleet: %s refused stage %d at %s: %s", st.peer.info.hostname, st.index, step, e.reply.message)
        return StageRefused([StageRefusal(st.index, st.start, st.end, st.peer.info.hostname,
                                          st.peer.info.fingerprint, st.device, step, refusal)])
    peer = f"{st.peer.info.hostname} ({st.peer.info.fingerprint})"
    return FleetError(f"{peer} cannot take stage {st.index} (layers {st.start}–{st.end}): "
                      f"{e.reply.message} ({e.code})")


def _raise_refusals(results: Sequence[Any]) -> None:
    """Of gathered per-stage results: nothing when no stage failed; every stage's refusal
    as one StageRefused when all failures are refusals; else one FleetError with every
    failure's line (an unexpected exception as itself)."""
    errors = [r for r in results if isinstance(r, BaseException)]
    if not errors:
        return
    if all(isinstance(e, StageRefused) for e in errors):
        raise StageRefused([r for e in errors for r in e.refusals])
    odd = [e for e in errors if not isinstance(e, FleetError)]
    if odd or len(errors) == 1:
        raise (odd or errors)[0]
    raise FleetError("; ".join(_one_line(e) for e in errors))


def _one_line(e: BaseException) -> str:
    return (" ".join(str(e).split()) or type(e).__name__)[:200]
