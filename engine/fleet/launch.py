"""The fleet launcher: paired agents -> a plan -> shards on them -> one PipelineEngine.

    keys = controller_keys()                       # this PC's CurveZMQ identity
    peers = discover(["127.0.0.1"], want=2)        # or Peer objects of manual peers
    engine = launch_fleet(keys, peers, LaunchConfig(model="demo"), progress,
                          on_event=lambda ev: print(ev.message))
    # or launch_fleet(keys, peers, cfg, plan=plan): the user's Plan, launched as is
    ...                                            # any Engine use: submit / stream / cancel
    engine.close()                                 # also unloads every worker

Steps, each failing with a clear message before the next starts:
1. connect to every peer's control port (CURVE; NotPaired when it does not
   know our key) and ask its Status: the sharing decision, RAM, devices;
   peers that do not share right now are left out (and said why).
2. plan: the user's Plan when one is given (the plan editor's): validated
   against the agents' fresh figures (engine.planner.validate) and
   launched as is -- boundaries, per-stage peer and device, weight precision,
   context, streams -- never re-planned; a stage that no longer fits (a peer
   left or stopped sharing, its memory shrank) is refused by name. Without
   one the launcher plans by itself: `auto_plan` over those peers' profiles
   (or an even split over the `stages` best peers), weights "auto" resolved
   by the planner to the most precise that fits, and the
   plan is reported (progress lines "plan: ...") before anything is exported.
   Peers announcing the same address talk over loopback in the cost model. A
   plan that does not fit raises PlanError here: nothing was sent or started.
3. shards: each stage's range is exported (cache) at the plan's precision and sent to its agent
   as one bundle made on the fly from the shard folder (engine/fleet/bundle_view.py: no archive
   is written), resumable and hashed
   (skipped when the agent has it), all agents in parallel.
4. load: each agent starts a real shard worker (engine/shards/worker.py)
   with CURVE on its data socket, admitting this controller and the other
   agents of the ring; it reports the port it bound.
   An agent that refuses a stage at 3 (its disk) or 4 (its policy's RAM cap,
   free RAM, device, owner back, CPU busy) answers "refused" with a Refusal
   (reason, need_bytes, limit_bytes); every refusing stage is reported as one
   StageRefused (engine/fleet/refusal.py: a PlanError and a FleetError) built
   from those fields: one line per stage naming it, the peer and the numbers.
5. wire: a PipelineEngine with CURVE on every data socket: each stage's
   server key is its agent's public key, and the coordinator's return socket
   admits the ring's agent keys only.

While it runs, the agents' pushed AgentEvents (yielding: the owner came back
and the agent grants a short hand-over grace; yield: it stopped our workers;
worker_exit) are watched. An event about one of our shards becomes a
FleetEvent: logged and handed to every listener (add_listener). Then, with
recovery on (LaunchConfig.recover, the default; engine/pipeline/recovery.py):
- "yielding": engine.migrate_stage(i): a replacement is started while the
  stage still serves, the ring is re-wired onto it, every stream replayed;
  the old worker is unloaded on its agent as soon as it left the ring (the
  agent stops it itself when its grace ends first; the coordinator then
  simply pauses until the replacement is up: no token lost or repeated);
- "yield" / "worker_exit": the stage's link is marked exited, so the
  coordinator starts a recovery at its next liveness tick (< 0.2 s).
The re-plan provider (FleetRingProvider) puts a lost stage's layers on a
spare paired agent that shares its PC now and has room (the shard is sent
and loaded as at launch), else on this PC (a local shard worker, as the
local runner starts them, under this controller's key) when
LaunchConfig.local_fallback allows; else RecoveryImpossible names why, every
stream ends with an error event saying so, and the conversations are kept.
CURVE: every worker admits every agent of the session (not only its ring
neighbours at launch), so a replacement may sit anywhere in the ring.
Without recovery the engine is stopped with a clear reason ("stage 1 on
laptop-2 yielded: user returned"), so requests end at once.

Where each part lives (this module keeps launch_fleet, the entry point):
  launch_config.py     LaunchConfig
  launch_reports.py    Progress, StageProgress, FleetEvent
  controller_setup.py  controller_keys, local_address_toward, async_discover, async_pair_all
  session.py           FleetSession: steps 1 and 3-5, agent events, teardown
  launch_plan.py       step 2: peer_profile, peer_links, the session's plan (LaunchPlanning)
  launch_errors.py     agents' refusals as StageRefused / FleetError
  ring_stage.py        one stage of the ring and its worker's handle
  ring_provider.py     FleetRingProvider: recovery's re-plan onto a spare agent or this PC
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine.fleet.discovery import Peer
from engine.fleet.launch_config import LaunchConfig
from engine.fleet.launch_reports import FleetEvent, Progress
from engine.fleet.session import FleetSession
from engine.planner.plan import Plan
from engine.transport.security import KeyPair


def launch_fleet(keys: KeyPair, peers: Sequence[Peer], cfg: LaunchConfig = LaunchConfig(),
                 progress: Progress | None = None,
                 on_event: Callable[[FleetEvent], None] | None = None, *, plan: Plan | None = None) -> Any:
    """Launch `plan` as is (checked, never re-planned), or plan over the peers;
    send the shards, start the workers, wire a PipelineEngine; engine.close()
    unloads everything. Raises PlanError before anything is sent when the plan
    does not fit (naming the stage), StageRefused (a PlanError) when agents
    refuse stages (their Refusal fields in .refusals), NotPaired for an agent
    that does not know our key, FleetError/EngineError for anything else (after cleaning up)."""
    session = FleetSession(keys, peers, cfg, progress, plan=plan)
    if on_event is not None:
        session.add_listener(on_event)
    return session.launch()


__all__ = ["launch_fleet"]
