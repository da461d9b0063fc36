"""The fleet launcher takes the user's Plan as is, or plans by itself and says so.

No agent runs here: FleetSession's control step (_connect_all) is replaced
by the agents' Status replies a test wants (their RAM, sharing decision,
devices), and its export step by a recorder that stops the launch there, so
each test sees what would have been exported -- or that nothing was. The
planning between the two is the real code on the real demo model's profile.
"""

from __future__ import annotations

import time

import msgspec
import pytest

from engine.fleet.discovery import Peer
from engine.fleet.launch_config import LaunchConfig
from engine.fleet.launch_plan import peer_profile
from engine.fleet.session import FleetSession
from engine.transport.security import KeyPair
from engine.planner import weights as plan_weights
from engine.planner.plan import PlanError, PlanModel, PlanRequest
from engine.planner.validate import evaluate_plan
from engine.protocol.control import AgentInfo, DeviceInfo, StatusReply

GB = 1_000_000_000


class Exported(Exception):
    """The launch reached its export step (what it would export is recorded)."""


def _peer(name: str, ram: int, devices=("CPU", "GPU.0")) -> Peer:
    node = (name.encode().hex() + "0" * 32)[:32]
    info = AgentInfo(node, name, "Linux", "0", 1, tuple(DeviceInfo(d, "") for d in devices), 2 * ram, ram,
                     True, None, True, 1, 2, 3, KeyPair.generate().public, "0" * 16)
    return Peer(info, ("10.0.0.%d" % (len(name) % 200 + 1),), "manual", time.time())


def _status(peer: Peer, ram: int | None = None, sharing: bool = True, reason: str = "") -> StatusReply:
    info = peer.info if ram is None else msgspec.structs.replace(peer.info, ram_available=ram)
    return StatusReply("s", info, sharing, reason, ())


@pytest.fixture(scope="module")
def demo_model(demo_dir) -> PlanModel:
    from engine.models import profile_model, resolve_model

    demo_dir("demo")
    return PlanModel.from_profile(profile_model(resolve_model("demo")))


def _fake_agents(monkeypatch, peers, statuses, events: list) -> None:
    """Agents answering Status as `statuses` says (default: sharing, RAM as announced); the
    export step records what it would export and stops the launch."""
    async def connect(self) -> None:
        self.statuses = {p.node_id: statuses.get(p.node_id) or _status(p) for p in peers}

    def export(self, model_path, total) -> None:
        events.append(("export", self.precision, [(st.peer.node_id, st.device, st.start, st.end)
                                                  for st in self.stages], self.plan))
        raise Exported()

    monkeypatch.setattr(FleetSession, "_connect_all", connect)
    monkeypatch.setattr(FleetSession, "_export", export)


def _launch(monkeypatch, peers, statuses, cfg=LaunchConfig(model="demo"), plan=None):
    """Run FleetSession.launch up to its export step; (session, events, the exception that ended it)."""
    events: list[tuple] = []
    _fake_agents(monkeypatch, peers, statuses, events)
    session = FleetSession(KeyPair.generate(), peers, cfg, lambda m, f: events.append(("progress", m)), plan=plan)
    try:
        session.launch()
    except (Exported, PlanError) as e:
        return session, events, e
    raise AssertionError("the launch went past its export step")


def _user_plan(model: PlanModel, peers, weights: str, specs, context=2048, streams=3):
    """The plan an editor would hold: these stages at this precision over these peers."""
    profiles = [peer_profile(p) for p in peers]
    return evaluate_plan(specs, model, profiles, PlanRequest(context_length=context, streams=streams,
                                                             weight_precision=weights))


def _progress(events) -> list[str]:
    return [e[1] for e in events if e[0] == "progress"]


def test_the_users_plan_is_launched_as_is(monkeypatch, demo_model):
    a, b = _peer("laptop-a", 8 * GB), _peer("laptop-b", 8 * GB)
    # The user's own split, stage 0 pinned to the GPU, stage 1 to the CPU, int8 weights.
    plan = _user_plan(demo_model, [a, b], "int8", [(a.node_id, "GPU.0", 0, 3), (b.node_id, "CPU", 3, 8)])
    session, events, err = _launch(monkeypatch, [a, b], {}, plan=plan)
    assert isinstance(err, Exported), err
    assert session.plan is plan  # the very object: not re-planned, not re-evaluated
    assert events[-1][:3] == ("export", "int8", [(a.node_id, "GPU.0", 0, 3), (b.node_id, "CPU", 3, 8)])
    assert (session.context_length, session.streams) == (2048, 3)
    assert not any(m.startswith("plan:") for m in _progress(events))  # the user has seen it already
    summary = session.summary()
    assert summary["weights"] == "int8" and summary["user_plan"] and summary["streams"] == 3


