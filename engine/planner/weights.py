"""Weight precision as a launcher sees it: the labels users pick, the plan shown
before export, and the launch-time check of a plan the user made.

Labels, agreed across the team (exporter, planner, UI): f32, bf16, fp16,
int8, int4, and "auto" in user-facing choices: the most precise at which the
plan fits, starting at the checkpoint's own dtype (bf16 for a bf16
checkpoint, never f32 by default). The planner resolves "auto" itself
(PlanRequest(weight_precision="auto"): auto_plan / evaluate_plan /
validate_plan walk plan.precision_ladder via choose_precision), so a Plan
always carries one concrete precision -- the one its shards are exported and
its workers run at. This module only adds what launchers share on top:

- check_choice: a user's label, or a coded PlanError (bad_weights);
- request_of: the request a Plan's figures stand for, to re-check it at launch;
- check_plan / refuse: the one-line, stage-named refusals of a plan that does
  not fit (codes from validate_plan, or the launcher's own: peer_gone, ...);
- refuse_unsupported: an architecture the pipeline cannot shard, at plan time;
- describe_plan: the plan as a terminal shows it before anything is exported.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from engine.planner.issues import PlanError, PlanIssue, gb
from engine.planner.memory import AUTO, PRECISIONS, precision_ladder
from engine.planner.model import PlanModel
from engine.planner.request import PlanRequest
from engine.planner.stages import Plan

WEIGHT_CHOICES = (AUTO,) + PRECISIONS  # what the editor, the CLI and the launcher accept


def check_choice(weights: str) -> str:
    """weights if it is a label users may pick, else PlanError (code bad_weights)."""
    if weights not in WEIGHT_CHOICES:
        raise refuse(None, "bad_weights", f"weight precision {weights!r} is not one of {', '.join(WEIGHT_CHOICES)}")
    return weights


def plan_precision(plan: Plan) -> str:
    """The precision the plan's shards are exported and run at ("f32", "int4", ...)."""
    return plan.weight_precision


def request_of(plan: Plan, exact: bool | None = None, kv_dtype_bytes: float | None = None) -> PlanRequest:
    """The request a plan's figures stand for: its precision, context and streams (and
    exact mode: the plan's own unless the launch runs otherwise; kv_dtype_bytes: a KV
    cache precision the launch sets, None = the devices' defaults)."""
    return PlanRequest(context_length=plan.context_length, streams=plan.streams,
                       weight_precision=plan.weight_precision, exact=plan.exact if exact is None else exact,
                       kv_dtype_bytes=kv_dtype_bytes)


def staged(issue: PlanIssue) -> str:
    """An issue's message, led by its stage ("stage 1: peer laptop-2 needs ...")."""
    if issue.stage is None or issue.message.startswith(f"stage {issue.stage}"):
        return issue.message
    return f"stage {issue.stage}: {issue.message}"


def check_plan(plan: Any, model: PlanModel, peers: Sequence[Any], request: PlanRequest,
               what: str = "the plan cannot launch", asked: str | None = None) -> None:
    """PlanError "<what>: stage i: ..." listing every issue of the plan (validate_plan), or
    nothing. asked "auto": the head says that even the least precise weights were tried."""
    from engine.planner.validate import validate_plan

    issues = validate_plan(plan, model, peers, request)
    if issues:
        tried = precision_ladder(model.checkpoint_precision) if asked == AUTO else ()
        if len(tried) > 1:
            what += f" even with {tried[-1]} weights (auto tried {', '.join(tried)})"
        raise PlanError(f"{what}: " + "; ".join(staged(i) for i in issues), issues)


def refuse(stage: int | None, code: str, message: str) -> PlanError:
    """A PlanError with one coded issue (launchers' own refusals: peer gone, not sharing...)."""
    return PlanError(message, [PlanIssue(stage, code, message)])


def refuse_unsupported(model_path: Any) -> None:
    """Refuse, before planning or exporting, a model the pipeline cannot shard:
    a PlanError coded unsupported_architecture (one line: engine/planner/architectures.py)."""
    from engine.planner.architectures import UnsupportedArchitecture, check_model_folder

    try:
        check_model_folder(model_path)
    except UnsupportedArchitecture as e:
        raise refuse(None, e.code, str(e)) from None


def _size(nbytes: float) -> str:
    return gb(nbytes) if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def describe_plan(plan: Plan, names: Mapping[str, str] | None = None, chosen: str | None = None) -> list[str]:
    """The plan as the lines a terminal shows before anything is exported:
    a head line (stages, weights, context x streams, prediction), then one per stage."""
    names = names or {}
    how = " (auto: the most precise that fits)" if chosen == AUTO else ""
    lines = [f"plan: {len(plan.stages)} stage(s), weights {plan.weight_precision}{how}, context "
             f"{plan.context_length} tokens x {plan.streams} stream(s), {plan.predicted_tok_s:.0f} tok/s predicted"
             + ("" if plan.fits else " -- DOES NOT FIT")]
    for i, s in enumerate(plan.stages):
        lines.append(f"  stage {i}: {names.get(s.peer_id, s.peer_id)} {s.device}, layers {s.start}–{s.end}, "
                     f"{_size(s.total_bytes)} of {_size(s.ram_free_bytes)} (weights {_size(s.resident_weight_bytes)} + "
                     f"KV {_size(s.kv_bytes)} + reserves {_size(s.margin_bytes)})"
                     + (f"; embedding {_size(s.mapped_bytes)} read from the mapped file" if s.mapped_bytes else "")
                     + ("" if s.fits else " -- too big"))
    return lines
