"""Step 2 of a fleet launch, the plan: what the planner sees of the agents (peer_profile,
peer_links) and LaunchPlanning, FleetSession's part that settles the plan it launches --
the user's, checked against the agents' fresh figures and never re-planned, or its own."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from engine.fleet.discovery import Peer
from engine.fleet.ring_stage import _Stage
from engine.pipeline.prompt_cache import planned_kv_bytes, stage_kv_precision
from engine.planner import weights as plan_weights
from engine.planner.plan import (DEVICE_KINDS, LOOPBACK_LINK, DeviceProfile, PeerProfile, Plan, PlanError,
                                  PlanModel, PlanRequest, auto_plan)
from engine.protocol.control import StatusReply

log = logging.getLogger(__name__)


def peer_profile(peer: Peer, status: StatusReply | None = None) -> PeerProfile:
    """What the planner needs from an agent's announcement (or fresher Status)."""
    info = status.info if status is not None else peer.info
    devices = tuple(DeviceProfile(d.name.split(".")[0].upper(), d.name) for d in info.devices
                    if d.name.split(".")[0].upper() in DEVICE_KINDS)
    # ram_available: what the agent shares now (min of free RAM and its policy cap); RAM total sizes the OS reserve.
    return PeerProfile(info.node_id, f"{info.hostname}-{info.node_id[:6]}", devices, info.ram_available,
                       info.ram_total)


def peer_links(peers: Sequence[Peer]) -> dict[tuple[str, str], Any]:
    """Peers answering on the same address are one host: loopback between them."""
    out = {}
    for a in peers:
        for b in peers:
            if a.node_id < b.node_id and a.same_host(b):
                out[(a.node_id, b.node_id)] = LOOPBACK_LINK
    return out


