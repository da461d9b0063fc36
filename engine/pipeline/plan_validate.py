"""Checking and editing user plans, and the explanation when no plan fits.

Pure functions over the plan types of ``engine.pipeline.plan``. Every issue
names its stage and says, with numbers, what is wrong. Editing helpers return
new plans with fresh predictions; a plan that overflows memory is still
returned (stages marked fits=False) so the editor can show it in red.
"""

from __future__ import annotations

from typing import Any, Sequence

from engine.pipeline.plan import (
    DEFAULT_PREFERENCE,
    DEVICE_KINDS,
    Links,
    PeerProfile,
    Plan,
    PlanError,
    PlanIssue,
    PlanModel,
    PlanRequest,
    _Fleet,
    _is_int,
    auto_plan,
    gb,
    stage_specs,
)


def validate_plan(plan_or_stages: Any, model: PlanModel, peers: Sequence[PeerProfile],
                  request: PlanRequest) -> list[PlanIssue]:
    """Every problem of a plan, in stage order; [] when it can launch.

    plan_or_stages: a Plan, Stages, dicts or (peer_id, device, start, end) tuples.
    Codes: empty_plan, malformed, empty_range, out_of_range, gap, overlap,
    unknown_peer, duplicate_peer, unknown_device, memory.
    """
    specs = stage_specs(plan_or_stages)
    if not specs:
        return [PlanIssue(None, "empty_plan", "the plan has no stages: add at least one peer")]
    L = model.num_layers
    byid = {p.peer_id: p for p in peers}
    fleet = _Fleet(model, list(byid.values()), request)
    issues: list[PlanIssue] = []
    seen: dict[str, int] = {}
    last = len(specs) - 1

    def add(i: int | None, code: str, msg: str) -> None:
        issues.append(PlanIssue(i, code, msg))

    for i, spec in enumerate(specs):
        if len(spec) != 4 or not (isinstance(spec[0], str) and isinstance(spec[1], str)
                                  and _is_int(spec[2]) and _is_int(spec[3])):
            add(i, "malformed", f"stage {i} must be (peer id, device, start layer, end layer)")
            continue
        pid, dev, s, e = spec
        ranged = True
        if e <= s:
            add(i, "empty_range", f"stage {i} has no layers: it starts at layer {s} and ends at {e}")
            ranged = False
        if s < 0 or e > L:
            bad = s if s < 0 else e
            add(i, "out_of_range", f"stage {i} covers layers {s}–{e} but the model has layers "
                                   f"0–{L} (layer {bad} is out of range)")
            ranged = False
        if i == 0 and s > 0:
            add(i, "gap", f"stage 0 starts at layer {s} but the first stage must start at layer 0")
        if i > 0 and _is_int(specs[i - 1][3]) and s != specs[i - 1][3]:
            code = "gap" if s > specs[i - 1][3] else "overlap"
            add(i, code, f"stage {i} starts at layer {s} but stage {i - 1} ends at {specs[i - 1][3]}")
        if i == last and e != L and e <= L:
            add(i, "gap", f"stage {i} ends at layer {e} but the model has {L} layers: "
                          f"layers {e}–{L} have no stage")
        peer = byid.get(pid)
        if peer is None:
            add(i, "unknown_peer", f"stage {i} uses unknown peer {pid}")
            continue
        if pid in seen:
            add(i, "duplicate_peer", f"stage {i} uses peer {peer.name or pid} again "
                                     f"(it already runs stage {seen[pid]})")
        else:
            seen[pid] = i
        if peer.device(dev) is None:
            have = ", ".join(d.name for d in peer.devices) or "none"
            add(i, "unknown_device", f"stage {i}: peer {peer.name or pid} has no device {dev} "
                                     f"(it has {have})")
        if ranged:
            w, kv, m, tot = fleet.memory(s, e, i == 0, i == last)
            if tot > peer.ram_free_bytes:
                add(i, "memory", f"peer {peer.name or pid} needs {gb(tot)} for layers {s}–{e} "
                                 f"but shares {gb(peer.ram_free_bytes)} (weights {gb(w)} + "
                                 f"KV {gb(kv)} + margin {gb(m)})")
    return issues


def _hints(fleet: _Fleet, kv: int, need: int) -> str:
    hints = ["add a peer"]
    if fleet.request.weight_precision != "int4":
        hints.append("use int4 weights")
    if kv > 0.1 * need:
        hints.append("shorten the context or serve fewer streams")
    return ", ".join(hints[:-1]) + " or " + hints[-1] if len(hints) > 1 else hints[0]