@pytest.mark.parametrize("change, code", [
    ("memory", "memory"),  # the peer's free RAM shrank since the plan was drawn
    ("not_sharing", "not_sharing"),  # its owner came back
    ("gone", "peer_gone"),  # it left the fleet
    ("weights", "weights_conflict"),  # the launch asks another precision than the plan's
])
def test_a_plan_that_no_longer_fits_is_refused_naming_the_stage(monkeypatch, demo_model, change, code):
    a, b = _peer("laptop-a", 8 * GB), _peer("laptop-b", 8 * GB)
    plan = _user_plan(demo_model, [a, b], "fp16", [(a.node_id, "CPU", 0, 4), (b.node_id, "CPU", 4, 8)])
    peers, statuses, cfg = [a, b], {}, LaunchConfig(model="demo")
    if change == "memory":
        statuses[b.node_id] = _status(b, ram=100_000_000)
    elif change == "not_sharing":
        statuses[b.node_id] = _status(b, sharing=False, reason="user active")
    elif change == "gone":
        peers = [a]
    else:
        cfg = LaunchConfig(model="demo", weights="f32")
    session, events, err = _launch(monkeypatch, peers, statuses, cfg, plan=plan)
    assert isinstance(err, PlanError), err
    assert not [e for e in events if e[0] == "export"], "a plan that does not fit reached the export"
    assert [i.code for i in err.issues] == [code]
    if code != "weights_conflict":
        assert "stage 1" in str(err) and err.issues[0].stage == 1
    if code == "memory":
        assert "needs" in str(err) and "shares 0.1 GB" in str(err)
    assert "\n" not in str(err)


def test_without_a_plan_the_launcher_resolves_auto_and_shows_its_plan_first(monkeypatch, demo_model):
    a, b = _peer("laptop-a", 8 * GB), _peer("laptop-b", 8 * GB)
    specs = [(a.node_id, "GPU.0", 0, 4), (b.node_id, "GPU.0", 4, 8)]
    profiles = [peer_profile(a), peer_profile(b)]
    totals = {}
    for label in ("f32", "fp16"):
        req = PlanRequest(context_length=4096, streams=4, weight_precision=label)
        totals[label] = max(s.total_bytes for s in evaluate_plan(specs, demo_model, profiles, req).stages)
    assert totals["fp16"] < totals["f32"]
    room = (totals["f32"] + totals["fp16"]) // 2  # fp16 fits, f32 (the checkpoint's own) does not
    statuses = {p.node_id: _status(p, ram=room) for p in (a, b)}
    session, events, err = _launch(monkeypatch, [a, b], statuses, LaunchConfig(model="demo", stages=2))
    assert isinstance(err, Exported), err
    assert plan_weights.plan_precision(session.plan) == "fp16" and session.plan.fits
    assert events[-1][:2] == ("export", "fp16")
    # The plan it will use is reported before the export: a head line and one line per stage.
    lines = _progress(events)
    head = lines.index(session.plan_lines[0])
    assert session.plan_lines == lines[head:head + 3]
    assert session.plan_lines[0].startswith("plan: 2 stage(s), weights fp16 (auto")
    assert [ln.split(",")[0].strip() for ln in session.plan_lines[1:]] == ["stage 0: laptop-a GPU.0",
                                                                          "stage 1: laptop-b GPU.0"]
    # Not even int4 fits: refused before the export, saying what was tried.
    statuses = {p.node_id: _status(p, ram=100_000_000) for p in (a, b)}
    session, events, err = _launch(monkeypatch, [a, b], statuses, LaunchConfig(model="demo", stages=2))
    assert isinstance(err, PlanError) and not [e for e in events if e[0] == "export"]
    assert "even with int4 weights" in str(err) and "stage 0" in str(err)


def test_the_facade_hands_the_editors_plan_object_to_the_launcher(monkeypatch, demo_model):
    from engine import client

    a, b = _peer("laptop-a", 8 * GB), _peer("laptop-b", 8 * GB)
    cards = [client.PeerCard(peer_id=p.node_id, name=p.info.hostname, os="Linux", devices=("CPU", "GPU.0"),
                             ram_total=16 * GB, ram_free=8 * GB, idle_since=None, sharing="shared", paired=True,
                             local=False, reachable=True, handle=p) for p in (a, b)]
    plan = client.evaluate_plan([(a.node_id, "CPU", 0, 5), (b.node_id, "GPU.0", 5, 8)], demo_model,
                                client.fleet_peers(cards), client.plan_request(1024, 2, "int4"))
    events: list[tuple] = []
    _fake_agents(monkeypatch, [a, b], {}, events)
    monkeypatch.setattr(client.fleet, "_controller_keys", KeyPair.generate)  # where launch_fleet looks it up
    with pytest.raises(client.EngineError):  # the fake export's stop, as the facade reports failures
        client.launch_fleet("demo", plan, cards)
    assert events[-1][3] is plan
    assert events[-1][:3] == ("export", "int4", [(a.node_id, "CPU", 0, 5), (b.node_id, "GPU.0", 5, 8)])
