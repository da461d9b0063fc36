"""Planning as the plan editor does it: peers as the planner sees them, requests, plans and their edits.

The edits (move_boundary, evaluate_plan...) are pure and take microseconds, so the editor may call
them while the user drags; plan_model is blocking."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, Union

from engine.client.fleet import PeerCard, this_pc
from engine.client.models import model_profile

if TYPE_CHECKING:
    from engine.models import ModelProfile
    from engine.planner.plan import Plan, PlanIssue, PlanModel, PlanRequest, PeerProfile

    StagesOrPlan = Union[Plan, Sequence[tuple[str, str, int, int]]]  # (peer_id, device, start, end) per stage


def plan_model(spec: str) -> tuple[PlanModel, ModelProfile]:
    """(PlanModel, ModelProfile) for a model: what the planner partitions. Blocking."""
    from engine.planner.plan import PlanModel

    profile = model_profile(spec)
    return PlanModel.from_profile(profile), profile


def local_peers(count: int, card: PeerCard | None = None) -> list[PeerProfile]:
    """`count` simulated stages on this PC ("this PC ×N"): PeerProfiles that
    share this PC's free RAM equally and offer its devices. The local runner
    starts one real worker process per stage on loopback."""
    from engine.planner.plan import DEVICE_KINDS, DeviceProfile, PeerProfile

    card = card or this_pc()
    devices = tuple(DeviceProfile(d.split(".")[0] if d.split(".")[0] in DEVICE_KINDS else "CPU", d)
                    for d in card.devices) or (DeviceProfile("CPU", "CPU"),)
    share = card.ram_free // max(1, count)
    # Each stage is sized as a PC of its share of the RAM (the OS reserve scales with it).
    return [PeerProfile(f"local-{i}", f"This PC #{i + 1}" if count > 1 else "This PC", devices, share,
                        card.ram_total // max(1, count)) for i in range(count)]


def fleet_peers(cards: Sequence[PeerCard]) -> list[PeerProfile]:
    """PeerProfiles for the planner from reachable fleet cards."""
    from engine.planner.plan import DEVICE_KINDS, DeviceProfile, PeerProfile

    out = []
    for c in cards:
        if not c.reachable:
            continue
        devs = tuple(DeviceProfile(d.split(".")[0], d) for d in c.devices if d.split(".")[0] in DEVICE_KINDS)
        out.append(PeerProfile(c.peer_id, c.name, devs or (DeviceProfile("CPU", "CPU"),), c.ram_free, c.ram_total))
    return out


# Weight precisions a plan may use; "auto" = the most precise at which the plan fits, starting at the
# checkpoint's own dtype (the planner resolves it: a Plan always holds one concrete precision).
WEIGHT_CHOICES = ("auto", "f32", "bf16", "fp16", "int8", "int4")


def plan_request(context_length: int | None = None, streams: int = 1, weight_precision: str = "auto",
                 exact_prompt_cache: bool = False) -> PlanRequest:
    """What to plan for. context_length None: the planner's default (engine.models.profile.
    DEFAULT_CONTEXT, at most the model's). weight_precision: one of WEIGHT_CHOICES ("auto" = the most precise
    at which the plan fits, from the model's own dtype, PlanModel.checkpoint_precision,
    down). Every planning function below returns a Plan at one concrete precision
    (plan_precision(plan)). PlanError (code bad_weights) for an unknown precision.
    exact_prompt_cache: the stages will keep the exact prompt cache's 16-bit KV cache
    (launch_pipeline / launch_fleet prompt_cache_exact), counted so."""
    from engine.pipeline.prompt_cache import planned_kv_bytes, stage_kv_precision
    from engine.planner.plan import PlanRequest
    from engine.planner.weights import check_choice

    kv = planned_kv_bytes(stage_kv_precision(exact_prompt_cache))
    return PlanRequest(context_length=context_length, streams=streams, weight_precision=check_choice(weight_precision),
                       kv_dtype_bytes=kv)


def plan_precision(plan: Plan) -> str:
    """The weight precision a plan's shards are exported and run at ("int4", "f32", ...)."""
    return plan.weight_precision


def auto_plan(model: PlanModel, peers: Sequence[PeerProfile], request: PlanRequest,
              pinned: dict[str, str] | None = None) -> Plan:
    """The planner's best plan (PlanError with the reason when nothing fits)."""
    from engine.planner.plan import auto_plan as plan

    return plan(model, peers, request, pinned_devices=pinned)


def balanced_plan(model: PlanModel, peers: Sequence[PeerProfile], request: PlanRequest,
                  devices: dict[str, str] | None = None) -> Plan:
    """A plan over exactly these peers in this order, layers split so the
    largest stage (by weight bytes) is as small as possible. The planner would
    put a small model on one of N equal local stages (fewest peers win a tie);
    this keeps all N, which is what "this PC ×N" is for."""
    from engine.planner.validate import evaluate_plan as evaluate

    sizes = list(model.bytes_per_layer)
    n = min(len(peers), len(sizes))
    cuts = _linear_partition(sizes, n)
    bounds = [0, *cuts, len(sizes)]
    devices = devices or {}
    specs = [(p.peer_id, devices.get(p.peer_id) or p.devices[0].name, bounds[i], bounds[i + 1])
             for i, p in enumerate(peers[:n])]
    return evaluate(specs, model, peers, request)


def _linear_partition(sizes: list[int], parts: int) -> list[int]:
    """Cut points splitting sizes into `parts` contiguous runs minimising the largest sum."""
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for e in range(k, n + 1):
            for s in range(k - 1, e):
                v = max(best[k - 1][s], prefix[e] - prefix[s])
                if v < best[k][e]:
                    best[k][e], cut[k][e] = v, s
    out, e = [], n
    for k in range(parts, 1, -1):
        e = cut[k][e]
        out.append(e)
    return sorted(out)


def evaluate_plan(stages: StagesOrPlan, model: PlanModel, peers: Sequence[PeerProfile],
                  request: PlanRequest) -> Plan:
    """Predictions for these stages ((peer_id, device, start, end) or a Plan) at the asked
    precision ("auto": the most precise at which every stage fits); a stage that
    overflows is marked fits=False, a malformed one raises PlanError."""
    from engine.planner.validate import evaluate_plan as evaluate

    return evaluate(stages, model, peers, request)


def validate_plan(stages: StagesOrPlan, model: PlanModel, peers: Sequence[PeerProfile],
                  request: PlanRequest) -> list[PlanIssue]:
    """Every issue of a plan ([] = it can launch). A Plan is checked at its own precision."""
    from engine.planner.validate import validate_plan as validate

    return validate(stages, model, peers, request)


def move_boundary(plan: Plan, index: int, layer: int, model: PlanModel, peers: Sequence[PeerProfile],
                  request: PlanRequest) -> Plan:
    from engine.planner.validate import move_boundary as move

    return move(plan, index, layer, model, peers, request)


def exclude_peer(plan: Plan, peer_id: str, model: PlanModel, peers: Sequence[PeerProfile],
                 request: PlanRequest) -> Plan:
    from engine.planner.validate import exclude_peer as exclude

    return exclude(plan, peer_id, model, peers, request)


def pin_device(plan: Plan, peer_id: str, device: str, model: PlanModel, peers: Sequence[PeerProfile],
               request: PlanRequest) -> Plan:
    from engine.planner.validate import pin_device as pin

    return pin(plan, peer_id, device, model, peers, request)