def explain_infeasible(fleet: _Fleet, usable: Sequence[str], preference: Sequence[str]) -> str:
    """Why no plan fits, with the needed and available memory in decimal GB."""
    name = fleet.model.model_id or "the model"
    if not fleet.peers:
        return f"{name} cannot be planned: the fleet has no peers"
    if not usable:
        return (f"{name} cannot be planned: no peer offers a device of kind "
                f"{', '.join(preference)}")
    L = fleet.L
    w, kv, m, need = fleet.memory(0, L, True, True)
    free = sum(fleet.peers[p].ram_free_bytes for p in usable)
    parts = f"(weights {gb(w)} + KV {gb(kv)} + margin {gb(m)})"
    if need > free:
        return (f"{name} needs {gb(need)} {parts}; the fleet has {gb(free)} free: "
                f"{_hints(fleet, kv, need)}")
    biggest = max(usable, key=lambda p: (fleet.peers[p].ram_free_bytes, p))
    cap = fleet.peers[biggest].ram_free_bytes
    for i in range(L):
        lw, lkv, lm, lneed = fleet.memory(i, i + 1, i == 0, i == L - 1)
        if lneed > cap:
            extra = ("with the embeddings " if i == 0 and fleet.emb else "") + \
                    ("with the final norm and head " if i == L - 1 and fleet.head else "")
            extra = extra.replace("embeddings with", "embeddings and")
            return (f"layer {i} of {name} {extra}needs {gb(lneed)} (weights {gb(lw)} + "
                    f"KV {gb(lkv)} + margin {gb(lm)}) but the largest peer "
                    f"({fleet.peers[biggest].name or biggest}) shares {gb(cap)}: "
                    f"{_hints(fleet, lkv, lneed)}")
    margin = fleet.request.runtime_margin_bytes
    return (f"{name} needs {gb(need)} {parts} and the fleet has {gb(free)} free, but no split "
            f"into contiguous layer ranges fits every peer (each used peer keeps a "
            f"{gb(margin)} runtime margin): {_hints(fleet, kv, need)}")


# ---------------------------------------------------------------- editing
def evaluate_plan(plan_or_stages: Any, model: PlanModel, peers: Sequence[PeerProfile],
                  request: PlanRequest, links: Links | None = None) -> Plan:
    """Predictions for an edited plan. Structural problems (ranges, peers,
    devices) raise PlanError; memory overflow only marks stages fits=False."""
    issues = [i for i in validate_plan(plan_or_stages, model, peers, request) if i.code != "memory"]
    if issues:
        raise PlanError("; ".join(i.message for i in issues), issues)
    return _Fleet(model, peers, request, links).build(stage_specs(plan_or_stages))


def move_boundary(plan: Plan, boundary_index: int, new_layer: int, model: PlanModel,
                  peers: Sequence[PeerProfile], request: PlanRequest,
                  links: Links | None = None) -> Plan:
    """Move the boundary between stage k and k + 1 (k = boundary_index) to new_layer."""
    specs = stage_specs(plan)
    k = boundary_index
    if not (_is_int(k) and 0 <= k < len(specs) - 1):
        raise PlanError(f"boundary {k} does not exist: the plan has {max(0, len(specs) - 1)} boundaries")
    lo, hi = specs[k][2] + 1, specs[k + 1][3] - 1
    if not (_is_int(new_layer) and lo <= new_layer <= hi):
        raise PlanError(f"boundary {k} must stay between layers {lo} and {hi} (got {new_layer})")
    a, b = specs[k], specs[k + 1]
    specs[k], specs[k + 1] = (a[0], a[1], a[2], new_layer), (b[0], b[1], new_layer, b[3])
    return evaluate_plan(specs, model, peers, request, links)


def exclude_peer(plan: Plan, peer_id: str, model: PlanModel, peers: Sequence[PeerProfile],
                 request: PlanRequest, links: Links | None = None,
                 device_preference: Sequence[str] = DEFAULT_PREFERENCE) -> Plan:
    """Re-plan without peer_id, keeping the devices the plan chose for the others."""
    if peer_id not in {p.peer_id for p in peers}:
        raise PlanError(f"cannot exclude unknown peer {peer_id}")
    rest = [p for p in peers if p.peer_id != peer_id]
    pins = {s.peer_id: s.device for s in plan.stages if s.peer_id != peer_id}
    return auto_plan(model, rest, request, links, device_preference, pins)


def pin_device(plan: Plan, peer_id: str, device: str, model: PlanModel,
               peers: Sequence[PeerProfile], request: PlanRequest, links: Links | None = None,
               rebalance: bool = False) -> Plan:
    """Run peer_id's stage on device. Keeps the layer ranges, or with rebalance
    re-plans over the plan's peers with their current devices pinned."""
    specs = stage_specs(plan)
    if peer_id not in [s[0] for s in specs]:
        raise PlanError(f"peer {peer_id} has no stage in this plan")
    specs = [(p, device if p == peer_id else d, a, b) for p, d, a, b in specs]
    if not rebalance:
        return evaluate_plan(specs, model, peers, request, links)
    used = {s[0] for s in specs}
    pins = {p: d for p, d, _, _ in specs}
    peer = next((p for p in peers if p.peer_id == peer_id), None)
    if peer is None or peer.device(device) is None:
        raise PlanError(f"peer {peer_id} has no device {device}")
    return auto_plan(model, [p for p in peers if p.peer_id in used], request, links,
                     DEVICE_KINDS, pins)
