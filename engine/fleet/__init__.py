"""The fleet: agents that lend an idle PC to a controller, and how they are found.

  mdns.py       advertise/browse `_flotilla._tcp.local.` (async core + sync wrapper)
  discovery.py  the small Discovery interface, Peer, ManualPeers (host:port list)
  identity.py   stable node id, repaired when an install is cloned
  idle.py       how long the local user has been away, per platform
  policy.py     when the owner lets the PC be used (idle minutes, AC, RAM, devices)
  shards.py     shard store: resumable, hash-verified chunked receive
  workers.py    shard worker child processes
  agent.py      the agent: info/pairing/control sockets, policy enforcement
  agent_config.py   what an agent is started with (AgentConfig)
  agent_process.py  the agent as a process: log file, run_agent, stop signals, stdin lifeline
  client.py     the controller's side of the control plane
  bundle.py     one deterministic tar per shard folder, for the shard store; safe unpack
  launch.py     the fleet launcher: peers -> plan -> shards -> workers -> PipelineEngine
                (launch_fleet; its docstring lists the modules below)
  launch_config.py    LaunchConfig
  launch_reports.py   what a launch reports: progress, StageProgress, FleetEvent
  controller_setup.py the controller's key pair and address; finding and pairing agents
  session.py          FleetSession: one pipeline's agents, shards, workers and events
  launch_plan.py      the launch's plan step (peer_profile, peer_links, LaunchPlanning)
  launch_errors.py    agents' refusals of stages as StageRefused / FleetError
  ring_stage.py       one stage of the ring and its worker's handle
  ring_provider.py    FleetRingProvider: recovery's re-plan onto a spare agent or this PC
  demo_mode.py  the gate that lets `flotilla demo` pair its own agents unattended

CurveZMQ keys, pairing codes, the allow-list and CURVE on the data plane are
engine/transport/ (security.py, curve_data.py), which the pipeline uses too.

docs/fleet.md explains discovery, pairing, the threat model and the ports.
"""
