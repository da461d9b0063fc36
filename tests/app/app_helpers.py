"""Set-up shared by the app tests."""

from __future__ import annotations


def open_plan_view(qtbot):
    """A PlanView on a fresh session and fleet model (discovery not started: tests put the
    cards in), shown at 1200 x 800, once its first plan is made. Returns (view, runner)."""
    from app.background import Runner
    from app.fleet.model import FleetModel
    from app.plan.view import PlanView
    from app.session import EngineSession

    runner = Runner()
    view = PlanView(EngineSession(runner), runner, FleetModel(runner))
    view.resize(1200, 800)
    qtbot.addWidget(view)
    qtbot.waitUntil(lambda: bool(view.kinds) and view.plan is not None and not view.error, timeout=120_000)
    return view, runner
