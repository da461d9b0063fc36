"""Render every view of the app to PNGs (docs, reviews), with the real demo
engine and a short real conversation, in an isolated data/config folder.

    xvfb-run -s "-screen 0 1280x800x24" env QT_QPA_PLATFORM=xcb \\
        python -m app.screenshot docs/screenshots [--theme dark] [--suffix -2x]

Writes fleet.png, models.png, plan.png, chat.png, settings.png (+ suffix).
With --pipeline the Plan view launches a 2-stage local pipeline first, so the
Fleet view shows the running ring. With --agent a real agent runs on loopback
(mDNS on 127.0.0.1 only, its own config dir): the Fleet view discovers it and
pairs with it (the code accepted as its owner would), and fleet-pairing.png
shows the pairing dialog. Exits non-zero if the chat does not complete.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication

PROMPTS = ["Hello! What can you tell me about sailing?", "Show me some code, please"]
SIZE = (1280, 800)
TIMEOUT_MS = 240_000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default="docs/screenshots")
    ap.add_argument("--theme", default="light")
    ap.add_argument("--suffix", default="")
    ap.add_argument("--pipeline", action="store_true")
    ap.add_argument("--views", default="fleet,models,plan,chat,settings")
    ap.add_argument("--agent", action="store_true", help="discover and pair a real agent on loopback")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="flotilla-shot-")
    os.environ["FLOTILLA_DATA"] = os.path.join(tmp, "data")
    os.environ["FLOTILLA_CONFIG"] = os.path.join(tmp, "config")

    from app import style
    from app.main import create_window
    from app.settings import AppSettings

    Path(os.environ["FLOTILLA_CONFIG"]).mkdir(parents=True, exist_ok=True)
    AppSettings(theme=args.theme, fleet_interfaces="127.0.0.1").save(Path(os.environ["FLOTILLA_CONFIG"]))
    agent = None
    if args.agent:
        from engine import client

        agent = client.AgentHandle.spawn(["--bind", "127.0.0.1", "--port", "0", "--interface", "127.0.0.1",
                                          "--idle-source", "none"], config=Path(tmp) / "agent-config")
    app = QApplication.instance() or QApplication([sys.argv[0]])
    app.setStyle("Fusion")
    app.setWindowIcon(style.app_icon())
    win = create_window("demo")
    win.resize(*SIZE)
    win.show()
    panel = win.chat.panel
    panel.max_tokens.setValue(40)  # the demo model is random: a wall of noise shows nothing
    pending = list(PROMPTS)
    result = {"code": 1}
    views = args.views.split(",") + (["plan-fleet"] if args.agent and "plan" in args.views else [])

    def step() -> None:
        if win.session.state == "failed":
            print("engine failed:", win.session.error, file=sys.stderr)
            app.quit()
            return
        if not win.session.is_ready or panel.answering:
            QTimer.singleShot(200, step)
            return
        if args.pipeline and win.session.kind != "pipeline":
            # Launch first, so the chat's stats and the Fleet ring show the pipeline at work.
            win.show_view("plan")
            if win.plan.plan is not None and not win.plan.launch_blocker():
                win.plan.launch()
            QTimer.singleShot(500, step)
            return
        if pending:
            panel.prompt.setPlainText(pending.pop(0))
            panel.send()
            QTimer.singleShot(200, step)
            return
        QTimer.singleShot(300, pair_agent if agent is not None else (lambda: shoot(list(views))))

    def pair_agent() -> None:
        """Find the agent on the Fleet view, pair with it, shoot the dialog, accept the code."""
        win.show_view("fleet")
        cards = [w for w in win.fleet.cards if w.pair_button is not None]
        if not cards:
            QTimer.singleShot(300, pair_agent)
            return
        dlg = win.fleet.pair(cards[0].card)
        from app.tray import Tray

        tray = Tray(win.runner, agent, poll_ms=300, parent=win)  # the agent owner's tray, for its picture

        def accept() -> None:
            if not dlg.code:
                QTimer.singleShot(200, accept)
                return
            if not (out / f"fleet-pairing{args.suffix}.png").exists() or accept.first:
                accept.first = False
                dlg.grab().save(str(out / f"fleet-pairing{args.suffix}.png"))
                print(f"saved {out / f'fleet-pairing{args.suffix}.png'}")
            if dlg.code not in tray.request_actions:
                QTimer.singleShot(200, accept)
                return
            tray.menu.adjustSize()
            tray.menu.grab().save(str(out / f"tray-menu{args.suffix}.png"))
            print(f"saved {out / f'tray-menu{args.suffix}.png'}")
            # As the agent's owner would, in its tray: the code matches, accept.
            task = win.runner.call(agent.accept, dlg.code, name="owner-accepts")
            task.failed.connect(lambda _e: QTimer.singleShot(300, accept))  # the request is not there yet
            task.result.connect(lambda _n: QTimer.singleShot(300, finish))

        accept.first = True

        def finish() -> None:
            if dlg.state != "accepted":
                QTimer.singleShot(200, finish)
                return
            dlg.accept()
            QTimer.singleShot(2500, lambda: shoot(list(views)))

        QTimer.singleShot(800, accept)

    def shoot(todo: list[str]) -> None:
        if not todo:
            result["code"] = 0
            win.shutdown()
            return
        key = todo.pop(0)
        if key == "plan-fleet":  # the plan over the discovered, paired agent
            win.show_view("plan")
            win.plan.where_box.setCurrentIndex(win.plan.where_box.findData("fleet"))
        else:
            win.show_view(key)
        if key == "chat":
            panel.prompt.setFocus()

        def grab() -> None:
            path = out / f"{key}{args.suffix}.png"
            win.grab().save(str(path))
            print(f"saved {path} ({win.width()}x{win.height()})")
            shoot(todo)

        QTimer.singleShot(1500 if key in ("fleet", "models") else 600, grab)

    win.shut_down.connect(app.quit)
    QTimer.singleShot(200, step)
    QTimer.singleShot(TIMEOUT_MS, app.quit)
    app.exec()
    win.runner.wait_for_done(3000)
    if agent is not None:
        agent.stop()
    return result["code"]


if __name__ == "__main__":
    sys.exit(main())
