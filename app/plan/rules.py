"""The plan editor's rules, apart from its widgets: why Launch or speculative decoding
is disabled, what the summary says about the weights, why a plan does not fit, and the
plan made for N simulated local stages.

Plain Python (no Qt), so the rules are easy to test and to read; app/plan/view.py
reads the editor's state, asks these, and shows the answers.
"""

from __future__ import annotations

from typing import Protocol

from engine import client

LOCAL_KINDS = ("local", "moe", "sparse")


class FleetLaunch(Protocol):
    """What the launch rules read of the fleet (app.fleet.model.FleetModel)."""

    launch_ok: bool
    launch_reason: str

    def peers(self) -> list[client.PeerCard]: ...


def launch_blocker(kind_name: str, kind: client.EngineKind | None, opening: bool, spec: str, model, profile,
                   plan, error: str, fleet: FleetLaunch | None) -> str:
    """Why Launch is disabled ("" = it is enabled); fleet is None for a plan on this PC."""
    if kind is None:
        return "checking which engines are available…"
    if not kind.available:
        return f"{kind.label} is not available: {kind.reason}"
    if opening:
        return "a launch is in progress (Cancel stops it)"
    if model is None:
        return error or "no model yet"
    if kind_name == "moe" and profile is not None and profile.experts is None:
        return f"{spec} is dense: MoE offload needs a model with experts (try demo-moe)"
    if kind_name in LOCAL_KINDS:
        return ""
    if plan is None or error:
        return f"the plan is invalid: {error}" if error else "no plan yet"
    if fleet is not None:
        return fleet_blocker(plan, fleet)
    if len({s.device for s in plan.stages}) > 1:
        return "the local runner runs every stage on one device: pick the same device for all"
    return ""


def fleet_blocker(plan, fleet: FleetLaunch) -> str:
    if not fleet.launch_ok:
        return fleet.launch_reason
    cards = {c.peer_id: c for c in fleet.peers()}
    gone = [s.peer_id for s in plan.stages if s.peer_id not in cards]
    if gone:
        return f"{len(gone)} peer(s) of this plan left the fleet: plan again"
    unpaired = [cards[s.peer_id].name for s in plan.stages if not cards[s.peer_id].paired]
    if unpaired:
        return (f"pair {', '.join(dict.fromkeys(unpaired))} first (Fleet view → Pair…): "
                "an agent obeys paired controllers only")
    busy = [f"{cards[s.peer_id].name} ({cards[s.peer_id].sharing})" for s in plan.stages
            if cards[s.peer_id].sharing_now is False]
    if busy:
        return f"not sharing right now: {', '.join(dict.fromkeys(busy))}"
    return ""


def spec_blocker(spec_ok: bool, spec_why: str, kind: str, on_fleet: bool) -> str:
    """Why speculative decoding is not offered ("" = it is)."""
    if not spec_ok:
        return spec_why
    if kind in ("moe", "sparse"):
        return f"the {kind} engine has no speculative decoding (local dense and pipeline do)"
    if kind == "pipeline" and on_fleet:
        return "not passed to the fleet launcher yet: use it on this PC's pipeline or the local engine"
    return ""


def weights_text(plan, kind: str, checkpoint: str, choice: str) -> str:
    """What the summary says about the plan's weights: the precision it will run at, and why."""
    if plan is None:
        return ""
    used = client.plan_precision(plan)
    if kind in LOCAL_KINDS:
        return f"Weights: the model's own ({checkpoint}) on the {kind} engine"
    if choice == "auto":
        why = ("the model's own precision" if used == checkpoint else
               f"the most precise at which this plan fits; the model's own {checkpoint} does not")
        return f"Weights <b>{used}</b> (auto: {why}) · context {plan.context_length} tokens"
    return f"Weights <b>{used}</b> (chosen) · context {plan.context_length} tokens"


def memory_reason(plan, model, peers: list, request, choice: str, checkpoint: str) -> str:
    """Why a plan does not fit its peers' memory (the planner's issues, in words)."""
    issues = client.validate_plan(plan, model, peers, request)
    reason = "; ".join(i.message for i in issues) or "a stage does not fit its peer's memory"
    if choice == "auto" and client.plan_precision(plan) != checkpoint:
        reason = f"even with {client.plan_precision(plan)} weights, {reason}"
    return reason


def local_stages_plan(model, peers: list, request, n: int) -> tuple:
    """(plan, note) over n simulated local stages: the planner's own plan, or the layers
    balanced over all n when the planner alone would use fewer (blocking: the Runner's)."""
    best = client.auto_plan(model, peers, request)
    if len(best.stages) >= n or n <= 1:
        return best, ""
    # Equal local stages: the planner's fewest-peers rule puts the model on one.
    kept = client.balanced_plan(model, peers, request)
    return kept, (f"The planner alone would use {len(best.stages)} of {n} stages "
                  f"({best.predicted_tok_s:.0f} tok/s predicted); the layers are balanced "
                  f"over all {n} so the pipeline runs as asked.")
