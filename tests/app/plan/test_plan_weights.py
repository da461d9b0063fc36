"""The plan editor's weight precision, and Launch handing over the very plan on screen.

The editor runs the real planner (engine.client over engine/planner/plan.py)
on the demo model; only the launch itself is faked, at the facade seam
(client.launch_pipeline / client.launch_fleet), so these tests see exactly the
object the editor gives the launcher. Fleet peers are PeerCards put into the
FleetModel as discovery would (no agent runs here).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from PySide6.QtWidgets import QComboBox, QLabel

from app.plan.memory_bar import MemoryBar
from app.plan.view import PlanView
from app_helpers import open_plan_view
from engine import client

GB = 1_000_000_000


class FakeEngine:
    """What a launch returns, as far as the session looks at it."""

    def __init__(self, plan) -> None:
        self.plan = plan
        self.info = SimpleNamespace(model_id="demo", engine="pipeline", device=plan.stages[0].device,
                                    context_length=plan.context_length)
        self.closed = False

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def editor(qtbot, monkeypatch):
    launched: list[tuple] = []

    def fake_pipeline(spec, plan, step=None, cancel=None, speculative=None, recover=True, prompt_cache_exact=False):
        launched.append(("local", spec, plan))
        view.exact_caches.append(prompt_cache_exact)
        return FakeEngine(plan)

    def fake_fleet(spec, plan, cards, step=None, cancel=None, prompt_cache_exact=False):
        launched.append(("fleet", spec, plan))
        view.exact_caches.append(prompt_cache_exact)
        return FakeEngine(plan)

    monkeypatch.setattr(client, "launch_pipeline", fake_pipeline)
    monkeypatch.setattr(client, "launch_fleet", fake_fleet)
    view, runner = open_plan_view(qtbot)
    view.launched, view.exact_caches = launched, []
    yield view
    runner.wait_for_done(10_000)


def _choose(view: PlanView, label: str) -> None:
    """Pick a precision as a user would; the split on screen is re-evaluated at once (pure planner)."""
    view.settings.weights_box.setCurrentIndex(view.settings.weights_box.findData(label))
    assert view.settings.weights_choice() == label


def _wait_plan(view: PlanView, qtbot, pred) -> None:
    qtbot.waitUntil(lambda: view.plan is not None and pred(view.plan), timeout=30_000)


def test_weights_combo_offers_every_precision_and_the_plan_uses_the_choice(editor, qtbot):
    view = editor
    box = view.settings.weights_box
    assert [box.itemText(i) for i in range(box.count())] == ["auto", "f32", "bf16", "fp16", "int8", "int4"]
    assert box.currentText() == "auto" and box.isEnabled()
    # The demo checkpoint is f32 and this PC holds it easily: auto is the model's own precision.
    assert view.checkpoint == "f32" and client.plan_precision(view.plan) == "f32"
    assert "Weights <b>f32</b> (auto: the model's own precision)" in view.summary.text()
    f32_weights = [s.weight_bytes for s in view.plan.stages]
    _choose(view, "int4")
    assert client.plan_precision(view.plan) == "int4" and not view.error
    # The memory bars are at the chosen precision: int4 (with its scales and int8 embedding/head)
    # is well under a quarter of f32.
    assert all(s.weight_bytes < w / 4 for w, s in zip(f32_weights, view.plan.stages))
    bars = sorted(view.stage_box.findChildren(MemoryBar), key=lambda b: b.weights)
    # each bar shows what the worker holds: stage 0's embedding stays in the mapped file on a CPU
    assert [b.weights for b in bars] == sorted(s.resident_weight_bytes for s in view.plan.stages)
    assert view.plan.stages[0].mapped_bytes > 0 and view.plan.stages[0].device == "CPU"
    assert "Weights <b>int4</b> (chosen)" in view.summary.text() and view.settings.weights_used.text() == ""
    assert any("int4 weights" in w.text() for w in view.stage_box.findChildren(QLabel))  # the table's header
    # A boundary the user moved stays where it is when the precision changes.
    view.move_boundary(0, 3)
    _choose(view, "fp16")
    assert [(s.start, s.end) for s in view.plan.stages] == [(0, 3), (3, 8)]
    assert client.plan_precision(view.plan) == "fp16"
    # The local engines run the checkpoint as it is: the choice is not offered there.
    view.engine_box.setCurrentIndex(view.engine_box.findData("local"))
    assert not box.isEnabled()
    view.engine_box.setCurrentIndex(view.engine_box.findData("pipeline"))
    assert box.isEnabled()


def test_auto_is_the_most_precise_precision_that_fits(editor, qtbot):
    view = editor
    view.settings.context.setValue(256)
    view.settings.streams.setValue(1)
    totals = {}
    for label in ("f32", "fp16"):
        _choose(view, label)
        totals[label] = max(s.total_bytes for s in view.plan.stages)
    assert totals["fp16"] < totals["f32"]
    # Each stage of this PC gets room for fp16 but not for f32 weights.
    share = (totals["fp16"] + totals["f32"]) // 2
    n = len(view.plan.stages)
    view._this_pc = dataclasses.replace(view._this_pc, ram_free=share * n)
    _choose(view, "auto")  # the split on screen, re-checked: fp16 is where it fits
    assert client.plan_precision(view.plan) == "fp16" and not view.error
    view.auto_button.click()  # and the planner's own plan for this PC
    _wait_plan(view, qtbot, lambda p: p is not None and len(p.stages) == n and not view.edited)
    qtbot.waitUntil(lambda: view.plan.fits, timeout=10_000)
    assert client.plan_precision(view.plan) == "fp16" and not view.error and view.plan.fits and view.launch_button.isEnabled()
    assert "Weights <b>fp16</b> (auto: the most precise at which this plan fits; the model's own f32 does not)" \
        in view.summary.text()
    assert view.settings.weights_used.text() == "→ fp16 for this plan"  # beside the choice, too
    # Asked for f32 outright, the same plan cannot launch, and says which stage and why.
    _choose(view, "f32")
    assert view.error and client.plan_precision(view.plan) == "f32"
    assert not view.launch_button.isEnabled() and "needs" in view.error and "layers" in view.error
    # With no room even for int4, auto shows the int4 plan in red with the reason.
    view._this_pc = dataclasses.replace(view._this_pc, ram_free=n * 10)
    _choose(view, "fp16")
    _choose(view, "auto")
    assert client.plan_precision(view.plan) == "int4" and not view.plan.fits
    assert view.error.startswith("even with int4 weights") and not view.launch_button.isEnabled()


def test_launch_passes_the_editors_plan_on_this_pc(editor, qtbot):
    view = editor
    view.settings.streams.setValue(3)
    _choose(view, "int8")
    view.move_boundary(0, 5)
    shown = view.plan
    assert [(s.start, s.end) for s in shown.stages] == [(0, 5), (5, 8)] and not view.error
    view.launch_button.click()
    qtbot.waitUntil(lambda: view.session.is_ready, timeout=10_000)
    kind, spec, plan = view.launched[-1]
    assert kind == "local" and spec == "demo"
    assert plan is shown  # the object on screen, not a re-plan of it
    assert client.plan_precision(plan) == "int8" and plan.streams == 3 and plan.context_length == 4096
    assert view.session.plan is shown and "int8 weights" in view.session.plan_text


def _card(name: str, ram: int) -> client.PeerCard:
    peer_id = (name.encode().hex() + "0" * 32)[:32]
    return client.PeerCard(peer_id=peer_id, name=name, os="Linux", devices=("CPU", "GPU.0"),
                           ram_total=2 * ram, ram_free=ram, idle_since=None, sharing="shared", paired=True,
                           local=False, reachable=True, address=f"{name}:5570",
                           device_names=("CPU", "GPU.0"), source="manual", sharing_now=True)


def test_fleet_launch_keeps_the_devices_the_user_pinned(editor, qtbot):
    view, fleet = editor, editor.fleet
    # Two laptops with a CPU and a GPU each.
    a, b = _card("laptop-a", 8 * GB), _card("laptop-b", 8 * GB)
    fleet.launch_ok, fleet.launch_reason = True, ""
    fleet.cards = {a.peer_id: a, b.peer_id: b}
    view.where_box.setCurrentIndex(view.where_box.findData("fleet"))
    fleet.changed.emit()
    _wait_plan(view, qtbot, lambda p: {s.peer_id for s in p.stages} <= {a.peer_id, b.peer_id})
    first = view.plan.stages[0]
    # The planner picks the GPU (faster); the user pins this stage to its CPU, from the stage table.
    assert first.device == "GPU.0"
    box = next(w for w in view.stage_box.findChildren(QComboBox)
               if w.accessibleName() == f"Device of {view._peer_name(first.peer_id)}")
    box.setCurrentIndex(box.findText("CPU"))
    box.activated.emit(box.currentIndex())
    _wait_plan(view, qtbot, lambda p: p.stages[0].device == "CPU")
    _choose(view, "int4")
    pinned = [(s.peer_id, s.device, s.start, s.end) for s in view.plan.stages]
    # A third peer shows up: the user's edited plan is kept, not re-planned over it.
    c = _card("desktop-c", 32 * GB)
    fleet.cards[c.peer_id] = c
    fleet.changed.emit()
    qtbot.waitUntil(lambda: "edited plan is kept" in view.note, timeout=10_000)
    assert [(s.peer_id, s.device, s.start, s.end) for s in view.plan.stages] == pinned
    assert view.launch_blocker() == "", view.launch_blocker()
    shown = view.plan
    view.launch_button.click()
    qtbot.waitUntil(lambda: view.session.is_ready, timeout=10_000)
    kind, spec, plan = view.launched[-1]
    assert kind == "fleet" and plan is shown
    assert [(s.peer_id, s.device, s.start, s.end) for s in plan.stages] == pinned
    assert client.plan_precision(plan) == "int4" and "int4 weights" in view.session.plan_text


def test_the_exact_prompt_cache_is_offered_for_pipelines_counted_in_the_plan_and_launched(editor, qtbot):
    view = editor
    box = view.settings.exact_cache
    assert box.isEnabled() and not box.isChecked()
    view.settings.weights_box.setCurrentIndex(view.settings.weights_box.findData("f32"))
    default_kv = [s.kv_bytes for s in view.plan.stages]
    box.setChecked(True)  # the split on screen is re-evaluated at the 16-bit KV the stages will keep
    _wait_plan(view, qtbot, lambda p: [s.kv_bytes for s in p.stages] != default_kv)
    assert all(s.kv_bytes > 0 for s in view.plan.stages)
    view.launch()
    qtbot.waitUntil(lambda: bool(view.exact_caches), timeout=10_000)
    assert view.exact_caches == [True]
    view.engine_box.setCurrentIndex(view.engine_box.findData("local"))
    assert not box.isEnabled() and not view.exact_cache()  # the local engine's prompt cache is its own
