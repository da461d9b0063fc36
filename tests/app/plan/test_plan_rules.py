"""The plan editor's rules without its widgets (app/plan/rules.py): why Launch and speculative
decoding are disabled, in the order a user meets the reasons."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from app.plan import rules
from engine import client


def _kind(name="pipeline", available=True, reason=""):
    return client.EngineKind(name, name.capitalize(), "", available, reason)


def _plan(*stages):
    return SimpleNamespace(stages=[SimpleNamespace(peer_id=p, device=d) for p, d in stages])


def _card(peer_id, paired=True, sharing_now=True, sharing="sharing now"):
    return SimpleNamespace(peer_id=peer_id, name=f"pc-{peer_id}", paired=paired, sharing_now=sharing_now,
                           sharing=sharing)


@dataclass
class _Fleet:
    cards: list = field(default_factory=list)
    launch_ok: bool = True
    launch_reason: str = ""

    def peers(self):
        return self.cards


def test_launch_is_blocked_first_by_the_engine_then_the_model_then_the_plan():
    plan = _plan(("a", "CPU"))
    args = dict(opening=False, spec="demo", model=object(), profile=None, plan=plan, error="", fleet=None)
    assert rules.launch_blocker("pipeline", None, **args).startswith("checking")
    assert "not available: no zmq" in rules.launch_blocker("pipeline", _kind(available=False, reason="no zmq"), **args)
    assert "in progress" in rules.launch_blocker("pipeline", _kind(), **{**args, "opening": True})
    assert rules.launch_blocker("pipeline", _kind(), **{**args, "model": None, "error": "no such model"}) \
        == "no such model"
    dense = SimpleNamespace(experts=None)
    assert "is dense" in rules.launch_blocker("moe", _kind("moe"), **{**args, "profile": dense})
    assert rules.launch_blocker("local", _kind("local"), **{**args, "plan": None}) == ""  # no plan needed
    assert "invalid: stage 0 overflows" in rules.launch_blocker("pipeline", _kind(), **{**args, "error": "stage 0 overflows"})
    two_devices = _plan(("a", "CPU"), ("a", "GPU.0"))
    assert "one device" in rules.launch_blocker("pipeline", _kind(), **{**args, "plan": two_devices})
    assert rules.launch_blocker("pipeline", _kind(), **args) == ""


def test_a_fleet_plan_needs_its_peers_present_paired_and_sharing():
    plan = _plan(("a", "CPU"), ("b", "CPU"))
    assert rules.fleet_blocker(plan, _Fleet(launch_ok=False, launch_reason="no fleet launcher")) \
        == "no fleet launcher"
    assert "1 peer(s) of this plan left" in rules.fleet_blocker(plan, _Fleet([_card("a")]))
    assert rules.fleet_blocker(plan, _Fleet([_card("a"), _card("b", paired=False)])).startswith("pair pc-b first")
    busy = _Fleet([_card("a"), _card("b", sharing_now=False, sharing="in use by its owner")])
    assert rules.fleet_blocker(plan, busy) == "not sharing right now: pc-b (in use by its owner)"
    assert rules.fleet_blocker(plan, _Fleet([_card("a"), _card("b")])) == ""


def test_speculation_is_offered_where_an_engine_can_speculate():
    assert rules.spec_blocker(False, "no draft", "local", False) == "no draft"
    assert "no speculative decoding" in rules.spec_blocker(True, "", "sparse", False)
    assert "fleet launcher" in rules.spec_blocker(True, "", "pipeline", True)
    assert rules.spec_blocker(True, "", "pipeline", False) == rules.spec_blocker(True, "", "local", False) == ""
