"""The pure partition planner: (model, peers, request) -> a pipeline plan.

A plan cuts a model's layers into contiguous half-open ranges ``[start, end)``,
one per peer, in ring order. Everything here is a pure function of plain,
frozen, JSON-serialisable data: no I/O, no clock, no randomness.

Cost model (per generated token, decode):
- Compute of a stage = bytes it reads / the device's effective bandwidth.
  Bytes = its layers' weights (at the requested precision), plus the final
  norm + LM head on the last stage. Decode is memory-bound, so this is a
  bandwidth model; a calibrated ``ms_per_layer_token`` turns into an effective
  bandwidth of ``mean layer bytes / ms``.
- Hop of a stage = the outgoing link's latency + bytes * 8 / bandwidth: the
  hidden state (``activation_bytes_per_token``) to the next stage, or a token
  id (``RETURN_BYTES``) from the last stage back to the first stage's peer,
  where the coordinator sits. The same peer talks over loopback.
- Stage time = compute + hop. Single-stream tok/s = 1000 / cycle, cycle = sum
  of stage times. With k interleaved streams, aggregate tok/s =
  min(k * 1000 / cycle, 1000 / bottleneck), bottleneck = max stage time; it
  reaches 1000 / bottleneck once k >= number of stages.
Memory of a stage (docs/planner.md has the measurements behind each number):
- weights: its layers (+ embeddings on stage 0, + head on the last) at the
  plan's precision, per tensor kind as the exporter writes them
  (``weight_bytes_of``: int4 groups of 128 + f16 scales, embedding/head and the
  shard's last MatMul in int8, norms f32);
- KV: elements/token/layer * context_length * streams * its layers * the
  bytes per element of the runtime's KV cache (``kv_element_bytes``: u8 +
  per-token scales on CPU by default, f32 in exact mode);
- runtime reserve: measured fixed memory of a worker process + the prefill
  chunk's activations and attention scores (``runtime_reserve``), + on a CPU
  the routed MoE experts' bytes once more (``EXPERT_COPIES``: the plugin ends
  up holding them twice);
- OS reserve: what the peer leaves to its OS and owner (``os_reserve``).
The constants and byte formulas live in ``planner.memory``; the search in ``planner.search``.
The sum must fit the peer's ``ram_free_bytes`` = min(free RAM, the agent's
sharing-policy cap). A weight precision of "auto" is resolved by
``choose_precision``: the checkpoint's own dtype if it fits, else int8, else
int4.

``auto_plan`` minimises the bottleneck exactly for every peer order (all
orders up to ``MAX_EXHAUSTIVE_PEERS`` peers, one speed-sorted order beyond) by
a DP over layer boundaries; among plans within a relative 1e-6 of the best
bottleneck it takes the fewest peers, then the smallest cycle, then the first
order in peer-id order. Checking and editing user plans (validate_plan,
evaluate_plan, move_boundary, exclude_peer, pin_device) live in ``planner.validate``.

The types live in ``plan_peers`` (PeerProfile, DeviceProfile, LinkProfile),
``plan_model`` (PlanModel), ``plan_request`` (PlanRequest), ``plan_stages``
(Plan, Stage) and ``plan_issues`` (PlanError, PlanIssue, FitHint); the cost
model in ``plan_cost``. This module is the planner's entry point and re-exports
them (``__all__``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping, Sequence

from engine.planner.cost import _Fleet
from engine.planner.issues import FitHint, PlanError, PlanIssue
from engine.planner.memory import (
    AUTO, DEFAULT_HEAD_DIM, EMBEDDING_MAPPED, DEQUANT_COPIES, INT4_GROUP_SIZE, KV_DEFAULT_PRECISION, KV_PRECISION_BYTES,
    KV_U8_GROWTH, OS_RESERVE_FRACTION, OS_RESERVE_MIN_BYTES, PRECISION_BYTES, PRECISION_LADDERS, PRECISIONS,
    PREFILL_CHUNK, RUNTIME_RESERVE_BYTES, RUNTIME_RESERVE_FRACTION, SCALE_BYTES, SCORE_COPIES,
    U8_KV_SCALE_BYTES, VECTOR_BYTES, ZERO_POINT_BYTES, WeightCounts,
    check_precision, embedding_mapped, embedding_table_bytes, expert_copies, kv_element_bytes, kv_growth, os_reserve, precision_ladder, prefill_scratch,
    weight_bytes_of)
from engine.planner.model import PlanModel
from engine.planner.peers import (
    DEFAULT_LINK, DEVICE_KINDS, LOOPBACK_LINK, DeviceProfile, LinkProfile, Links, PeerProfile)
from engine.planner.request import PlanRequest
from engine.planner.search import MAX_EXHAUSTIVE_PEERS, REL_TIE, Search, StageSpec
from engine.planner.stages import Plan, Stage

# The planner's public names: what it makes plans from and of, and (plan.X stays the public
# name of each) planner.memory's constants and byte formulas.
__all__ = [
    # entry points (here)
    "DEFAULT_PREFERENCE", "auto_plan", "choose_precision",
    # types
    "DEFAULT_LINK", "DEVICE_KINDS", "LOOPBACK_LINK", "DeviceProfile", "FitHint", "LinkProfile", "Links",
    "MAX_EXHAUSTIVE_PEERS", "PeerProfile", "Plan", "PlanError", "PlanIssue", "PlanModel", "PlanRequest", "Stage",
    "StageSpec",
    # planner.memory
    "AUTO", "DEFAULT_HEAD_DIM", "EMBEDDING_MAPPED", "DEQUANT_COPIES", "INT4_GROUP_SIZE", "KV_DEFAULT_PRECISION",
    "KV_PRECISION_BYTES", "KV_U8_GROWTH", "OS_RESERVE_FRACTION", "OS_RESERVE_MIN_BYTES", "PRECISION_BYTES",
    "PRECISION_LADDERS", "PRECISIONS", "PREFILL_CHUNK", "RUNTIME_RESERVE_BYTES", "RUNTIME_RESERVE_FRACTION",
    "SCALE_BYTES", "SCORE_COPIES", "U8_KV_SCALE_BYTES", "VECTOR_BYTES", "ZERO_POINT_BYTES", "WeightCounts",
    "check_precision", "embedding_mapped", "embedding_table_bytes", "expert_copies", "kv_element_bytes", "kv_growth",
    "os_reserve", "precision_ladder", "prefill_scratch", "weight_bytes_of",
]

DEFAULT_PREFERENCE = ("GPU", "NPU", "CPU")


# ---------------------------------------------------------------- search

def auto_plan(model: PlanModel, peers: Sequence[PeerProfile], request: PlanRequest,
              links: Links | None = None, device_preference: Sequence[str] = DEFAULT_PREFERENCE,
              pinned_devices: Mapping[str, str] | None = None) -> Plan:
    """The plan with the smallest bottleneck, then fewest peers, then smallest cycle.

    Each peer runs on its fastest device among the kinds in device_preference
    (ties: earlier kind) unless pinned_devices names one. A weight precision of
    "auto" is resolved by choose_precision. Raises PlanError when nothing fits:
    its message and its issue say what is needed, what the fleet shares, and
    what would make it fit (PlanIssue.hints).
    """
    if request.weight_precision == AUTO:
        return choose_precision(model, peers, request, links, device_preference, pinned_devices)[1]
    return _plan_at(model, peers, request, links, device_preference, pinned_devices, explain=True)


def choose_precision(model: PlanModel, peers: Sequence[PeerProfile], request: PlanRequest,
                     links: Links | None = None, device_preference: Sequence[str] = DEFAULT_PREFERENCE,
                     pinned_devices: Mapping[str, str] | None = None,
                     specs: Sequence[StageSpec] | None = None) -> tuple[str, Plan]:
    """(precision, plan) at the most precise weights that fit: for "auto" the
    checkpoint's own dtype, else int8, else int4 (precision_ladder); a concrete
    request precision is the only one tried.

    specs None: auto_plan at each precision; PlanError (with hints) when even the
    last does not fit. specs given (a user's stages): the first precision at which
    every stage fits, else the last one's plan with its stages marked fits=False.
    """
    asked = request.weight_precision
    ladder = precision_ladder(model.checkpoint_precision) if asked == AUTO else (check_precision(asked),)
    plan: Plan | None = None
    for i, label in enumerate(ladder):
        req = replace(request, weight_precision=label)
        if specs is not None:
            from engine.planner.validate import evaluate_plan

            plan = evaluate_plan(specs, model, peers, req, links)
            if plan.fits:
                return label, plan
            continue
        try:
            return label, _plan_at(model, peers, req, links, device_preference, pinned_devices,
                                   explain=i == len(ladder) - 1)
        except PlanError as e:
            if i == len(ladder) - 1:
                if len(ladder) > 1:
                    raise PlanError(f"{e} (auto tried weights {', '.join(ladder)})", e.issues) from None
                raise
    assert plan is not None
    return ladder[-1], plan


def _plan_at(model: PlanModel, peers: Sequence[PeerProfile], request: PlanRequest,
             links: Links | None, device_preference: Sequence[str],
             pinned_devices: Mapping[str, str] | None, explain: bool) -> Plan:
    """auto_plan at the request's concrete precision; explain: hints in the PlanError."""
    fleet = _Fleet(model, peers, request, links)
    pinned = dict(pinned_devices or {})
    unknown = sorted(set(pinned) - set(fleet.peers))
    if unknown:
        raise PlanError(f"cannot pin a device on unknown peer {', '.join(unknown)}")
    devices = {}
    for pid in fleet.peers:
        d = fleet.best_device(pid, device_preference, pinned)
        if d is not None:
            devices[pid] = d
    search = Search(fleet, devices)
    per_m = search.bottlenecks() if devices else {}
    finite = {m: b for m, b in per_m.items() if math.isfinite(b)}
    if not finite:
        if not explain:
            raise PlanError(f"{model.model_id or 'the model'} does not fit the fleet")
        from engine.planner.validate import infeasible_error

        def retry(req: PlanRequest, extra: Sequence[PeerProfile] = ()) -> bool:
            try:
                _plan_at(model, [*peers, *extra], req, links, device_preference, pinned, explain=False)
                return True
            except PlanError:
                return False

        raise infeasible_error(fleet, devices, device_preference, retry)
    best = min(finite.values())
    m = min(k for k, b in finite.items() if b <= best * (1 + REL_TIE))
    limit = max(finite[m], best) * (1 + REL_TIE)
    return fleet.build(search.cheapest(m, limit))
