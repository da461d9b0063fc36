"""The engine facade for the desktop app.

This is the only engine package, besides engine.protocol, that app/ may import
(import-linter enforces it). Everything the app needs from the engines goes
through a function here, so the engine packages can change shape without the
app noticing, and so this package shows the whole app <-> engine surface:

  engines.py   engine_kinds, open_engine, engine_load, SpecChoice, speculative_available,
               draft_models, start_api_server, settle_heap
  launch.py    launch_pipeline (this PC), ring_snapshot, stage_pids, LaunchStep
  models.py    list_models, list_demo_models, model_profile, import_model_folder,
               download_model, convert_to_openvino
  planning.py  plan_model, local_peers, fleet_peers, plan_request, WEIGHT_CHOICES,
               plan_precision, auto_plan, evaluate_plan, validate_plan, move_boundary,
               exclude_peer, pin_device, balanced_plan
               (a Plan made here is what launch_pipeline / launch_fleet launch, as is)
  fleet.py     this_pc, FleetWatcher (mDNS + manual peers, live), pair_peer,
               pairing_code_for, fleet_launch_available, launch_fleet,
               peer_addresses, add_peer_address, remove_peer_address
  agent.py     AgentHandle: this PC's agent as its tray drives it (state, pairing
               requests accept/deny, revoke, pause, share now, policy)
  settings.py  config_dir, settings_dir, data_dir, sharing_policy_path, load/save_sharing_policy

The app calls them as `client.name` (from engine import client), so a test may
replace one on this package. Heavy imports (torch, OpenVINO, transformers, zmq)
happen lazily inside the functions, so importing this package is cheap and the
app can show its window before any engine code is loaded. No Qt here. Functions
marked "blocking" run on the app's background runner, never on the GUI thread.
The planner's types (Plan, PlanModel, PlanError...) are engine.planner.plan's,
imported on first use.
"""

from __future__ import annotations

from typing import Any

from engine.client._common import Progress
from engine.client.agent import AgentHandle, AgentState, PairedController, PairingRequest
from engine.client.engines import (SPEC_MAX_K, SPEC_MODES, EngineKind, SpecChoice, draft_models, engine_kinds,
                                   engine_load, open_engine, settle_heap, speculative_available,
                                   start_api_server)
from engine.client.fleet import (FleetChange, FleetWatcher, PeerCard, add_peer_address, controller_name,
                                 fleet_launch_available, launch_fleet, pair_peer, pairing_code_for, peer_addresses,
                                 remove_peer_address, this_pc)
from engine.client.launch import LaunchCancelled, LaunchStep, RingSnapshot, RingStage, launch_pipeline, \
    ring_snapshot, stage_pids
from engine.client.models import (DownloadPaused, convert_to_openvino, download_model, import_model_folder,
                                  list_demo_models, list_models, model_profile)
from engine.client.planning import (WEIGHT_CHOICES, auto_plan, balanced_plan, evaluate_plan, exclude_peer,
                                    fleet_peers, local_peers, move_boundary, pin_device, plan_model, plan_precision,
                                    plan_request, validate_plan)
from engine.client.settings import (config_dir, data_dir, load_sharing_policy, save_sharing_policy, settings_dir,
                                    sharing_policy_path)
from engine.core.interface import Engine, EngineError, EngineInfo

__all__ = [
    "AgentHandle", "AgentState", "DownloadPaused", "Engine", "EngineError", "EngineInfo", "EngineKind",
    "FleetChange", "FleetWatcher", "LaunchCancelled", "LaunchStep", "PairedController", "PairingRequest",
    "PeerCard", "Progress", "RingSnapshot", "RingStage", "SPEC_MAX_K", "SPEC_MODES", "SpecChoice",
    "open_engine", "engine_kinds", "engine_load", "launch_pipeline", "launch_fleet", "ring_snapshot",
    "stage_pids", "settle_heap", "speculative_available", "draft_models", "list_demo_models", "list_models",
    "model_profile", "import_model_folder", "download_model", "convert_to_openvino", "plan_model",
    "local_peers", "fleet_peers", "plan_request", "auto_plan", "balanced_plan", "evaluate_plan",
    "validate_plan", "plan_precision", "WEIGHT_CHOICES", "move_boundary", "exclude_peer", "pin_device",
    "this_pc", "controller_name", "pair_peer", "pairing_code_for", "fleet_launch_available",
    "peer_addresses", "add_peer_address", "remove_peer_address", "config_dir", "settings_dir", "data_dir",
    "sharing_policy_path", "load_sharing_policy", "save_sharing_policy", "start_api_server",
]

# The planner's types, imported on first use (numpy): PlanError, Plan, ...
_PLAN_NAMES = {"PlanError", "Plan", "PlanModel", "PlanRequest", "PeerProfile", "DeviceProfile",
               "Stage", "PlanIssue"}


def __getattr__(name: str) -> Any:
    if name in _PLAN_NAMES:
        from engine.planner import plan

        return getattr(plan, name)
    raise AttributeError(f"module 'engine.client' has no attribute {name!r}")
