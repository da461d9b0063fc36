"""Checking and editing user plans, and the explanation when no plan fits.

Pure functions over the plan types of ``engine.planner.plan``. Every issue
names its stage and says, with numbers, what is wrong; a memory issue also
carries its shortfall and computed hints (PlanIssue.hints, FitHint): the
weight precision, the context, the number of streams or the extra peer at
which the plan would fit, in that order. Editing helpers return new plans
with fresh predictions; a plan that overflows memory is still returned
(stages marked fits=False) so the editor can show it in red.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

from engine.planner.plan import DEFAULT_PREFERENCE, auto_plan, choose_precision
from engine.planner.cost import _Fleet
from engine.planner.issues import FitHint, PlanError, PlanIssue, gb
from engine.planner.memory import AUTO, OS_RESERVE_FRACTION, OS_RESERVE_MIN_BYTES, _is_int, precision_ladder
from engine.planner.model import PlanModel
from engine.planner.peers import DEVICE_KINDS, Links, PeerProfile
from engine.planner.request import PlanRequest
from engine.planner.search import StageSpec
from engine.planner.stages import Plan, stage_specs

CONTEXT_STEP = 256  # suggested contexts are multiples of this many tokens
BISECT_STEPS = 10  # bisection steps when sizing an extra peer (0.1 % of the model's size)


def _concrete(plan_or_stages: Any, model: PlanModel, peers: Sequence[PeerProfile],
              request: PlanRequest) -> PlanRequest:
    """request at a concrete precision: a Plan's own, else for "auto" the one choose_precision picks."""
    if request.weight_precision != AUTO:
        return request
    if isinstance(plan_or_stages, Plan):
        return replace(request, weight_precision=plan_or_stages.weight_precision)
    specs = stage_specs(plan_or_stages)
    try:
        label = choose_precision(model, peers, request, specs=specs)[0]
    except (PlanError, ValueError, TypeError, KeyError, AttributeError, IndexError):
        label = model.checkpoint_precision  # malformed specs: reported below at that precision
    return replace(request, weight_precision=label)


def validate_plan(plan_or_stages: Any, model: PlanModel, peers: Sequence[PeerProfile],
                  request: PlanRequest) -> list[PlanIssue]:
    """Every problem of a plan, in stage order; [] when it can launch.

    plan_or_stages: a Plan, Stages, dicts or (peer_id, device, start, end) tuples.
    Codes: empty_plan, malformed, empty_range, out_of_range, gap, overlap,
    unknown_peer, duplicate_peer, unknown_device, memory (with shortfall_bytes
    and hints). A request precision of "auto" is checked at the plan's own
    precision (a Plan) or the most precise at which the stages fit.
    """
    specs = stage_specs(plan_or_stages)
    if not specs:
        return [PlanIssue(None, "empty_plan", "the plan has no stages: add at least one peer")]
    L = model.num_layers
    byid = {p.peer_id: p for p in peers}
    request = _concrete(plan_or_stages, model, list(byid.values()), request)
    fleet = _Fleet(model, list(byid.values()), request)
    issues: list[PlanIssue] = []
    seen: dict[str, int] = {}
    last = len(specs) - 1
    memory: list[int] = []  # stages over their peer's memory

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
            continue
        if ranged and fleet.memory(pid, dev, s, e, i == 0, i == last).total > peer.ram_free_bytes:
            memory.append(i)
    if memory and not issues:  # hints need a well-formed plan
        hints = _plan_hints(specs, model, byid, request)
    else:
        hints = {}
    for i in memory:
        pid, dev, s, e = specs[i]
        peer = byid[pid]
        mem = fleet.memory(pid, dev, s, e, i == 0, i == last)
        short = mem.total - peer.ram_free_bytes
        mine = hints.get(i, ())
        msg = (f"peer {peer.name or pid} needs {gb(mem.total)} for layers {s}–{e} but shares "
               f"{gb(peer.ram_free_bytes)} ({_parts(mem)}): {gb(short)} short{_hint_text(mine)}")
        issues.append(PlanIssue(i, "memory", msg, short, mine))
    issues.sort(key=lambda x: -1 if x.stage is None else x.stage)
    return issues


