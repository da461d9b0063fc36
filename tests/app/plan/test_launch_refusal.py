"""A fleet launch that agents refuse: the plan editor says on each refused
stage's row why, from the refusal's fields, and the whole line below.

The editor runs the real planner on the demo model; the launch itself is faked
at the facade seam (client.launch_fleet) raising what the launcher raises when
an agent answers "refused" (engine/fleet/refusal.py)."""

from __future__ import annotations

import pytest

from app_helpers import open_plan_view
from engine import client
from engine.fleet.refusal import StageRefusal, StageRefused
from engine.protocol.errors import Refusal

GB = 1_000_000_000


def _card(name: str, ram: int) -> client.PeerCard:
    peer_id = (name.encode().hex() + "0" * 32)[:32]
    return client.PeerCard(peer_id=peer_id, name=name, os="Linux", devices=("CPU",),
                           ram_total=2 * ram, ram_free=ram, idle_since=None, sharing="shared", paired=True,
                           local=False, reachable=True, address=f"{name}:5570",
                           device_names=("CPU",), source="manual", sharing_now=True)


@pytest.fixture
def editor(qtbot, monkeypatch):
    refusals: list[StageRefusal] = []

    def refused_launch(spec, plan, cards, step=None, cancel=None, prompt_cache_exact=False):
        last = len(plan.stages) - 1  # the last stage's agent says no
        st = plan.stages[last]
        name = next(c.name for c in cards if c.peer_id == st.peer_id)
        refusals.append(StageRefusal(last, st.start, st.end, name, "ab" * 8, st.device, "load",
                                     Refusal("policy_cap", 3_100_000_000, 2_000_000_000)))
        raise StageRefused(refusals)

    monkeypatch.setattr(client, "launch_fleet", refused_launch)
    view, runner = open_plan_view(qtbot)
    view.refusals = refusals
    yield view
    runner.wait_for_done(10_000)


def test_a_refused_stage_says_why_on_its_row(editor, qtbot):
    view, fleet = editor, editor.fleet
    a, b = _card("laptop-a", 8 * GB), _card("laptop-b", 8 * GB)
    fleet.launch_ok, fleet.launch_reason = True, ""
    fleet.cards = {a.peer_id: a, b.peer_id: b}
    view.where_box.setCurrentIndex(view.where_box.findData("fleet"))
    fleet.changed.emit()
    qtbot.waitUntil(lambda: view.plan is not None
                    and {s.peer_id for s in view.plan.stages} <= {a.peer_id, b.peer_id}, timeout=30_000)
    assert view.launch_blocker() == "", view.launch_blocker()
    view.launch_button.click()
    qtbot.waitUntil(lambda: view.session.state == "failed", timeout=10_000)
    [r] = view.refusals
    why = "over its owner's RAM limit for fleet work: needs 3.10 GB, the limit leaves 2.00 GB"
    assert view.session.refused == {r.stage: why}
    qtbot.waitUntil(lambda: view.progress.phases()[-1].startswith("refused"), timeout=5_000)
    assert view.progress.phases() == ["stopped"] * r.stage + [f"refused: {why}"]
    assert view.launch_reason.text() == f"Last launch failed: {r.line()}"
    assert r.peer in view.launch_reason.text() and f"stage {r.stage}" in view.launch_reason.text()