class LaunchPlanning:
    """FleetSession's plan step, mixed into it (engine/fleet/session.py): it reads the session's
    peers, statuses, cfg, user_plan and model figures, and sets its left_out, plan_lines, stages,
    precision and the plan's model and request (the ring provider checks a replacement with them)."""

    @property
    def kv_precision(self) -> str:
        """The workers' KV cache precision: the exact prompt cache's 16-bit one, or "" (the
        devices' defaults; exact mode's f32 comes with the worker's --exact)."""
        return stage_kv_precision(self.cfg.prompt_cache_exact, self.cfg.exact)

    @property
    def kv_bytes(self) -> float | None:
        """Bytes of a KV element at kv_precision, as the plan counts it (None: the devices' defaults)."""
        return planned_kv_bytes(self.kv_precision)

    def _make_plan(self, model: PlanModel) -> Plan:
        """The plan to launch: the user's (checked) or our own (reported); PlanError before anything is sent."""
        from engine.planner.validate import evaluate_plan
        from engine.pipeline.runner import even_split

        if self.user_plan is not None:
            return self._check_user_plan(model)
        plan_weights.check_choice(self.cfg.weights)
        usable = []
        for nid, st in self.statuses.items():
            if not st.sharing:
                self.left_out[nid] = f"not sharing now: {st.reason}"
            else:
                usable.append(self.peers[nid])
        if not usable:
            why = "; ".join(f"{self.peers[n].info.hostname}: {r}" for n, r in self.left_out.items())
            raise PlanError(f"no agent shares its PC right now ({why})")
        profiles = [peer_profile(p, self.statuses[p.node_id]) for p in usable]
        # "auto" weights: the planner picks the most precise at which its plan fits.
        request = PlanRequest(context_length=self.context_length, streams=self.streams, exact=self.cfg.exact,
                              weight_precision=self.cfg.weights, kv_dtype_bytes=self.kv_bytes)
        links = peer_links(usable)
        if self.cfg.stages is None:
            plan = auto_plan(model, profiles, request, links, self.cfg.device_preference)
        else:
            k = self.cfg.stages
            if k > len(profiles):
                raise PlanError(f"{k} stages need {k} sharing agents; {len(profiles)} found")
            chosen = sorted(profiles, key=lambda p: (-p.ram_free_bytes, p.peer_id))[:k]
            specs = []
            for prof, (s, e) in zip(chosen, even_split(model.num_layers, k)):
                kinds = [d for kind in self.cfg.device_preference for d in prof.devices if d.kind == kind]
                if not kinds:
                    raise PlanError(f"{prof.name} offers no device of kinds {', '.join(self.cfg.device_preference)}")
                specs.append((prof.peer_id, kinds[0].name, s, e))
            plan = evaluate_plan(specs, model, profiles, request, links)
            plan_weights.check_plan(plan, model, profiles, plan_weights.request_of(plan, kv_dtype_bytes=self.kv_bytes),
                                    "the plan does not fit the fleet", asked=self.cfg.weights)
        # We planned: show the plan we will use before anything is exported.
        names = {p.node_id: p.info.hostname for p in usable}
        self.plan_lines = plan_weights.describe_plan(plan, names, chosen=self.cfg.weights)
        for line in self.plan_lines:
            log.info("fleet: %s", line.strip())
            self.progress(line, 0.0)
        self._adopt(plan, model, plan_weights.request_of(plan, kv_dtype_bytes=self.kv_bytes))
        return plan

    def _check_user_plan(self, model: PlanModel) -> Plan:
        """The user's plan, unchanged, once it still fits the agents as they are now."""
        plan = self.user_plan
        precision = plan_weights.plan_precision(plan)
        if self.cfg.weights not in ("auto", precision):
            raise plan_weights.refuse(None, "weights_conflict",
                                      f"the plan's weights are {precision} but {self.cfg.weights} was asked: "
                                      "change the precision in the plan")
        if plan.model_id and model.model_id and plan.model_id != model.model_id:
            raise plan_weights.refuse(None, "model_mismatch",
                                      f"the plan is for {plan.model_id}, not {model.model_id}: plan again")
        if plan.context_length > self._trained:
            raise plan_weights.refuse(None, "context_too_long",
                                      f"the plan reserves {plan.context_length} tokens of context but "
                                      f"{self.model_id} was trained for {self._trained}")
        for i, st in enumerate(plan.stages):
            peer = self.peers.get(st.peer_id)
            if peer is None:
                raise plan_weights.refuse(i, "peer_gone", f"stage {i} (layers {st.start}–{st.end}): its peer "
                                                          f"{st.peer_id[:8]} is not among the agents any more")
            status = self.statuses.get(st.peer_id)
            if status is not None and not status.sharing:
                raise plan_weights.refuse(i, "not_sharing",
                                          f"stage {i} (layers {st.start}–{st.end}): {peer.info.hostname} does "
                                          f"not share its PC right now: {status.reason or 'policy'}")
        for nid in self.peers:
            if nid not in plan.peer_ids:
                self.left_out[nid] = "not in the plan"
        used = [self.peers[pid] for pid in dict.fromkeys(plan.peer_ids)]
        profiles = [peer_profile(p, self.statuses.get(p.node_id)) for p in used]
        # Checked as it will run: exact mode (f32 KV) if this launch asks for it, the exact prompt cache's KV.
        request = plan_weights.request_of(plan, exact=plan.exact or self.cfg.exact, kv_dtype_bytes=self.kv_bytes)
        plan_weights.check_plan(plan, model, profiles, request, "the plan no longer fits the fleet")
        self._adopt(plan, model, request)
        return plan

    def _adopt(self, plan: Plan, model: PlanModel, request: PlanRequest) -> None:
        """Stages from the plan, exactly: peer, device and layer range of each."""
        self.stages = [_Stage(i, self.peers[s.peer_id], s.device, s.start, s.end) for i, s in enumerate(plan.stages)]
        self.precision = plan_weights.plan_precision(plan)  # what every shard is exported at
        self._plan_model, self._plan_request = model, request