def _parts(mem: Any) -> str:
    return (f"weights {gb(mem.weights - mem.mapped)} + KV {gb(mem.kv)} + runtime {gb(mem.runtime)} "
            f"+ OS {gb(mem.os)}{_mapped_note(mem)}")


def _mapped_note(mem: Any) -> str:
    """The embedding that stays in the mapped shard file: on disk, not in the sum."""
    return f"; the {gb(mem.mapped)} embedding is read from the mapped file" if mem.mapped else ""


def _hint_text(hints: Sequence[FitHint]) -> str:
    if not hints:
        return ""
    words = [h.message for h in hints]
    joined = words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
    return f"; it fits with {joined}"


# ---------------------------------------------------------------- hints
def _bisect_max(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """The largest n in [lo, hi] with ok(n) (ok monotone: true up to some n), or None."""
    if hi < lo or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_hints(fits: Callable[[PlanRequest], bool], model: PlanModel,
                  request: PlanRequest) -> list[FitHint]:
    """Weights, context, streams hints: each the nearest change to request at which fits() holds."""
    hints: list[FitHint] = []
    ladder = precision_ladder(model.checkpoint_precision)
    here = request.weight_precision
    lower = ladder[ladder.index(here) + 1:] if here in ladder else [p for p in ("int8", "int4") if p != here]
    for label in lower:
        if fits(replace(request, weight_precision=label)):
            hints.append(FitHint("weights", f"{label} weights", weight_precision=label))
            break
    ctx = request.context_for(model)
    steps = _bisect_max(1, (ctx - 1) // CONTEXT_STEP,
                        lambda k: fits(replace(request, context_length=k * CONTEXT_STEP)))
    if steps is not None:
        c = steps * CONTEXT_STEP
        hints.append(FitHint("context", f"a {c}-token context", context_length=c))
    if request.streams > 1:
        n = _bisect_max(1, request.streams - 1, lambda k: fits(replace(request, streams=k)))
        if n is not None:
            hints.append(FitHint("streams", f"{n} stream{'s' if n > 1 else ''}", streams=n))
    return hints


def _plan_hints(specs: Sequence[StageSpec], model: PlanModel, byid: Mapping[str, PeerProfile],
                request: PlanRequest) -> dict[int, tuple[FitHint, ...]]:
    """Per overflowing stage of a well-formed plan: what makes the whole plan fit."""
    peers = list(byid.values())
    last = len(specs) - 1

    def over(req: PlanRequest) -> list[int]:
        f = _Fleet(model, peers, req)
        return [i for i, (p, d, s, e) in enumerate(specs)
                if f.memory(p, d, s, e, i == 0, i == last).total > byid[p].ram_free_bytes]

    common = _common_hints(lambda req: not over(req), model, request)
    fleet = _Fleet(model, peers, request)
    out = {}
    for i in over(request):
        hints = list(common)
        extra = _split_off(fleet, specs, i, byid)
        if extra is not None:
            k, ram = extra
            p, d, s, e = specs[i]
            hints.append(FitHint("add_peer", f"another peer sharing {_gb_up(ram)} for layers {e - k}–{e}",
                                 ram_bytes=ram))
        out[i] = tuple(hints)
    return out


def _split_off(fleet: _Fleet, specs: Sequence[StageSpec], i: int,
               byid: Mapping[str, PeerProfile]) -> tuple[int, int] | None:
    """(k, bytes): the fewest last layers of stage i to move to a new peer (on the same
    kind of device, right after it) for stage i to fit, and what that peer must share."""
    pid, dev, s, e = specs[i]
    last = len(specs) - 1
    ram = byid[pid].ram_free_bytes
    for k in range(1, e - s):
        if fleet.memory(pid, dev, s, e - k, i == 0, False).total <= ram:
            need = fleet.memory(pid, dev, e - k, e, False, i == last)
            return k, _share_for(fleet, need.total - need.os)
    return None


def _share_for(fleet: _Fleet, body: int) -> int:
    """What a new peer must share to hold body bytes plus its own OS reserve, which grows
    with its RAM (os_reserve: max(1 GB, 10 %)); we take its RAM = what it shares."""
    if fleet.request.os_reserve_bytes is not None:
        return body + fleet.request.os_reserve_bytes
    return max(body + OS_RESERVE_MIN_BYTES, -(-body * 10 // 9) if OS_RESERVE_FRACTION == 0.10
               else math.ceil(body / (1 - OS_RESERVE_FRACTION)))


def _gb_up(nbytes: int) -> str:
    """Decimal GB rounded up to 0.1: what a peer must share, never shown as less."""
    return f"{-(-nbytes // 100_000_000) / 10:.1f} GB"


# ---------------------------------------------------------------- no plan at all
def infeasible_error(fleet: _Fleet, devices: Mapping[str, str], preference: Sequence[str],
                     retry: Callable[..., bool]) -> PlanError:
    """Why no plan fits, with the needed and available memory in decimal GB and hints.

    retry(request, extra_peers=()) -> whether auto_plan then finds a plan."""
    name = fleet.model.model_id or "the model"
    if not fleet.peers:
        msg = f"{name} cannot be planned: the fleet has no peers"
        return PlanError(msg, [PlanIssue(None, "no_peers", msg)])
    usable = sorted(devices)
    if not usable:
        msg = f"{name} cannot be planned: no peer offers a device of kind {', '.join(preference)}"
        return PlanError(msg, [PlanIssue(None, "no_device", msg)])
    L = fleet.L
    best = max(usable, key=lambda p: (fleet.bw(p, devices[p]), fleet.peers[p].ram_free_bytes, p))
    dev = devices[best]
    whole = fleet.memory(best, dev, 0, L, True, True)
    free = sum(fleet.peers[p].ram_free_bytes for p in usable)
    # The model on one peer counts one OS reserve and one runtime; a fleet of n pays n of each.
    need = whole.total + sum(fleet.os(p) + fleet.fixed(p, devices[p]) for p in usable if p != best)
    hints = _common_hints(lambda req: retry(req), fleet.model, fleet.request)
    hints += _peer_hint(fleet, best, dev, whole, retry)
    biggest = max(usable, key=lambda p: (fleet.peers[p].ram_free_bytes, p))
    cap = fleet.peers[biggest].ram_free_bytes
    for i in range(L):
        one = fleet.memory(biggest, devices[biggest], i, i + 1, i == 0, i == L - 1)
        if one.total > cap:
            extra = ("with the embeddings " if i == 0 and fleet.emb else "") + \
                    ("with the final norm and head " if i == L - 1 and fleet.head else "")
            extra = extra.replace("embeddings with", "embeddings and")
            short = one.total - cap
            msg = (f"layer {i} of {name} {extra}needs {gb(one.total)} ({_parts(one)}) but the largest "
                   f"peer ({fleet.peers[biggest].name or biggest}) shares {gb(cap)}: {gb(short)} short"
                   f"{_hint_text(hints)}")
            return PlanError(msg, [PlanIssue(None, "layer_too_big", msg, short, tuple(hints))])
    if need > free:
        short = need - free
        n = len(usable)
        msg = (f"{name} at {fleet.precision} needs {gb(need)} on {n} peer{'s' if n > 1 else ''} "
               f"(weights {gb(whole.weights - whole.mapped)} + KV {gb(whole.kv)} + runtime and OS reserves "
               f"{gb(need - (whole.weights - whole.mapped) - whole.kv)}{_mapped_note(whole)}); the fleet shares {gb(free)}: {gb(short)} short"
               f"{_hint_text(hints)}")
        return PlanError(msg, [PlanIssue(None, "fleet_memory", msg, short, tuple(hints))])
    msg = (f"{name} at {fleet.precision} needs {gb(need)} and the fleet shares {gb(free)}, but no split "
           f"into contiguous layer ranges fits every peer (each used peer keeps its own runtime "
           f"and OS reserve){_hint_text(hints)}")
    return PlanError(msg, [PlanIssue(None, "fragmented", msg, 0, tuple(hints))])


def _peer_hint(fleet: _Fleet, best: str, dev: str, whole: Any,
               retry: Callable[..., bool]) -> list[FitHint]:
    """The least memory one more peer (like the fastest one) must share for a plan to exist."""
    like = fleet.peers[best]
    kind = like.device(dev)

    def with_peer(ram: int) -> bool:
        extra = PeerProfile("(another peer)", "another peer", (kind,), int(ram))
        return retry(fleet.request, [extra])

    hi = whole.total  # a peer that holds the whole model always does
    if not with_peer(hi):
        return []
    lo = 0
    for _ in range(BISECT_STEPS):
        mid = (lo + hi) // 2
        if with_peer(mid):
            hi = mid
        else:
            lo = mid
    return [FitHint("add_peer", f"another peer sharing {_gb_up(hi)}", ram_bytes=hi)]


# ---------------------------------------------------------------- editing
def evaluate_plan(plan_or_stages: Any, model: PlanModel, peers: Sequence[PeerProfile],
                  request: PlanRequest, links: Links | None = None) -> Plan:
    """Predictions for an edited plan. Structural problems (ranges, peers,
    devices) raise PlanError; memory overflow only marks stages fits=False.
    "auto" weights: the most precise at which every stage fits (choose_precision)."""
    if request.weight_precision == AUTO:
        structural = [i for i in validate_plan(plan_or_stages, model, peers, request) if i.code != "memory"]
        if structural:
            raise PlanError("; ".join(i.message for i in structural), structural)
        return choose_precision(model, peers, request, links, specs=stage_specs(plan_or_stages))[1]
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


# ---------------------------------------------------------------- tables
def memory_table(plan: Plan, peers: Sequence[PeerProfile] = ()) -> list[str]:
    """A plan's per-stage memory as Markdown table lines (docs/planner.md)."""
    names = {p.peer_id: p.name or p.peer_id for p in peers}
    out = [f"{plan.model_id}: {len(plan.stages)} stage(s), weights {plan.weight_precision}, context "
           f"{plan.context_length} x {plan.streams} stream(s){'' if plan.fits else ' -- DOES NOT FIT'}",
           "",
           "| stage | peer | layers | weights (shard) | of which mapped | KV | runtime | OS | total | shares | fits |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, s in enumerate(plan.stages):
        out.append(f"| {i} | {names.get(s.peer_id, s.peer_id)} | {s.start}–{s.end} | {gb(s.weight_bytes)} | "
                   f"{gb(s.mapped_bytes)} | {gb(s.kv_bytes)} | {gb(s.runtime_reserve_bytes)} | {gb(s.os_reserve_bytes)} | "
                   f"{gb(s.total_bytes)} | {gb(s.ram_free_bytes)} | {'yes' if s.fits else 'no'} |")
    return out


def _peers_arg(text: str) -> list[PeerProfile]:
    """"4x32" -> 4 CPU peers sharing 32 GB of 32 GB; "2x8/16": 8 GB free of 16 GB."""
    from engine.planner.peers import DeviceProfile

    count, _, size = text.partition("x")
    free, _, total = size.partition("/")
    return [PeerProfile(f"peer-{i + 1}", f"peer-{i + 1}", (DeviceProfile("CPU", "CPU"),),
                        int(float(free) * 1e9), int(float(total or free) * 1e9)) for i in range(int(count))]


def main(argv: Sequence[str] | None = None) -> int:
    """python -m engine.planner.validate MODEL_DIR --peers 4x32 [--weights int4]: the plan's table."""
    import argparse

    from engine.models.profile import profile_model

    p = argparse.ArgumentParser(prog="python -m engine.planner.validate",
                                description="print the planner's per-stage memory for a model folder "
                                            "(config.json is enough) over N equal CPU peers")
    p.add_argument("model", help="model folder")
    p.add_argument("--peers", required=True, help="COUNTxGB or COUNTxFREE/TOTAL, e.g. 4x32 or 2x8/16")
    p.add_argument("--weights", default=AUTO, help="auto or a precision label")
    p.add_argument("--context", type=int, default=None, help="tokens per stream (default: DEFAULT_CONTEXT)")
    p.add_argument("--streams", type=int, default=1)
    args = p.parse_args(argv)
    model = PlanModel.from_profile(profile_model(args.model))
    peers = _peers_arg(args.peers)
    request = PlanRequest(context_length=args.context, streams=args.streams, weight_precision=args.weights)
    try:
        plan = auto_plan(model, peers, request)
    except PlanError as e:
        print(f"{model.model_id} at {args.weights} over {args.peers} GB: does not fit: {e}")
        return 1
    print("\n".join(memory_table(plan, peers)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
