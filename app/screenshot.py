"""Render every view of the app to PNGs (docs, reviews), with the real demo
engine and a short real conversation, in an isolated data/config folder.

    xvfb-run -s "-screen 0 1280x800x24" env QT_QPA_PLATFORM=xcb \\
        python -m app.screenshot docs/screenshots [--theme dark] [--suffix -2x]

Writes fleet.png, models.png, plan.png, chat.png, settings.png (+ suffix).
With --pipeline the Plan view launches a 2-stage local pipeline first, so the
Fleet view shows the running ring. Exits non-zero if the chat does not complete.
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
    AppSettings(theme=args.theme).save(Path(os.environ["FLOTILLA_CONFIG"]))
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
    views = args.views.split(",")

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
        QTimer.singleShot(300, lambda: shoot(list(views)))

    def shoot(todo: list[str]) -> None:
        if not todo:
            result["code"] = 0
            win.shutdown()
            return
        key = todo.pop(0)
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
    return result["code"]


if __name__ == "__main__":
    sys.exit(main())
